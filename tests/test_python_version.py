"""The supported Python versions and the pinned libraries agree everywhere they are stated.

pyproject's ``requires-python`` is the one source; ruff's target, mypy's version and the
README's quick start must say the same, and the libraries whose behaviour the tests depend on
(help output, error wording) are installed within their pins.
"""

from __future__ import annotations

import re
import sys
import tomllib
from importlib.metadata import version
from pathlib import Path

from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parent.parent
PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())


def _minimum() -> tuple[int, int]:
    spec = PROJECT["project"]["requires-python"]
    found = re.fullmatch(r">=(\d+)\.(\d+)", spec)
    assert found, f"requires-python {spec!r}: expected '>=X.Y'"
    return int(found[1]), int(found[2])


def test_ruff_and_mypy_target_the_minimum() -> None:
    major, minor = _minimum()
    assert PROJECT["tool"]["ruff"]["target-version"] == f"py{major}{minor}"
    assert PROJECT["tool"]["mypy"]["python_version"] == f"{major}.{minor}"


def test_readme_states_the_minimum() -> None:
    major, minor = _minimum()
    text = (ROOT / "README.md").read_text()
    stated = set(re.findall(r"Python (\d+\.\d+)\+", text))
    assert stated == {f"{major}.{minor}"}, f"README states Python {stated or 'nothing'}+"


def test_this_interpreter_is_supported() -> None:
    assert sys.version_info[:2] >= _minimum()


def test_pinned_libraries_are_installed_within_their_pins() -> None:
    pinned = [Requirement(r) for r in PROJECT["project"]["dependencies"]]
    bounded = [r for r in pinned if any(s.operator in ("<", "<=", "==", "~=")
                                        for s in r.specifier)]
    assert {r.name for r in bounded} >= {"typer", "click"}
    for req in bounded:
        installed = version(req.name)
        assert req.specifier.contains(installed, prereleases=True), (
            f"{req.name} {installed} is outside {req}")
