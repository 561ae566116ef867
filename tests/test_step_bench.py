"""bench/step.py: the PyTorch/JAX ratio by hand, and one real measurement of both frameworks."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests._bench import ROOT, load_bench

step = load_bench("step")


def _r(fw: str, mode: str, tps: float, cap: float, batch: int = 32) -> object:
    return step.Result(mode, fw, batch, 64, 4, tps, 1.0, cap, 1.0, 0.0, 0.0)


def test_torch_vs_jax_pairs_each_mode_and_shape_and_skips_unpaired_ones() -> None:
    best = [_r("jax", "procs", 30_000.0, 32_000.0), _r("torch", "procs", 15_000.0, 12_800.0),
            _r("jax", "single", 9_000.0, 18_000.0), _r("torch", "single", 10_800.0, 18_000.0),
            _r("torch", "procs", 5_000.0, 5_000.0, batch=8)]  # no JAX twin: left out
    assert step.torch_vs_jax(best) == [
        {"mode": "procs", "batch": 32, "seq": 64, "tokens_per_s": 0.5, "capacity": 0.4},
        {"mode": "single", "batch": 32, "seq": 64, "tokens_per_s": 1.2, "capacity": 1.0}]


def test_both_frameworks_are_measured_on_the_learners_own_steps() -> None:
    pytest.importorskip("torch")
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "step.py"), "--framework", "both", "--configs",
         "4x16", "--procs", "2", "--no-single", "--steps", "3", "--warmup", "1"],
        capture_output=True, text=True, cwd=ROOT, timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    line = json.loads(proc.stdout.strip().splitlines()[-1])
    assert {(r["framework"], r["mode"], r["procs"]) for r in line["results"]} == {
        ("jax", "procs", 2), ("torch", "procs", 2)}
    assert all(r["tokens_per_s"] > 0 and r["step_ms"] > 0 for r in line["results"])
    (ratio,) = line["torch_vs_jax"]
    assert ratio["batch"] == 4 and ratio["seq"] == 16 and ratio["tokens_per_s"] > 0
    assert line["torch_blas"] != "unknown" and line["cpu_model"]
