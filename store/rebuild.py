"""Rebuild a run's Redis state from its object store (docs/RELIABILITY.md, "Losing Redis
altogether"; ``ddiloco store rebuild``).

With blobs in an object store, every version leaves an immutable record beside its blobs
(:mod:`ddiloco.store.version_records`), and the manifest and the initial values' pointers are
kept there too. :func:`rebuild` writes into a Redis that does not hold the run what training
needs to go on:

* the blob location and the manifest;
* each fragment's initial-value pointer, its head (version, epoch, ``updated_at``, token and
  merge ledger) and its kept versions (value and momentum pointers, meta), in one chain
  (:func:`~ddiloco.store.version_records.plan_fragment`);
* the shard-epoch counter and, per learner named in a merge ledger, its incarnation counter and
  its place in the learner registry. Both counters are set :data:`COUNTER_GAP` above the highest
  value the records show: a lease taken, or a learner registered, after the last publish
  before the loss left no record, and a number handed out again would let a fenced-out shard
  write, or make a restarted learner's first deltas look like duplicates.

What is not rebuilt: leases, shard endpoints and learner heartbeats (their owners write them
again within a heartbeat), stop requests, and telemetry (events, counters, fate records): it
lives in Redis only; export it (Prometheus, ``ddiloco report``) if it must outlive Redis.
:func:`snapshot_telemetry` / :func:`restore_telemetry` carry it over where the old Redis can
still be read first (the chaos ``wipe`` fault uses them so that its audit spans the loss).

The writes are one MULTI/EXEC transaction: a rebuild that fails leaves nothing behind.
"""

from __future__ import annotations

import fnmatch
import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import crc32c
import redis

from ddiloco.pipeline.errors import ConfigError, StoreError
from ddiloco.store.core import RedisCore, as_str, dumps, unavailable
from ddiloco.store.keys import COUNTERS, EVENTS, FATE, FATES
from ddiloco.store.objects import REDIS, CorruptObject, ObjectBlobs, Pointer, open_objects
from ddiloco.store.version_records import (
    INIT_RECORD,
    RECORD_SUFFIX,
    VersionRecord,
    init_record_path,
    manifest_path,
    plan_fragment,
)

__all__ = [
    "COUNTER_GAP",
    "RebuildReport",
    "RunExists",
    "rebuild",
    "restore_telemetry",
    "snapshot_telemetry",
]

#: How far above the highest epoch and incarnation the records show the rebuilt counters start
#: (module docstring): far more leases and registrations than a run makes between two
#: publishes of a fragment.
COUNTER_GAP = 1000


class RunExists(StoreError):
    """The Redis already holds keys of the run: a rebuild would mix two states."""


@dataclass
class RebuildReport:
    """What :func:`rebuild` wrote.

    Attributes:
        run_id: the run.
        location: its blob location.
        heads: fragment -> rebuilt head version (-1: initial value only, nothing published).
        kept: fragment -> how many versions were rebuilt (the head included).
        skipped: records not used (of versions that never became the head, or past the chain).
        epoch: the shard-epoch counter written.
        learners: learner id -> the incarnation counter written.
        seconds: wall time of the rebuild.
        chains: fragment -> ``(version, token)`` of each rebuilt version, newest first.
    """

    run_id: str
    location: str
    heads: dict[int, int] = field(default_factory=dict)
    kept: dict[int, int] = field(default_factory=dict)
    skipped: int = 0
    epoch: int = 0
    learners: dict[str, int] = field(default_factory=dict)
    seconds: float = 0.0
    chains: dict[int, list[tuple[int, str]]] = field(default_factory=dict)

    def to_json(self) -> dict[str, Any]:
        """The report as JSON-able data (fragment keys as strings)."""
        return {"run_id": self.run_id, "location": self.location,
                "heads": {str(p): v for p, v in sorted(self.heads.items())},
                "kept": {str(p): n for p, n in sorted(self.kept.items())},
                "skipped": self.skipped, "epoch": self.epoch, "learners": self.learners,
                "seconds": round(self.seconds, 3)}


def _read(objs: ObjectBlobs, paths: list[str]) -> list[bytes]:
    """Whole small objects (records, the manifest) without a pointer to check them against:
    a record checks itself (format, fields against its path)."""
    got = objs.read_many(paths)
    out: list[bytes] = []
    for item in got:
        if isinstance(item, BaseException):
            raise item
        out.append(bytes(item))
    return out


_FRAGMENT = re.compile(r"^f(\d+)/(.+)$")


@unavailable
def rebuild(client: redis.Redis, run_id: str, location: str,
            *, clock: Callable[[], float] = time.monotonic) -> RebuildReport:
    """Recreate run ``run_id``'s state in ``client``'s Redis from the object store at
    ``location`` (module docstring).

    Args:
        client: a Redis that does not hold the run (nothing is read from it but a check).
        run_id: the run to rebuild.
        location: the run's blob location, e.g. ``s3://bucket/prefix`` or ``file:///dir``.
        clock: seconds, for the report's wall time.

    Returns:
        What was written.

    Raises:
        RunExists: the Redis holds keys of the run (nothing written).
        ConfigError: ``location`` is ``redis`` (nothing to rebuild from), or is not a
            location.
        StoreError: the object store holds no manifest of the run, a record is corrupt, or a
            fragment has neither an initial value nor a usable version.
        StoreUnavailable: Redis or the object store did not answer.
    """
    t0 = clock()
    core = RedisCore(client, run_id)  # checks the run id
    keys = core.keys
    for pattern in keys.patterns():
        for key in client.scan_iter(match=pattern, count=1000):
            raise RunExists(
                f"run {run_id!r} is already in this Redis (e.g. key {as_str(key)!r}): rebuild "
                "into a Redis that does not hold it, or remove the run's keys first")
    objs = open_objects(location)
    if objs is None:
        raise ConfigError(f"run {run_id!r}: blobs kept in {REDIS!r} leave nothing to rebuild "
                          "from; a rebuild needs store.blobs set to an object store")
    try:
        return _rebuild(client, core, objs, t0, clock)
    finally:
        objs.close()


def _rebuild(client: redis.Redis, core: RedisCore, objs: ObjectBlobs, t0: float,
             clock: Callable[[], float]) -> RebuildReport:
    run_id, keys = core.run_id, core.keys
    listed = objs.list(run_id)
    present = set(listed)
    if manifest_path(run_id) not in present:
        raise StoreError(f"run {run_id!r}: no manifest in {objs.location} "
                         f"({len(listed)} objects under {run_id}/): nothing to rebuild")
    by_fragment: dict[int, list[str]] = {}
    for path in listed:
        m = _FRAGMENT.match(path[len(run_id) + 1:])
        if m:
            by_fragment.setdefault(int(m.group(1)), []).append(m.group(2))
    record_paths = [f"{run_id}/f{p}/{name}" for p, names in by_fragment.items()
                    for name in names if name.endswith(RECORD_SUFFIX)]
    raws = _read(objs, [manifest_path(run_id), *record_paths])
    manifest, records_raw = raws[0], raws[1:]
    records: dict[int, list[VersionRecord]] = {}
    for path, raw in zip(record_paths, records_raw, strict=True):
        rec = VersionRecord.decode(raw, path)
        records.setdefault(rec.fragment, []).append(rec)

    report = RebuildReport(run_id=run_id, location=objs.location)
    pipe = client.pipeline(transaction=True)
    pipe.set(keys.blob_location, objs.location)
    pipe.set(keys.manifest, manifest)
    epoch = 0
    incarnations: dict[str, int] = {}
    for p in sorted(by_fragment):
        initial = _initial(objs, run_id, p, by_fragment[p])
        chain = plan_fragment(records.get(p, []), present)
        if initial is None and not chain:
            raise StoreError(f"run {run_id!r} fragment {p}: neither an initial value nor a "
                             f"complete version in {objs.location}")
        if initial is not None:
            pipe.set(keys.initial(p), initial.encode())
        report.skipped += len(records.get(p, [])) - len(chain)
        report.heads[p], report.kept[p] = (chain[0].version if chain else -1), len(chain)
        report.chains[p] = [(r.version, r.token) for r in chain]
        if not chain:
            continue
        head = chain[0]
        fields: dict[str | bytes, bytes | float | int | str] = {
            "version": head.version, "epoch": head.epoch,
            "updated_at": repr(head.updated_at), "token": head.token}
        fields.update({f"merged:{who}": seq for who, seq in head.ledger.items()})
        pipe.hset(keys.head(p), mapping=fields)
        for rec in chain:
            pipe.set(keys.value(p, rec.version), rec.value.encode())
            pipe.set(keys.momentum(p, rec.version), rec.momentum.encode())
            pipe.set(keys.meta(p, rec.version), dumps(rec.meta))
        epoch = max([epoch, *(r.epoch for r in records.get(p, []))])
        for who in head.ledger:
            learner, _, number = who.rpartition(":")
            if learner and number.isdigit():
                incarnations[learner] = max(incarnations.get(learner, 0), int(number))
    report.epoch = epoch + COUNTER_GAP
    pipe.set(keys.epoch, report.epoch)
    for learner, last in sorted(incarnations.items()):
        report.learners[learner] = last + COUNTER_GAP
        pipe.set(keys.incarnation(learner), report.learners[learner])
        pipe.sadd(keys.learners, learner)
    pipe.execute()
    report.seconds = clock() - t0
    return report


def _initial(objs: ObjectBlobs, run_id: str, p: int, names: list[str]) -> Pointer | None:
    """Fragment ``p``'s initial-value pointer: the one its init step recorded, else the only
    initial object there is (the init step crashed before recording it: then its checksum is
    taken by reading the object)."""
    if INIT_RECORD in names:
        path = init_record_path(run_id, p)
        ptr = Pointer.decode(_read(objs, [path])[0])
        if ptr is None:
            raise CorruptObject(f"{path} is not a pointer")
        return ptr
    inits = sorted(n for n in names if n.startswith("init-"))
    if not inits:
        return None
    if len(inits) > 1:
        raise StoreError(f"run {run_id!r} fragment {p}: {len(inits)} initial objects and no "
                         f"{INIT_RECORD} naming the one in use: {inits}")
    path = f"{run_id}/f{p}/{inits[0]}"
    data = _read(objs, [path])[0]
    return Pointer(path, len(data), crc32c.crc32c(data))


#: Key-name parts of the telemetry groups (:mod:`ddiloco.store.keys`).
_TELEMETRY = (EVENTS, FATES, f"{COUNTERS}:", f"{FATE}:")


@unavailable
def snapshot_telemetry(client: redis.Redis, run_id: str,
                       *, other_runs: bool = False) -> dict[bytes, bytes]:
    """The run's telemetry keys (events, counters, fate records) as ``DUMP`` payloads, by key;
    with ``other_runs``, also every key that is not the run's (other runs on the same server,
    whole). Pause the writers first (``CLIENT PAUSE ... WRITE``) for a snapshot nothing slips
    past."""
    keys = RedisCore(client, run_id).keys
    prefix = keys.run_prefix
    mine = [re.compile(fnmatch.translate(p)) for p in keys.patterns()]
    out: dict[bytes, bytes] = {}
    for key in client.scan_iter(match="*" if other_runs else f"{prefix}*", count=1000):
        name = as_str(key)
        if name.startswith(prefix):
            part = name[len(prefix):]
            if not (part in (EVENTS, FATES) or part.startswith(_TELEMETRY[2:])):
                continue
        elif any(m.match(name) for m in mine):
            continue  # the run's fragment keys: rebuilt, not carried
        dumped = client.dump(key)
        if dumped is not None:
            out[name.encode()] = bytes(dumped)
    return out


@unavailable
def restore_telemetry(client: redis.Redis, snapshot: dict[bytes, bytes]) -> int:
    """Write back what :func:`snapshot_telemetry` took (replacing keys written since: the
    snapshot holds everything up to the loss); returns how many keys."""
    pipe = client.pipeline(transaction=True)
    for key, payload in snapshot.items():
        pipe.restore(key, 0, payload, replace=True)
    pipe.execute()
    return len(snapshot)
