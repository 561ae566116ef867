"""Refusals and failures at the start of a run, each with one line that names the fix: a chaos
run into a folder that holds an earlier one (its learners would meet that run's checkpoints;
``--force`` removes only what a chaos run writes), CPU quotas off root, and a worker that
failed (named with its exit code and its log)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from ddiloco.bundled import resolve_chaos_script
from ddiloco.chaos.runner import CHAOS_MODES, CHAOS_TOP, run_chaos
from ddiloco.workers.run.config import load_config
from ddiloco.workers.run.rundir import OutHoldsRun, check_out, clear_run


def _earlier_chaos_run(out: Path) -> None:
    (out / "diloco" / "learner-0").mkdir(parents=True)
    (out / "diloco" / "learner-0" / "ckpt").write_text("x")
    (out / "diloco-ref").mkdir()
    (out / "diloco-ref" / "logs").write_text("y")
    (out / "chaos.json").write_text(json.dumps({"modes": {}}))
    (out / "notes.txt").write_text("the user's")


def test_a_second_chaos_run_into_the_same_out_is_refused(tmp_path: Path) -> None:
    out = tmp_path / "out-chaos"
    _earlier_chaos_run(out)
    before = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    cfg = load_config("ci-tiny", ["run.learners=4"])
    with pytest.raises(OutHoldsRun, match=r"out-chaos: holds files of an earlier run .*"
                       r"pass --force"):
        run_chaos(cfg, resolve_chaos_script("ci-short"), out, live=False)
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == before


def test_force_removes_only_what_a_chaos_run_writes(tmp_path: Path) -> None:
    out = tmp_path / "out-chaos"
    _earlier_chaos_run(out)
    found = check_out(out, force=True, top=CHAOS_TOP, modes=CHAOS_MODES)
    assert {str(p.relative_to(out)) for p in found} == {
        "chaos.json", "diloco/learner-0", "diloco-ref/logs"}
    clear_run(out, top=CHAOS_TOP, modes=CHAOS_MODES)
    assert sorted(p.name for p in out.iterdir()) == ["diloco", "diloco-ref", "notes.txt"]
    assert not any((out / "diloco").iterdir())


def test_cpu_quotas_off_root_are_refused_before_anything_starts() -> None:
    from ddiloco.chaos.faults import ChaosError
    from ddiloco.chaos.runner import check_cpu_limits
    from ddiloco.chaos.script import FaultKind, expand, load_script

    gentle = expand(load_script(resolve_chaos_script("gentle")), 4, 2, 0)
    with pytest.raises(ChaosError, match=r"^--isolate needs root .*leave --isolate out"):
        check_cpu_limits(gentle, isolate=True, euid=1000)
    check_cpu_limits(gentle, isolate=True, euid=0)
    slow = [a for a in expand(load_script(resolve_chaos_script("stragglers")), 4, 2, 0)
            if a.kind == FaultKind.SLOW]
    assert slow, "stragglers.yaml has slow faults"
    with pytest.raises(ChaosError, match=r"^slow faults need root .*remove the slow faults"):
        check_cpu_limits(slow, isolate=False, euid=1000)
    check_cpu_limits([a for a in gentle if a.kind != FaultKind.SLOW], isolate=False, euid=1000)


def test_a_failed_worker_is_named_with_its_exit_code_and_log(tmp_path: Path) -> None:
    import subprocess
    import sys

    from ddiloco.workers.run.launch import LocalCluster

    cluster = LocalCluster("redis://127.0.0.1:1", "run-x", tmp_path)
    worker = cluster.add_evaluator()
    worker.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    worker.proc.wait()
    log = tmp_path / "logs" / "evaluator.log"
    log.parent.mkdir(parents=True, exist_ok=True)
    log.write_text("starting\nValueError: [bad] task\n")
    first, *rest = cluster.failure("evaluator", "exited early").splitlines()
    assert first == (f"evaluator exited early (exit code 3; its log: {log}); the log ends:")
    assert rest == ["    starting", "    ValueError: [bad] task"]
    log.unlink()
    assert cluster.failure("evaluator", "failed") == (
        f"evaluator failed (exit code 3; its log: {log})")
