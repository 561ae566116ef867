"""Rebuilding Redis from the object store (store/version_records.py, store/rebuild.py): the
chain rule by hand, then a real Redis emptied and rebuilt from files and from a real S3 server."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
import redis

from ddiloco.pipeline.errors import AlreadyMerged, ConfigError, StoreUnavailable
from ddiloco.store.core import RedisCore
from ddiloco.store.embedded import EmbeddedRedis
from ddiloco.store.objects import CorruptObject, Pointer
from ddiloco.store.rebuild import (
    COUNTER_GAP,
    RunExists,
    rebuild,
    restore_telemetry,
    snapshot_telemetry,
)
from ddiloco.store.redis_store import RedisStore
from ddiloco.store.version_records import VersionRecord, plan_fragment, record_path

RUN = "rb-run"


def rec(version: int, token: str, parent: str, *, epoch: int = 1, keep: int = 3,
        t: float = 0.0) -> VersionRecord:
    base = f"{RUN}/f0/v{version:012d}-{token}"
    return VersionRecord(fragment=0, version=version, epoch=epoch, updated_at=t, token=token,
                         parent=parent, keep=keep, meta={}, value=Pointer(base + ".value", 4, 0),
                         momentum=Pointer(base + ".momentum", 4, 0))


def blobs_of(*records: VersionRecord) -> set[str]:
    return {p for r in records for p in r.complete_in}


# -- the chain rule ---------------------------------------------------------------------------
def test_the_chain_follows_parent_tokens_up_to_keep() -> None:
    chain = [rec(0, "a0", ""), rec(1, "a1", "a0"), rec(2, "a2", "a1"), rec(3, "a3", "a2")]
    # a writer that lost the race for version 2 left b2 (built on a1) behind
    loser = rec(2, "b2", "a1", epoch=0)
    got = plan_fragment([*chain, loser], blobs_of(*chain, loser))
    assert [(r.version, r.token) for r in got] == [(3, "a3"), (2, "a2"), (1, "a1")]  # keep = 3


def test_the_newest_needs_both_blobs_and_ties_go_to_the_higher_epoch() -> None:
    a1, half = rec(1, "a1", "a0"), rec(2, "c2", "a1", epoch=9)
    a0 = rec(0, "a0", "")
    fenced, successor = rec(2, "f2", "a1", epoch=1), rec(2, "s2", "a1", epoch=2)
    present = blobs_of(a0, a1, fenced, successor) | {half.value.path}  # half: no momentum
    got = plan_fragment([a0, a1, half, fenced, successor], present)
    assert [r.token for r in got] == ["s2", "a1", "a0"]


def test_a_missing_link_ends_the_chain_and_no_usable_record_gives_none() -> None:
    a2, a3 = rec(2, "a2", "a1"), rec(3, "a3", "a2")
    assert [r.token for r in plan_fragment([a2, a3], blobs_of(a2, a3))] == ["a3", "a2"]
    assert plan_fragment([a3], set()) == []


def test_a_record_checks_itself_against_its_path() -> None:
    r = rec(4, "ab", "aa")
    path = record_path(RUN, 0, 4, "ab")
    assert VersionRecord.decode(r.encode(), path) == r
    with pytest.raises(CorruptObject, match="its path"):
        VersionRecord.decode(r.encode(), record_path(RUN, 0, 5, "ab"))
    with pytest.raises(CorruptObject, match="format"):
        VersionRecord.decode(b'{"format": "other"}', path)
    with pytest.raises(CorruptObject):
        VersionRecord.decode(b"not json", path)


# -- a real Redis, emptied and rebuilt --------------------------------------------------------


@pytest.fixture(params=["file", pytest.param("s3", marks=pytest.mark.integration)])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file://{tmp_path / 'blobs'}"
    return str(request.getfixturevalue("s3_server").url(f"rebuild-{tmp_path.name}"))


@pytest.fixture
def store(real_redis: redis.Redis, location: str) -> Iterator[RedisStore]:
    st = RedisStore(real_redis, RUN)
    st.set_blob_location(location)
    try:
        yield st
    finally:
        st.flush_run()


def fill(st: RedisStore) -> None:
    """Two fragments: initial values, four versions of fragment 0 (keep 2) with ledgers from
    two learners, one of fragment 1; events and a counter."""
    st.put_manifest({"schema_hash": "h1", "fragments": 2})
    st.put_initial(0, b"init-0" * 100)
    st.put_initial(1, b"init-1" * 100)
    st.register_learner("learner-0")
    st.register_learner("learner-1")
    st.register_learner("learner-1")  # a restart: incarnation 2
    st.claim_fragment(0, 3)
    for v in range(4):
        st.publish(0, expected_version=v - 1, epoch=3, value=f"value-{v}".encode() * 50,
                   momentum=f"mom-{v}".encode() * 50, keep=2, meta={"round": v},
                   ledger=[("learner-0:1", 2 * v, 2 * v + 1), ("learner-1:2", v, v)])
    st.publish(1, expected_version=-1, epoch=2, value=b"v1" * 64, momentum=b"m1" * 64, keep=2)
    st.add_event("merge", {"fragment": 0})
    st.incr_counter("drops", "stale", 3)


def redis_view(st: RedisStore, client: redis.Redis) -> dict[str, object]:
    """What a worker reads: heads, kept versions with blobs, manifest, initial values."""
    heads = st.heads(2)
    out: dict[str, object] = {"heads": [(h.version, h.epoch, h.updated_at, h.token)
                                        for h in heads if h is not None],
                              "manifest": st.get_manifest(),
                              "initial": [st.get_initial(p) for p in (0, 1)],
                              "ledger": {k: v for k, v in client.hgetall(st.keys.head(0)).items()
                                         if k.startswith(b"merged:")}}
    for p, h in enumerate(heads):
        assert h is not None
        for v in range(h.version + 1):
            blob = st.get_version(p, v)
            out[f"{p}/{v}"] = None if blob is None else (blob.value, blob.momentum, blob.meta)
    return out


@pytest.mark.integration
def test_rebuild_recreates_what_workers_read(store: RedisStore, real_redis: redis.Redis,
                                             location: str) -> None:
    fill(store)
    before = redis_view(store, real_redis)
    assert before["0/1"] is None and before["0/3"] is not None  # keep = 2
    RedisCore.flush_run(store)  # Redis loses the run; the objects stay
    assert store.get_manifest() is None

    report = rebuild(real_redis, RUN, location)
    assert report.heads == {0: 3, 1: 0} and report.kept == {0: 2, 1: 1}
    fresh = RedisStore(real_redis, RUN)
    assert redis_view(fresh, real_redis) == before
    # counters start above anything the records show; the registry knows both learners
    assert int(real_redis.get(fresh.keys.epoch)) == 3 + COUNTER_GAP
    assert report.learners == {"learner-0": 1 + COUNTER_GAP, "learner-1": 2 + COUNTER_GAP}
    assert fresh.register_learner("learner-1") == 3 + COUNTER_GAP
    assert fresh.known_learner("learner-0")
    assert (fresh.acquire_lease(0, "shard-0", 10_000) or 0) > 3 + COUNTER_GAP
    # training goes on where it stopped, and the ledger still refuses a second merge
    with pytest.raises(AlreadyMerged):
        fresh.publish(0, expected_version=3, epoch=3, value=b"x", momentum=b"y", keep=2,
                      ledger=[("learner-0:1", 7, 7)])
    assert fresh.publish(0, expected_version=3, epoch=3, value=b"x", momentum=b"y", keep=2,
                         ledger=[("learner-0:1", 8, 9)]) == 4
    # telemetry is not rebuilt (docs/RELIABILITY.md)
    assert fresh.events() == []


@pytest.mark.integration
def test_rebuild_refuses_a_redis_that_holds_the_run(store: RedisStore, real_redis: redis.Redis,
                                                   location: str) -> None:
    fill(store)
    with pytest.raises(RunExists, match=RUN):
        rebuild(real_redis, RUN, location)


@pytest.mark.integration
def test_rebuild_needs_an_object_store_and_a_manifest(real_redis: redis.Redis,
                                                     tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nothing to rebuild"):
        rebuild(real_redis, RUN, "redis")
    with pytest.raises(Exception, match="no manifest"):
        rebuild(real_redis, RUN, f"file://{tmp_path / 'empty'}")


@pytest.mark.integration
def test_orphans_a_rebuild_takes_and_leaves(store: RedisStore, real_redis: redis.Redis,
                                             location: str, monkeypatch: pytest.MonkeyPatch,
                                             ) -> None:
    fill(store)
    objs = store._objects_for_write()
    assert objs is not None
    monkeypatch.setattr(objs, "delete", lambda paths: None)  # a crash skips the clean-up
    # a fenced-out writer's version 3 (epoch 2 < 3): refused, its objects left behind
    with pytest.raises(Exception, match="FENCED"):
        store.publish(0, expected_version=2, epoch=2, value=b"fenced", momentum=b"m",
                      keep=2, token="dead")
    # version 4 whose objects were written but whose compare-and-set never ran (Redis died)
    def lost(*args: object) -> None:
        raise StoreUnavailable("Redis died before the script ran")
    monkeypatch.setattr(store, "_publish_durably", lost)
    with pytest.raises(StoreUnavailable):
        store.publish(0, expected_version=3, epoch=3, value=b"orphan", momentum=b"m4",
                      keep=2, token="feed")
    committed3 = store.get_version(0, 3)
    RedisCore.flush_run(store)
    report = rebuild(real_redis, RUN, location)
    assert report.heads[0] == 4 and report.skipped >= 1
    fresh = RedisStore(real_redis, RUN)
    head = fresh.get_latest(0)
    assert head is not None and head.version == 4 and head.value == b"orphan"
    assert fresh.head(0).token == "feed"  # type: ignore[union-attr]
    # below it, the committed version 3, not the fenced writer's
    assert fresh.get_version(0, 3) == committed3


@pytest.mark.integration
def test_telemetry_can_be_carried_over(real_redis: redis.Redis) -> None:
    st = RedisStore(real_redis, RUN)
    st.add_event("merge", {"fragment": 0})
    st.incr_counter("drops", "stale", 2)
    st.publish(0, expected_version=-1, epoch=1, value=b"v", momentum=b"m", keep=1)
    snap = snapshot_telemetry(real_redis, RUN)
    assert len(snap) == 2  # the events stream and one counter group; not the head
    real_redis.flushdb()
    assert restore_telemetry(real_redis, snap) == 2
    assert [e["kind"] for _, e in st.events()] == ["merge"]
    assert st.counters("drops") == {"stale": 2}


@pytest.mark.integration
def test_the_cli_rebuilds_once_and_then_refuses(store: RedisStore, real_redis: redis.Redis,
                                                location: str, redis_server: EmbeddedRedis,
                                                ) -> None:
    fill(store)
    RedisCore.flush_run(store)
    args = [sys.executable, "-m", "ddiloco.cli", "store", "rebuild", "--redis-url",
            redis_server.url, "--run-id", RUN, "--blobs", location]
    done = subprocess.run([*args, "--json"], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["heads"] == {"0": 3, "1": 0}
    again = subprocess.run(args, capture_output=True, text=True, timeout=120)
    assert again.returncode == 2 and f"run {RUN!r} is already in this Redis" in again.stderr
    assert len(again.stderr.strip().splitlines()) == 1, again.stderr
