"""Standby learners (workers/learner/standby.py): the handover line a standby reads, and the
local cluster's hand-over rules. A standby taking over a killed learner in a real run is in
tests/test_integration.py (the shared cluster keeps one)."""

from __future__ import annotations

import io
import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddiloco.workers.learner.standby import BadHandover, Handover, read_handover
from ddiloco.workers.run.launch import LocalCluster


def test_the_handover_line_round_trips() -> None:
    h = Handover(id="learner-1", redis_url="redis://127.0.0.1:6379/0", log="/tmp/x.log",
                 steps=40, cpu=1, metrics_port=9101)
    assert read_handover(io.StringIO(h.line().decode())) == h


def test_a_closed_stdin_is_no_handover() -> None:
    assert read_handover(io.StringIO("")) is None


@pytest.mark.parametrize("line", [
    "not json\n",
    json.dumps({"redis_url": "redis://x"}) + "\n",                      # no id
    json.dumps({"id": "learner-1"}) + "\n",                             # no URL
    json.dumps({"id": "../etc", "redis_url": "redis://x"}) + "\n",      # not a worker name
    json.dumps({"id": "learner-1", "redis_url": "redis://x", "steps": 0}) + "\n",
    json.dumps({"id": "learner-1", "redis_url": "redis://x", "shell": "rm"}) + "\n",
])
def test_a_bad_handover_line_is_a_named_error(line: str) -> None:
    with pytest.raises(BadHandover, match="handover line"):
        read_handover(io.StringIO(line))


def _cluster_with_a_fake_standby(tmp_path: Path) -> tuple[LocalCluster, subprocess.Popen[bytes]]:
    """A cluster whose standby-0 is a process that records its stdin (no JAX)."""
    c = LocalCluster("redis://127.0.0.1:1/0", "run-s", tmp_path, standby=1)
    c.add_learner(1, max_steps=7)
    c.workers["learner-1"].starts = 1  # it ran before: a start is a restart
    s = c.add_standby()
    s.argv = [sys.executable, "-c", "import sys, pathlib; pathlib.Path(sys.argv[1])"
              ".write_text(sys.stdin.readline())", str(tmp_path / "got")]
    # the standby that replaces the one handed over must not start JAX either
    c.add_standby = lambda: _fake(c, tmp_path)  # type: ignore[method-assign]
    proc = c.start("standby-0").proc
    assert proc is not None
    return c, proc


def _fake(c: LocalCluster, tmp_path: Path) -> object:
    name = f"standby-{c.standbys_started}"
    c.standbys_started += 1
    from ddiloco.workers.run.launch import Worker

    c.workers[name] = Worker(name, [sys.executable, "-c", "import sys; sys.stdin.read()"])
    return c.workers[name]


def test_a_restarted_learner_is_handed_to_a_live_standby(tmp_path: Path) -> None:
    c, proc = _cluster_with_a_fake_standby(tmp_path)
    try:
        w = c.start("learner-1")
        assert w.proc is proc and c.handovers == 1 and w.starts == 2
        proc.wait(timeout=30)
        got = Handover.model_validate_json((tmp_path / "got").read_text())
        assert got.id == "learner-1" and got.steps == 7
        assert got.log == str(tmp_path / "logs" / "learner-1.log")
        # the standby is replaced, under a new name
        assert "standby-0" not in c.workers and c.workers["standby-1"].alive
    finally:
        c.stop_all()


def test_a_learner_under_its_own_group_or_namespace_starts_fresh(tmp_path: Path) -> None:
    c, proc = _cluster_with_a_fake_standby(tmp_path)
    try:
        c.workers["learner-1"].gid = 12345  # chaos partitions tell it apart by its group
        assert not c._hand_over("learner-1")
        c.workers["learner-1"].gid = None
        c.placement["learner-1"] = (["ip", "netns", "exec", "x"], None)
        assert not c._hand_over("learner-1")
        assert c.handovers == 0 and proc.poll() is None
    finally:
        c.stop_all()


def test_standbys_are_not_in_commands_or_metrics(tmp_path: Path) -> None:
    c = LocalCluster("redis://127.0.0.1:1/0", "run-s", tmp_path, standby=1, metrics_base=9000)
    c.add_learner(0)
    c.add_standby()
    c.write_commands(tmp_path / "commands.sh")
    assert "# standby" not in (tmp_path / "commands.sh").read_text()
    assert set(c.metrics_targets()) == {"learner-0"}


def test_a_run_whose_learners_are_all_placed_keeps_no_standby(tmp_path: Path) -> None:
    c = LocalCluster("redis://127.0.0.1:1/0", "run-s", tmp_path, standby=2)
    c.add_learner(0)
    c.placement["learner-0"] = (["true"], None)  # the command exits at once
    try:
        c.start_all()
        assert c.names("standby-") == []
    finally:
        c.stop_all()


def test_the_chaos_supervisor_hands_a_learner_that_exited_to_a_standby(tmp_path: Path) -> None:
    """A learner that exits on its own is started again by the chaos runner's supervisor,
    through a standby: the hand-over replaces the standby's entry while the supervisor walks
    the workers."""
    from ddiloco.chaos.fault_loop import Pending
    from ddiloco.chaos.runner import _supervise

    c, proc = _cluster_with_a_fake_standby(tmp_path)
    exited = subprocess.Popen([sys.executable, "-c", "pass"])
    exited.wait()
    c.workers["learner-1"].proc = exited
    restarts: dict[str, int] = {}
    try:
        _supervise(c, set(), restarts, Pending())
        assert restarts == {"learner-1": 1} and c.handovers == 1
        assert c.workers["learner-1"].proc is proc
    finally:
        c.stop_all()
