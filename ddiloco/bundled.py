"""The chaos scripts and configs installed with the package, by name.

``ddiloco chaos run gentle`` reads ``chaos/scripts/gentle.yaml`` of the installed package
(``ddiloco.chaos.scripts``); ``ddiloco chaos scripts`` lists the scripts with their one-line
descriptions and ``--configs`` the configs. A path that exists wins over a bundled name. The
configs' resolution is the workers layer's (:mod:`ddiloco.workers.run.bundled`, which the worker
commands use too); this module adds the chaos scripts, which belong to the chaos layer.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from ddiloco.workers.run.bundled import CONFIGS, Bundle, bundled_configs, first_sentence

__all__ = ["CHAOS_SCRIPTS", "CONFIGS", "bundled_chaos_scripts", "bundled_configs",
           "resolve_chaos_script"]

#: the fault scripts of ``chaos/scripts`` (docs/CHAOS.md)
CHAOS_SCRIPTS = Bundle(
    kind="chaos script", package="ddiloco.chaos.scripts", folder="chaos/scripts",
    suffixes=(".yaml", ".yml"), lister="ddiloco chaos scripts")


def resolve_chaos_script(name_or_path: str | Path) -> Path:
    """The fault script a command line names: an existing path, else a bundled script's name
    (``gentle``, ``ci-storm``; ``chaos/scripts/gentle.yaml`` outside a checkout too).

    Raises:
        ddiloco.workers.run.bundled.UnknownBundledName: a bare name that is neither a file nor a
            bundled script ("unknown chaos script 'gentel'; did you mean 'gentle'? ...").
    """
    return CHAOS_SCRIPTS.resolve(name_or_path)


def script_description(path: Path) -> str:
    """The first sentence of a fault script's ``description`` ("" when it has none or the
    file is not a YAML mapping: the listing shows every file, the loader judges it)."""
    try:
        doc = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError):
        return ""
    text = doc.get("description") if isinstance(doc, dict) else None
    return first_sentence(text) if isinstance(text, str) else ""


def bundled_chaos_scripts() -> dict[str, str]:
    """Every bundled fault script by name, with its one-line description, e.g.
    ``{"gentle": "One learner kill -9 with a 10 s outage, then one 5 s pause of another
    learner.", ...}``; ``ddiloco chaos run NAME`` runs it."""
    return {name: script_description(path) for name, path in CHAOS_SCRIPTS.files().items()}


def listing(entries: dict[str, str]) -> str:
    """``name  description`` lines, the names padded to one column."""
    width = max((len(n) for n in entries), default=0)
    return "\n".join(f"{name:<{width}}  {text}".rstrip() for name, text in entries.items())

