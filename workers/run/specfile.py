"""Declarative YAML files checked by pydantic: fault scripts (``ddiloco.chaos.script``) and
region topologies (``ddiloco.chaos.wan.topology``) read and report errors the same way.

* :func:`read_yaml` reads a file with a safe loader that rejects duplicate keys;
* :func:`validate_model` reports every invalid field as ``<file>: <field path>: <problem>``;
* :func:`parse_duration` reads ``"40s"``, ``"1.5m"``, ``"500ms"`` or a number of seconds.
"""

from __future__ import annotations

import math
import re
from pathlib import Path
from typing import Annotated, Any, TypeVar

import yaml
from pydantic import BaseModel, BeforeValidator, Field, ValidationError

from ddiloco.pipeline.errors import ConfigError

__all__ = ["Duration", "FieldProblem", "PositiveDuration", "SpecError", "parse_duration",
           "read_yaml", "validate_model"]

_M = TypeVar("_M", bound=BaseModel)


class SpecError(ConfigError):
    """A value of a declarative file is invalid (raised inside validators; the file's own
    error class, e.g. ``ScriptError``, carries the file name and field path)."""


_DURATION_RE = re.compile(
    r"^\s*([-+]?(?:[0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE][-+]?[0-9]+)?)\s*(ms|s|m|h)?\s*$"
)


def parse_duration(value: Any) -> float:
    """Read a duration in seconds.

    Args:
        value: a number of seconds (int or float), or a string: a number with an optional unit
            ``ms``, ``s``, ``m`` (minutes) or ``h``, e.g. ``"40s"``, ``"1.5m"``, ``"500ms"``.

    Returns:
        The duration in seconds (finite; the sign is kept, callers bound it).

    Raises:
        SpecError: not a number or a number with a known unit, or not finite.
    """
    seconds: float
    if isinstance(value, bool):
        raise SpecError(f"{value!r} is not a duration (seconds, or e.g. '40s', '1.5m', '500ms')")
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str) and (match := _DURATION_RE.match(value)):
        number = float(match.group(1))
        unit = match.group(2) or "s"
        if unit == "ms":
            seconds = number / 1000.0
        elif unit == "m":
            seconds = number * 60.0
        elif unit == "h":
            seconds = number * 3600.0
        else:
            seconds = number
    else:
        raise SpecError(f"{value!r} is not a duration (seconds, or e.g. '40s', '1.5m', '500ms')")
    if not math.isfinite(seconds):
        raise SpecError(f"{value!r} is not a finite duration")
    return seconds


Duration = Annotated[float, BeforeValidator(parse_duration), Field(ge=0)]
"""A duration >= 0 s."""
PositiveDuration = Annotated[float, BeforeValidator(parse_duration), Field(gt=0)]
"""A duration > 0 s."""


class FieldProblem(ValueError):
    """A validator's error that points below the location pydantic knows (``at``); shared by
    every YAML format of the project (fault scripts, topologies)."""

    def __init__(self, message: str, at: str | None = None) -> None:
        super().__init__(message)
        self.at = at



class _UniqueKeyLoader(yaml.SafeLoader):
    """A safe YAML loader that rejects a key given twice in one mapping."""

    def construct_mapping(self, node: Any, deep: bool = False) -> Any:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            try:
                duplicate = key in seen
            except TypeError:  # unhashable key: let the base class report it
                break
            if duplicate:
                raise yaml.constructor.ConstructorError(
                    "while constructing a mapping", node.start_mark,
                    f"found duplicate key {key!r}", key_node.start_mark,
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _path(loc: tuple[Any, ...]) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out


def _join(path: str, sub: str | None) -> str:
    if not sub:
        return path
    if not path or sub.startswith("["):
        return path + sub
    return f"{path}.{sub}"


_CONSTRAINTS = {
    "greater_than": ("gt", ">"),
    "greater_than_equal": ("ge", ">="),
    "less_than": ("lt", "<"),
    "less_than_equal": ("le", "<="),
}


def _message(err: Any) -> tuple[str, str]:
    """(field path, problem) of one pydantic error."""
    path = _path(tuple(err["loc"]))
    kind = err["type"]
    ctx = err.get("ctx") or {}
    if kind == "value_error" and "error" in ctx:
        exc = ctx["error"]
        return _join(path, getattr(exc, "at", None)), str(exc)
    if kind == "missing":
        return path, "required"
    if kind == "extra_forbidden":
        return path, "unknown key"
    if kind in _CONSTRAINTS:
        key, op = _CONSTRAINTS[kind]
        return path, f"must be {op} {ctx.get(key)}, got {err.get('input')!r}"
    return path, f"{err['msg']}, got {err.get('input')!r}"


def validate_model(model: type[_M], data: Any, source: str, error: type[ConfigError]) -> _M:
    """Validate parsed YAML into ``model``; every problem is reported as
    ``"<source>: <field path>: <problem>"`` in one ``error``.

    Raises:
        error: the top level is not a mapping, or any field is invalid.
    """
    if not isinstance(data, dict):
        raise error(f"{source}: top level must be a mapping, got {type(data).__name__}")
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = []
        for err in exc.errors():
            path, problem = _message(err)
            problems.append(f"{path}: {problem}" if path else problem)
        raise error(f"{source}: " + "; ".join(problems)) from None


def yaml_error_line(path: Path, exc: yaml.YAMLError) -> str:
    """One line for a YAML error: ``FILE:LINE:COLUMN: malformed YAML: <problem>`` (PyYAML's
    own text spans several lines, with a snippet and a caret)."""
    mark = getattr(exc, "problem_mark", None)
    where = f"{path}:{mark.line + 1}:{mark.column + 1}" if mark is not None else str(path)
    problem = getattr(exc, "problem", None)
    context = getattr(exc, "context", None)
    text = " ".join(str(x) for x in (context, problem) if x) or " ".join(str(exc).split())
    return f"{where}: malformed YAML: {text}"


def read_yaml(path: Path | str, error: type[ConfigError], what: str) -> Any:
    """Read a YAML file with a safe loader that also rejects duplicate keys.

    Raises:
        error: missing or unreadable file, not UTF-8, malformed or empty YAML (the message
            names the file and ``what`` it should be).
    """
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as exc:
        raise error(f"{p}: cannot read {what}: {exc.strerror or exc}") from None
    except UnicodeDecodeError as exc:
        raise error(f"{p}: not UTF-8 text: {exc}") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader subclass
    except yaml.YAMLError as exc:
        raise error(f"{yaml_error_line(p, exc)}") from None
    if data is None:
        raise error(f"{p}: empty {what}")
    return data
