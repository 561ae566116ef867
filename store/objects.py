"""Fragment blobs in an object store; Redis keeps the metadata (DESIGN §3, "blobs").

At real model sizes Redis cannot hold the blobs: each fragment keeps ``history`` versions of its
float32 value and of its outer momentum, about 16x the model, and one string holds at most
512 MB. With a blob location other than ``redis`` the store writes every value, momentum and
initial blob as an immutable object and keeps in Redis, where the blob used to be, a small
*pointer* to it: the object's path, its length in bytes and its CRC-32C.

Blob locations (``store.blobs``)
--------------------------------
``redis``                 the default: blobs are Redis strings, as the parameter store always
                          kept them. For models whose fragments fit (see
                          :data:`REDIS_MAX_FRAGMENT_BYTES`).
``file:///abs/dir``       a local or shared file system (NFS, a mounted volume). Each object is
                          written to a temporary file, renamed into place, and fsync'd with its
                          directory before the head may point at it.
``s3://bucket/prefix``    any S3-compatible endpoint (AWS, MinIO, SeaweedFS, R2). Credentials and
                          endpoint come from the standard variables only (``AWS_ACCESS_KEY_ID``,
                          ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``/``AWS_ENDPOINT``,
                          ``AWS_REGION``, ``AWS_ALLOW_HTTP``), never from the URL: URLs are
                          stored in Redis and printed in reports.
``gs://``, ``az://``      passed to ``obstore`` as they are (untested here).

Every backend goes through ``obstore`` (one client for S3, GCS, Azure and local files), an
optional dependency: ``pip install 'ddiloco[objects]'``.

Object paths
------------
``<run>/f<p>/v<version:012d>-<token>.value``, ``....momentum`` and ``<run>/f<p>/init-<token>``,
relative to the location's prefix. ``token`` is the random id of the publish (the same one the
head records), so two writers racing for one version never write the same path, and an object
is never overwritten.

Pointers
--------
``b"ddl-obj1 "`` followed by JSON ``{"path": str, "size": int, "crc32c": int}``. A pointer is at
most a few hundred bytes; a blob never starts with the magic (codec blobs start with a zstd
frame's magic number), so a store can tell the two apart.
"""

from __future__ import annotations

import functools
import json
import os
import re
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import crc32c

from ddiloco.pipeline.errors import ConfigError, StoreError, StoreUnavailable

__all__ = [
    "OBJECTS_EXTRA",
    "POINTER_MAGIC",
    "RANGE_BYTES",
    "REDIS",
    "REDIS_MAX_FRAGMENT_BYTES",
    "CorruptObject",
    "MissingObject",
    "ObjectBlobs",
    "ObjectStoreUnavailable",
    "Pointer",
    "check_location",
    "object_version",
    "open_objects",
]

#: The default blob location: blobs are Redis strings.
REDIS = "redis"
#: ``pip install 'ddiloco[objects]'`` installs the object-store client.
OBJECTS_EXTRA = "objects"
#: Marks a pointer in place of a blob.
POINTER_MAGIC = b"ddl-obj1 "
#: A run whose largest fragment blob exceeds this many bytes is refused on ``redis``: one GET of
#: it would block every other client of the single-threaded Redis for seconds, and 512 MB is
#: Redis's default ``proto-max-bulk-len``. 256 MiB = a fragment of 64M float32 values.
REDIS_MAX_FRAGMENT_BYTES = 256 << 20
#: Objects larger than this are read in ranges of this many bytes, in parallel.
RANGE_BYTES = 32 << 20

_SCHEMES = ("file", "s3", "s3a", "gs", "az", "abfs", "abfss")
_VERSION = re.compile(r"/v(\d{12})-[0-9a-f]+\.(value|momentum)$")


class MissingObject(StoreError):
    """A pointer names an object that is not there (garbage-collected under a reader, or lost)."""


class CorruptObject(StoreError):
    """An object's length or CRC-32C differs from what its pointer recorded."""


class ObjectStoreUnavailable(StoreUnavailable):
    """The object store did not answer (after the client's own retries)."""


@dataclass(frozen=True)
class Pointer:
    """Where a blob lives: ``path`` relative to the location, ``size`` in bytes, ``crc32c`` of
    its bytes (CRC-32C, the Castagnoli polynomial of iSCSI, S3 and GCS checksums: computed in
    hardware by the ``crc32c`` package, several times the speed of ``zlib.crc32``)."""

    path: str
    size: int
    crc32c: int

    def encode(self) -> bytes:
        """The pointer as stored in Redis in place of the blob."""
        return POINTER_MAGIC + json.dumps(
            {"path": self.path, "size": self.size, "crc32c": self.crc32c}, sort_keys=True
        ).encode()

    @staticmethod
    def decode(raw: bytes) -> Pointer | None:
        """The pointer in ``raw``, or None when ``raw`` is a blob, not a pointer.

        Raises:
            StoreError: ``raw`` starts with the magic but is not a valid pointer.
        """
        if not raw.startswith(POINTER_MAGIC):
            return None
        try:
            d = json.loads(raw[len(POINTER_MAGIC):])
            ptr = Pointer(str(d["path"]), int(d["size"]), int(d["crc32c"]))
        except (ValueError, KeyError, TypeError) as exc:
            raise StoreError(f"malformed object pointer {raw[:80]!r}: {exc}") from None
        if ptr.size < 0 or not 0 <= ptr.crc32c < 1 << 32:
            raise StoreError(f"malformed object pointer {raw[:80]!r}: size or crc32c out of range")
        return ptr


def check_location(spec: str) -> str:
    """Validate a blob location (``store.blobs``) and return it normalised.

    ``redis`` stays ``redis``; ``file://DIR`` becomes ``file:///absolute/dir`` (a relative
    ``DIR`` is resolved against the working directory); cloud URLs are returned unchanged.

    Raises:
        ConfigError: an unknown scheme, a URL with credentials in it, a bucket-less cloud URL.
    """
    spec = spec.strip()
    if spec == REDIS:
        return REDIS
    parts = urlsplit(spec)
    if parts.scheme not in _SCHEMES:
        raise ConfigError(
            f"store.blobs: {spec!r} is not a blob location; use 'redis' (the default), "
            "'file:///path/to/dir' or 's3://bucket/prefix'"
        )
    if parts.password is not None or parts.username is not None:
        raise ConfigError(
            "store.blobs: the URL carries credentials; give them in the standard variables "
            "(AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY, ...) instead: the location is stored "
            "in Redis and printed in reports"
        )
    if parts.scheme == "file":
        raw = spec[len("file://"):]
        if not raw:
            raise ConfigError("store.blobs: file:// needs a directory, e.g. file:///data/blobs")
        return "file://" + str(Path(raw).expanduser().resolve())
    if not parts.netloc:
        raise ConfigError(f"store.blobs: {spec!r} names no bucket, e.g. s3://bucket/prefix")
    return spec.rstrip("/")


def object_version(path: str) -> int | None:
    """The fragment version in a value or momentum object's path, or None for other paths."""
    m = _VERSION.search(path)
    return int(m.group(1)) if m else None


def _obstore() -> Any:
    try:
        import obstore
    except ImportError:
        raise ConfigError(
            "store.blobs names an object store, but its client is not installed: "
            f"pip install 'ddiloco[{OBJECTS_EXTRA}]'"
        ) from None
    return obstore


def _is_not_found(exc: BaseException) -> bool:
    import obstore.exceptions as oe

    return isinstance(exc, (oe.NotFoundError, FileNotFoundError))


class ObjectBlobs:
    """Immutable blobs in one object-store location (module docstring).

    Args:
        location: a checked location (:func:`check_location`), not ``redis``.
        threads: parallel requests for ranged reads and multi-object reads.

    Raises:
        ConfigError: a bad location, or ``obstore`` is not installed (names the extra).
    """

    def __init__(self, location: str, *, threads: int = 8) -> None:
        obstore = _obstore()
        from obstore.store import LocalStore, from_url

        self.location = check_location(location)
        if self.location == REDIS:
            raise ConfigError("ObjectBlobs: 'redis' is not an object-store location")
        self._ob = obstore
        self._root: Path | None = None
        if self.location.startswith("file://"):
            self._root = Path(self.location[len("file://"):])
            self._root.mkdir(parents=True, exist_ok=True)
            self._store: Any = LocalStore(self._root)
        else:
            try:
                self._store = from_url(self.location)
            except Exception as exc:  # obstore raises its own config errors
                raise ConfigError(f"store.blobs {self.location!r}: {exc}") from None
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="ddl-objects")

    def __repr__(self) -> str:
        return f"ObjectBlobs({self.location!r})"

    def close(self) -> None:
        """Stop the reader threads."""
        self._pool.shutdown(wait=False)

    def _call(self, what: str, fn: Callable[[], Any]) -> Any:
        import obstore.exceptions as oe

        try:
            return fn()
        except (oe.NotFoundError, FileNotFoundError):
            raise
        except (oe.GenericError, oe.UnauthenticatedError, oe.PermissionDeniedError,
                OSError) as exc:
            raise ObjectStoreUnavailable(
                f"object store {self.location}: {what} failed: {_first_line(exc)}"
            ) from None

    def put(self, path: str, data: bytes | memoryview) -> Pointer:
        """Write ``data`` at ``path`` (durably, for ``file://``) and return its pointer.

        Raises:
            ObjectStoreUnavailable: the write failed (after obstore's own retries).
        """
        self._call(f"put {path}", lambda: self._ob.put(self._store, path, data))
        if self._root is not None:
            self._fsync(self._root / path)
        return Pointer(path, len(data), crc32c.crc32c(data))

    @staticmethod
    def _fsync(file: Path) -> None:
        # obstore renames a staged file into place but does not fsync; a head in an fsync'd AOF
        # must never outlive the object it points at.
        fd = os.open(file, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        dfd = os.open(file.parent, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    def get(self, ptr: Pointer) -> bytes:
        """The blob ``ptr`` points at, checked against its length and CRC-32C. Objects larger
        than :data:`RANGE_BYTES` are read in parallel ranges.

        Raises:
            MissingObject: no object at ``ptr.path``.
            CorruptObject: the object's length or CRC-32C differs from the pointer's.
            ObjectStoreUnavailable: the read failed.
        """
        try:
            if ptr.size <= RANGE_BYTES:
                data = bytes(self._call(f"get {ptr.path}",
                                        lambda: self._ob.get(self._store, ptr.path).bytes()))
            else:
                data = self._ranged(ptr)
        except Exception as exc:
            if _is_not_found(exc):
                raise MissingObject(f"object {ptr.path} is missing from {self.location}") from None
            raise
        if len(data) != ptr.size:
            raise CorruptObject(f"object {ptr.path}: {len(data)} bytes, the pointer says "
                                f"{ptr.size}")
        crc = crc32c.crc32c(data)
        if crc != ptr.crc32c:
            raise CorruptObject(f"object {ptr.path}: CRC-32C {crc:08x}, the pointer says "
                                f"{ptr.crc32c:08x}")
        return data

    def _ranged(self, ptr: Pointer) -> bytes:
        starts = list(range(0, ptr.size, RANGE_BYTES))
        ends = [min(s + RANGE_BYTES, ptr.size) for s in starts]
        parts = self._call(f"get {ptr.path}", lambda: self._ob.get_ranges(
            self._store, ptr.path, starts=starts, ends=ends))
        return b"".join(bytes(p) if not isinstance(p, bytes) else p for p in parts)

    def get_many(self, ptrs: Sequence[Pointer]) -> list[bytes | BaseException]:
        """:meth:`get` of each pointer, in parallel; a failed read gives its exception in place
        of the bytes (the caller decides whether to retry)."""
        def one(p: Pointer) -> bytes | BaseException:
            try:
                return self.get(p)
            except StoreError as exc:
                return exc
        return list(self._pool.map(one, ptrs))

    def delete(self, paths: Iterable[str]) -> None:
        """Delete ``paths``; absent ones are ignored.

        Raises:
            ObjectStoreUnavailable: the store did not answer.
        """
        for path in paths:
            try:
                self._call(f"delete {path}", functools.partial(self._ob.delete, self._store, path))
            except Exception as exc:
                if not _is_not_found(exc):
                    raise

    def list(self, prefix: str) -> list[str]:
        """Paths of every object under ``prefix`` (a folder, ending without ``/``)."""
        def run() -> list[str]:
            out: list[str] = []
            for batch in self._ob.list(self._store, prefix + "/"):
                out.extend(str(meta["path"]) for meta in batch)
            return out
        try:
            return list(self._call(f"list {prefix}", run))
        except Exception as exc:
            if _is_not_found(exc):
                return []
            raise


def open_objects(location: str) -> ObjectBlobs | None:
    """The object store of ``location``, or None for ``redis``.

    Raises:
        ConfigError: as :class:`ObjectBlobs`.
    """
    location = check_location(location)
    return None if location == REDIS else ObjectBlobs(location)


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip() or type(exc).__name__
    return text.splitlines()[0][:300]
