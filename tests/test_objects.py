"""Blobs in an object store, metadata in Redis (:mod:`ddiloco.store.objects`).

Every test runs on a real Redis and on each object store: files, and a real S3 server
(SeaweedFS). The generic store guarantees run over every backend in ``test_store.py``; these
are the ones that only objects have: pointers, write order, collection, orphans, readers racing
the collector, damaged objects, and the errors a user sees.
"""

from __future__ import annotations

import builtins
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import crc32c
import numpy as np
import pytest
import redis

import ddiloco.store.objects as objects_mod
from ddiloco.pipeline.errors import ConfigError, VersionConflict
from ddiloco.store import RedisStore
from ddiloco.store.objects import (
    POINTER_MAGIC,
    CorruptObject,
    MissingObject,
    ObjectBlobs,
    ObjectStoreUnavailable,
    Pointer,
    check_location,
    object_version,
)

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

VALUE = bytes(range(256)) * 64  # 16 KiB, binary
MOMENTUM = b"\x00\xff" * 4096


@pytest.fixture(params=["file", "s3"])
def location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    if request.param == "file":
        return f"file://{tmp_path / 'blobs'}"
    return str(request.getfixturevalue("s3_server").url(f"objects-{tmp_path.name}"))


@pytest.fixture
def store(real_redis: redis.Redis, location: str) -> Iterator[RedisStore]:
    st = RedisStore(real_redis, "obj-run")
    st.set_blob_location(location)
    try:
        yield st
    finally:
        st.flush_run()


def publish(store: RedisStore, p: int, expected: int, *, keep: int = 2,
            value: bytes = VALUE) -> int:
    return store.publish(p, expected_version=expected, epoch=1, value=value + bytes([expected + 1]),
                         momentum=MOMENTUM, keep=keep)


def objects_of(store: RedisStore, p: int) -> list[str]:
    return sorted(x for x in store.object_paths() if f"/f{p}/" in x)


def test_redis_holds_pointers_and_the_objects_hold_the_blobs(store: RedisStore,
                                                              real_redis: redis.Redis) -> None:
    publish(store, 0, -1)
    raw = real_redis.get(store.keys.value(0, 0))
    assert raw is not None and raw.startswith(POINTER_MAGIC) and len(raw) < 200
    ptr = Pointer.decode(raw)
    assert ptr is not None
    assert ptr.size == len(VALUE) + 1 and ptr.crc32c == crc32c.crc32c(VALUE + b"\x00")
    assert object_version(ptr.path) == 0 and ptr.path.startswith("obj-run/f0/")
    blob = store.get_latest(0)
    assert blob is not None and blob.value == VALUE + b"\x00" and blob.momentum == MOMENTUM
    assert store.get_version(0, 0) == blob


def test_collection_keeps_exactly_the_kept_versions(store: RedisStore) -> None:
    v = -1
    for _ in range(5):
        v = publish(store, 0, v, keep=2)
    versions = sorted({object_version(x) for x in objects_of(store, 0)})
    assert versions == [3, 4]  # value, momentum and version record of each
    assert len(objects_of(store, 0)) == 6
    assert store.get_version(0, 2) is None
    got = store.get_version(0, 3)
    assert got is not None and got.value == VALUE + b"\x03"


def test_a_refused_publish_leaves_no_object(store: RedisStore) -> None:
    publish(store, 0, -1)
    before = objects_of(store, 0)
    with pytest.raises(VersionConflict):
        publish(store, 0, -1)  # stale writer
    assert objects_of(store, 0) == before


def test_orphans_of_a_crashed_publish_are_collected(store: RedisStore) -> None:
    objs = store._objects
    assert objs is not None
    # A writer that died between its objects and the compare-and-set of the head.
    orphan = objs.put("obj-run/f0/v000000000000-deadbeef.value", b"orphan").path
    v = publish(store, 0, -1, keep=1)
    assert orphan in objects_of(store, 0)  # version 0 is still the kept one
    publish(store, 0, v, keep=1)
    assert orphan not in objects_of(store, 0)
    head = store.get_latest(0)
    assert head is not None and head.version == 1


def test_a_reader_raced_by_the_collector_gets_the_newer_head(
        store: RedisStore, monkeypatch: pytest.MonkeyPatch) -> None:
    v = publish(store, 0, -1, keep=1)
    objs = store._objects
    assert objs is not None
    real_get_many = objs.get_many
    raced = {"done": False}

    def get_many_after_a_publish(ptrs: Any) -> Any:
        if not raced["done"]:  # between the pointer read and the object read
            raced["done"] = True
            publish(store, 0, v, keep=1)  # collects version 0's objects
            store.wait_collected()
        return real_get_many(ptrs)

    monkeypatch.setattr(objs, "get_many", get_many_after_a_publish)
    blob = store.get_latest(0)
    assert raced["done"] and blob is not None and blob.version == 1
    assert blob.value == VALUE + b"\x01"
    many = store.get_latest_many([0])
    assert many[0] is not None and many[0].version == 1


def _object_file(store: RedisStore, location: str, path: str) -> Path | None:
    return Path(location[len("file://"):]) / path if location.startswith("file://") else None


def test_a_missing_object_is_a_named_error(store: RedisStore, real_redis: redis.Redis) -> None:
    publish(store, 0, -1)
    ptr = Pointer.decode(real_redis.get(store.keys.value(0, 0)) or b"")
    assert ptr is not None and store._objects is not None
    store._objects.delete([ptr.path])
    with pytest.raises(MissingObject, match=ptr.path):
        store.get_latest(0)
    with pytest.raises(MissingObject):
        store.get_latest_many([0])


def test_a_truncated_or_altered_object_is_caught_before_use(
        store: RedisStore, real_redis: redis.Redis) -> None:
    publish(store, 0, -1)
    ptr = Pointer.decode(real_redis.get(store.keys.value(0, 0)) or b"")
    assert ptr is not None and store._objects is not None
    # Objects are immutable in normal operation; overwrite one by hand as damage would.
    store._objects._ob.put(store._objects._store, ptr.path, VALUE[:100])
    with pytest.raises(CorruptObject, match="100 bytes, the pointer says"):
        store.get_latest(0)
    store._objects._ob.put(store._objects._store, ptr.path, b"\x01" * ptr.size)
    with pytest.raises(CorruptObject, match="CRC-32"):
        store.get_latest(0)


def test_initial_blobs_are_objects_written_once(store: RedisStore,
                                               real_redis: redis.Redis) -> None:
    assert store.put_initial(0, VALUE)
    assert not store.put_initial(0, b"other")
    assert store.get_initial(0) == VALUE
    raw = real_redis.get(store.keys.initial(0))
    assert raw is not None and raw.startswith(POINTER_MAGIC)
    assert len([x for x in objects_of(store, 0) if "/init-" in x]) == 1


def test_large_objects_are_read_in_ranges(store: RedisStore,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    from ddiloco.store import objects as objects_module

    monkeypatch.setattr(objects_module, "RANGE_BYTES", 4096)  # 16 KiB -> 5 ranges
    publish(store, 0, -1)
    blob = store.get_latest(0)
    assert blob is not None and blob.value == VALUE + b"\x00"


def test_flush_run_deletes_the_objects(store: RedisStore) -> None:
    publish(store, 0, -1)
    store.put_initial(1, VALUE)
    assert store.object_paths()
    store.flush_run()
    assert store.object_paths() == []


def test_another_location_for_a_recorded_run_is_refused(store: RedisStore,
                                                       real_redis: redis.Redis,
                                                       tmp_path: Path) -> None:
    other = RedisStore(real_redis, "obj-run")
    with pytest.raises(ConfigError, match=r"keeps its blobs in .* set store\.blobs"):
        other.set_blob_location(f"file://{tmp_path / 'elsewhere'}")
    assert other.blob_location == store.blob_location  # a new reader finds the location


def test_an_object_store_that_fails_publishes_nothing(real_redis: redis.Redis,
                                                      tmp_path: Path) -> None:
    root = tmp_path / "blobs"
    st = RedisStore(real_redis, "obj-fail")
    st.set_blob_location(f"file://{root}")
    publish(st, 0, -1)
    # The store's directory becomes unusable (a full or detached volume).
    (root / "obj-fail" / "f0").rename(tmp_path / "moved")
    (root / "obj-fail" / "f0").write_text("not a directory")
    with pytest.raises(ObjectStoreUnavailable, match="put obj-fail/f0/v000000000001"):
        publish(st, 0, 0)
    head = st.head(0)
    assert head is not None and head.version == 0
    st.flush_run()


def test_a_blob_given_as_parts_is_written_whole_without_a_copy(store: RedisStore,
                                                               location: str) -> None:
    # header + two buffers, as a shard publishes a fragment (workers.blobs.blob_parts)
    parts = [memoryview(b"head"), memoryview(VALUE), memoryview(MOMENTUM)]
    whole = b"head" + VALUE + MOMENTUM
    store.publish(0, expected_version=-1, epoch=1, value=parts, momentum=[memoryview(MOMENTUM)],
                  keep=2)
    blob = store.get_latest(0)
    assert blob is not None and blob.value == whole and blob.momentum == MOMENTUM
    objs = ObjectBlobs(location)
    try:
        ptr = objs.put("direct/x.value", parts)
        assert (ptr.size, ptr.crc32c) == (len(whole), crc32c.crc32c(whole))
        assert objs.get(ptr) == whole
    finally:
        objs.close()
    if location.startswith("file://"):
        # the temporary files were renamed into place: nothing else is left in the directory
        root = Path(location[len("file://"):])
        assert not [f for f in root.rglob("*") if f.name.endswith(".tmp")]


@pytest.mark.parametrize("size", [4096 * 3, 4096 * 3 + 1, 10_000, 4096 * 2 - 7, 8192 * 5 + 100])
def test_a_large_file_blob_written_directly_is_exact(tmp_path: Path,
                                                     monkeypatch: pytest.MonkeyPatch,
                                                     size: int) -> None:
    if not objects_mod._O_DIRECT:
        pytest.skip("no O_DIRECT on this platform: the buffered path is tested below")
    # two-page bounce buffers, so parts straddle them, both are refilled, and the tail is
    # padded, then cut back
    monkeypatch.setattr(objects_mod, "_BOUNCE", 8192)
    monkeypatch.setattr(objects_mod, "_DIRECT_MIN", 1)
    monkeypatch.setattr(objects_mod, "_LOCAL", threading.local())
    opened: list[int] = []
    real_open = objects_mod.os.open

    def spy_open(path: object, flags: int, *a: object) -> int:
        opened.append(flags)
        return real_open(path, flags, *a)

    monkeypatch.setattr(objects_mod.os, "open", spy_open)
    rng = np.random.default_rng(size)
    body = np.frombuffer(rng.bytes(size - 12), np.uint8)
    parts = [memoryview(b"twelve bytes"), body.data]
    crc = objects_mod.write_durably(tmp_path / "d" / "blob", parts)
    assert (tmp_path / "d" / "blob").read_bytes() == b"twelve bytes" + body.tobytes()
    assert crc == crc32c.crc32c(b"twelve bytes" + body.tobytes())
    assert opened[0] & objects_mod._O_DIRECT  # the direct path was taken (tmp_path: a disk)
    assert sorted(f.name for f in (tmp_path / "d").iterdir()) == ["blob"]


def test_a_short_direct_write_mid_blob_falls_back_to_a_buffered_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    if not objects_mod._O_DIRECT:
        pytest.skip("no O_DIRECT on this platform")
    monkeypatch.setattr(objects_mod, "_BOUNCE", 8192)
    monkeypatch.setattr(objects_mod, "_DIRECT_MIN", 1)
    monkeypatch.setattr(objects_mod, "_LOCAL", threading.local())
    real_pwrite = objects_mod.os.pwrite
    calls = {"n": 0}

    def short_third(fd: int, data: Any, offset: int) -> int:
        calls["n"] += 1
        if calls["n"] == 3:  # on the writer thread, while the caller fills the next buffer
            return real_pwrite(fd, data[:100], offset)
        return real_pwrite(fd, data, offset)

    monkeypatch.setattr(objects_mod.os, "pwrite", short_third)
    body = np.frombuffer(np.random.default_rng(1).bytes(8192 * 6 + 5), np.uint8)
    crc = objects_mod.write_durably(tmp_path / "blob", [body.data])
    assert crc == crc32c.crc32c(body.tobytes())  # the buffered retry's, from the start
    assert calls["n"] >= 3
    assert (tmp_path / "blob").read_bytes() == body.tobytes()
    assert [f.name for f in tmp_path.iterdir()] == ["blob"]


def test_a_file_system_that_refuses_direct_writes_gets_a_buffered_one(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import errno

    monkeypatch.setattr(objects_mod, "_O_DIRECT", 0o40000)
    monkeypatch.setattr(objects_mod, "_DIRECT_MIN", 1)
    real_open = objects_mod.os.open

    def refusing_open(path: object, flags: int, *a: object) -> int:
        if flags & 0o40000:
            raise OSError(errno.EINVAL, "Invalid argument")  # as tmpfs answers O_DIRECT
        return real_open(path, flags, *a)

    monkeypatch.setattr(objects_mod.os, "open", refusing_open)
    parts = [memoryview(b"head"), memoryview(b"x" * 5000)]
    crc = objects_mod.write_durably(tmp_path / "blob", parts)
    assert (tmp_path / "blob").read_bytes() == b"head" + b"x" * 5000
    assert crc == crc32c.crc32c(b"head" + b"x" * 5000)


def test_a_file_blob_written_in_chunks_with_writeback_kicks_is_exact(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # Small chunks so that parts straddle chunk boundaries and every chunk is kicked.
    monkeypatch.setattr(objects_mod, "_WRITE_MAX", 1000)
    monkeypatch.setattr(objects_mod, "_KICK_MIN", 1)
    monkeypatch.setattr(objects_mod, "_O_DIRECT", 0)
    kicked: list[tuple[int, int]] = []
    real = objects_mod.os.posix_fadvise if objects_mod._FADVISE else None

    def spy(fd: int, offset: int, n: int, advice: int) -> None:
        kicked.append((offset, n))
        if real is not None:
            real(fd, offset, n, advice)

    monkeypatch.setattr(objects_mod, "_FADVISE", True)
    monkeypatch.setattr(objects_mod.os, "posix_fadvise", spy, raising=False)
    rng = np.random.default_rng(0)
    parts = [memoryview(b"head"), memoryview(rng.bytes(2500)), memoryview(rng.bytes(1999))]
    whole = b"".join(parts)
    assert objects_mod.write_durably(tmp_path / "a" / "blob", parts) == crc32c.crc32c(whole)
    assert (tmp_path / "a" / "blob").read_bytes() == whole
    # every byte advised exactly once, in order, each write at most one chunk
    assert [o for o, _ in kicked] == [sum(n for _, n in kicked[:i]) for i in range(len(kicked))]
    assert sum(n for _, n in kicked) == len(whole) and max(n for _, n in kicked) <= 1000
    assert sorted(f.name for f in (tmp_path / "a").iterdir()) == ["blob"]


def test_a_refused_file_write_leaves_no_temporary_file(tmp_path: Path) -> None:
    objs = ObjectBlobs(f"file://{tmp_path}")
    try:
        (tmp_path / "run" / "f0").mkdir(parents=True)
        (tmp_path / "run" / "f0" / "v.value").mkdir()  # the rename target is a directory
        with pytest.raises(ObjectStoreUnavailable, match=r"put run/f0/v\.value"):
            objs.put("run/f0/v.value", [memoryview(VALUE)])
        assert [f.name for f in (tmp_path / "run" / "f0").iterdir()] == ["v.value"]
    finally:
        objs.close()


@pytest.mark.parametrize("bad", ["ftp://x/y", "s3://", "s3://key:secret@bucket/p", "file://",
                                 "redis://localhost"])
def test_bad_locations_are_named_errors(bad: str) -> None:
    with pytest.raises(ConfigError, match=r"store\.blobs"):
        check_location(bad)


def test_file_locations_are_made_absolute(tmp_path: Path,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.chdir(tmp_path)
    assert check_location("file://blobs") == f"file://{tmp_path / 'blobs'}"
    assert check_location(" redis ") == "redis"


def test_a_missing_client_names_the_extra(monkeypatch: pytest.MonkeyPatch,
                                          tmp_path: Path) -> None:
    real_import = builtins.__import__

    def no_obstore(name: str, *args: Any, **kwargs: Any) -> Any:
        if name == "obstore" or name.startswith("obstore."):
            raise ImportError("No module named 'obstore'")
        return real_import(name, *args, **kwargs)

    monkeypatch.delitem(sys.modules, "obstore", raising=False)
    monkeypatch.setattr(builtins, "__import__", no_obstore)
    with pytest.raises(ConfigError, match=r"pip install 'ddiloco\[objects\]'"):
        ObjectBlobs(f"file://{tmp_path}")


def test_pointers_round_trip_and_reject_garbage() -> None:
    ptr = Pointer("r/f0/v000000000003-ab.value", 10, 123)
    assert Pointer.decode(ptr.encode()) == ptr
    assert Pointer.decode(b"\x28\xb5\x2f\xfd...") is None  # a zstd frame: a blob
    from ddiloco.pipeline.errors import StoreError

    with pytest.raises(StoreError, match="malformed object pointer"):
        Pointer.decode(POINTER_MAGIC + b"{not json")
    with pytest.raises(StoreError, match="out of range"):
        Pointer.decode(POINTER_MAGIC + b'{"path": "x", "size": -1, "crc32c": 0}')


def test_the_store_section_validates_and_defaults_to_redis(tmp_path: Path) -> None:
    from ddiloco.workers.run.config import load_config

    assert load_config(None, {}).store.blobs == "redis"
    got = load_config(None, {"store.blobs": f"file://{tmp_path}/b"})
    assert got.store.blobs == f"file://{tmp_path}/b"
    assert load_config(None, {"store.blobs": "embedded-s3"}).store.blobs == "embedded-s3"
    with pytest.raises(ConfigError, match=r"store\.blobs"):
        load_config(None, {"store.blobs": "s3://k:secret@bucket/p"})


def test_a_model_too_large_for_redis_is_refused_with_the_setting_to_use(
        real_redis: redis.Redis, tmp_path: Path) -> None:
    from ddiloco.workers.run.config import load_config
    from ddiloco.workers.run.manifest import init_run

    st = RedisStore(real_redis, "obj-big")
    # The small preset's largest fragment holds 4 MB of float32: above a 1 MB limit.
    cfg = load_config(None, {"model.preset": "small", "store.redis_max_fragment_mb": 1})
    with pytest.raises(ConfigError, match=r"store\.blobs = 'file:///path/to/dir' or 's3://"):
        init_run(st, cfg, "obj-big")
    assert st.get_manifest() is None and st.object_paths() == []  # nothing was written
    with pytest.raises(ConfigError, match="ddiloco run"):
        init_run(st, load_config(None, {"store.blobs": "embedded-s3"}), "obj-big")
    cfg = load_config(None, {"model.preset": "small", "store.redis_max_fragment_mb": 1,
                             "store.blobs": f"file://{tmp_path / 'b'}"})
    init_run(st, cfg, "obj-big", fragments=[0])
    assert st.blob_location == f"file://{tmp_path / 'b'}"
    assert any(path.startswith("obj-big/f0/init-") for path in st.object_paths())
    st.flush_run()


def test_values_alone_are_read_without_the_momentum_objects(store: RedisStore) -> None:
    publish(store, 0, -1)
    publish(store, 1, -1)
    # the momentum objects gone: a read of values alone does not touch them
    for path in store.object_paths():
        if path.endswith(".momentum"):
            store._objects_for_read(path).delete([path])
    got = store.get_latest_many([0, 1, 2], momentum=False)
    assert [b.value if b else None for b in got] == [VALUE + b"\x00", VALUE + b"\x00", None]
    assert all(b.momentum == b"" for b in got if b)
    with pytest.raises(MissingObject):
        store.get_latest_many([0])


# -- multipart uploads (S3) -----------------------------------------------------------------
PART = 5 << 20  # S3's smallest part: a blob of a few parts stays fast to upload


@pytest.fixture
def s3_location(s3_server: Any, tmp_path: Path) -> str:
    return str(s3_server.url(f"mp-{tmp_path.name}"))


def spy_puts(monkeypatch: pytest.MonkeyPatch) -> list[dict[str, Any]]:
    """Record each ``obstore.put``'s options and the slices it was given (the slices are read
    on the caller's thread before the real put gets them, as a list)."""
    import obstore

    calls: list[dict[str, Any]] = []
    real_put = obstore.put

    def put(store: Any, path: str, file: Any, **kw: Any) -> Any:
        pieces = list(file)
        calls.append({"path": path, "pieces": pieces, **kw})
        return real_put(store, path, iter(pieces) if kw.get("use_multipart") else pieces, **kw)

    monkeypatch.setattr(obstore, "put", put)
    return calls


def test_a_blob_larger_than_a_part_is_a_concurrent_multipart_upload_of_its_parts(
        s3_location: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import obstore

    head = b"ddl-head"
    values = np.arange(2 * PART // 4 + 1000, dtype=np.float32)  # 2 upload parts and a bit
    tail = bytes(range(256)) * 3
    parts = [memoryview(head), memoryview(values).cast("B"), memoryview(tail)]
    whole = head + values.tobytes() + tail
    calls = spy_puts(monkeypatch)
    objs = ObjectBlobs(s3_location, part_bytes=PART, put_concurrency=2)
    try:
        ptr = objs.put("mp/x.value", parts)
        assert (ptr.size, ptr.crc32c) == (len(whole), crc32c.crc32c(whole))
        (call,) = calls
        assert (call["use_multipart"], call["chunk_size"], call["max_concurrency"]) == (
            True, PART, 2)
        # slices of the caller's buffers (no copy), none crossing an upload part's boundary
        assert all(p.obj is head or p.obj is values or p.obj is tail for p in call["pieces"])
        ends = np.cumsum([p.nbytes for p in call["pieces"]])
        starts = ends - [p.nbytes for p in call["pieces"]]
        assert ends[-1] == len(whole)
        assert all(s // PART == (e - 1) // PART for s, e in zip(starts, ends, strict=True))
        # S3's ETag of a multipart object ends with its number of upload parts
        etag = str(obstore.head(objs._store, "mp/x.value")["e_tag"]).strip('"')
        assert etag.endswith(f"-{-(-len(whole) // PART)}")
        assert objs.get(ptr) == whole
        monkeypatch.setattr(objects_mod, "RANGE_BYTES", 50_000)  # read back in ranges too
        assert objs.get(ptr) == whole
        objs.delete([ptr.path])
    finally:
        objs.close()


def test_a_blob_of_one_part_or_less_is_one_put_of_its_parts(
        s3_location: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import obstore

    calls = spy_puts(monkeypatch)
    objs = ObjectBlobs(s3_location, part_bytes=PART)
    try:
        for name, parts in (("exact", [memoryview(b"h"), memoryview(bytes(PART - 1))]),
                            ("empty", [memoryview(b"")])):
            whole = b"".join(parts)
            ptr = objs.put(f"one/{name}", parts)
            assert calls[-1]["use_multipart"] is False
            assert [p.obj for p in calls[-1]["pieces"]] == [p.obj for p in parts]  # unjoined
            assert "-" not in str(obstore.head(objs._store, f"one/{name}")["e_tag"])
            assert (ptr.size, ptr.crc32c) == (len(whole), crc32c.crc32c(whole))
            assert objs.get(ptr) == whole
    finally:
        objs.close()


def test_a_refused_multipart_upload_is_an_unavailable_store(
        s3_location: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "not-the-secret")
    objs = ObjectBlobs(s3_location, part_bytes=PART)
    try:
        with pytest.raises(ObjectStoreUnavailable, match="put mp/refused"):
            objs.put("mp/refused", [memoryview(bytes(3 * PART))])
    finally:
        objs.close()


def test_parts_below_s3s_minimum_and_no_concurrency_are_refused(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="part_bytes"):
        ObjectBlobs(f"file://{tmp_path}", part_bytes=PART - 1)
    with pytest.raises(ConfigError, match="put_concurrency"):
        ObjectBlobs(f"file://{tmp_path}", put_concurrency=0)


def test_a_large_s3_object_is_read_in_one_streamed_get_and_checked(
        s3_location: str, monkeypatch: pytest.MonkeyPatch) -> None:
    import obstore

    monkeypatch.setattr(objects_mod, "RANGE_BYTES", 4096)  # 16 KiB is "large"
    monkeypatch.setattr(obstore, "get_ranges", None)  # a call of it would fail the test
    objs = ObjectBlobs(s3_location)
    try:
        ptr = objs.put("read/x.value", VALUE)
        got = objs.get(ptr)
        assert isinstance(got, bytearray) and got == VALUE
        objs._ob.put(objs._store, ptr.path, VALUE[:5000])  # damage: cut short
        with pytest.raises(CorruptObject, match="5000 bytes, the pointer says"):
            objs.get(ptr)
        objs._ob.put(objs._store, ptr.path, VALUE + b"x")
        with pytest.raises(CorruptObject, match="longer than"):
            objs.get(ptr)
        objs.delete([ptr.path])
        with pytest.raises(MissingObject):
            objs.get(ptr)
    finally:
        objs.close()
