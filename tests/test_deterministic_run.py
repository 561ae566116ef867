"""``run.deterministic`` end to end: two ``ddiloco run`` s of the CI model with the same seed
(real learners, shard, evaluator and Redis; M = 2, P = 4, tau = 2, int4 both ways) give the
same final validation loss, the same loss for every round both evaluated, and the same stored
fragments, bit for bit. From the event stream: every merge holds both learners, every round
is released at its send step + tau (or at the end of training), none times out, and the token
fate balances. A learner started by hand against the finished run is refused.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from ddiloco.store import EmbeddedRedis, RedisStore
from ddiloco.store.connect import connect
from ddiloco.workers.run.deterministic import LAUNCHED_ENV
from tests._runs import run_ci_tiny

pytestmark = [pytest.mark.integration, pytest.mark.timeout(420)]

ROOT = Path(__file__).resolve().parent.parent
STEPS = 36
TAU = 2
LEARNERS = ["learner-0", "learner-1"]


def _run(out: Path) -> dict[str, Any]:
    """One deterministic run of ci-tiny at seed 0; its report block, events and heads."""
    # On a loaded 2-core machine a learner may compile its first step long after the other
    # sent its first delta: a generous bound, since a timeout stops a deterministic run.
    block, run_id = run_ci_tiny(out, STEPS, ["run.deterministic=true", "train.seed=0",
                                             "sync.blocking_timeout_s=300"])
    with EmbeddedRedis(out / "redis") as server:
        store = RedisStore(connect(server.url), run_id)
        events = [e for _, e in store.events()]
        heads = [store.get_latest(p) for p in range(4)]
    assert all(h is not None for h in heads)
    return {"block": block, "events": events,
            "heads": [(h.version, bytes(h.value)) for h in heads if h is not None],
            "run_id": run_id}


def _evals(events: list[dict[str, Any]]) -> dict[Any, float]:
    """Evaluation key (a round, or "final") -> loss."""
    return {("final" if e.get("final") else e["round"]): e["loss"]
            for e in events if e["kind"] == "eval"}


def test_two_runs_of_one_seed_give_the_same_bits(tmp_path: Path) -> None:
    a, b = _run(tmp_path / "a"), _run(tmp_path / "b")

    assert a["block"]["final_val_loss"] == b["block"]["final_val_loss"]
    assert a["heads"] == b["heads"]  # versions and every stored float32, bit for bit
    ea, eb = _evals(a["events"]), _evals(b["events"])
    assert "final" in ea and "final" in eb
    assert ea["final"] == a["block"]["final_val_loss"]
    shared = set(ea) & set(eb)
    assert len(shared) >= 3, (ea, eb)
    assert {k: ea[k] for k in shared} == {k: eb[k] for k in shared}

    for run in (a, b):
        events = run["events"]
        fate = run["block"]["token_fate"]
        assert fate["processed"] == 2 * STEPS * 8 * 32  # learners x steps x batch x seq
        assert fate["balance"] == 0 and sum(fate["lost"].values()) == 0
        merges = [e for e in events if e["kind"] == "merge"]
        assert all(e["contributors"] == LEARNERS for e in merges), merges
        waits = [e for e in events if e["kind"] == "round_wait"]
        assert len(waits) == 2 * len(merges)  # every learner waited for every round
        for e in waits:
            assert not e["timed_out"] and e["included"] and e["version"] == e["base"] + 1, e
            # adopted after step send + tau exactly; rounds sent in the last tau steps (and
            # the drain's) at the end of training
            assert e["step"] == min(e["sent_step"] + TAU, STEPS), e

    # A learner started by hand against the deterministic run is refused before it registers.
    with EmbeddedRedis(tmp_path / "a" / "redis") as server:
        env = {k: v for k, v in os.environ.items() if k != LAUNCHED_ENV}
        proc = subprocess.run(
            [sys.executable, "-m", "ddiloco.workers", "learner", "--redis-url", server.url,
             "--run-id", a["run_id"], "--id", "learner-0", "--run-dir", str(tmp_path / "hand")],
            capture_output=True, text=True, timeout=120, cwd=ROOT, env=env)
        assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
        assert "learner-0 was not started by `ddiloco run`" in proc.stderr
        assert RedisStore(connect(server.url), a["run_id"]).live_learners() == {}
