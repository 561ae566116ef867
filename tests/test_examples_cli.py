"""The examples' command lines: ``--help`` prints help and exits 0 without training."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


@pytest.mark.parametrize("example", ["nnx_transformer.py", "bpe_transformer.py"])
def test_example_help_exits_0_without_training(example: str, tmp_path: Path) -> None:
    pytest.importorskip("flax")
    if example == "bpe_transformer.py":
        pytest.importorskip("tokenizers")
    res = subprocess.run([sys.executable, str(ROOT / "examples" / example), "--help"],
                         cwd=tmp_path, capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "usage:" in res.stdout and "--set" in res.stdout and "--config" in res.stdout
    # nothing started: a run would have created its run directory under the cwd
    assert not (tmp_path / "out").exists()


def test_example_rejects_an_unknown_option(tmp_path: Path) -> None:
    pytest.importorskip("flax")
    res = subprocess.run([sys.executable, str(ROOT / "examples" / "nnx_transformer.py"),
                          "--learners", "2"], cwd=tmp_path, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 2 and "unrecognized arguments: --learners" in res.stderr
    assert not (tmp_path / "out").exists()
