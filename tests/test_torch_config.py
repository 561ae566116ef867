"""What a run with PyTorch learners may ask for, and the one line a user without torch gets.

``run.torch_learners`` picks PyTorch learners of the built-in GPT in a DiLoCo run; it is
refused beyond M, with a user task (whose factory decides its framework) and with the
data-parallel baseline. ``ddiloco run`` without torch installed names the extra before it
starts anything.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from ddiloco.pipeline.errors import ConfigError
from ddiloco.workers.learner.engines import learner_index, uses_torch
from ddiloco.workers.run.config import load_config

ROOT = Path(__file__).resolve().parent.parent


def test_torch_learners_are_the_first_n_of_a_diloco_run() -> None:
    cfg = load_config(None, {"run.learners": 4, "run.torch_learners": 2})
    assert [uses_torch(cfg, f"learner-{m}") for m in range(4)] == [True, True, False, False]
    assert learner_index("learner-12") == 12 and learner_index("odd") == 0
    assert not uses_torch(load_config(None, {"run.learners": 4}), "learner-0")


@pytest.mark.parametrize(("sets", "match"), [
    ({"run.learners": 2, "run.torch_learners": 3}, "3 of run.learners = 2"),
    ({"run.torch_learners": 1, "model.task": "examples/hf_gpt2.py:task"},
     "decides its own framework"),
    ({"run.torch_learners": 1, "run.mode": "dp"}, "JAX ones"),
])
def test_torch_learners_refused_where_they_cannot_run(sets: dict[str, object],
                                                      match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_config(None, sets)


def test_a_run_without_torch_names_the_extra(tmp_path: Path) -> None:
    hidden = tmp_path / "hide"
    hidden.mkdir()
    (hidden / "torch.py").write_text("raise ImportError('torch hidden by the test')\n")
    env = {**os.environ, "PYTHONPATH": f"{hidden}{os.pathsep}{os.environ.get('PYTHONPATH', '')}"}
    out = tmp_path / "out"
    proc = subprocess.run([sys.executable, "-m", "ddiloco.cli", "run", "--no-live", "--out",
                           str(out), "--set", "run.torch_learners=1"], capture_output=True,
                          text=True, env=env, cwd=ROOT, timeout=120)
    assert proc.returncode == 2, proc.stderr
    assert "pip install 'ddiloco[torch]'" in proc.stderr and "Traceback" not in proc.stderr
    assert not out.exists()  # refused before anything was written
