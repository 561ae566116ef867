"""The run record of the Redis store (DESIGN §3): where the run keeps its blobs, its manifest
and its fragments' initial values, and the object store behind them.

:class:`RedisRunRecord` is the part of :class:`~ddiloco.store.versions.RedisVersions` written
once per run (the blob location and the manifest with SET NX, each initial value once) or read
by every worker at start; the versions themselves, their publish and their reads are
:mod:`ddiloco.store.versions`. With blobs in an object store, the manifest and each initial
value's pointer are also kept there, for a rebuild of Redis (:mod:`ddiloco.store.rebuild`).
"""

from __future__ import annotations

import json
import time
import uuid
from collections.abc import Callable
from typing import Any, cast

import redis

from ddiloco.pipeline.errors import ConfigError, ManifestMismatch, StoreError
from ddiloco.store.collection import Collector
from ddiloco.store.core import RedisCore, as_str, dumps, unavailable
from ddiloco.store.objects import REDIS, ObjectBlobs, Pointer, check_location, open_objects
from ddiloco.store.version_records import init_record_path, manifest_path

__all__ = ["RedisRunRecord"]


class RedisRunRecord(RedisCore):
    """Blob location, manifest and initial values of one run (part of :class:`VersionStore`).

    Args and errors as :class:`~ddiloco.store.core.RedisCore`.
    """

    def __init__(
        self, client: redis.Redis, run_id: str, *, clock: Callable[[], float] = time.time
    ) -> None:
        super().__init__(client, run_id, clock=clock)
        self._location: str | None = None
        self._objects: ObjectBlobs | None = None
        #: deletes the objects of versions that left the kept window, in the background
        self.collector = Collector(run_id)
        #: applied to the object store when it is opened (failpoints wrap it: store/failpoints.py)
        self.object_wrapper: Callable[[ObjectBlobs], ObjectBlobs] | None = None

    # -- blob location --------------------------------------------------------------------------
    @unavailable
    def set_blob_location(self, location: str) -> str:
        """Record where the run keeps its blobs (SET NX; the first writer wins) and return it.

        Args:
            location: ``redis``, ``file:///dir`` or ``s3://bucket/prefix``
                (:func:`ddiloco.store.objects.check_location`).

        Raises:
            ConfigError: a bad location; the run already keeps its blobs elsewhere (both are
                named); the object-store client is not installed (names the extra).
        """
        loc = check_location(location)
        if not self._r.set(self.keys.blob_location, loc, nx=True):
            raw = self._r.get(self.keys.blob_location)
            stored = loc if raw is None else as_str(raw)
            if stored != loc:
                raise ConfigError(
                    f"run {self.run_id!r} keeps its blobs in {stored!r}, the configuration "
                    f"names {loc!r}: set store.blobs = {stored!r}, use another run id, or "
                    "start the run afresh"
                )
        self._use_location(loc)
        return loc

    def _use_location(self, loc: str) -> None:
        if self._location != loc:
            objs = open_objects(loc)
            wrap = self.object_wrapper
            self._objects = objs if objs is None or wrap is None else wrap(objs)
            self._location = loc

    @property
    def blob_location(self) -> str:
        """Where the run keeps its blobs: ``redis`` until the init step recorded another.

        Raises:
            StoreUnavailable: Redis did not answer.
        """
        if self._location is None:
            raw = unavailable(self._r.get)(self.keys.blob_location)
            if raw is None:
                return REDIS  # not cached: the init step may record the location later
            self._use_location(as_str(raw))
        assert self._location is not None
        return self._location

    def _objects_for_write(self) -> ObjectBlobs | None:
        return None if self.blob_location == REDIS else self._objects

    def _objects_for_read(self, path: str) -> ObjectBlobs:
        if self.blob_location == REDIS or self._objects is None:
            raise StoreError(
                f"run {self.run_id!r}: a pointer to object {path!r}, but the run records no "
                "object-store location (its blobs key was deleted?)"
            )
        return self._objects

    def _resolve(self, raws: list[bytes]) -> list[bytes | bytearray]:
        """Blobs for raw Redis values: pointers are replaced by their objects (read in
        parallel, checked)."""
        ptrs = [Pointer.decode(r) for r in raws]
        wanted = [pt for pt in ptrs if pt is not None]
        if not wanted:
            return list(raws)
        got = self._objects_for_read(wanted[0].path).get_many(wanted)
        fetched = iter(got)
        out: list[bytes | bytearray] = []
        for raw, pt in zip(raws, ptrs, strict=True):
            if pt is None:
                out.append(raw)
                continue
            item = next(fetched)
            if isinstance(item, BaseException):
                raise item
            out.append(item)
        return out

    def wait_collected(self) -> None:
        """Wait for the garbage collections that publishes started
        (:class:`~ddiloco.store.collection.Collector`)."""
        self.collector.wait()

    def object_paths(self) -> list[str]:
        """Paths of every object this run holds in its object store (empty on ``redis``)."""
        self.wait_collected()
        objs = self._objects_for_write()
        return [] if objs is None else objs.list(self.run_id)

    def flush_run(self) -> int:
        """Delete every key of this run and, with an object store, every object of it; return
        how many keys and objects were deleted. Not atomic: run it with no writer active."""
        self.wait_collected()
        objs = self._objects_for_write()
        paths = [] if objs is None else objs.list(self.run_id)
        if objs is not None:
            objs.delete(paths)
        deleted = super().flush_run()
        self._location, self._objects = None, None
        return deleted + len(paths)

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
                self._keep_manifest(encoded)
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
            self._keep_manifest(bytes(raw))
            return stored
        raise StoreError(f"run {self.run_id!r}: manifest key deleted while being written")

    def _keep_manifest(self, encoded: bytes | str) -> None:
        """With an object store, keep the stored manifest there too, for a rebuild of Redis
        (:mod:`ddiloco.store.rebuild`). Every worker writes it (same bytes: the stored
        manifest's), so a crash of the first writer right after its SET NX loses nothing."""
        objs = self._objects_for_write()
        if objs is not None:
            objs.put(manifest_path(self.run_id),
                     encoded.encode() if isinstance(encoded, str) else encoded)

    @unavailable
    def get_manifest(self) -> dict[str, Any] | None:
        """The stored run manifest, or None."""
        raw = self._r.get(self.keys.manifest)
        return None if raw is None else cast(dict[str, Any], json.loads(raw))

    @unavailable
    def update_manifest(
        self, change: Callable[[dict[str, Any]], dict[str, Any]]
    ) -> dict[str, Any] | None:
        """Replace the stored manifest by ``change(manifest)`` (a WATCH/MULTI transaction,
        retried while other writers change it); return the new one, or None when the run has
        none. With an object store, its copy there is replaced too.

        Raises:
            StoreError: the manifest kept changing under the update (5 tries).
        """
        key = self.keys.manifest
        for _ in range(5):
            with self._r.pipeline() as pipe:
                try:
                    pipe.watch(key)
                    raw = cast(bytes | None, pipe.get(key))  # watched: runs at once
                    if raw is None:
                        return None
                    updated = change(cast(dict[str, Any], json.loads(raw)))
                    pipe.multi()
                    pipe.set(key, dumps(updated))
                    pipe.execute()
                except redis.WatchError:
                    continue
            self._keep_manifest(dumps(updated))
            return updated
        raise StoreError(f"run {self.run_id!r}: the manifest kept changing while being updated")

    @unavailable
    def put_initial(self, p: int, value: bytes) -> bool:
        """Store fragment ``p``'s initial value blob unless it has one (SET NX). Returns True
        if this call stored it. With an object store the blob is written as an object first
        and Redis gets its pointer; a writer that lost the race deletes its object."""
        objs = self._objects_for_write()
        if objs is None:
            return bool(self._r.set(self.keys.initial(p), value, nx=True))
        if self._r.exists(self.keys.initial(p)):
            return False
        ptr = objs.put(f"{self.run_id}/f{p}/init-{uuid.uuid4().hex}", value)
        if self._r.set(self.keys.initial(p), ptr.encode(), nx=True):
            # the winner names its object for a rebuild; a crash right here leaves the one
            # init object to find by listing (ddiloco.store.rebuild)
            objs.put(init_record_path(self.run_id, p), ptr.encode())
            return True
        objs.delete([ptr.path])
        return False

    @unavailable
    def get_initial(self, p: int) -> bytes | None:
        """Fragment ``p``'s initial value blob, or None before the init step.

        Raises:
            MissingObject, CorruptObject: the pointer's object is gone or damaged.
        """
        raw = self._r.get(self.keys.initial(p))
        return None if raw is None else bytes(self._resolve([bytes(raw)])[0])

