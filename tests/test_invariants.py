"""The post-run audit (chaos/invariants.py): each check passes a good history, fails a bad one."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import redis

from ddiloco.chaos.accounting import token_fate
from ddiloco.chaos.invariants import (
    Invariant,
    InvariantViolation,
    adoption_digests,
    audit,
    check_adoptions,
    check_exactly_once,
    check_final_store,
    check_no_nan,
    check_objects,
    check_token_fate,
    check_versions,
    raise_if_failed,
)
from ddiloco.pipeline.errors import DDilocoError
from ddiloco.pipeline.fragments import FragmentLayout, TensorInfo
from ddiloco.store import FragmentBlob, FragmentHead, RedisStore
from ddiloco.workers.run.blobs import digest, encode_blob

pytestmark = pytest.mark.timeout(30)

RUN = "audit-run"
LAYOUT = FragmentLayout((
    (TensorInfo("a", (2, 3)),),
    (TensorInfo("b", (4,)), TensorInfo("c", (1, 2))),
))


def merge(fragment: int, version: int,
          contributions: Sequence[tuple[str, int, list[int]]] = (),
          shard: str = "shard-0") -> dict[str, Any]:
    contribs = [{"learner": lid, "inc": inc, "seqs": seqs, "tokens": 10}
                for lid, inc, seqs in contributions]
    return {"kind": "merge", "t": 0.0, "shard": shard, "fragment": fragment, "version": version,
            "contributors": [c["learner"] for c in contribs], "tokens": 10 * len(contribs),
            "contributions": contribs}


def drop(reason: str, learner: str, inc: int, seq: int, fragment: int) -> dict[str, Any]:
    return {"kind": "drop", "t": 0.0, "shard": "shard-0", "reason": reason, "detail": "",
            "learner": learner, "inc": inc, "seq": seq, "fragment": fragment, "tokens": 10}


def shard_start(versions: dict[str, int]) -> dict[str, Any]:
    return {"kind": "shard_start", "t": 0.0, "shard": "shard-0", "epoch": 1,
            "versions": versions}


# ------------------------------------------------------------------------------------------
# versions
# ------------------------------------------------------------------------------------------

GOOD_VERSIONS = [shard_start({"0": 0, "1": 0, "2": 0}), merge(0, 1), merge(1, 1), merge(0, 2),
                 merge(0, 3)]


def test_versions_good_log() -> None:
    inv = check_versions(GOOD_VERSIONS, {0: 3, 1: 1, 2: 0})
    assert inv.ok, inv.evidence
    assert inv.evidence["merges"] == 4 and inv.evidence["fragments"] == 3
    assert inv.evidence["gaps"] == 0


def test_versions_reuse_fails() -> None:
    inv = check_versions([*GOOD_VERSIONS, merge(0, 3, shard="shard-9")], {0: 3, 1: 1, 2: 0})
    assert not inv.ok
    assert inv.evidence["n_reused"] == 1
    assert inv.evidence["reused"][0]["shard"] == "shard-9"


def test_versions_decreasing_fails() -> None:
    inv = check_versions([merge(0, 1), merge(0, 3), merge(0, 2)], {0: 3})
    assert not inv.ok
    assert inv.evidence["n_decreasing"] == 1
    assert inv.evidence["decreasing"][0] == {"fragment": 0, "version": 2, "shard": "shard-0",
                                             "t": 0.0, "after": 3}
    assert inv.evidence["gaps"] == 1  # 1 -> 3


@pytest.mark.parametrize("heads", [{0: 2, 1: 1, 2: 0}, {0: 4, 1: 1, 2: 0},
                                   {0: None, 1: 1, 2: 0}, {0: 3, 1: 1, 2: 1}])
def test_versions_head_mismatch_fails(heads: dict[int, int | None]) -> None:
    inv = check_versions(GOOD_VERSIONS, heads)
    assert not inv.ok
    assert inv.evidence["n_head_mismatch"] == 1


def test_versions_unpublished_fragment_without_merges_passes() -> None:
    assert check_versions([], {0: None, 1: 0}).ok


def test_versions_unlogged_publish_is_explained_by_the_restart() -> None:
    # The shard published v4 and was killed before logging it; its successor loaded v4.
    log = [*GOOD_VERSIONS, shard_start({"0": 4, "1": 1, "2": 0}), merge(0, 5)]
    inv = check_versions(log, {0: 5, 1: 1, 2: 0})
    assert inv.ok, inv.evidence
    assert inv.evidence["unlogged_publishes"] == 1
    assert check_versions(log[:-1], {0: 4, 1: 1, 2: 0}).ok


def test_versions_dp_rollback_is_a_publish() -> None:
    rollback = {"kind": "dp_rollback", "t": 0.0, "shard": "shard-0", "fragment": 0,
                "dp_step": 20, "version": 4}
    inv = check_versions([*GOOD_VERSIONS, rollback, merge(0, 5)], {0: 5, 1: 1, 2: 0})
    assert inv.ok, inv.evidence
    assert inv.evidence["dp_rollbacks"] == 1 and inv.evidence["merges"] == 4 + 1
    assert not check_versions([*GOOD_VERSIONS, rollback, merge(0, 4)], {0: 4, 1: 1, 2: 0}).ok


def test_versions_restart_regression_fails() -> None:
    log = [*GOOD_VERSIONS, shard_start({"0": 1, "1": 1, "2": 0})]
    inv = check_versions(log, {0: 3, 1: 1, 2: 0})
    assert not inv.ok
    assert inv.evidence["restart_regressions"][0]["loaded"] == 1


# ------------------------------------------------------------------------------------------
# exactly once
# ------------------------------------------------------------------------------------------

GOOD_ONCE = [
    merge(0, 1, [("learner-0", 1, [1]), ("learner-1", 1, [1, 2])]),
    merge(1, 1, [("learner-0", 1, [2])]),
    merge(0, 2, [("learner-0", 2, [1])]),  # a new incarnation restarts its sequence numbers
    drop("stale", "learner-1", 1, 3, 1),
    drop("duplicate", "learner-0", 1, 1, 0),  # the dedup rejecting a second copy
    {"kind": "drop", "t": 0.0, "shard": "shard-0", "reason": "corrupt", "detail": "x"},
]


def test_exactly_once_good_log() -> None:
    inv = check_exactly_once(GOOD_ONCE)
    assert inv.ok, inv.evidence
    assert inv.evidence["deltas"] == 6
    assert inv.evidence["duplicate_drops"] == 1


def test_delta_merged_twice_fails() -> None:
    inv = check_exactly_once([*GOOD_ONCE, merge(1, 2, [("learner-0", 1, [2])])])
    assert not inv.ok
    assert inv.evidence["n_merged_twice"] == 1
    item = inv.evidence["merged_twice"][0]
    assert (item["learner"], item["inc"], item["seq"], item["fragment"]) == ("learner-0", 1, 2, 1)


def test_delta_merged_and_dropped_fails() -> None:
    inv = check_exactly_once([*GOOD_ONCE, drop("shard_stop", "learner-1", 1, 2, 0)])
    assert not inv.ok and inv.evidence["n_merged_and_dropped"] == 1


def test_dropped_contribution_names_its_folded_deltas() -> None:
    fenced = {**drop("fenced", "learner-2", 1, 0, 1), "seq": None, "seqs": [4, 5]}
    inv = check_exactly_once([*GOOD_ONCE, fenced])
    assert inv.ok and inv.evidence["deltas"] == 8
    inv = check_exactly_once([*GOOD_ONCE, fenced, merge(1, 2, [("learner-2", 1, [5])])])
    assert not inv.ok and inv.evidence["merged_and_dropped"][0]["seq"] == 5


def test_delta_dropped_twice_fails() -> None:
    inv = check_exactly_once([*GOOD_ONCE, drop("zero_weight", "learner-1", 1, 3, 1)])
    assert not inv.ok and inv.evidence["n_dropped_twice"] == 1


# ------------------------------------------------------------------------------------------
# token fate
# ------------------------------------------------------------------------------------------


def test_token_fate_invariant() -> None:
    fates = [{"learner": "learner-0", "incarnation": 1, "ended": "drained", "processed": 30,
              "sent": 30, "discarded": {"overwritten": 0, "drain": 0}}]
    merges = [merge(0, 1, [("learner-0", 1, [1])]), merge(1, 1, [("learner-0", 1, [2])])]
    good = token_fate(fates, merges, [drop("stale", "learner-0", 1, 3, 0)],
                      {("learner-0", 1): 30}, 2)
    assert check_token_fate(good).ok
    double = token_fate(fates, [*merges, merges[0]], [drop("stale", "learner-0", 1, 3, 0)],
                        {("learner-0", 1): 30}, 2)
    inv = check_token_fate(double)
    assert not inv.ok
    assert inv.evidence["balance"] == -10 and inv.evidence["n_anomalies"] == 1


# ------------------------------------------------------------------------------------------
# adoptions
# ------------------------------------------------------------------------------------------


def adoption_log(versions: list[int], digests: dict[str, str]) -> list[dict[str, Any]]:
    return [
        merge(0, 1), merge(1, 1),
        {"kind": "join", "t": 0.0, "learner": "learner-3", "incarnation": 2},
        merge(0, 2),  # after the join: adopting v1 of fragment 0 is still up to date
        {"kind": "adopted", "t": 0.0, "learner": "learner-3", "incarnation": 2,
         "versions": versions, "digests": digests, "step": 40},
    ]


STORED = {(0, 1): "aa", (1, 1): "bb", (0, 2): "cc", (1, 0): "dd"}


def test_adoptions_good() -> None:
    inv = check_adoptions(adoption_log([1, 1], {"0": "aa", "1": "bb"}), STORED)
    assert inv.ok, inv.evidence
    assert inv.evidence["checked"] == 2 and inv.evidence["unverifiable"] == 0


def test_adoption_of_a_version_no_longer_kept_is_unverifiable() -> None:
    inv = check_adoptions(adoption_log([1, 1], {"0": "aa", "1": "bb"}),
                          {(0, 1): None, (1, 1): "bb"})
    assert inv.ok and inv.evidence["unverifiable"] == 1 and inv.evidence["checked"] == 1


def test_adoption_digest_mismatch_fails() -> None:
    inv = check_adoptions(adoption_log([1, 1], {"0": "aa", "1": "XX"}), STORED)
    assert not inv.ok
    assert inv.evidence["digest_mismatch"][0]["fragment"] == 1


def test_adoption_of_an_old_version_fails() -> None:
    # Fragment 1 was at v1 before the learner joined; adopting v0 is stale even though the
    # bytes match the stored v0.
    inv = check_adoptions(adoption_log([1, 0], {"0": "aa", "1": "dd"}), STORED)
    assert not inv.ok
    assert inv.evidence["stale_adoption"] == [{"learner": "learner-3", "inc": 2, "fragment": 1,
                                               "version": 0, "merged_before_join": 1}]


# ------------------------------------------------------------------------------------------
# the store
# ------------------------------------------------------------------------------------------


def tensors(p: int, seed: int, nan: bool = False) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    out = [rng.normal(size=s).astype(np.float32) for s in LAYOUT.shapes(p)]
    if nan:
        out[0].flat[0] = np.nan
    return out


def put(store: RedisStore, p: int, expected: int, values: list[np.ndarray]) -> int:
    return store.publish(p, expected_version=expected, epoch=1, value=encode_blob(values),
                         momentum=encode_blob(values), keep=4)


@pytest.fixture
def store(fake_redis: redis.Redis) -> RedisStore:
    s = RedisStore(fake_redis, RUN)
    s.put_manifest({"schema_hash": "h", "layout": LAYOUT.to_json()})
    put(s, 0, -1, tensors(0, 0))
    put(s, 0, 0, tensors(0, 1))
    put(s, 1, -1, tensors(1, 2))
    return s


def test_final_store_good(store: RedisStore) -> None:
    inv = check_final_store(store, 2)
    assert inv.ok, inv.evidence
    assert inv.evidence["heads"] == [1, 0] and inv.evidence["dangling_check"] == "scan"
    assert check_no_nan([], store, 2).ok


def test_final_store_nan_fails(store: RedisStore) -> None:
    put(store, 1, 0, tensors(1, 3, nan=True))
    inv = check_final_store(store, 2)
    assert not inv.ok and inv.evidence["n_nonfinite"] == 1
    assert inv.evidence["nonfinite"][0]["fragment"] == 1
    nn = check_no_nan([], store, 2)
    assert not nn.ok and nn.evidence["n_nonfinite_fragments"] == 1


def test_final_store_dangling_version_fails(store: RedisStore, fake_redis: redis.Redis) -> None:
    fake_redis.set(store.keys.value(0, 7), encode_blob(tensors(0, 4)))  # newer than head 1
    inv = check_final_store(store, 2)
    assert not inv.ok
    assert inv.evidence["dangling"] == [{"fragment": 0, "head": 1, "stored": 7}]


class Proxy:
    """A store that is not a RedisStore (no SCAN): dangling versions are probed."""

    def __init__(self, inner: RedisStore) -> None:
        self.inner = inner
        self.run_id = inner.run_id

    def get_manifest(self) -> dict[str, Any] | None:
        return self.inner.get_manifest()

    def heads(self, n: int) -> list[FragmentHead | None]:
        return self.inner.heads(n)

    def get_latest_many(self, ps: list[int]) -> list[FragmentBlob | None]:
        return self.inner.get_latest_many(ps)

    def get_version(self, p: int, v: int) -> FragmentBlob | None:
        return self.inner.get_version(p, v)


def test_final_store_dangling_by_probe(store: RedisStore, fake_redis: redis.Redis) -> None:
    proxy: Any = Proxy(store)
    assert check_final_store(proxy, 2).ok
    fake_redis.set(store.keys.value(1, 2), b"half a version")  # value without momentum
    inv = check_final_store(proxy, 2)
    assert not inv.ok and inv.evidence["dangling_check"] == "probe +3"
    assert inv.evidence["dangling"] == [{"fragment": 1, "head": 0, "stored": 2}]


def test_final_store_undecodable_and_wrong_fragment_count(store: RedisStore) -> None:
    store.publish(1, expected_version=0, epoch=1, value=encode_blob([np.zeros(3, np.float32)]),
                  momentum=b"", keep=4)  # wrong size for fragment 1's shapes
    inv = check_final_store(store, 3)  # the manifest has 2 fragments
    assert not inv.ok
    errors = [x["error"] for x in inv.evidence["problems"]]
    assert any("manifest has 2 fragments" in e for e in errors)
    assert any("undecodable" in e for e in errors)
    nn = check_no_nan([], store, 2)
    assert nn.ok and nn.evidence["unreadable"] == 1  # not a NaN: final_store reports it


def test_final_store_without_manifest_or_head(fake_redis: redis.Redis) -> None:
    empty = RedisStore(fake_redis, "empty")
    inv = check_final_store(empty, 2)
    assert not inv.ok and inv.evidence["problems"] == [{"error": "no manifest"}]
    empty.put_manifest({"schema_hash": "h", "layout": LAYOUT.to_json()})
    put(empty, 0, -1, tensors(0, 0))
    inv = check_final_store(empty, 2)
    assert not inv.ok and inv.evidence["problems"] == [{"fragment": 1, "error": "no head"}]
    assert inv.evidence["heads"] == [0, None]


def test_objects_on_redis_blobs_read_back(store: RedisStore) -> None:
    store.put_initial(0, encode_blob(tensors(0, 9)))
    inv = check_objects(store, 2)
    assert inv.ok, inv.evidence
    assert inv.evidence["location"] == "redis" and inv.evidence["objects"] is None
    assert inv.evidence["read"] == {"heads": 2, "versions": 1, "initial": 1}


@pytest.fixture
def object_store(fake_redis: redis.Redis, tmp_path: Path) -> RedisStore:
    """Fragment 0 at versions 0..2 (head 2), fragment 1 at 0, blobs as files."""
    s = RedisStore(fake_redis, RUN)
    s.set_blob_location(f"file://{tmp_path / 'blobs'}")
    s.put_manifest({"schema_hash": "h", "layout": LAYOUT.to_json()})
    s.put_initial(0, encode_blob(tensors(0, 9)))
    for v in range(3):
        put(s, 0, v - 1, tensors(0, v))
    put(s, 1, -1, tensors(1, 5))
    return s


def _object(store: RedisStore, tmp_path: Path, p: int, version: int) -> Path:
    name = f"v{version:012d}-"
    found = [x for x in store.object_paths()
             if x.startswith(f"{RUN}/f{p}/{name}") and x.endswith(".value")]
    assert len(found) == 1, store.object_paths()
    return tmp_path / "blobs" / found[0]


def test_objects_every_head_and_kept_version_reads_back(object_store: RedisStore) -> None:
    inv = check_objects(object_store, 2)
    assert inv.ok, inv.evidence
    assert inv.evidence["location"].startswith("file://")
    assert inv.evidence["read"] == {"heads": 2, "versions": 2, "initial": 1}
    # 3 + 1 versions of value, momentum and version record (store/version_records.py), one
    # initial blob and its pointer, the manifest
    assert inv.evidence["objects"] == 4 * 3 + 2 + 1


def test_objects_a_head_without_its_object_fails(object_store: RedisStore,
                                                 tmp_path: Path) -> None:
    _object(object_store, tmp_path, 0, 2).unlink()
    inv = check_objects(object_store, 2)
    assert not inv.ok and inv.evidence["n_missing"] == 1
    assert inv.evidence["missing"][0]["fragment"] == 0
    assert inv.evidence["missing"][0]["version"] == 2
    assert inv.evidence["missing"][0]["read"] == "heads"
    final = check_final_store(object_store, 2)  # the final-store check fails too, less precisely
    assert not final.ok


def test_objects_a_kept_version_damaged_or_gone_fails(object_store: RedisStore,
                                                      tmp_path: Path) -> None:
    _object(object_store, tmp_path, 0, 0).unlink()
    damaged = _object(object_store, tmp_path, 0, 1)
    data = bytearray(damaged.read_bytes())
    data[-1] ^= 0xFF
    damaged.write_bytes(bytes(data))
    inv = check_objects(object_store, 2)
    assert not inv.ok
    assert [(x["version"], x["read"]) for x in inv.evidence["missing"]] == [(0, "versions")]
    assert [(x["version"], x["read"]) for x in inv.evidence["corrupt"]] == [(1, "versions")]
    assert "CRC-32" in inv.evidence["corrupt"][0]["error"]
    assert inv.evidence["read"]["heads"] == 2


def test_no_nan_in_losses() -> None:
    good = [{"kind": "eval", "t": 0.0, "loss": 2.5, "tokens": 10},
            {"kind": "leave", "t": 0.0, "train_loss": [2.0, 1.9]}]
    assert check_no_nan(good, None, 2).ok
    bad = [*good, {"kind": "eval", "t": 1.0, "loss": float("nan")},
           {"kind": "learner", "t": 2.0, "train_loss": float("inf")}]
    inv = check_no_nan(bad, None, 2)
    assert not inv.ok
    assert inv.evidence["losses"] == 5 and inv.evidence["n_nonfinite_losses"] == 2


def test_no_nan_loss_read_back_from_the_stream(store: RedisStore) -> None:
    store.add_event("eval", {"loss": float("nan"), "tokens": 5})
    inv = check_no_nan(store.events(), store, 2)
    assert not inv.ok and inv.evidence["n_nonfinite_losses"] == 1


def test_adoption_digests_from_the_store(store: RedisStore) -> None:
    log = [{"kind": "join", "t": 0.0, "learner": "learner-0", "incarnation": 1},
           {"kind": "adopted", "t": 0.0, "learner": "learner-0", "incarnation": 1,
            "versions": [1, 0], "digests": {"0": digest(tensors(0, 1)),
                                            "1": digest(tensors(1, 2))}},
           {"kind": "adopted", "t": 0.0, "learner": "learner-1", "incarnation": 1,
            "versions": [0, 9], "digests": {"0": digest(tensors(0, 0)), "1": "ff"}}]
    stored = adoption_digests(log, store)
    assert stored == {(0, 1): digest(tensors(0, 1)), (1, 0): digest(tensors(1, 2)),
                      (0, 0): digest(tensors(0, 0)), (1, 9): None}
    inv = check_adoptions(log, stored)
    assert inv.ok and inv.evidence["checked"] == 3 and inv.evidence["unverifiable"] == 1
    assert inv.evidence["no_join"] == 1


# ------------------------------------------------------------------------------------------
# audit
# ------------------------------------------------------------------------------------------


def test_audit_and_raise() -> None:
    good = Invariant("a", True, {"n": 1})
    bad = Invariant("versions", False, {"n_reused": 1, "reused": [{"fragment": 0}]})
    ok = audit([good])
    assert ok == {"ok": True, "invariants": [{"name": "a", "ok": True, "evidence": {"n": 1}}]}
    raise_if_failed(ok)
    report = audit([good, bad])
    assert report["ok"] is False
    with pytest.raises(InvariantViolation, match="versions") as info:
        raise_if_failed(report)
    assert isinstance(info.value, DDilocoError)
    assert "n_reused" in str(info.value) and "a:" not in str(info.value)
    assert info.value.report == report
