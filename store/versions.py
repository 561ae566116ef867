"""Fragment versions of the Redis store (DESIGN §2 step 6, §3): heads, blobs, claim, publish.

The run record (blob location, manifest, initial values) is :mod:`ddiloco.store.run_record`;
the background deletion of old versions' objects is :mod:`ddiloco.store.collection`.

:class:`RedisVersions` implements :class:`~ddiloco.store.base.VersionStore` on the fragment keys
of :mod:`ddiloco.store.keys`, with the Lua scripts ``publish.lua``, ``claim.lua`` and
``latest.lua``.

Guarantees:

* :meth:`RedisVersions.publish` is a compare-and-set on the head version, fenced by the shard
  epoch, and writes value, momentum, meta and head and deletes the versions that leave the kept
  window in one Lua script: readers see all of a version or none of it.
* :meth:`RedisVersions.get_latest` reads head and blobs in one Lua script (no torn read).
* Garbage collection deletes, on each publish, the versions in
  ``(new - keep - GC_SPAN, new - keep]``. With a constant ``keep`` that is exactly the version
  leaving the window; if ``keep`` shrinks by more than ``GC_SPAN`` between two publishes, the
  older surplus versions stay until :meth:`~ddiloco.store.core.RedisCore.flush_run`.
* Connection errors are retried by the client's redis-py ``Retry`` (see
  :func:`ddiloco.store.connect`); what still fails is raised as ``StoreUnavailable``. A publish
  re-sent after a lost reply is recognised by its token and answered as a success, not as a
  conflict.

Blobs in an object store:

With a blob location other than ``redis`` (:meth:`RedisVersions.set_blob_location`, done by the
run's init step before the manifest), value, momentum and initial blobs are immutable objects and
their Redis keys hold pointers (:mod:`ddiloco.store.objects`). The same Lua scripts run on the
pointers, so every guarantee above holds for them. In addition:

* :meth:`RedisVersions.publish` writes (and, for ``file://``, fsyncs) both objects *before* the
  compare-and-set of the head, so no head ever points at a missing object. A refused publish
  deletes its own objects; a crash between the two leaves orphans, which the garbage
  collection of a later publish removes (it lists the fragment's objects and deletes every
  one whose version left the kept window).
* Readers fetch the pointers, then the objects, checking length and CRC-32 before anything is
  decoded. An object collected under a reader is retried on the newer head
  (``READ_RETRIES`` times); a head whose object is missing or corrupt after that raises
  ``MissingObject`` / ``CorruptObject``.
* An object store that does not answer raises ``ObjectStoreUnavailable`` (a
  ``StoreUnavailable``): a shard keeps its round and publishes when the store is back.

What a crash can lose:

The store is as durable as the Redis behind it. With the configuration of
:class:`ddiloco.store.embedded.EmbeddedRedis` (AOF, ``appendfsync always``) a ``kill -9`` of Redis
loses no acknowledged write: heads are consistent after a restart (each Lua script is logged as a
whole). With ``appendfsync everysec`` a crash loses about the last second of writes; the heads
may then be a version behind what shards published and broadcast, and a re-published version
number would carry other contents than the one learners adopted: run the parameter store with
``appendfsync always``. A Redis with an eviction policy other than ``noeviction`` may drop
blobs; reads then raise ``StoreError`` instead of returning torn data.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Callable, Iterable, Sequence
from typing import Any, cast

import redis

from ddiloco.pipeline.errors import (
    AlreadyMerged,
    FencedOut,
    StoreError,
    StoreUnavailable,
    VersionConflict,
)
from ddiloco.store.base import FragmentBlob, FragmentHead
from ddiloco.store.connect import REPLICAS_ATTR
from ddiloco.store.core import ReadOnlyScript, as_str, dumps, load_script, unavailable
from ddiloco.store.objects import (
    MissingObject,
    ObjectBlobs,
    ObjectStoreUnavailable,
    Pointer,
    join_parts,
)
from ddiloco.store.run_record import RedisRunRecord
from ddiloco.store.version_records import (
    VersionRecord,
    record_path,
)

__all__ = ["GC_SPAN", "READ_RETRIES", "RedisVersions"]

#: How many versions below the kept window one publish deletes (see module docstring).
GC_SPAN = 8
#: How many times a read whose object was garbage-collected under it is retried on the newer
#: head before it fails.
READ_RETRIES = 5

log = logging.getLogger(__name__)


#: The head hash fields of a :class:`FragmentHead`.
_HEAD_FIELDS = ["version", "epoch", "updated_at", "token"]


class RedisVersions(RedisRunRecord):
    """The versioned fragments of one run: heads, versions, claim and publish
    (:class:`VersionStore`, with the run record of :class:`RedisRunRecord`).

    Args and errors as :class:`~ddiloco.store.core.RedisCore`.
    """

    def __init__(
        self, client: redis.Redis, run_id: str, *, clock: Callable[[], float] = time.time
    ) -> None:
        super().__init__(client, run_id, clock=clock)
        self._publish = load_script(client, "publish")
        self._claim = load_script(client, "claim")
        self._latest = ReadOnlyScript(client, "latest")

    # -- fragments ------------------------------------------------------------------------------
    @staticmethod
    def _head(raw: list[Any]) -> FragmentHead | None:
        version, epoch, updated_at, token = raw
        if version is None:  # never published (possibly claimed: then only `epoch` is set)
            return None
        return FragmentHead(int(version), int(epoch), float(updated_at),
                            "" if token is None else as_str(token))

    @unavailable
    def head(self, p: int) -> FragmentHead | None:
        """Head of fragment ``p``; None if no version was published (claimed or not)."""
        return self._head(self._r.hmget(self.keys.head(p), _HEAD_FIELDS))

    @unavailable
    def heads(self, n_fragments: int) -> list[FragmentHead | None]:
        """Heads of fragments ``0 .. n_fragments-1``, one pipelined round trip."""
        pipe = self._r.pipeline(transaction=False)
        for p in range(n_fragments):
            pipe.hmget(self.keys.head(p), _HEAD_FIELDS)
        return [self._head(raw) for raw in pipe.execute()]

    def _blob(
        self, p: int, version: int, value: Any, momentum: Any, meta: Any
    ) -> FragmentBlob | None:
        if value is None and momentum is None:
            return None
        if value is None or momentum is None:
            # publish writes both and GC deletes both in one script: only eviction or a hand
            # edit can split them. Say so rather than hand back half a version.
            raise StoreError(
                f"run {self.run_id!r} fragment {p} version {version}: value or momentum blob "
                "missing (evicted? the Redis must run with maxmemory-policy noeviction)"
            )
        value, momentum = self._resolve([bytes(value), bytes(momentum)])
        return FragmentBlob(
            fragment=p,
            version=version,
            value=value,
            momentum=momentum,
            meta=json.loads(meta) if meta is not None else {},
        )

    @unavailable
    def get_version(self, p: int, version: int) -> FragmentBlob | None:
        """Version ``version`` of fragment ``p``, or None if never written or garbage-collected.

        Raises:
            StoreError: only one of value and momentum is present (evicted).
            MissingObject, CorruptObject: a pointer's object is gone or damaged (after
                ``READ_RETRIES`` reads).
        """
        for attempt in range(READ_RETRIES + 1):
            pipe = self._r.pipeline(transaction=True)  # MULTI: the three reads see one state
            for key in self.keys.blobs(p, version):
                pipe.get(key)
            value, momentum, meta = pipe.execute()
            try:
                return self._blob(p, version, value, momentum, meta)
            except MissingObject:
                # Collected between the pointer read and the object read: the next read finds
                # no pointer (None) or, if it is still there, the object must be too.
                if attempt == READ_RETRIES:
                    raise
        raise AssertionError("unreachable")

    @unavailable
    def version_meta(self, p: int, version: int) -> dict[str, Any] | None:
        """The meta of version ``version`` of ``p`` (one GET, no blobs), or None if never
        written or garbage-collected."""
        raw = self._r.get(self.keys.meta(p, version))
        return None if raw is None else cast(dict[str, Any], json.loads(raw))

    @unavailable
    def stored_versions(self, p: int) -> list[int]:
        """Every version of ``p`` whose value key exists, ascending (a read-only SCAN)."""
        prefix = f"{self.keys.fragment_prefix(p)}v:"
        found: list[int] = []
        for key in self._r.scan_iter(match=f"{prefix}*", count=500):
            suffix = as_str(key)[len(prefix):]
            if suffix.isdigit():
                found.append(int(suffix))
        return sorted(found)

    def _latest_from(self, p: int, raw: Any) -> FragmentBlob | None:
        if not raw:
            return None
        version, _epoch, _updated_at, value, momentum, meta = raw
        return self._blob(p, int(version), value, momentum, meta)

    def _latest_call(self, p: int, client: Any = None) -> Any:
        return self._latest(
            keys=[self.keys.head(p)], args=[self.keys.fragment_prefix(p)], client=client
        )

    @unavailable
    def get_latest(self, p: int) -> FragmentBlob | None:
        """Head version of ``p`` with its blobs, read atomically by one Lua script.

        Returns None when nothing was published.

        Raises:
            StoreError: the head's blobs are missing (evicted).
            MissingObject, CorruptObject: the head's object is gone or damaged after
                ``READ_RETRIES`` reads of newer heads.
        """
        for attempt in range(READ_RETRIES + 1):
            try:
                return self._latest_from(p, self._latest_call(p))
            except MissingObject:
                if attempt == READ_RETRIES:
                    raise
                log.info("fragment %d: object collected under the read, reading the new head", p)
        raise AssertionError("unreachable")

    @unavailable
    def get_latest_many(self, ps: Iterable[int], momentum: bool = True,
                        ) -> list[FragmentBlob | None]:
        """:meth:`get_latest` of each fragment in ``ps``, one pipelined round trip.

        Each fragment is read atomically; different fragments may be read at slightly different
        moments (they are independent, DESIGN §2). ``momentum=False``: the records' momentum is
        ``b""`` and its objects are not read (a learner or the evaluator needs values alone:
        half the bytes of a rejoin when the outer momentum is kept).
        """
        ps = list(ps)
        for attempt in (0, 1):
            pipe = self._r.pipeline(transaction=False)
            for p in ps:
                self._latest_call(p, client=pipe)
            try:
                raws = pipe.execute()
                break
            except redis.exceptions.NoScriptError:
                if attempt:
                    raise
                self._latest.load()  # the server restarted and lost its scripts
        if not momentum:
            raws = [[*r[:4], b"", *r[5:]] if r else r for r in raws]
        return self._latest_many_from(ps, raws)

    def _latest_many_from(self, ps: list[int], raws: list[Any]) -> list[FragmentBlob | None]:
        # Fetch every pointer's object in one parallel batch (a rejoining learner's pull), then
        # build the records; a fragment whose object was collected meanwhile is read again.
        found = [r for r in raws if r]
        flat = [bytes(x) for r in found for x in (r[3], r[4]) if x is not None]
        ptrs = [pt for pt in (Pointer.decode(x) for x in flat) if pt is not None]
        if ptrs:
            got = self._objects_for_read(ptrs[0].path).get_many(ptrs)
            table = dict(zip((pt.encode() for pt in ptrs), got, strict=True))
        out: list[FragmentBlob | None] = []
        for p, raw in zip(ps, raws, strict=True):
            if not raw or not ptrs:
                out.append(self._latest_from(p, raw))
                continue
            version, _epoch, _updated_at, value, momentum, meta = raw
            items = [table.get(bytes(x)) if x is not None else None for x in (value, momentum)]
            if any(isinstance(i, MissingObject) for i in items):
                out.append(self.get_latest(p))
                continue
            for i in items:
                if isinstance(i, BaseException):
                    raise i
            blobs = [i if i is not None else x for i, x in zip(items, (value, momentum),
                                                                 strict=True)]
            out.append(self._blob_checked(p, int(version), blobs[0], blobs[1], meta))
        return out

    def _blob_checked(self, p: int, version: int, value: Any, momentum: Any,
                      meta: Any) -> FragmentBlob | None:
        """:meth:`_blob` for blobs whose pointers were already resolved."""
        if value is None or momentum is None:
            return self._blob(p, version, value, momentum, meta)
        return FragmentBlob(fragment=p, version=version, value=_owned(value),
                            momentum=_owned(momentum),
                            meta=json.loads(meta) if meta is not None else {})

    @unavailable
    def claim_fragment(self, p: int, epoch: int) -> None:
        """Raise fragment ``p``'s epoch to ``epoch`` (a shard does this on taking its lease).

        After the claim, :meth:`publish` with a lower epoch fails with ``FencedOut``, so a shard
        whose lease expired while it was paused cannot overwrite its successor's versions. An
        unpublished fragment records the epoch in its head hash without a version: it still has
        no head (:meth:`head` returns None) and the next publish expects version -1.
        Re-claiming with the same epoch is a no-op.

        Raises:
            FencedOut: a higher epoch already claimed or wrote the fragment.
        """
        try:
            self._claim(keys=[self.keys.head(p)], args=[epoch])
        except redis.ResponseError as exc:
            if "FENCED" in str(exc):
                raise FencedOut(f"run {self.run_id!r} fragment {p}: {exc}") from exc
            raise

    @unavailable
    def publish(
        self,
        p: int,
        *,
        expected_version: int,
        epoch: int,
        value: bytes | Sequence[memoryview],
        momentum: bytes | Sequence[memoryview],
        keep: int,
        meta: dict[str, Any] | None = None,
        now: float | None = None,
        token: str | None = None,
        ledger: Sequence[tuple[str, int, int]] = (),
    ) -> int:
        """Write version ``expected_version + 1`` of fragment ``p`` (DESIGN §2 step 6).

        One Lua script checks the fence (``epoch`` >= the fragment's epoch) and then the head
        (``version == expected_version``, -1 when nothing was published), writes value,
        momentum, meta and head and deletes the versions ``<= new - keep`` (see ``GC_SPAN``).

        Args:
            p: fragment index.
            expected_version: the head version the new one is built on; -1 for the first.
            epoch: the writer's shard epoch from
                :meth:`~ddiloco.store.membership.RedisMembership.acquire_lease`.
            value: Theta_p, opaque bytes, or the blob's parts in order
                (:data:`ddiloco.store.objects.BlobParts`: an object store writes them with no
                joined copy).
            momentum: the outer momentum of the fragment, likewise.
            keep: how many latest versions stay readable, >= 1 (the new one included).
            meta: small JSON-able dict stored with the version.
            now: wall-clock seconds for ``updated_at``; ``self.clock()`` when None.
            token: the write token kept in the head (a fresh one when None): the same call
                repeated after a lost reply is answered as a success.
            ledger: ``(learner:incarnation, first seq, last seq)`` of each merged delta
                group; checked against and added to the fragment's merge ledger.

        Returns:
            The new version.

        Raises:
            ValueError: ``keep < 1`` or ``expected_version < -1``.
            FencedOut: a higher epoch claimed the fragment; nothing written.
            VersionConflict: the head is not ``expected_version``; nothing written.
            AlreadyMerged: the merge ledger holds one of ``ledger``'s deltas; nothing written.
            ObjectStoreUnavailable: the object store did not take the objects; nothing
                published (retry later).
        """
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (the new version is kept), got {keep}")
        if expected_version < -1:
            raise ValueError(f"expected_version must be >= -1, got {expected_version}")
        new = expected_version + 1
        oldest_gone = new - keep
        gc_keys = [
            key
            for n in range(max(0, oldest_gone - GC_SPAN + 1), oldest_gone + 1)
            for key in self.keys.blobs(p, n)
        ]
        token = token or uuid.uuid4().hex
        objs = self._objects_for_write()
        written: list[str] = []
        if objs is not None:
            # Objects first, durably: the head must never point at a missing object. The
            # version record comes last, so a record implies both blobs (version_records.py).
            base = f"{self.run_id}/f{p}/v{new:012d}-{token}"
            try:
                vptr = objs.put(base + ".value", value)
                written.append(vptr.path)
                mptr = objs.put(base + ".momentum", momentum)
                written.append(mptr.path)
                record = self._record(p, new, epoch, token, keep, meta, vptr, mptr, ledger,
                                      self.clock() if now is None else now)
                if record is not None:
                    written.append(objs.put(record_path(self.run_id, p, new, token),
                                            record.encode()).path)
            except ObjectStoreUnavailable:
                self._delete_quietly(objs, written)
                raise
            stored_value: bytes | memoryview = vptr.encode()
            stored_momentum: bytes | memoryview = mptr.encode()
            now = record.updated_at if record is not None else now
        else:
            stored_value, stored_momentum = join_parts(value), join_parts(momentum)
        keys = [self.keys.head(p), *self.keys.blobs(p, new), *gc_keys]
        args = [expected_version, epoch, stored_value, stored_momentum, dumps(meta or {}),
                repr(self.clock() if now is None else now), token,
                dumps([[who, int(first), int(last)] for who, first, last in ledger])]
        try:
            result = self._publish_durably(p, new, keys, args)
        except redis.ResponseError as exc:
            if objs is not None:
                self._delete_quietly(objs, written)
            message = f"run {self.run_id!r} fragment {p}: {exc}"
            if "VERSION_CONFLICT" in str(exc):
                raise VersionConflict(message) from exc
            if "FENCED" in str(exc):
                raise FencedOut(message) from exc
            if "ALREADY_MERGED" in str(exc):
                raise AlreadyMerged(message) from exc
            raise
        if objs is not None:
            self.collector.later(objs, p, oldest_gone)
        return int(result)

    def _record(self, p: int, new: int, epoch: int, token: str, keep: int,
                meta: dict[str, Any] | None, vptr: Pointer, mptr: Pointer,
                ledger: Sequence[tuple[str, int, int]], now: float) -> VersionRecord | None:
        """The version record of a publish about to be tried, or None when this very publish
        is already the head (a call repeated after a lost reply: its record was written then).

        The head is read first for the parent's token and the merge ledger. Reading it apart
        from the compare-and-set is safe: if the head moves in between, the compare-and-set
        fails and the record is deleted with the blobs.
        """
        head = {as_str(k): as_str(v) for k, v in self._r.hgetall(self.keys.head(p)).items()}
        current = int(head["version"]) if "version" in head else -1
        if current == new and head.get("token") == token:
            return None
        merged = {k[len("merged:"):]: int(v) for k, v in head.items() if k.startswith("merged:")}
        for who, _first, last in ledger:
            merged[who] = int(last)
        return VersionRecord(
            fragment=p, version=new, epoch=epoch, updated_at=now, token=token,
            parent=head.get("token", "") if current == new - 1 else "", keep=keep,
            meta=dict(meta or {}), value=vptr, momentum=mptr, ledger=merged)

    def _publish_durably(self, p: int, new: int, keys: list[str], args: list[Any]) -> Any:
        """Run the publish script; under Sentinel (:data:`~ddiloco.store.connect.REPLICAS_ATTR`)
        then ``WAIT`` on the same connection until enough replicas have it.

        Raises:
            StoreUnavailable: too few replicas took the version in time: it is on the primary,
                so its outcome is unknown until a replica has it (a failover may lose it);
                the caller settles it by the head's token.
        """
        wait = getattr(self._r, REPLICAS_ATTR, None)
        if not wait or wait[0] <= 0:
            return self._publish(keys=keys, args=args)
        replicas, timeout_ms = wait
        pipe = self._r.pipeline(transaction=False)  # one connection: WAIT covers the write
        self._publish(keys=keys, args=args, client=pipe)
        pipe.execute_command("WAIT", replicas, timeout_ms)
        result, acked = pipe.execute(raise_on_error=False)
        if isinstance(result, Exception):
            raise result
        if isinstance(acked, Exception) or int(acked) < replicas:
            raise StoreUnavailable(
                f"run {self.run_id!r} fragment {p}: version {new} is on the primary but "
                f"reached {acked} of {replicas} replica(s) within {timeout_ms} ms")
        return result

    @staticmethod
    def _delete_quietly(objs: ObjectBlobs, paths: list[str]) -> None:
        try:
            objs.delete(paths)
        except ObjectStoreUnavailable as exc:  # orphans: a later collection removes them
            log.warning("could not delete %s: %s", paths, exc)



def _owned(blob: Any) -> bytes:
    """``blob`` as bytes; a ``bytearray`` (an object read in ranges) is kept, not copied: it
    reads as bytes everywhere (``FragmentBlob.value``), and a rejoining learner decodes it in
    place (:func:`ddiloco.workers.run.blobs.decode_blob` with ``own``)."""
    if isinstance(blob, bytearray):
        return cast(bytes, blob)
    return blob if isinstance(blob, bytes) else bytes(blob)
