"""``sync.blocking`` end to end: synchronous DiLoCo (M = K = 2, tau = 0, fp32 both ways) through
``ddiloco run`` with real learners, shard and Redis, with one fragment and with four.

From the run's event stream: every merge holds both learners; every round a learner waited
for was released by a version that merged its delta, before it took a step past the send; no
wait timed out (four fragments: no two learners each waiting for a round the other has not
sent); and the token fate balances exactly.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from ddiloco.store import EmbeddedRedis, RedisStore
from ddiloco.store.connect import connect
from tests._runs import run_ci_tiny

pytestmark = [pytest.mark.integration, pytest.mark.timeout(240)]

STEPS = 36
H = 6


# Four fragments, not the ladder's one: with several fragments an early round join could shift
# one learner's schedule against the other's and deadlock both; P = 1 is the simpler case.
@pytest.mark.parametrize("fragments", [4])
def test_blocking_run_is_synchronous_diloco(fragments: int, tmp_path: Path) -> None:
    out = tmp_path / "run"
    sets = ["sync.blocking=true", "sync.min_quorum=2", f"sync.fragments={fragments}",
            "sync.tau=0", "sync.codec_up=fp32", "sync.codec_down=fp32", "data.iid=true",
            f"sync.H={H}"]
    block, run_id = run_ci_tiny(out, STEPS, sets, timeout_s=220)
    fate = block["token_fate"]
    assert fate["processed"] == 2 * STEPS * 8 * 32  # learners x steps x batch x seq
    assert fate["balance"] == 0
    assert sum(fate["lost"].values()) == 0
    assert fate["discarded"].get("overwritten", 0) == 0

    with EmbeddedRedis(out / "redis") as server:
        store = RedisStore(connect(server.url), run_id)
        events = [e for _, e in store.events()]
    merges = [e for e in events if e["kind"] == "merge"]
    waits = [e for e in events if e["kind"] == "round_wait"]
    # Every merge holds both learners (learners per merge == M).
    assert all(sorted(e["contributors"]) == ["learner-0", "learner-1"] for e in merges), \
        [e["contributors"] for e in merges]
    for p in range(fragments):
        versions = sorted(e["version"] for e in merges if e["fragment"] == p)
        assert len(versions) >= STEPS // H - 1, (p, versions)
        assert versions == list(range(1, len(versions) + 1))
        # Every round but the last (no step follows it) was waited for, by both learners.
        for learner in ("learner-0", "learner-1"):
            mine = sorted((e for e in waits if e["learner"] == learner and e["fragment"] == p),
                          key=lambda e: e["sent_step"])
            assert len(mine) >= STEPS // H - 1, (p, learner, mine)
            for e in mine:
                assert not e["timed_out"] and e["included"], e
                # tau = 0: released before the learner took any step past its send
                assert e["step"] == e["sent_step"], e
                assert e["version"] == e["base"] + 1, e
            assert [e["base"] for e in mine] == list(range(len(mine)))
