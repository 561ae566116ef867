"""Fragment versions of the Redis store (DESIGN §2 step 6, §3): manifest, heads, blobs, publish.

:class:`RedisVersions` implements :class:`~ddiloco.store.base.VersionStore` on the fragment keys
of :mod:`ddiloco.store.keys`, with the Lua scripts ``publish.lua``, ``claim.lua`` and
``latest.lua``.

Guarantees
----------
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

What a crash can lose
---------------------
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
import time
import uuid
from collections.abc import Callable, Iterable
from typing import Any, cast

import redis

from ddiloco.pipeline.errors import (
    ConfigError,
    FencedOut,
    ManifestMismatch,
    StoreError,
    VersionConflict,
)
from ddiloco.store.base import FragmentBlob, FragmentHead
from ddiloco.store.core import ReadOnlyScript, RedisCore, dumps, load_script, unavailable

__all__ = ["GC_SPAN", "RedisVersions"]

#: How many versions below the kept window one publish deletes (see module docstring).
GC_SPAN = 8


class RedisVersions(RedisCore):
    """The run manifest and the versioned fragments of one run (:class:`VersionStore`).

    Args and errors as :class:`~ddiloco.store.core.RedisCore`.
    """

    def __init__(
        self, client: redis.Redis, run_id: str, *, clock: Callable[[], float] = time.time
    ) -> None:
        super().__init__(client, run_id, clock=clock)
        self._publish = load_script(client, "publish")
        self._claim = load_script(client, "claim")
        self._latest = ReadOnlyScript(client, "latest")

    # -- manifest -------------------------------------------------------------------------------
    @unavailable
    def put_manifest(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Store the run manifest unless one exists (SET NX); return the stored manifest.

        The first writer wins. A later worker whose ``schema_hash`` equals the stored one gets the
        stored manifest back (as decoded JSON), even if other fields differ: the stored one is the
        run's truth.

        Raises:
            ConfigError: ``manifest`` has no ``schema_hash``.
            ManifestMismatch: the stored manifest has another ``schema_hash``; the message shows
                both hashes and the top-level fields that differ.
        """
        if "schema_hash" not in manifest:
            raise ConfigError("manifest.schema_hash: required to compare workers of a run")
        encoded = dumps(manifest)
        # A loop, not a single SET NX + GET: the key may be flushed between the two (--fresh).
        for _ in range(3):
            if self._r.set(self.keys.manifest, encoded, nx=True):
                return cast(dict[str, Any], json.loads(encoded))
            raw = self._r.get(self.keys.manifest)
            if raw is None:
                continue
            stored = cast(dict[str, Any], json.loads(raw))
            if stored.get("schema_hash") != manifest["schema_hash"]:
                mine = cast(dict[str, Any], json.loads(encoded))
                differ = sorted(
                    k for k in set(stored) | set(mine) if stored.get(k, ...) != mine.get(k, ...)
                )
                raise ManifestMismatch(
                    f"run {self.run_id!r}: manifest schema_hash {manifest['schema_hash']!r} "
                    f"differs from the stored {stored.get('schema_hash')!r}; differing fields: "
                    f"{', '.join(differ)}. Use the run's configuration, another run id, or "
                    "start the run afresh."
                )
            return stored
        raise StoreError(f"run {self.run_id!r}: manifest key deleted while being written")

    @unavailable
    def get_manifest(self) -> dict[str, Any] | None:
        """The stored run manifest, or None."""
        raw = self._r.get(self.keys.manifest)
        return None if raw is None else cast(dict[str, Any], json.loads(raw))

    @unavailable
    def put_initial(self, p: int, value: bytes) -> bool:
        """Store fragment ``p``'s initial value blob unless it has one (SET NX). Returns True
        if this call stored it."""
        return bool(self._r.set(self.keys.initial(p), value, nx=True))

    @unavailable
    def get_initial(self, p: int) -> bytes | None:
        """Fragment ``p``'s initial value blob, or None before the init step."""
        raw = self._r.get(self.keys.initial(p))
        return None if raw is None else bytes(raw)

    # -- fragments ------------------------------------------------------------------------------
    @staticmethod
    def _head(raw: list[Any]) -> FragmentHead | None:
        version, epoch, updated_at = raw
        if version is None:  # never published (possibly claimed: then only `epoch` is set)
            return None
        return FragmentHead(int(version), int(epoch), float(updated_at))

    @unavailable
    def head(self, p: int) -> FragmentHead | None:
        """Head of fragment ``p``; None if no version was published (claimed or not)."""
        return self._head(self._r.hmget(self.keys.head(p), ["version", "epoch", "updated_at"]))

    @unavailable
    def heads(self, n_fragments: int) -> list[FragmentHead | None]:
        """Heads of fragments ``0 .. n_fragments-1``, one pipelined round trip."""
        pipe = self._r.pipeline(transaction=False)
        for p in range(n_fragments):
            pipe.hmget(self.keys.head(p), ["version", "epoch", "updated_at"])
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
        return FragmentBlob(
            fragment=p,
            version=version,
            value=bytes(value),
            momentum=bytes(momentum),
            meta=json.loads(meta) if meta is not None else {},
        )

    @unavailable
    def get_version(self, p: int, version: int) -> FragmentBlob | None:
        """Version ``version`` of fragment ``p``, or None if never written or garbage-collected.

        Raises:
            StoreError: only one of value and momentum is present (evicted).
        """
        pipe = self._r.pipeline(transaction=True)  # MULTI: the three reads see one state
        for key in self.keys.blobs(p, version):
            pipe.get(key)
        value, momentum, meta = pipe.execute()
        return self._blob(p, version, value, momentum, meta)

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
        """
        return self._latest_from(p, self._latest_call(p))

    @unavailable
    def get_latest_many(self, ps: Iterable[int]) -> list[FragmentBlob | None]:
        """:meth:`get_latest` of each fragment in ``ps``, one pipelined round trip.

        Each fragment is read atomically; different fragments may be read at slightly different
        moments (they are independent, DESIGN §2).
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
        return [self._latest_from(p, raw) for p, raw in zip(ps, raws, strict=True)]

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
        value: bytes,
        momentum: bytes,
        keep: int,
        meta: dict[str, Any] | None = None,
        now: float | None = None,
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
            value: Theta_p, opaque bytes.
            momentum: the outer momentum of the fragment, opaque bytes.
            keep: how many latest versions stay readable, >= 1 (the new one included).
            meta: small JSON-able dict stored with the version.
            now: wall-clock seconds for ``updated_at``; ``self.clock()`` when None.

        Returns:
            The new version.

        Raises:
            ValueError: ``keep < 1`` or ``expected_version < -1``.
            FencedOut: a higher epoch claimed the fragment; nothing written.
            VersionConflict: the head is not ``expected_version``; nothing written.
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
        try:
            result = self._publish(
                keys=[self.keys.head(p), *self.keys.blobs(p, new), *gc_keys],
                args=[
                    expected_version,
                    epoch,
                    value,
                    momentum,
                    dumps(meta or {}),
                    repr(self.clock() if now is None else now),
                    uuid.uuid4().hex,
                ],
            )
        except redis.ResponseError as exc:
            message = f"run {self.run_id!r} fragment {p}: {exc}"
            if "VERSION_CONFLICT" in str(exc):
                raise VersionConflict(message) from exc
            if "FENCED" in str(exc):
                raise FencedOut(message) from exc
            raise
        return int(result)

