"""What the configuration schema says about itself: key lookup, allowed ranges, readable types,
``--set`` value parsing and error messages a user can act on.

Everything here works on a tree of pydantic models (a root whose fields are sections, each a
model of plain fields) passed in as ``root``, so :mod:`ddiloco.workers.run.config` owns the schema
and this module owns the wording. Messages name the full dotted path of a key
(``train.steps``), never pydantic's internal phrasing.
"""

from __future__ import annotations

import difflib
import json
import re
import types
from collections.abc import Iterable
from typing import Any, Literal, Union, get_args, get_origin

import annotated_types as at
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import ErrorDetails

from ddiloco.pipeline.errors import ConfigError

#: Keys that configurations once accepted and no longer do: dotted path -> what to do instead.
REMOVED_KEYS: dict[str, str] = {
    "run.out": "not a config key; the run directory is the --out option",
}

#: Words a shell user types for "no value" in ``--set k=none`` (an optional key only).
NONE_WORDS = frozenset({"none", "null", "~", ""})


def section_model(annotation: Any) -> type[BaseModel] | None:
    """The model class of a section annotation, or None for a plain value."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    return None


def strip_none(annotation: Any) -> tuple[Any, bool]:
    """``X | None`` -> (X, True); anything else -> (annotation, False)."""
    if get_origin(annotation) in (Union, types.UnionType):
        args = [a for a in get_args(annotation) if a is not type(None)]
        if len(args) < len(get_args(annotation)):
            return (args[0] if len(args) == 1 else Union[tuple(args)]), True  # noqa: UP007
    return annotation, False


def unknown_key(path: str, valid: Iterable[str]) -> str:
    """The message for a key the schema does not have: a removed key's replacement, the
    closest valid key ("did you mean"), or the list of valid keys where none is close."""
    if path in REMOVED_KEYS:
        return f"{path}: {REMOVED_KEYS[path]}"
    parent, _, key = path.rpartition(".")
    names = list(valid)
    # Case-insensitive first (sync.h -> sync.H), then difflib's similarity (sync.HH -> sync.H).
    close = [n for n in names if n.lower() == key.lower()] or difflib.get_close_matches(
        key, names, n=1)
    prefix = f"{parent}." if parent else ""
    if close:
        return f"unknown key {path}; did you mean {prefix}{close[0]}?"
    where = f"section {parent}" if parent else "the top level"
    return f"unknown key {path}; {where} has: {', '.join(names)}"


def model_at(root: type[BaseModel], parts: Iterable[str]) -> type[BaseModel] | None:
    """The section model reached by following ``parts`` from ``root`` (None: not a section)."""
    model: type[BaseModel] | None = root
    for part in parts:
        if model is None or part not in model.model_fields:
            return None
        model = section_model(model.model_fields[part].annotation)
    return model


def lookup(root: type[BaseModel], path: str) -> tuple[FieldInfo | None, Any]:
    """Resolve a dotted key to (its field, the annotation of the value it takes).

    A key inside a table-valued field (``train.speed.learner-3``) resolves to the table's field
    and the annotation of one entry.

    Raises:
        ConfigError: an unknown key (with "did you mean"), a section where a key is needed, or
            a key below a plain value.
    """
    parts = path.split(".")
    model = root
    for i, part in enumerate(parts):
        here = ".".join(parts[: i + 1])
        if part not in model.model_fields:
            raise ConfigError(unknown_key(here, model.model_fields))
        info = model.model_fields[part]
        sub = section_model(info.annotation)
        rest = parts[i + 1:]
        if sub is not None:
            model = sub
            continue
        if not rest:
            return info, info.annotation
        base, _ = strip_none(info.annotation)
        if get_origin(base) is dict and len(rest) == 1:
            return info, get_args(base)[1]
        raise ConfigError(f"{path}: {here} is a value ({type_name(info.annotation)}), not a "
                          "section")
    first = next(iter(model.model_fields))
    raise ConfigError(f"{path}: a section, not a key; set one of its keys, e.g. "
                      f"{path}.{first}=...")


def parse_value(raw: str, annotation: Any) -> Any:
    """Read a ``--set`` value the way a shell user means it, given the key's annotation.

    * an optional key: ``none``, ``null``, ``~`` or nothing -> None;
    * a list key: ``[a, b]`` is YAML; otherwise comma-separated items, so a single path is a
      one-element list (``data.corpus=/p/a.txt``);
    * a string or choice key: the text as typed (``run.run_id=2024`` stays a string), unless
      quoted (then YAML unquotes it);
    * anything else (numbers, booleans, tables, unknown keys): YAML.
    """
    base, optional = strip_none(annotation)
    text = raw.strip()
    if optional and text.lower() in NONE_WORDS:
        return None
    origin = get_origin(base)
    if origin in (tuple, list):
        if text.startswith("["):
            return _yaml(raw)
        return [item.strip() for item in text.split(",")] if text else []
    if (base is str or origin is Literal) and not text.startswith(("'", '"')):
        return raw
    return _yaml(raw) if raw else ""


def _yaml(raw: str) -> Any:
    try:
        return yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw


def coerce_value(value: Any, annotation: Any) -> Any:
    """A Python override value for a list key given as one string becomes a one-element
    list (``{"data.corpus": "a.txt"}``); anything else is returned as it is."""
    base, _ = strip_none(annotation)
    if get_origin(base) in (tuple, list) and isinstance(value, str):
        return [value]
    return value


def value_range(info: FieldInfo) -> str | None:
    """A field's numeric bounds in interval notation (``(0, 1]``, ``>= 1``), or None."""
    lo: tuple[str, Any] | None = None
    hi: tuple[Any, str] | None = None
    for m in info.metadata:
        if isinstance(m, at.Gt):
            lo = ("(", m.gt)
        elif isinstance(m, at.Ge):
            lo = ("[", m.ge)
        elif isinstance(m, at.Lt):
            hi = (m.lt, ")")
        elif isinstance(m, at.Le):
            hi = (m.le, "]")
    if lo and hi:
        return f"{lo[0]}{lo[1]}, {hi[0]}{hi[1]}"
    if lo:
        return f"{'>' if lo[0] == '(' else '>='} {lo[1]}"
    if hi:
        return f"{'<' if hi[1] == ')' else '<='} {hi[0]}"
    return None


def choices(annotation: Any) -> list[Any] | None:
    """The values a ``Literal`` key accepts (optional or not), or None."""
    base, _ = strip_none(annotation)
    return list(get_args(base)) if get_origin(base) is Literal else None


_NAMES = {int: "integer", float: "number", bool: "boolean", str: "string"}


def type_name(annotation: Any) -> str:
    """A reader's name for a key's type: ``integer``, ``number or none``, ``list of string``."""
    base, optional = strip_none(annotation)
    origin = get_origin(base)
    if origin is Literal:
        name = "choice"
    elif origin in (tuple, list):
        name = f"list of {type_name(get_args(base)[0])}"
    elif origin is dict:
        k, v = get_args(base)
        name = f"table of {type_name(k)} -> {type_name(v)}"
    else:
        name = _NAMES.get(base, getattr(base, "__name__", str(base)))
    return f"{name} or none" if optional else name


#: pydantic error types -> what the key expects.
_EXPECTED = {
    "int_parsing": "an integer", "int_type": "an integer", "int_from_float": "an integer",
    "float_parsing": "a number", "float_type": "a number", "finite_number": "a finite number",
    "bool_parsing": "true or false", "bool_type": "true or false",
    "string_type": "a string", "dict_type": "a table", "tuple_type": "a list",
    "list_type": "a list", "model_type": "a table of keys", "model_attributes_type":
    "a table of keys",
}
_BOUNDS = {"greater_than": "gt", "greater_than_equal": "ge", "less_than": "lt",
           "less_than_equal": "le"}
_BOUND_TEXT = {"gt": ">", "ge": ">=", "lt": "<", "le": "<="}


def _path(loc: Iterable[int | str]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _field_at(root: type[BaseModel], loc: tuple[int | str, ...]) -> FieldInfo | None:
    names = [p for p in loc if isinstance(p, str)]
    model = model_at(root, names[:-1])
    if model is None or not names or names[-1] not in model.model_fields:
        return None
    return model.model_fields[names[-1]]


def error_message(root: type[BaseModel], e: ErrorDetails) -> str:
    """One pydantic error as a line that names the full key path and what it accepts."""
    loc = tuple(e["loc"])
    path = _path(loc)
    kind = e["type"]
    ctx = e.get("ctx") or {}
    value = e.get("input")
    if kind == "extra_forbidden":
        model = model_at(root, [str(p) for p in loc[:-1]])
        return unknown_key(path, model.model_fields if model is not None else ())
    if kind in ("value_error", "assertion_error") and "error" in ctx:
        # Our validators already write "section.key: ..." (or a message for the whole file).
        text = str(ctx["error"])
        return text if not path or text.startswith(path) else f"{path}: {text}"
    if kind == "literal_error":
        return f"{path}: {value!r} is not a valid choice; expected {ctx.get('expected')}"
    if kind in _BOUNDS:
        info = _field_at(root, loc)
        allowed = value_range(info) if info is not None else None
        if allowed is None:
            bound = _BOUNDS[kind]
            allowed = f"{_BOUND_TEXT[bound]} {ctx.get(bound)}"
        return f"{path}: {value!r} is out of range; allowed: {allowed}"
    if kind in _EXPECTED:
        return f"{path}: expected {_EXPECTED[kind]}, got {value!r}"
    msg = e["msg"].removeprefix("Value error, ")
    return f"{path}: {msg[:1].lower()}{msg[1:]}" if path else msg


def count_keys(root: type[BaseModel]) -> int:
    """How many keys the schema has (a table-valued key counts once)."""
    total = 0
    for info in root.model_fields.values():
        sub = section_model(info.annotation)
        total += count_keys(sub) if sub is not None else 1
    return total


def _default_text(info: FieldInfo) -> str:
    if info.default_factory is not None:
        value: Any = info.default_factory()  # type: ignore[call-arg]
    else:
        value = info.default
    if value is None:
        return "none"
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, tuple | list | dict | str):
        return json.dumps(value)
    return repr(value)


def _md(text: str) -> str:
    """A docstring's reStructuredText roles and literals as Markdown, on one line."""
    text = re.sub(r":\w+:`~?([^`]+)`", r"`\1`", text).replace("``", "`")
    return " ".join(text.split())


def _cell(text: str) -> str:
    # A table cell is one line, and "|" would end it.
    return " ".join(text.split()).replace("|", "\\|")


def reference_markdown(root: type[BaseModel], *, removed: dict[str, str] | None = None,
                       intro: str = "") -> str:
    """The configuration reference (docs/CONFIG.md) of ``root``: per section, every key with
    its type, default, allowed range or choices and description. Deterministic: the same
    schema gives the same text, byte for byte."""
    lines = ["# Configuration reference", "",
             "<!-- Generated from the schema (workers/run/config.py) by `ddiloco config docs > "
             "docs/CONFIG.md`; edit the schema, not this file. -->", ""]
    if intro:
        lines += [intro.strip(), ""]
    lines += ["| section | keys | what |", "|---|---|---|"]
    sections = [(name, info, section_model(info.annotation))
                for name, info in root.model_fields.items()]
    for name, _, model in sections:
        if model is not None:
            lines.append(f"| [`{name}`](#{name}) | {count_keys(model)} | "
                         f"{_cell(_md((model.__doc__ or '').split(chr(10) * 2)[0]))} |")
    for name, _, model in sections:
        if model is None:
            continue
        lines += ["", f"## {name}", "", _md(model.__doc__ or ""), "",
                  "| key | type | default | allowed | meaning |", "|---|---|---|---|---|"]
        for key, info in model.model_fields.items():
            allowed = value_range(info)
            options = choices(info.annotation)
            if options is not None:
                allowed = ", ".join(str(o) for o in options)
            lines.append(f"| `{name}.{key}` | {type_name(info.annotation)} | "
                         f"`{_default_text(info)}` | {_cell(allowed or '')} | "
                         f"{_cell(_md(info.description or ''))} |")
    if removed:
        lines += ["", "## Removed keys", "",
                  "A file that still sets one of these is refused with this message.", "",
                  "| key | message |", "|---|---|"]
        lines += [f"| `{k}` | {_cell(v)} |" for k, v in sorted(removed.items())]
    return "\n".join(lines) + "\n"
