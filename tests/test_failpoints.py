"""Exactly once under store faults (docs/RELIABILITY.md): failpoints, the merge ledger, commit
then apply, receive then record, and the sweep of a real shard process over every point of its
merge and receive paths."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ddiloco.chaos.failpoint_sweep import OBJECT_POINTS, cases, sweep
from ddiloco.chaos.invariants import check_exactly_once
from ddiloco.pipeline import wire
from ddiloco.pipeline.errors import AlreadyMerged, StoreUnavailable
from ddiloco.pipeline.wire import Header, Kind
from ddiloco.store import EmbeddedRedis, RedisStore
from ddiloco.store.failpoints import (
    ENV,
    POINTS,
    FailpointFired,
    UnknownFailpoint,
    arm,
    from_env,
    parse,
    with_failpoints,
)
from ddiloco.workers.syncer.records import ShardRecords
from tests.test_hostile import RUN, header, make_core, small

# ------------------------------------------------------------------------ the spec


def test_spec_parses_places_counts_calls_and_workers() -> None:
    arms = parse("store.publish=after-effect:once@3, shard-1/store.add_event=before:always,"
                 "objects.put=after:2")
    assert [(a.point, a.place, a.times, a.skip, a.worker) for a in arms] == [
        ("store.publish", "after-effect", 1, 2, None),
        ("store.add_event", "before", -1, 0, "shard-1"),
        ("objects.put", "after", 2, 0, None)]
    # a worker gets the points armed for every worker and its own
    env = {ENV: "store.publish=before,shard-1/store.head=before"}
    assert sorted(from_env(env, worker="shard-1").arms) == ["store.head", "store.publish"]
    assert sorted(from_env(env, worker="learner-0").arms) == ["store.publish"]
    assert not from_env({}, worker="shard-0")


@pytest.mark.parametrize("spec, message", [
    ("store.pubish=before", "unknown failpoint 'store.pubish'; the points are: "),
    ("store.publish=sideways", "unknown place 'sideways'; the places are before, "
                               "after-effect, after"),
    ("store.publish", "write store.publish=PLACE"),
    ("store.publish=before:twice", "count 'twice' must be once, always or a number"),
    ("store.publish=before@0", "must be a call number >= 1"),
])
def test_a_bad_spec_is_refused_by_name(spec: str, message: str) -> None:
    with pytest.raises(UnknownFailpoint, match=message.replace("(", r"\(")) as info:
        parse(spec)
    if "the points are" in message:
        assert all(p in str(info.value) for p in POINTS)


class Recorder:
    """A store double that records the calls that reached it."""

    def __init__(self) -> None:
        self.calls: list[str] = []

    def publish(self, p: int) -> int:
        self.calls.append(f"publish {p}")
        return p + 1

    def head(self, p: int) -> int:
        self.calls.append(f"head {p}")
        return p


def test_each_place_fails_where_it_says() -> None:
    inner = Recorder()
    # unarmed: the store itself, not a proxy (zero cost)
    assert with_failpoints(inner, arm("")) is inner
    s: Any = with_failpoints(inner, arm("store.publish=before@2"))
    assert s.publish(1) == 2
    with pytest.raises(FailpointFired, match="did not run"):
        s.publish(2)
    assert inner.calls == ["publish 1"]
    assert s.publish(3) == 4  # once
    s = with_failpoints(inner, arm("store.publish=after-effect"))
    with pytest.raises(StoreUnavailable, match="took effect"):
        s.publish(5)
    assert inner.calls[-1] == "publish 5"
    s = with_failpoints(inner, arm("store.publish=after"))
    assert s.publish(7) == 8  # the reply arrives ...
    with pytest.raises(FailpointFired):
        s.head(0)  # ... and the next call, whichever it is, finds the store down
    assert inner.calls[-1] == "publish 7"
    assert s.head(0) == 0


# ------------------------------------------------------------------------ the merge ledger


def test_the_store_refuses_a_publish_that_merges_a_delta_twice(store: RedisStore) -> None:
    store.publish(0, expected_version=-1, epoch=1, value=b"v0", momentum=b"", keep=4)
    store.publish(0, expected_version=0, epoch=1, value=b"v1", momentum=b"", keep=4,
                  ledger=[("learner-0:1", 3, 5)])
    with pytest.raises(AlreadyMerged, match="learner-0:1 seq 5 <= merged 5"):
        store.publish(0, expected_version=1, epoch=1, value=b"v2", momentum=b"", keep=4,
                      ledger=[("learner-1:1", 1, 1), ("learner-0:1", 5, 6)])
    assert store.head(0).version == 1  # nothing written
    # newer deltas of the same incarnation, and a new incarnation, pass
    assert store.publish(0, expected_version=1, epoch=1, value=b"v2", momentum=b"", keep=4,
                         ledger=[("learner-0:1", 6, 6), ("learner-0:2", 1, 1)]) == 2
    # a repeat of a publish that took effect (same token) is answered as its success
    assert store.publish(0, expected_version=2, epoch=1, value=b"v3", momentum=b"", keep=4,
                         token="t3", ledger=[("learner-0:1", 7, 7)]) == 3
    assert store.publish(0, expected_version=2, epoch=1, value=b"v3", momentum=b"", keep=4,
                         token="t3", ledger=[("learner-0:1", 7, 7)]) == 3
    assert store.head(0).token == "t3"


# ------------------------------------------------------------------------ commit, then apply


def _round(core: Any, clock: Any, seq0: int, base: int) -> list[list[bytes]]:
    for i, who in enumerate(("learner-0", "learner-1")):
        core.handle(wire.encode(header(sender=who, seq=seq0, base=base,
                                       step=24 * (base + 1)), small(core, seed=10 * base + i)))
    clock.now += 5.0
    return core.tick()


@pytest.mark.parametrize("place", ["before", "after-effect", "after"])
def test_a_failed_publish_is_settled_by_the_heads_token(place: str) -> None:
    twin, _, twin_clock = make_core({"sync.min_quorum": 2})
    core, store, clock = make_core({"sync.min_quorum": 2})
    core.store = with_failpoints(store, arm(f"store.publish={place}@2"))
    core.records.store = core.store
    for c, cl in ((core, clock), (twin, twin_clock)):
        assert len(_round(c, cl, 1, 0)) == 1
    if place == "after":
        # the reply came back: committed; the merge event waits for the store, queued
        frames = _round(core, clock, 2, 1)
        assert len(frames) == 1 and len(core.records) == 1
        assert core.records.flush() == 0
    else:
        with pytest.raises(StoreUnavailable):
            _round(core, clock, 2, 1)
        st = core.frags[0]
        assert st.pending is not None and st.version == 1 and not st.contributions
        # a delta anchored at the version being committed waits for the settle
        core.handle(wire.encode(header(sender="learner-0", seq=3, base=2, step=72),
                                small(core, seed=99)))
        assert len(core.held) == 1
        frames = core.tick()  # settles: applies (after-effect) or publishes (before)
        assert len(frames) == 1 and core.frags[0].pending is None
        core.records.flush()
        if core.held:
            core.retry_held()
        assert "learner-0" in core.frags[0].contributions
    _round(twin, twin_clock, 2, 1)
    assert core.frags[0].version == twin.frags[0].version == 2
    np.testing.assert_array_equal(core.frags[0].flat_value, twin.frags[0].flat_value)
    merges = [e for _, e in store.events(kinds={"merge"})]
    assert [m["version"] for m in merges] == [1, 2]
    assert check_exactly_once(store.events()).ok


def test_records_wait_for_the_store_and_keep_their_order() -> None:
    _core, store, _ = make_core()
    down = with_failpoints(store, arm("store.add_event=before:2,store.note_received=before"))
    rec = ShardRecords(down, "shard-0")
    rec.event("merge", {"version": 1})  # fails: queued
    rec.add_received("learner-0", 1, 100, None)  # behind it, in order
    rec.event("drop", {"reason": "stale"})
    assert len(rec) == 3
    assert rec.flush() == 3  # the second add_event failure
    assert rec.flush() == 2  # the event went; note_received failed
    assert rec.flush() == 0
    kinds = [e["kind"] for _, e in store.events() if e["kind"] in ("merge", "drop")]
    assert kinds == ["merge", "drop"]
    assert store.received_total("learner-0", 1, "shard-0") == 100


def test_a_delta_from_an_unknown_sender_waits_for_the_registry() -> None:
    core, store, _clock = make_core()
    core.known.discard("learner-1")
    core.store = with_failpoints(store, arm("store.known_learner=before"))
    core.records.store = core.store
    core.handle(wire.encode(header(sender="learner-1", seq=1), small(core)))
    assert len(core.held) == 1 and not core.frags[0].contributions
    core.retry_held()
    assert not core.held and "learner-1" in core.frags[0].contributions


# ------------------------------------------------------------------------ the sweep


@pytest.mark.integration
def test_the_sweep_of_every_merge_and_receive_point(redis_server: EmbeddedRedis,
                                                    tmp_path: Path) -> None:
    # each point once, at each place (the first call of it on the path; the full sweep,
    # `python -m ddiloco.chaos.failpoint_sweep`, adds later calls), and the recovery paths
    first = ("store.publish@3", "store.add_event@2", "store.incr_counter@1",
             "store.note_received@1", "store.received_total@1")
    specs = [*cases(first, compound=False),
             "store.publish=after-effect@3,store.head=before",
             "store.publish=before@1"]
    result = sweep(redis_server.url, tmp_path / "redis", specs, rounds=2, parallel=2)
    report = result.to_json()
    assert report["points"] == 6 and report["cases"] == len(specs)
    assert report["double_merges"] == 0
    assert result.ok, report
    # the version record: the last object a publish writes before the head moves (the full
    # sweep adds the value object)
    objects = sweep(redis_server.url, tmp_path / "file",
                    cases(OBJECT_POINTS[-1:], compound=False),
                    blobs=f"file://{tmp_path / 'objects'}", rounds=2, parallel=2)
    assert objects.ok, objects.to_json()


# ------------------------------------------------------------------------ supervised threads


def test_a_comms_thread_that_dies_is_reported_to_the_trainer() -> None:
    import logging

    from ddiloco.pipeline.errors import NonFinite
    from ddiloco.workers.learner.comms import Comms

    core, store, _ = make_core()
    c = Comms(store, core.manifest, "learner-0", 1, logging.getLogger("test"))

    def boom() -> None:
        raise NonFinite("a non-finite delta under sync.adopt=overwrite")

    c._send_pending = boom  # type: ignore[method-assign]
    c.start()
    c.join(timeout=30)
    assert not c.is_alive()
    assert c.failure == "NonFinite: a non-finite delta under sync.adopt=overwrite"


def test_the_reliability_doc_lists_every_point() -> None:
    doc = (Path(__file__).resolve().parent.parent / "docs" / "RELIABILITY.md").read_text()
    listed = set(re.findall(r"\b(?:store|objects)\.\w+", doc))
    missing = [p for p in POINTS if p not in listed]
    assert not missing, f"docs/RELIABILITY.md does not list {missing}"


# ------------------------------------------------------------------------ the DP baseline


class _QuietSockets:
    """The shard loop's sockets with nothing arriving; what it publishes is kept."""

    last_peer = None

    def __init__(self) -> None:
        self.sent: list[list[bytes]] = []

    def recv(self, timeout_ms: int) -> None:
        return None

    def publish(self, frames: list[bytes]) -> None:
        self.sent.append(frames)


def test_a_dp_checkpoint_of_unknown_outcome_is_settled_by_the_loop_with_nothing_arriving() -> None:
    """A DP checkpoint's publish took effect but its reply was lost. The job then stands still
    (a learner is down: no gradient comes, so no later checkpoint settles it). The shard's loop
    settles it from the head's token anyway, and logs it as a merge: the head never runs ahead
    of the merge events (the versions audit)."""
    import logging
    import threading
    import time

    from ddiloco.workers.dp import DPShardCore
    from ddiloco.workers.syncer.server import _serve_once

    core, store, _ = make_core({"run.mode": "dp", "run.learners": 2, "run.dp_publish_every": 1})
    assert isinstance(core, DPShardCore)
    core.store = with_failpoints(store, arm("store.publish=after-effect@1"))
    core.records.store = core.store
    g = [np.full(s, 1e-3, np.float32) for s in core.layout.shapes(0)]
    for i, who in enumerate(("learner-0", "learner-1")):
        out = core.handle(wire.encode(Header(kind=Kind.GRAD, run=RUN, sender=who, inc=1, seq=1,
                                             frag=0, ver=0, codec="bf16"), g))
        assert len(out) == i  # the average goes out once both are in; the checkpoint failed
    st = core.frags[0]
    assert st.dp_pending is not None  # type: ignore[attr-defined]
    assert store.head(0).version == 1 and not list(store.events(kinds={"merge"}))
    socks = _QuietSockets()
    now = time.monotonic()
    clock = {"house": now + 3600.0, "started": 0.0, "pub": now}
    code = _serve_once(core, socks, core.store, core.cfg,  # type: ignore[arg-type]
                       threading.Event(), clock, logging.getLogger("test"))
    assert code is None
    assert st.dp_pending is None and st.version == 1  # type: ignore[attr-defined]
    merges = [e for _, e in store.events(kinds={"merge"})]
    assert [(m["fragment"], m["version"], m["dp_step"]) for m in merges] == [(0, 1, 0)]
