"""Fragment blobs in an object store; Redis keeps the metadata (DESIGN §3, "blobs").

At real model sizes Redis cannot hold the blobs: each fragment keeps ``history`` versions of its
float32 value and of its outer momentum, about 16x the model, and one string holds at most
512 MB. With a blob location other than ``redis`` the store writes every value, momentum and
initial blob as an immutable object and keeps in Redis, where the blob used to be, a small
*pointer* to it: the object's path, its length in bytes and its CRC-32C.

Blob locations (``store.blobs``):

``redis``                 the default: blobs are Redis strings, as the parameter store always
                          kept them. For models whose fragments fit (see
                          :data:`REDIS_MAX_FRAGMENT_BYTES`).
``file:///abs/dir``       a local or shared file system (NFS, a mounted volume). Each object is
                          written to a temporary file, fsync'd, renamed into place, and its
                          directory fsync'd before the head may point at it.
``s3://bucket/prefix``    any S3-compatible endpoint (AWS, MinIO, SeaweedFS, R2). Credentials and
                          endpoint come from the standard variables only (``AWS_ACCESS_KEY_ID``,
                          ``AWS_SECRET_ACCESS_KEY``, ``AWS_ENDPOINT_URL``/``AWS_ENDPOINT``,
                          ``AWS_REGION``, ``AWS_ALLOW_HTTP``), never from the URL: URLs are
                          stored in Redis and printed in reports.
``gs://``, ``az://``      passed to ``obstore`` as they are (untested here).

Every backend goes through ``obstore`` (one client for S3, GCS, Azure and local files), an
optional dependency: ``pip install 'ddiloco[objects]'``, with one exception: writes to
``file://`` are this module's own (:func:`write_durably`). A blob is given as its parts (the
header, then the fragment's float32 buffer, :data:`BlobParts`) and written from them with no
joined copy, then fsync'd, which obstore's local store does not do; a publish then costs one
checksum pass and the disk write (docs/SCALE.md, "Publish"). Other stores get the same parts,
never joined either: one PUT up to :data:`PART_BYTES`, above it a multipart upload of
:data:`PART_BYTES` parts, :data:`PUT_CONCURRENCY` in flight (:meth:`ObjectBlobs.put`).

Object paths:

``<run>/f<p>/v<version:012d>-<token>.value``, ``....momentum`` and ``<run>/f<p>/init-<token>``,
relative to the location's prefix. ``token`` is the random id of the publish (the same one the
head records), so two writers racing for one version never write the same path, and an object
is never overwritten.

Pointers:

``b"ddl-obj1 "`` followed by JSON ``{"path": str, "size": int, "crc32c": int}``. A pointer is at
most a few hundred bytes; a blob never starts with the magic (codec blobs start with a zstd
frame's magic number), so a store can tell the two apart.
"""

from __future__ import annotations

import contextlib
import errno
import functools
import json
import mmap
import os
import re
import sys
import threading
import uuid
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import crc32c

from ddiloco.pipeline.errors import ConfigError, StoreError, StoreUnavailable

__all__ = [
    "OBJECTS_EXTRA",
    "PART_BYTES",
    "POINTER_MAGIC",
    "PUT_CONCURRENCY",
    "RANGE_BYTES",
    "REDIS",
    "REDIS_MAX_FRAGMENT_BYTES",
    "BlobParts",
    "CorruptObject",
    "MissingObject",
    "ObjectBlobs",
    "ObjectStoreUnavailable",
    "Pointer",
    "check_location",
    "join_parts",
    "object_version",
    "open_objects",
    "write_durably",
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
#: Objects larger than this are read into one ``bytearray``: from files in ranges of this many
#: bytes (:meth:`ObjectBlobs._ranged`), from other stores in one streamed GET
#: (:meth:`ObjectBlobs._streamed`). obstore (object_store) merges ranges less than 1 MiB apart
#: into one request, so the ranges of one object were one GET on S3 as well. Reading a 336 MB
#: object from SeaweedFS here (a loaded host, 3 series of the ways alternated), the streamed
#: GET ran at 0.08-0.15 GB/s (median 0.14 in the last series), the ranges at 0.05-0.11
#: (0.09), and 32 or 64 MiB ranges fetched by parallel threads at 0.05-0.17 (0.11): no
#: faster than the one GET, and a rejoin reads its fragments in parallel anyway.
RANGE_BYTES = 32 << 20
#: Bytes of one part of a multipart upload (S3 and the other non-file stores), and the size
#: above which a blob is uploaded in parts at all; with :data:`PUT_CONCURRENCY`, parts in
#: flight at once. On this project's 2-core VM against SeaweedFS (128 MB blobs, alternated
#: with file writes, docs/SCALE.md) parts of 8, 16, 32 and 64 MiB with 4 in flight, and of
#: 16 MiB with 2 or 8, all ran at 0.017-0.041 GB/s, the same within noise: the server's CPU
#: bounds it (three MD5 passes over every byte, 13 CPU seconds a GB), not the client, and
#: one PUT of the joined blob was no faster. So the values are set for a remote
#: S3 endpoint, where one connection carries far less than a disk writes: 8 parts in flight
#: (they are slices of the caller's buffers, so they cost no memory), and parts small enough
#: that a 100M-parameter fragment (33 MB) still spreads over 4 connections, large enough that
#: S3's 10,000-part limit allows 80 GB objects.
PART_BYTES = 8 << 20
#: Upload parts of one blob in flight at once (:data:`PART_BYTES` says why 8).
PUT_CONCURRENCY = 8
#: S3's smallest upload part but the last (``EntityTooSmall`` at completion otherwise).
_MIN_PART_BYTES = 5 << 20

#: A blob as its parts, written in order without joining them (e.g. a header, then views of
#: float32 buffers); :func:`join_parts` makes one ``bytes`` of them where a backend needs it.
BlobParts = Sequence[memoryview]
#: Bytes per ``os.write`` of a blob; after each, the kernel is asked to start writing them
#: back (:func:`write_durably`). Linux writes at most 2 GiB - 4 KiB per call.
_WRITE_MAX = 32 << 20
#: Writes shorter than this (headers, small blobs) are left to the final fsync.
_KICK_MIN = 1 << 20
_FADVISE = hasattr(os, "posix_fadvise") and sys.platform.startswith("linux")
#: ``O_DIRECT`` where the platform has it (Linux); blobs of at least ``_DIRECT_MIN`` bytes use it.
_O_DIRECT = getattr(os, "O_DIRECT", 0)
_DIRECT_MIN = 8 << 20
#: Bounce buffers of a direct write (two per writing thread: one is filled while the other is
#: written), and the alignment of its writes (a page: covers 512-byte and 4 KiB logical
#: blocks). Their pages are touched only as far as a blob reaches.
_BOUNCE = 64 << 20
_ALIGN = 4096
_LOCAL = threading.local()
#: The thread that issues direct writes while the caller fills the next bounce buffer.
_WRITER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddl-direct-write")

_SCHEMES = ("file", "s3", "s3a", "gs", "az", "abfs", "abfss")
_VERSION = re.compile(r"/v(\d{12})-[0-9a-f]+\.(value|momentum|meta)$")


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
    """The fragment version in a value, momentum or version-record object's path
    (:mod:`ddiloco.store.version_records`), or None for other paths."""
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
        part_bytes: bytes of one part of a multipart upload (not ``file://``), at least
            5 MiB (S3's smallest part); a blob of at most this many bytes is one PUT
            (:data:`PART_BYTES`).
        put_concurrency: parts of one upload in flight at once (:data:`PUT_CONCURRENCY`).

    Raises:
        ConfigError: a bad location, ``obstore`` is not installed (names the extra), or a
            ``part_bytes`` below 5 MiB or a ``put_concurrency`` below 1.
    """

    def __init__(self, location: str, *, threads: int = 8, part_bytes: int = PART_BYTES,
                 put_concurrency: int = PUT_CONCURRENCY) -> None:
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
        if part_bytes < _MIN_PART_BYTES or put_concurrency < 1:
            raise ConfigError(f"ObjectBlobs: part_bytes ({part_bytes}) must be at least "
                              f"{_MIN_PART_BYTES} (S3's smallest part) and put_concurrency "
                              f"({put_concurrency}) at least 1")
        self.part_bytes = part_bytes
        self.put_concurrency = put_concurrency

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

    def put(self, path: str, data: bytes | memoryview | BlobParts) -> Pointer:
        """Write ``data`` (bytes, or a blob's parts in order) at ``path``, durably for
        ``file://``, and return its pointer.

        Other stores get the parts as they are, never joined: a blob of at most
        :attr:`part_bytes` bytes in one PUT, a larger one as a multipart upload of
        :attr:`part_bytes`-byte parts, :attr:`put_concurrency` of them in flight
        (:meth:`_put_multipart`).

        Raises:
            ObjectStoreUnavailable: the write failed (after obstore's own retries), or the
                file system refused it (full, read-only, permissions).
        """
        parts = _as_parts(data)
        size = sum(part.nbytes for part in parts)
        root = self._root
        if root is not None:
            # the checksum is taken by the write, chunk by chunk, while the disk works
            crc = self._call(f"put {path}", lambda: write_durably(root / path, parts))
        elif size > self.part_bytes:
            crc = self._put_multipart(path, parts, size)
        else:
            crc = 0
            for part in parts:
                crc = crc32c.crc32c(part, crc)
            # a list of buffers: obstore sends them as one body without joining them
            self._call(f"put {path}", lambda: self._ob.put(self._store, path, parts,
                                                           use_multipart=False))
        return Pointer(path, size, crc)

    def _put_multipart(self, path: str, parts: BlobParts, size: int) -> int:
        """Upload ``parts`` (``size`` bytes in all) as one multipart object and return their
        CRC-32C.

        obstore is given an iterator of memoryview slices of the blob's parts, each ending at
        the latest at the next multiple of :attr:`part_bytes` in the blob: it sends them as
        they are (no copy), cut into upload parts of exactly :attr:`part_bytes` bytes but the
        last, and asks for the next slice only when fewer than :attr:`put_concurrency` upload
        parts are in flight, so that is the upload's concurrency (one slice as large as the
        blob would start all of its upload parts at once). The checksum of each slice is taken
        as obstore takes it, while the previous parts are on the wire. A failed upload is
        aborted by obstore.

        Raises:
            ObjectStoreUnavailable: the upload failed.
        """
        step = self.part_bytes
        state = {"crc": 0, "sent": 0}

        def slices() -> Iterator[memoryview]:
            at = 0
            for part in parts:
                view = part
                while view.nbytes:
                    n = min(view.nbytes, step - at % step)
                    piece = view[:n]
                    state["crc"] = crc32c.crc32c(piece, state["crc"])
                    state["sent"] += n
                    at += n
                    view = view[n:]
                    yield piece

        self._call(f"put {path}", lambda: self._ob.put(
            self._store, path, slices(), use_multipart=True, chunk_size=step,
            max_concurrency=self.put_concurrency))
        if state["sent"] != size:  # obstore stopped reading early yet reported success
            raise ObjectStoreUnavailable(f"object store {self.location}: put {path} sent "
                                         f"{state['sent']} of {size} bytes")
        return state["crc"]

    def get(self, ptr: Pointer) -> bytes | bytearray:
        """The blob ``ptr`` points at, checked against its length and CRC-32C. Objects larger
        than :data:`RANGE_BYTES` are read into a ``bytearray``: in ranges from files, in one
        streamed GET from other stores.

        Raises:
            MissingObject: no object at ``ptr.path``.
            CorruptObject: the object's length or CRC-32C differs from the pointer's.
            ObjectStoreUnavailable: the read failed.
        """
        data: bytes | bytearray
        try:
            if ptr.size <= RANGE_BYTES:
                data = bytes(self._call(f"get {ptr.path}",
                                        lambda: self._ob.get(self._store, ptr.path).bytes()))
            elif self._root is None:
                data = self._streamed(ptr)
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

    def _ranged(self, ptr: Pointer) -> bytearray:
        """The object in ranged reads (:data:`RANGE_BYTES`), each copied once into one
        buffer (a ``bytearray``: writable, so a float32 view of it needs no further copy)."""
        starts = list(range(0, ptr.size, RANGE_BYTES))
        ends = [min(s + RANGE_BYTES, ptr.size) for s in starts]
        parts = self._call(f"get {ptr.path}", lambda: self._ob.get_ranges(
            self._store, ptr.path, starts=starts, ends=ends))
        out = bytearray(ptr.size)
        view = memoryview(out)
        at = 0
        for part in parts:
            chunk = memoryview(part).cast("B")
            if at + chunk.nbytes > ptr.size:
                raise CorruptObject(f"object {ptr.path}: ranges longer than its "
                                    f"{ptr.size} bytes")
            view[at:at + chunk.nbytes] = chunk
            at += chunk.nbytes
        if at != ptr.size:
            raise CorruptObject(f"object {ptr.path}: {at} bytes, the pointer says {ptr.size}")
        return out

    def _streamed(self, ptr: Pointer) -> bytearray:
        """The object in one GET, its body copied chunk by chunk as it arrives into one
        ``bytearray`` (writable, so a float32 view of it needs no further copy).

        Raises:
            CorruptObject: the body is longer or shorter than ``ptr.size`` bytes.
            ObjectStoreUnavailable: the read failed.
        """
        out = bytearray(ptr.size)
        view = memoryview(out)

        def read() -> int:
            at = 0
            for part in self._ob.get(self._store, ptr.path).stream():
                chunk = memoryview(part).cast("B")
                if at + chunk.nbytes > ptr.size:
                    raise CorruptObject(f"object {ptr.path}: longer than its {ptr.size} bytes")
                view[at:at + chunk.nbytes] = chunk
                at += chunk.nbytes
            return at

        got = int(self._call(f"get {ptr.path}", read))
        if got != ptr.size:
            raise CorruptObject(f"object {ptr.path}: {got} bytes, the pointer says {ptr.size}")
        return out

    def get_many(self, ptrs: Sequence[Pointer]) -> list[bytes | bytearray | BaseException]:
        """:meth:`get` of each pointer, in parallel; a failed read gives its exception in place
        of the bytes (the caller decides whether to retry)."""
        def one(p: Pointer) -> bytes | bytearray | BaseException:
            try:
                return self.get(p)
            except StoreError as exc:
                return exc
        return list(self._pool.map(one, ptrs))

    def read_many(self, paths: Sequence[str]) -> list[bytes | BaseException]:
        """Whole objects by path, in parallel, unchecked: for small objects that check
        themselves (version records, the manifest: :mod:`ddiloco.store.version_records`).
        A failed read gives its exception in place of the bytes (``MissingObject`` when absent,
        ``ObjectStoreUnavailable``)."""
        def one(path: str) -> bytes | BaseException:
            try:
                return bytes(self._call(f"get {path}",
                                        lambda: self._ob.get(self._store, path).bytes()))
            except StoreError as exc:
                return exc
            except Exception as exc:
                if _is_not_found(exc):
                    return MissingObject(f"object {path} is missing from {self.location}")
                raise
        return list(self._pool.map(one, paths))

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


def _as_parts(data: bytes | memoryview | BlobParts) -> list[memoryview]:
    if isinstance(data, (bytes, bytearray, memoryview)):
        return [memoryview(data).cast("B")]
    return [memoryview(part).cast("B") for part in data]


def join_parts(data: bytes | memoryview | BlobParts) -> bytes | memoryview:
    """One buffer of a blob given as bytes or as its parts (a copy only for several parts)."""
    if isinstance(data, (bytes, bytearray, memoryview)):
        return data
    return data[0] if len(data) == 1 else b"".join(data)


def write_durably(final: Path, parts: BlobParts) -> int:
    """Write ``parts`` in order to a new file at ``final``: a temporary file in the same
    directory, fsync'd, renamed into place, then the directory fsync'd, so a pointer written
    after this returns never outlives the object (a head in an fsync'd AOF).

    No joined copy of the blob is made. A blob of :data:`_DIRECT_MIN` bytes or more is written
    with ``O_DIRECT`` (Linux) through two page-aligned bounce buffers of :data:`_BOUNCE`
    bytes (:func:`_write_direct`): the kernel then needs no page cache for it. A buffered
    write of a fragment-sized blob must first find that much free page cache, and on a host
    whose memory is mostly cache (a shard's, with the run's earlier blobs) reclaiming it made
    a 336 MB write take 0.8-0.9 s instead of 0.11 s (``bench/publish.py``). The blob is read
    back by other processes, if at all (a learner's rejoin pull), not by its writer. Smaller
    blobs, and file systems that refuse ``O_DIRECT`` (tmpfs), take the buffered path: writes
    of :data:`_WRITE_MAX` bytes, each followed by a request to start writing it back
    (``POSIX_FADV_DONTNEED``), so the disk works while the next bytes are copied.

    Returns:
        The CRC-32C of the bytes written, taken chunk by chunk as they are handed to the
        kernel (while the disk writes the previous chunk), not in a pass of its own.

    Raises:
        OSError: the file system refused a step; the temporary file is removed.
    """
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(f".{final.name}.{uuid.uuid4().hex[:12]}.tmp")
    size = sum(part.nbytes for part in parts)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
    try:
        fd = -1
        if _O_DIRECT and size >= _DIRECT_MIN:
            try:
                fd = os.open(tmp, flags | _O_DIRECT, 0o644)
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
        try:
            if fd >= 0:
                try:
                    crc = _write_direct(fd, parts, size)
                except OSError as exc:
                    if exc.errno != errno.EINVAL:
                        raise
                    os.close(fd)  # the file system took the open but not the writes
                    fd = -1
                    tmp.unlink()
            if fd < 0:
                fd = os.open(tmp, flags, 0o644)
                crc = _write_buffered(fd, parts)
            os.fsync(fd)
        finally:
            if fd >= 0:
                os.close(fd)
        os.rename(tmp, final)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dfd = os.open(final.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)
    return crc


def _write_buffered(fd: int, parts: BlobParts) -> int:
    offset = crc = 0
    for part in parts:
        view = part
        while view.nbytes:
            n = os.write(fd, view[:_WRITE_MAX])
            crc = crc32c.crc32c(view[:n], crc)
            view = view[n:]
            if _FADVISE and n >= _KICK_MIN:
                os.posix_fadvise(fd, offset, n, os.POSIX_FADV_DONTNEED)
            offset += n
    return crc


def _write_direct(fd: int, parts: BlobParts, size: int) -> int:
    """Write ``parts`` to ``fd`` (opened with ``O_DIRECT``) through two page-aligned bounce
    buffers of :data:`_BOUNCE` bytes: the caller copies into one while :data:`_WRITER` writes
    the other, so the disk always has the next write queued. The last block is padded with
    zeros, then the file is cut back to ``size``. Returns the CRC-32C of ``parts``, each
    chunk's taken after it is copied, while the previous one is written.

    Measured on this project's 2-core VM (a 336 MB blob, ten alternated repetitions of each):
    one 16 MiB buffer, copied then written in turn, 1.42 GB/s (median); two of 16 or 32 MiB
    1.45; two of 64 MiB 1.78, against 1.78 for buffered writes with fdatasync of 64 MiB chunks.

    Raises:
        OSError: a write failed; ``EINVAL`` for a short direct write (the caller falls back
            to buffered writes). No write is in flight when it is raised.
    """
    bufs = _bounce_buffers()
    pending: list[Future[None] | None] = [None, None]
    k = fill = offset = crc = 0

    def write(buf: memoryview, n: int, at: int) -> None:
        done = 0
        while done < n:
            w = os.pwrite(fd, buf[done:n], at + done)
            if w <= 0 or w % _ALIGN:
                # a short direct write leaves the next one unaligned: let the caller retry
                raise OSError(errno.EINVAL, f"short O_DIRECT write of {w} bytes")
            done += w

    def wait(i: int) -> None:
        job, pending[i] = pending[i], None
        if job is not None:
            job.result()

    try:
        for part in parts:
            view = part.cast("B") if part.format != "B" else part
            while view.nbytes:
                if fill == 0:
                    wait(k)  # this buffer's previous write must be done before it is refilled
                n = min(view.nbytes, _BOUNCE - fill)
                bufs[k][fill:fill + n] = view[:n]
                crc = crc32c.crc32c(view[:n], crc)
                fill += n
                view = view[n:]
                if fill == _BOUNCE:
                    pending[k] = _WRITER.submit(write, bufs[k], fill, offset)
                    offset += fill
                    k, fill = 1 - k, 0
        if fill:
            wait(k)
            padded = -(-fill // _ALIGN) * _ALIGN
            bufs[k][fill:padded] = bytes(padded - fill)
            pending[k] = _WRITER.submit(write, bufs[k], padded, offset)
        wait(0)
        wait(1)
    finally:
        for job in pending:  # after a failure: nothing may still write to fd once it closes
            if job is not None:
                with contextlib.suppress(OSError):
                    job.result()
    os.ftruncate(fd, size)
    return crc


def _bounce_buffers() -> list[memoryview]:
    """This thread's two page-aligned (anonymous mmap) buffers of :data:`_BOUNCE` bytes."""
    bufs = getattr(_LOCAL, "bounce", None)
    if bufs is None:
        bufs = _LOCAL.bounce = [memoryview(mmap.mmap(-1, _BOUNCE)) for _ in range(2)]
    return bufs


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
