"""The parameter store (DESIGN §3): one suite run on fakeredis and on a real redis-server.

Tests that need a real server process (AOF persistence, connection failures) follow the shared
suite and are marked ``integration``.
"""

from __future__ import annotations

import inspect
import os
import signal
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import fakeredis
import pytest
import redis

from ddiloco.pipeline.errors import (
    ConfigError,
    FencedOut,
    ManifestMismatch,
    StoreError,
    StoreUnavailable,
    VersionConflict,
)
from ddiloco.pipeline.waiting import wait_until
from ddiloco.store import (
    STOP_ROLES,
    EmbeddedRedis,
    FragmentBlob,
    FragmentHead,
    MembershipStore,
    ParameterStore,
    RedisStore,
    RunStore,
    TelemetryStore,
    VersionStore,
    connect,
    redact_url,
)
from ddiloco.store import telemetry as telemetry_module
from ddiloco.store import versions as versions_module
from ddiloco.store.membership import RedisMembership
from ddiloco.store.telemetry import RedisTelemetry
from ddiloco.store.versions import RedisVersions

pytestmark = pytest.mark.timeout(60)

# Blobs with NUL and non-UTF-8 bytes: the store must be binary-safe.
BLOB = bytes(range(256)) * 4


@pytest.fixture
def store(store_client: redis.Redis, blob_location: str) -> Iterator[RedisStore]:
    """The suite's store on each Redis (fakeredis, real) and each blob location (Redis strings,
    files, a real S3 server): every guarantee below holds for every backend."""
    st = RedisStore(store_client, "test-run")
    st.set_blob_location(blob_location)
    try:
        yield st
    finally:
        st.flush_run()


def put(store: RedisStore, p: int, expected: int, *, epoch: int = 1, keep: int = 4) -> int:
    """Publish a recognisable version ``expected + 1`` of fragment ``p``."""
    n = expected + 1
    return store.publish(
        p,
        expected_version=expected,
        epoch=epoch,
        value=f"value {p}/{n}".encode() + BLOB,
        momentum=f"momentum {p}/{n}".encode(),
        keep=keep,
        meta={"n": n},
        now=1000.0 + n,
    )


def fragment_keys(client: redis.Redis, p: int) -> set[str]:
    return {k.decode() for k in client.scan_iter(match=f"ddl:{{test-run:{p}}}:*")}


def expire_now(client: redis.Redis, key: str) -> None:
    """Let ``key``'s TTL run out now, on either backend and without waiting: an expiry time in
    the past (PEXPIREAT 1 ms after the epoch) deletes the key as its expiry would."""
    assert client.pttl(key) > 0, f"{key} has no TTL to run out"
    assert client.pexpireat(key, 1)
    assert not client.exists(key)


# --------------------------------------------------------------------------------------------
# construction
# --------------------------------------------------------------------------------------------


PROTOCOLS = [RunStore, VersionStore, MembershipStore, TelemetryStore, ParameterStore]


def protocol_members(proto: type) -> set[str]:
    """Public names a protocol declares, its base protocols' included."""
    names: set[str] = set()
    for base in proto.__mro__:
        if base in PROTOCOLS:
            names |= {n for n in (*vars(base), *base.__annotations__) if not n.startswith("_")}
    return names


def public_names(cls: type) -> set[str]:
    return {n for n in dir(cls) if not n.startswith("_")}


def test_store_satisfies_protocol(store: RedisStore) -> None:
    # The static proof is the TYPE_CHECKING block of store/redis_store.py, checked by mypy
    # (`make lint`); this is the runtime view of the same claim.
    typed: ParameterStore = store
    for proto in PROTOCOLS:
        assert isinstance(typed, proto)
    assert typed.run_id == "test-run"


@pytest.mark.parametrize(
    ("proto", "impl"),
    [(VersionStore, RedisVersions), (MembershipStore, RedisMembership),
     (TelemetryStore, RedisTelemetry), (ParameterStore, RedisStore)],
    ids=lambda x: x.__name__,
)
def test_protocol_signatures_match_the_implementation(proto: type, impl: type) -> None:
    members = protocol_members(proto)
    assert "run_id" in members and "pipeline" in members
    for name in sorted(members - {"run_id"}):
        declared, actual = getattr(proto, name), getattr(impl, name, None)
        assert actual is not None, f"{impl.__name__} lacks {name}"
        if isinstance(declared, property):
            assert isinstance(actual, property), name
            continue
        # Same parameter names, kinds, defaults and annotations (the annotations are compared
        # as written: both modules use postponed evaluation).
        assert inspect.signature(actual) == inspect.signature(declared), name


def test_protocols_cover_every_public_method() -> None:
    # A method added to the store must be added to a protocol, or its callers fall back to Any.
    union = set().union(*(protocol_members(p) for p in PROTOCOLS[1:4]))
    assert protocol_members(ParameterStore) == union
    assert public_names(RedisStore) - {"keys", "clock"} == union - {"run_id"}
    parts = [(VersionStore, RedisVersions), (MembershipStore, RedisMembership),
             (TelemetryStore, RedisTelemetry)]
    own = public_names(RunStore)
    for proto, impl in parts:  # each concept lives in its own module
        assert public_names(impl) - {"keys", "clock"} - own == protocol_members(proto) - own - {
            "run_id"}, proto.__name__


def test_injected_clock_dates_what_callers_leave_undated(store_client: redis.Redis) -> None:
    now = [1000.0]
    store = RedisStore(store_client, "clocked", clock=lambda: now[0])
    store.publish(0, expected_version=-1, epoch=1, value=b"v", momentum=b"m", keep=2)
    assert store.head(0) == FragmentHead(0, 1, 1000.0)
    store.add_event("join", {"learner": "l0"})
    store.add_event("leave", {"learner": "l0"}, t=990.0)  # backdated by the caller
    assert [e["t"] for _, e in store.events()] == [1000.0, 990.0]
    now[0] = 1500.0
    store.request_stop("shards", "run finished")
    # A worker obeys a stop request only if it is not older than the worker's own start.
    assert store.stop_requested("shards", since=1500.0)
    assert not store.stop_requested("shards", since=1500.001)
    assert not store.stop_requested("evaluator", since=0.0)
    assert set(STOP_ROLES) == {"shards", "evaluator", "routers"}


@pytest.mark.parametrize("bad", ["", "a:b", "a{b}", "run*", "-lead", "x" * 129])
def test_run_id_must_be_key_safe(fake_redis: redis.Redis, bad: str) -> None:
    with pytest.raises(ConfigError, match="run_id"):
        RedisStore(fake_redis, bad)


def test_decoding_client_is_refused() -> None:
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer(), decode_responses=True)
    with pytest.raises(ConfigError, match="decode_responses"):
        RedisStore(client, "r")


# --------------------------------------------------------------------------------------------
# manifest
# --------------------------------------------------------------------------------------------


def test_manifest_first_writer_wins(store: RedisStore) -> None:
    assert store.get_manifest() is None
    manifest = {"schema_hash": "abc", "model": {"d": 64}, "fragments": [[0, 1], [2]]}
    assert store.put_manifest(manifest) == manifest
    assert store.get_manifest() == manifest
    # Same schema, other details: the stored manifest is the run's truth.
    assert store.put_manifest({**manifest, "note": "late joiner"}) == manifest


def test_manifest_mismatch_names_hashes_and_fields(store: RedisStore) -> None:
    store.put_manifest({"schema_hash": "abc", "model": {"d": 64}, "lr": 0.7})
    with pytest.raises(ManifestMismatch) as info:
        store.put_manifest({"schema_hash": "xyz", "model": {"d": 128}, "lr": 0.7})
    message = str(info.value)
    assert "'abc'" in message and "'xyz'" in message
    assert "model" in message and "schema_hash" in message
    assert "lr" not in message.split("differing fields:")[1]
    assert store.get_manifest() == {"schema_hash": "abc", "model": {"d": 64}, "lr": 0.7}


def test_manifest_needs_schema_hash(store: RedisStore) -> None:
    with pytest.raises(ConfigError, match="schema_hash"):
        store.put_manifest({"model": {}})


# --------------------------------------------------------------------------------------------
# fragments: compare-and-set publish, fencing, garbage collection, reads
# --------------------------------------------------------------------------------------------


def test_publish_versions_count_up_from_zero(store: RedisStore) -> None:
    assert store.head(0) is None
    assert [put(store, 0, v) for v in (-1, 0, 1)] == [0, 1, 2]
    assert store.head(0) == FragmentHead(version=2, epoch=1, updated_at=1002.0)
    blob = store.get_version(0, 1)
    assert blob == FragmentBlob(0, 1, b"value 0/1" + BLOB, b"momentum 0/1", {"n": 1})


def test_publish_conflict_writes_nothing(store: RedisStore, store_client: redis.Redis) -> None:
    put(store, 0, -1)
    put(store, 0, 0)
    before = fragment_keys(store_client, 0)
    for wrong in (-1, 0, 2, 7):
        with pytest.raises(VersionConflict, match="head version 1, expected"):
            put(store, 0, wrong)
    assert fragment_keys(store_client, 0) == before
    assert store.head(0) == FragmentHead(1, 1, 1001.0)
    assert store.get_version(0, 1) is not None  # untouched by the failed writes


def test_publish_arguments_are_checked(store: RedisStore) -> None:
    with pytest.raises(ValueError, match="keep"):
        put(store, 0, -1, keep=0)
    with pytest.raises(ValueError, match="expected_version"):
        put(store, 0, -2)
    assert store.head(0) is None


def test_fencing_by_epoch(store: RedisStore) -> None:
    store.claim_fragment(0, 5)
    assert store.head(0) is None  # a claim alone publishes nothing
    with pytest.raises(FencedOut):
        put(store, 0, -1, epoch=4)
    assert store.head(0) is None
    assert put(store, 0, -1, epoch=6) == 0
    assert store.head(0) == FragmentHead(0, 6, 1000.0)
    with pytest.raises(FencedOut):
        store.claim_fragment(0, 5)
    store.claim_fragment(0, 6)  # re-claiming with the same epoch is fine
    store.claim_fragment(0, 9)
    # A fenced writer learns it is fenced even when its expected version is also stale.
    with pytest.raises(FencedOut):
        put(store, 0, -1, epoch=6)
    assert put(store, 0, 0, epoch=9) == 1


def test_gc_keeps_exactly_keep_versions(store: RedisStore, store_client: redis.Redis) -> None:
    for v in range(-1, 6):  # versions 0..6
        put(store, 0, v, keep=3)
    assert [store.get_version(0, n) is not None for n in range(7)] == [False] * 4 + [True] * 3
    # head + (value, momentum, meta) of versions 4, 5, 6: nothing else lingers.
    assert len(fragment_keys(store_client, 0)) == 1 + 3 * 3


def test_keep_one_leaves_only_the_head_version(store: RedisStore) -> None:
    for v in range(-1, 3):
        put(store, 0, v, keep=1)
    assert store.get_version(0, 2) is None
    assert store.get_version(0, 3) is not None


def test_get_latest_reads_head_with_its_blobs(store: RedisStore) -> None:
    assert store.get_latest(0) is None
    for v in range(-1, 3):
        put(store, 0, v)
        latest = store.get_latest(0)
        assert latest is not None and latest.version == v + 1
        assert latest == store.get_version(0, v + 1)
    assert store.get_latest(0) == FragmentBlob(0, 3, b"value 0/3" + BLOB, b"momentum 0/3", {"n": 3})


def test_many_fragment_reads_in_one_round_trip(store: RedisStore) -> None:
    put(store, 0, -1)
    put(store, 2, -1)
    put(store, 2, 0)
    store.claim_fragment(1, 3)  # claimed, unpublished: still no head
    assert store.heads(3) == [FragmentHead(0, 1, 1000.0), None, FragmentHead(1, 1, 1001.0)]
    latest = store.get_latest_many([2, 1, 0])
    assert [b.version if b else None for b in latest] == [1, None, 0]
    assert latest[0] == store.get_latest(2)
    assert store.get_latest_many([]) == []


def test_publish_without_meta_and_empty_blobs(store: RedisStore) -> None:
    store.publish(3, expected_version=-1, epoch=1, value=b"", momentum=b"", keep=2)
    assert store.get_latest(3) == FragmentBlob(3, 0, b"", b"", {})


def test_missing_blob_is_an_error_not_a_torn_read(
    store: RedisStore, store_client: redis.Redis
) -> None:
    put(store, 0, -1)
    store_client.delete(store.keys.momentum(0, 0))  # what an evicting Redis could do
    with pytest.raises(StoreError, match="noeviction"):
        store.get_latest(0)
    with pytest.raises(StoreError, match="noeviction"):
        store.get_version(0, 0)


def test_publish_resent_after_lost_reply_succeeds(
    store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    # redis-py re-sends a script whose reply was lost; the second execution carries the same
    # token and must report the version it wrote, not a conflict.
    monkeypatch.setattr(versions_module.uuid, "uuid4", lambda: type("U", (), {"hex": "t1"}))
    assert put(store, 0, -1) == 0
    assert put(store, 0, -1) == 0
    monkeypatch.setattr(versions_module.uuid, "uuid4", lambda: type("U", (), {"hex": "t2"}))
    with pytest.raises(VersionConflict):
        put(store, 0, -1)


# --------------------------------------------------------------------------------------------
# leases and shard endpoints
# --------------------------------------------------------------------------------------------


def test_lease_acquire_renew_release(store: RedisStore) -> None:
    e1 = store.acquire_lease(0, "shard-a", ttl_ms=10_000)
    assert e1 is not None
    assert store.acquire_lease(0, "shard-b", ttl_ms=10_000) is None
    e2 = store.acquire_lease(1, "shard-b", ttl_ms=10_000)  # another shard, same counter
    e3 = store.acquire_lease(0, "shard-a", ttl_ms=10_000)  # re-acquire by the holder
    assert e2 is not None and e3 is not None and e1 < e2 < e3
    assert store.renew_lease(0, "shard-a", ttl_ms=10_000)
    assert not store.renew_lease(0, "shard-b", ttl_ms=10_000)
    store.release_lease(0, "shard-b")  # not the holder: no effect
    assert store.acquire_lease(0, "shard-b", ttl_ms=10_000) is None
    store.release_lease(0, "shard-a")
    assert not store.renew_lease(0, "shard-a", ttl_ms=10_000)
    e4 = store.acquire_lease(0, "shard-b", ttl_ms=10_000)
    assert e4 is not None and e4 > e3


def test_lease_ttl_is_set_and_renewed(store: RedisStore, store_client: redis.Redis) -> None:
    key = store.keys.lease(0)
    assert store.acquire_lease(0, "shard-a", ttl_ms=5_000) is not None
    assert 0 < store_client.pttl(key) <= 5_000
    assert store.renew_lease(0, "shard-a", ttl_ms=60_000)
    assert 5_000 < store_client.pttl(key) <= 60_000
    # Re-acquiring by the holder sets the TTL again (PEXPIRE), here down to 2 s.
    assert store.acquire_lease(0, "shard-a", ttl_ms=2_000) is not None
    assert 0 < store_client.pttl(key) <= 2_000


def test_expired_lease_passes_to_another_owner(
    store: RedisStore, store_client: redis.Redis
) -> None:
    e1 = store.acquire_lease(0, "shard-a", ttl_ms=10_000)
    assert store.acquire_lease(0, "shard-b", ttl_ms=10_000) is None
    expire_now(store_client, store.keys.lease(0))  # shard-a paused past its TTL
    assert not store.renew_lease(0, "shard-a", ttl_ms=10_000)
    e2 = store.acquire_lease(0, "shard-b", ttl_ms=10_000)
    assert e1 is not None and e2 is not None and e2 > e1


def test_shard_endpoints_expire(store: RedisStore, store_client: redis.Redis) -> None:
    assert store.shards() == {}
    store.announce_shard(0, {"pull": "tcp://127.0.0.1:5000"}, ttl_ms=10_000)
    store.announce_shard(1, {"pull": "tcp://127.0.0.1:5001"}, ttl_ms=150)
    assert 0 < store_client.pttl(store.keys.shard(1)) <= 150
    assert store.shard_endpoints(0) == {"pull": "tcp://127.0.0.1:5000"}
    assert set(store.shards()) == {0, 1}
    expire_now(store_client, store.keys.shard(1))
    assert store.shard_endpoints(1) is None
    assert store.shards() == {0: {"pull": "tcp://127.0.0.1:5000"}}


# --------------------------------------------------------------------------------------------
# learners
# --------------------------------------------------------------------------------------------


def test_incarnation_counts_registrations(store: RedisStore) -> None:
    assert not store.known_learner("l0")
    assert [store.register_learner("l0") for _ in range(3)] == [1, 2, 3]
    assert store.register_learner("l1") == 1
    assert store.known_learner("l0") and store.known_learner("l1")


def test_learner_liveness_is_a_ttl(store: RedisStore, store_client: redis.Redis) -> None:
    store.register_learner("l0")
    store.register_learner("l1")
    assert store.live_learners() == {}
    store.heartbeat_learner("l0", {"step": 3, "host": "a"}, ttl_ms=200)
    store.heartbeat_learner("l1", {"step": 1}, ttl_ms=10_000)
    assert 0 < store_client.pttl(store.keys.learner("l0")) <= 200
    assert store.live_learners() == {"l0": {"step": 3, "host": "a"}, "l1": {"step": 1}}
    expire_now(store_client, store.keys.learner("l0"))
    assert store.live_learners() == {"l1": {"step": 1}}
    store.remove_learner("l1")
    assert store.live_learners() == {}
    assert store.known_learner("l0") and store.known_learner("l1")


def test_ttl_keys_expire_on_the_server_clock(
    store: RedisStore, store_client: redis.Redis
) -> None:
    # The one test of real expiry: lease, endpoints and heartbeat go by the server's own clock.
    assert store.acquire_lease(0, "shard-a", ttl_ms=50) is not None
    store.announce_shard(0, {"pull": "tcp://x"}, ttl_ms=50)
    store.register_learner("l0")
    store.heartbeat_learner("l0", {}, ttl_ms=50)
    wait_until(
        lambda: (not store_client.exists(store.keys.lease(0)) and store.shards() == {}
                 and store.live_learners() == {}),
        timeout_s=10.0, interval_s=0.02, what="50 ms TTL keys to expire",
    )
    assert store.acquire_lease(0, "shard-b", ttl_ms=10_000) is not None


# --------------------------------------------------------------------------------------------
# events, counters, pipelines
# --------------------------------------------------------------------------------------------


def test_events_round_trip_and_filter(store: RedisStore) -> None:
    before = time.time()
    ids = [
        store.add_event("join", {"learner": "l0", "incarnation": 1}),
        store.add_event("merge", {"fragment": 2, "contributors": ["l0", "l1"], "w": [0.5, 1]}),
        store.add_event("drop", {"reason": "stale"}),
        store.add_event("merge", {"fragment": 3}),
    ]
    events = store.events()
    assert [i for i, _ in events] == ids
    first = events[1][1]
    assert first["kind"] == "merge" and before <= first["t"] <= time.time()
    assert {k: v for k, v in first.items() if k != "t"} == {
        "kind": "merge",
        "fragment": 2,
        "contributors": ["l0", "l1"],
        "w": [0.5, 1],
    }
    merges = store.events(kinds={"merge"})
    assert [e["fragment"] for _, e in merges] == [2, 3]
    assert [i for i, _ in store.events(kinds={"merge"}, count=1)] == [ids[1]]
    assert [i for i, _ in store.events(count=2)] == ids[:2]
    assert [i for i, _ in store.events(start=f"({ids[1]}")] == ids[2:]
    assert store.events(count=0) == []


def test_events_page_through_long_streams(
    store: RedisStore, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(telemetry_module, "_EVENTS_PAGE", 3)
    for i in range(10):
        store.add_event("even" if i % 2 == 0 else "odd", {"i": i})
    assert [e["i"] for _, e in store.events()] == list(range(10))
    assert [e["i"] for _, e in store.events(kinds={"odd"})] == [1, 3, 5, 7, 9]
    assert [e["i"] for _, e in store.events(kinds={"odd"}, count=4)] == [1, 3, 5, 7]


def test_event_fields_cannot_shadow_kind_or_time(store: RedisStore) -> None:
    with pytest.raises(ValueError, match="reserved"):
        store.add_event("join", {"t": 1})


def test_counters(store: RedisStore) -> None:
    assert store.counters("drops") == {}
    store.incr_counter("drops", "stale")
    store.incr_counter("drops", "stale", 2)
    store.incr_counter("drops", "corrupt")
    assert store.counters("drops") == {"stale": 3, "corrupt": 1}


def test_wire_peers_are_absolute_per_incarnation_and_summed(store: RedisStore) -> None:
    assert store.wire_peers() == {}
    store.set_wire_peers("learner-1", 1, {"learner-1>shard-0": 100, "shard-0>learner-1": 40})
    # The same totals again (a retried write after a lost reply) change nothing.
    store.set_wire_peers("learner-1", 1, {"learner-1>shard-0": 100, "shard-0>learner-1": 40})
    store.set_wire_peers("learner-1", 1, {"learner-1>shard-0": 150, "shard-0>learner-1": 40})
    store.set_wire_peers("learner-1", 2, {"learner-1>shard-0": 7, "redis>learner-1": 1000})
    store.set_wire_peers("learner-0", 1, {})
    pipe = store.pipeline()
    store.set_wire_peers("learner-0", 1, {"learner-0>shard-1": 5}, pipe=pipe)
    assert "learner-0>shard-1" not in store.wire_peers()  # not before the pipeline runs
    pipe.execute()
    assert store.wire_peers() == {"learner-1>shard-0": 157, "shard-0>learner-1": 40,
                                  "redis>learner-1": 1000, "learner-0>shard-1": 5}


def test_writes_compose_in_one_pipeline(store: RedisStore) -> None:
    store.register_learner("l0")
    pipe = store.pipeline()
    store.heartbeat_learner("l0", {"step": 1}, ttl_ms=10_000, pipe=pipe)
    assert store.add_event("join", {"learner": "l0"}, pipe=pipe) is None
    store.incr_counter("joins", "l0", pipe=pipe)
    store.announce_shard(0, {"pub": "tcp://x"}, ttl_ms=10_000, pipe=pipe)
    assert store.live_learners() == {} and store.events() == []  # queued only
    results: list[Any] = pipe.execute()
    assert store.live_learners() == {"l0": {"step": 1}}
    assert [i for i, _ in store.events()] == [results[2].decode()]  # heartbeat: SET, SADD
    assert store.counters("joins") == {"l0": 1}
    assert store.shards() == {0: {"pub": "tcp://x"}}


# --------------------------------------------------------------------------------------------
# flush
# --------------------------------------------------------------------------------------------


def test_flush_run_deletes_only_this_run(store: RedisStore, store_client: redis.Redis) -> None:
    other = RedisStore(store_client, "test-run2")  # a prefix-sharing run id must survive
    for s in (store, other):
        s.put_manifest({"schema_hash": "h"})
        put(s, 0, -1)
        put(s, 11, -1)
        s.acquire_lease(0, "a", ttl_ms=10_000)
        s.register_learner("l0")
        s.heartbeat_learner("l0", {}, ttl_ms=10_000)
        s.add_event("join", {})
        s.incr_counter("c", "f")
    other_keys = set(store_client.scan_iter(match="ddl:{test-run2*"))
    assert store.flush_run() > 0
    assert set(store_client.scan_iter()) == other_keys
    assert store.get_manifest() is None and store.head(0) is None and store.events() == []
    assert other.head(11) is not None
    assert store.flush_run() == 0


# --------------------------------------------------------------------------------------------
# real server only: persistence, startup and connection failures
# --------------------------------------------------------------------------------------------


def _dead_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@pytest.mark.integration
def test_embedded_redis_reloads_aof_after_restart(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path) as server:
        store = RedisStore(connect(server.url), "persist")
        put(store, 0, -1)
        put(store, 0, 0)
        store.add_event("merge", {"fragment": 0})
        store.client.close()
    assert server.pid is None
    assert any(tmp_path.glob("appendonly*"))  # appendonly.aof (6.x) or appendonlydir (7.x)
    with EmbeddedRedis(tmp_path) as server:
        store = RedisStore(connect(server.url), "persist")
        assert store.head(0) == FragmentHead(1, 1, 1001.0)
        latest = store.get_latest(0)
        assert latest is not None and latest.value == b"value 0/1" + BLOB
        assert [e["kind"] for _, e in store.events()] == ["merge"]
        store.client.close()


@pytest.mark.integration
def test_killed_redis_keeps_every_acknowledged_write(tmp_path: Path) -> None:
    # appendfsync always (EmbeddedRedis's default): a SIGKILL right after a write loses nothing.
    with EmbeddedRedis(tmp_path) as server:
        assert server.fsync == "always"
        store = RedisStore(connect(server.url), "crash")
        put(store, 0, -1)
        put(store, 0, 0)
        assert server.pid is not None
        os.kill(server.pid, signal.SIGKILL)
        store.client.close()
    with EmbeddedRedis(tmp_path) as server:
        store = RedisStore(connect(server.url), "crash")
        assert store.head(0) == FragmentHead(1, 1, 1001.0)
        store.client.close()


@pytest.mark.integration
def test_embedded_redis_port_in_use_reports_log(
    redis_server: EmbeddedRedis, tmp_path: Path
) -> None:
    clash = EmbeddedRedis(tmp_path, port=redis_server.port)
    with pytest.raises(StoreUnavailable, match=r"(?s)exited.*in use"):
        clash.start()
    assert clash.pid is None


def test_embedded_redis_that_never_answers_times_out(tmp_path: Path) -> None:
    # A "server" that runs but never listens: the start gives up after start_timeout_s.
    exe = tmp_path / "silent-redis-server"
    exe.write_text("#!/bin/sh\nexec sleep 30\n")
    exe.chmod(0o755)
    server = EmbeddedRedis(tmp_path / "data", executable=exe, start_timeout_s=0.3)
    with pytest.raises(StoreUnavailable, match=r"did not answer PING within 0.3 s"):
        server.start()
    assert server.pid is None  # the silent child was killed


def test_embedded_redis_without_binary(tmp_path: Path) -> None:
    with pytest.raises(StoreUnavailable, match="not executable"):
        EmbeddedRedis(tmp_path, executable=tmp_path / "no-redis-server").start()


@pytest.mark.integration
def test_connect_returns_working_client(redis_server: EmbeddedRedis) -> None:
    client = connect(redis_server.url, attempts=2)
    assert client.ping()
    client.close()


@pytest.mark.integration
@pytest.mark.parametrize("scheme", ["redis", "rediss"])
def test_connect_to_dead_port_fails_fast_without_password(scheme: str) -> None:
    url = f"{scheme}://:secret@127.0.0.1:{_dead_port()}/0"
    start = time.monotonic()
    with pytest.raises(StoreUnavailable) as info:
        connect(url, attempts=3, timeout_s=1.0, backoff_base_s=0.01)
    assert time.monotonic() - start < 5.0
    message = str(info.value)
    assert message.startswith(f"cannot reach Redis at {scheme}://:***@127.0.0.1:")
    assert "secret" not in message
    assert "after 3 attempt(s)" in message


@pytest.mark.integration
def test_connect_with_wrong_password_hides_it(tmp_path: Path) -> None:
    with EmbeddedRedis(tmp_path) as server:
        admin = redis.Redis.from_url(server.url)
        admin.config_set("requirepass", "right-one")
        admin.close()
        url = server.url.replace("redis://", "redis://:hunter2@")
        with pytest.raises(StoreUnavailable, match="authentication failed") as info:
            connect(url, attempts=1)
        assert "hunter2" not in str(info.value)
        assert connect(url.replace("hunter2", "right-one"), attempts=1).ping()


def test_connect_rejects_bad_urls() -> None:
    with pytest.raises(ConfigError, match="scheme"):
        connect("http://:pw@localhost:6379")
    with pytest.raises(ConfigError, match="attempts"):
        connect("redis://localhost", attempts=0)


def test_redact_url() -> None:
    assert redact_url("redis://:pw@h:1/0") == "redis://:***@h:1/0"
    assert redact_url("rediss://user:pw@h/2?ssl_cert_reqs=none") == (
        "rediss://user:***@h/2?ssl_cert_reqs=none"
    )
    assert redact_url("redis://h:6379") == "redis://h:6379"
