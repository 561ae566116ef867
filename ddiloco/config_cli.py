"""``ddiloco config``: the effective configuration, a file's validation and the reference.

* ``ddiloco config show [--config F] [--set k=v ...] [--format yaml|toml|json]``: every key of
  the configuration a run would use (defaults < file < ``--set``);
* ``ddiloco config validate F [--set k=v ...]``: ``F: valid (N keys set, M defaults)``, or the
  error and exit 2;
* ``ddiloco config docs``: docs/CONFIG.md, generated from the schema
  (:func:`ddiloco.workers.run.config_schema.reference_markdown`).
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from ddiloco.pipeline.errors import ConfigError, DDilocoError
from ddiloco.workers.cli import ConfigOpt, SetOpt, guard, new_app

config_app = new_app("The run configuration: show the effective one, validate a file, print "
                     "the reference (docs/CONFIG.md).")

#: The text above the tables of docs/CONFIG.md.
INTRO = """\
A run's configuration is a TOML or YAML file of the sections below (`--config F`; every key is
optional), plus `--set section.key=value` overrides on the command line, applied in that order
over the defaults. `ddiloco config show` prints the effective configuration, every key;
`ddiloco config validate F` checks a file. `configs/default.toml` holds the common keys.

`--set` values are read the way a shell user types them: numbers and booleans as such; a string
key takes the text as typed (`--set run.run_id=2024` is the string "2024"); a list key takes
comma-separated items or a YAML list (`--set data.corpus=/p/a.txt`, `data.corpus=a.txt,b.txt`,
`data.corpus='[a.txt, b.txt]'`); a table key takes a YAML mapping
(`--set 'train.speed={learner-3: 0.5}'`) or one entry (`--set train.speed.learner-3=0.5`);
`none` clears an optional key. Sources, as in docs/API.md: DESIGN §n is a section of the
design notes, docs/DESIGN.md (§2: the algorithm and its numbered steps), *paper* is Decoupled
DiLoCo (arXiv 2604.21428), *lineage* DiLoCo (2311.08105) and Streaming DiLoCo (2501.18512)."""


class Format(str, Enum):
    """Output formats of ``config show``."""

    yaml = "yaml"
    toml = "toml"
    json = "json"


def reference() -> str:
    """The text of docs/CONFIG.md for the current schema."""
    from ddiloco.workers.run.config import Config
    from ddiloco.workers.run.config_schema import REMOVED_KEYS, reference_markdown

    return reference_markdown(Config, removed=REMOVED_KEYS, intro=INTRO)


def to_toml(tree: Mapping[str, Mapping[str, Any]]) -> str:
    """A config tree as TOML. TOML has no null: a key whose value is none is written as a
    comment (``# key = none``) and left out, which loads back as its default; ``--format
    yaml`` or ``json`` show it as null."""
    try:
        import tomli_w
    except ImportError:
        raise DDilocoError("--format toml needs tomli-w (pip install tomli-w); "
                           "--format yaml shows the same keys") from None
    parts = []
    for section, keys in tree.items():
        body = tomli_w.dumps({section: {k: v for k, v in keys.items() if v is not None}})
        head, _, rest = body.partition("\n")
        unset = [f"# {k} = none  (TOML has no null: left out)" for k, v in keys.items()
                 if v is None]
        parts.append("\n".join([head, *unset, rest.rstrip("\n")]).rstrip("\n"))
    return "\n\n".join(parts) + "\n"


def render(tree: Mapping[str, Mapping[str, Any]], fmt: Format) -> str:
    """A config tree (``Config.model_dump(mode="json")``) as YAML, TOML or JSON."""
    if fmt is Format.json:
        return json.dumps(tree, indent=2) + "\n"
    if fmt is Format.toml:
        return to_toml(tree)
    import yaml

    return yaml.safe_dump(dict(tree), sort_keys=False, default_flow_style=False)


def keys_set(tree: Mapping[str, Any], overrides: Sequence[str]) -> set[str]:
    """The ``section.key`` paths a file tree and ``--set`` items set (a table key once)."""
    out = {f"{section}.{key}" for section, keys in tree.items() if isinstance(keys, dict)
           for key in keys}
    out |= {".".join(item.split("=", 1)[0].strip().split(".")[:2]) for item in overrides}
    return out


FormatOpt = Annotated[Format, typer.Option("--format", "-f", help="yaml (none as null), toml "
                                           "(none left out, as a comment) or json")]


@config_app.command("show")
def show(config: ConfigOpt = None, set_: SetOpt = None, fmt: FormatOpt = Format.yaml) -> None:
    """Print the effective configuration, every key (defaults < --config < --set)."""
    def go() -> int:
        from ddiloco.workers.run.config import load_config

        cfg = load_config(config, set_)
        typer.echo(render(cfg.model_dump(mode="json"), fmt), nl=False)
        return 0

    guard(go)


@config_app.command("validate")
def validate(
    file: Annotated[Path, typer.Argument(help="TOML or YAML configuration file")],
    set_: SetOpt = None,
) -> None:
    """Check a configuration file against the schema.

    Prints 'FILE: valid (N keys set, M defaults)', or the problem and exits 2."""
    def go() -> int:
        from ddiloco.workers.run.config import Config, load_config, read_config_file
        from ddiloco.workers.run.config_schema import count_keys

        try:
            tree = read_config_file(file)
            load_config(file, set_)
        except ConfigError as exc:
            text = str(exc)
            raise ConfigError(text if text.startswith("config file") else f"{file}: {text}") \
                from None
        n = len(keys_set(tree, set_ or []))
        typer.echo(f"{file}: valid ({n} keys set, {count_keys(Config) - n} defaults)")
        return 0

    guard(go)


@config_app.command("docs")
def docs() -> None:
    """Print the configuration reference (docs/CONFIG.md).

    Every key with its type, default, allowed values and meaning, from the schema."""
    typer.echo(reference(), nl=False)
