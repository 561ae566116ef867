"""Load a script of ``bench/`` as a module, for the tests of its pure functions."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

ROOT = Path(__file__).resolve().parent.parent


def load_bench(name: str) -> ModuleType:
    """``bench/<name>.py`` as the module ``bench_<name>`` (registered in ``sys.modules``, which
    dataclasses need to resolve their module by name)."""
    spec = importlib.util.spec_from_file_location(f"bench_{name}", ROOT / "bench" / f"{name}.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    spec.loader.exec_module(mod)
    return mod
