"""docs/ARCHITECTURE.md's module map matches the code: every module of every layer is listed
once with its one idea, and every listed module exists."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOC = ROOT / "docs" / "ARCHITECTURE.md"
FOLDERS = ("ddiloco", "chaos", "workers", "store", "pipeline")
ROW = re.compile(r"^\|\s*`([^`]+\.py)`\s*\|\s*(.*?)\s*\|\s*$")


def module_map() -> list[tuple[str, str]]:
    """(path, idea) of every row of the doc's "Module map" section."""
    text = DOC.read_text()
    start = text.index("## Module map")
    end = text.find("\n## ", start + 1)
    section = text[start:end if end > 0 else len(text)]
    return [(m.group(1), m.group(2)) for line in section.splitlines()
            if (m := ROW.match(line))]


def code_modules() -> set[str]:
    out = set()
    for folder in FOLDERS:
        for path in (ROOT / folder).rglob("*.py"):
            if path.name in {"__init__.py", "__main__.py"} or "__pycache__" in path.parts:
                continue
            out.add(str(path.relative_to(ROOT)))
    return out


def test_the_module_map_lists_every_module_once() -> None:
    rows = module_map()
    listed = [path for path, _ in rows]
    assert len(listed) == len(set(listed)), sorted(p for p in listed if listed.count(p) > 1)
    code = code_modules()
    assert sorted(code - set(listed)) == [], "modules missing from docs/ARCHITECTURE.md"
    assert sorted(set(listed) - code) == [], "docs/ARCHITECTURE.md lists modules that are gone"


def test_every_module_has_its_idea_in_a_sentence() -> None:
    for path, idea in module_map():
        assert len(idea.split()) >= 3, (path, idea)


def test_every_subpackage_of_workers_has_a_docstring() -> None:
    for init in (ROOT / "workers").glob("*/__init__.py"):
        text = init.read_text().lstrip()
        assert text.startswith('"""'), init
