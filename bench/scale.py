"""The sync path at scale: real shard processes, a real Redis and blob store, synthetic learners.

    python bench/scale.py --size tiny|10M|100M|1B --backend redis|file|s3 [--json PATH]
        [--periods N] [--learners 4] [--shards 2] [--codec-up int4] [--codec-down int4]
        [--topk] [--step-s 0] [--timeout-s T] [--workdir DIR] [--keep]
    python bench/scale.py --backend s3 --publish-only [--sizes 100M,1B] [--reps 2] [--json PATH]

``--publish-only`` runs no workers: it compares the two object-store backends' publish on one
disk, side by side in one process. For each size of ``--sizes`` it stores the real manifest
(no initial values) of two runs, one with its blobs in files (``work/blobs``) and one on a
SeaweedFS S3 server (``work/s3``, the same disk), then publishes every fragment ``--reps``
times to each with :meth:`ddiloco.store.RedisStore.publish`, as a shard does (the value as its
blob parts, :func:`ddiloco.workers.run.blobs.blob_parts`; an empty momentum; history 2), the two
backends alternated fragment by fragment so that a disk or host that slows down slows both.
The old version's collection is waited for after each timed call, outside it. It reports
each backend's publish GB/s (bytes over the wall seconds of the publishes, per rep), their
ratio, the S3 server's own rate (the largest blob joined, in one plain PUT, alternated with
the same blob's multipart upload, neither through Redis), the CPU seconds per GB of the S3
server and of the publishing process, and a learner's rejoin (the ``rejoin_s`` below) from
each backend, ``--reps`` times, alternated.

What runs, all on this host:

* a real ``redis-server`` (:class:`ddiloco.store.EmbeddedRedis`, AOF ``appendfsync always`` as
  in ``ddiloco run``) and, for ``--backend s3``, a SeaweedFS S3 server
  (:class:`ddiloco.store.embedded_s3.EmbeddedS3`); ``--backend file`` keeps the blobs in a
  directory of the work dir;
* the init step (:func:`ddiloco.workers.run.manifest.init_run`) in a child process: the real
manifest
  of the built-in byte-level GPT at the size's width and depth (``model.*`` overrides), with its
  real numpy initial values (no JAX model is built: ``init_params`` is numpy);
* S syncer shards, the real shard (:func:`ddiloco.workers.roles.serve`, as ``python -m
  ddiloco.workers syncer``) with CURVE keys as a local run creates them
  (:func:`ddiloco.workers.run.launch.with_run_keys`). The shard process is wrapped by this file only
  to time what the shard does not record itself: ``ShardCore.handle`` (receive, decode, file),
  ``ShardCore.merge`` (merge, outer step, quantize, publish) and ``RedisStore.publish`` (blob
  writes and the head's compare-and-set); wall and thread CPU seconds go to a JSON-lines file;
* M synthetic learners: no model and no inner steps. Each one registers, heartbeats, follows the
  fragment schedule (:mod:`ddiloco.pipeline.fragments`, the Streaming DiLoCo stagger), and for
  each due fragment sends a delta of the fragment's shapes (noise of scale 1e-3, tiled from a
  16 MiB pool) encoded with the run's uplink codec by :func:`ddiloco.pipeline.wire.encode`
  through the learner's sender (:class:`ddiloco.pipeline.transport.DeltaPush`, CURVE client
  keys). It adopts every version broadcast it receives: decodes it (the real downlink decode)
  and, when the whole model of every learner fits in a quarter of the host's memory, adds the
  difference to its own float32 copy of the global model (the Clone pattern of the comms
  thread); otherwise it keeps the version numbers only (``learner_keeps_view`` false).

Two deliberate departures from a real learner, both to make the learners a load generator that
runs at the rate the sync path sustains: a learner whose previous delta of a fragment is not
merged yet when that fragment is due again waits for the merge (``learner_stall_s``; a real
learner never waits), up to ``--stall-max-s`` after which it sends anyway; and ``--step-s`` (0 by
default) is the time of one virtual inner step. Learners do not run the error-feedback
quantize round trip of the trainer (learner compute, not the sync path).

What it reports (one JSON object, ``--json``; a table on the terminal):

* ``merge_s_per_fragment``: mean wall seconds of one ``ShardCore.merge`` (merge of the round's
  contributions, outer step, quantized broadcast, fp32 blob encoding, publish); the shard's own
  merge events carry the same as ``sync_s``; ``decode_s_per_contribution``: one delta's receive
  path (``ShardCore.handle``); ``merge_s_per_period``: both summed over one sync period of the
  fragments one shard owns (mean over shards and periods);
* ``merge_fp32_gbps_per_core``: fp32-equivalent bytes of merged contributions (contributors x
  fragment float32 bytes) over the CPU seconds of the merge pipeline's threads (the shard's
  main thread and the merge engine's threads: :func:`pipeline_cpu`) in handle + merge, publish
  excluded: decode, validation, weighted accumulation, RDA, outer step, broadcast encode, the
  checksums, the telemetry calls and the interpreter's garbage collection;
  ``merge_fp32_gbps_per_core_process`` the same over the whole process's CPU seconds, which
  adds the transport (ZeroMQ's I/O thread: CURVE decryption of the deltas, encryption of one
  broadcast copy per learner) and the lease, ZAP and store threads meanwhile, a conservative
  figure; ``merge_fp32_gbps_wall`` the same over wall
  seconds (on a host with fewer cores than processes, wall includes waiting for a core);
* ``publish_s`` (mean), ``publish_bytes`` (mean, value + momentum blobs) and ``publish_gbps``
  (bytes over wall seconds of ``RedisStore.publish``), ``publish_total_bytes`` (the run's), and
  ``publish_over_fdatasync``, its ratio to ``disk_fdatasync_gbps``: 3 GiB written in 64 MiB
  chunks, each followed by ``os.fdatasync``, to the filesystem of the blobs (of Redis's AOF for
  ``redis``), measured after the workers stopped; the first GiB's rate is
  ``disk_fdatasync_burst_gbps`` and the rest's ``disk_fdatasync_sustained_gbps`` (a virtual
  disk takes a burst at several times what it sustains), with
  ``publish_over_fdatasync_sustained``; and ``disk_fdatasync_loaded_gbps``, the median of
  ``--loaded-probes`` probes of 256 MiB written the same way *during* the run (one at the end
  of each of the first periods, while shards, learners and stores share the host), with
  ``publish_over_fdatasync_loaded``: a publish competes with that load for cores, memory and
  the disk, and the idle disk's rate is not what it could have had;
* ``redis_used_memory_bytes`` (INFO memory at the end, workers stopped) and the largest sample
  taken every second of the run, ``redis_used_memory_max_bytes``; ``object_store_bytes``: bytes
  of the files under the blob directory (``file``) or SeaweedFS's data directory (``s3``);
* ``rejoin_s``: a fresh process opens the store, reads the manifest, pulls every fragment's
  latest version with ``get_latest_many`` (parallel ranged reads from an object store) and
  decodes each into float32 arrays; run after the workers stopped, so it has the host's cores;
* peak RSS (``VmHWM``) of every worker; ``shard_peak_rss_ratio``: the largest shard's peak RSS
  over the float32 bytes of the fragments it owns;
* ``periods_completed``: the smallest number of merges any fragment went through (its head
  version; every merge is one synchronisation of that fragment), ``full_rounds``: merges that had
  every learner in them. The run stops when every fragment has ``--periods`` merges, or at
  ``--timeout-s``.

``sync.history`` is 2 (two versions per fragment on disk and in each shard: enough for a learner
whose base is one version behind); ``sync.min_quorum`` is M, so every merge holds one delta of
every learner and one merge is one sync period of that fragment (with K = 1 and learners that
report no real step time, the grace window is zero and rounds would merge one delta at a time);
learner and lease TTLs are 30 s so a shard or learner
busy with a 1B fragment on a small host is not declared dead; every other setting is the
default. ``store.blobs = redis`` refuses fragments over ``store.redis_max_fragment_mb`` (1B):
that refusal is reported as the run's ``error``.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

#: Width and depth of the byte-level GPT (vocabulary 256) per size; n_values from
#: ``workers.task.model.param_shapes``: tiny 0.83M, 10M 10.8M, 100M 99.5M, 1B 1.008B.
SIZES: dict[str, dict[str, Any]] = {
    "tiny": {"model.preset": "tiny"},
    "10M": {"model.preset": "small"},
    "100M": {"model.preset": "small", "model.d_model": 768, "model.n_layers": 14,
             "model.n_heads": 12, "model.d_ff": 3072, "model.seq_len": 256},
    "1B": {"model.preset": "small", "model.d_model": 2048, "model.n_layers": 24,
           "model.n_heads": 16, "model.d_ff": 6144, "model.seq_len": 256},
}
#: Default wall-clock limit of the synchronising part of a run, per size, seconds.
TIMEOUTS = {"tiny": 120.0, "10M": 300.0, "100M": 900.0, "1B": 3600.0}
BACKENDS = ("redis", "file", "s3")
#: Scale of the synthetic deltas (about a real outer gradient's per-value magnitude).
DELTA_SCALE = 1e-3
#: Values in the noise pool the deltas are tiled from (16 MiB of float32).
POOL_VALUES = 1 << 22
#: Seconds a learner heartbeat's TTL and a shard lease last (module docstring).
TTL_S = 30.0
GB = 1e9


# ------------------------------------------------------------------------------ helpers
def peak_rss(pid: int) -> int | None:
    """VmHWM of a live process, bytes (None once it is gone)."""
    try:
        text = Path(f"/proc/{pid}/status").read_text()
    except OSError:
        return None
    for line in text.splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    return None


def mem_available() -> int | None:
    """The host's MemAvailable, bytes (None where /proc/meminfo has none)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def tree_bytes(root: Path) -> int:
    """Apparent size of every file under ``root``."""
    total = 0
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def _nbytes(blob: Any) -> int:
    """Bytes of a blob given as bytes or as its parts (``ddiloco.store.objects.BlobParts``)."""
    if isinstance(blob, (bytes, bytearray, memoryview)):
        return memoryview(blob).nbytes
    return sum(memoryview(part).nbytes for part in blob)


#: Bytes of one disk probe during a run (``disk_fdatasync_loaded_gbps``).
LOADED_PROBE_BYTES = 256 << 20


def fdatasync_gbps(directory: Path, total: int = 1 << 30, chunk: int = 64 << 20,
                   burst: int = 1 << 30) -> dict[str, float]:
    """Write ``total`` bytes in ``chunk``-byte writes, each followed by ``os.fdatasync``, to a
    file in ``directory`` (random bytes: nothing on the way can compress them).

    Returns:
        GB/s over everything (``all``), over the first ``burst`` bytes (``burst``) and over the
        rest (``sustained``; absent when ``total <= burst``). Virtual disks often take a burst
        at several times the rate they sustain (this machine's: about 1.5 GB/s for the first
        GiB, then about 0.3 GB/s), and a long run's publishes write far more than one burst.
    """
    data = np.random.default_rng(0).integers(0, 256, chunk, dtype=np.uint8).tobytes()
    path = directory / "fdatasync.bench"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    marks: list[tuple[int, float]] = []
    try:
        t0 = time.perf_counter()
        written = 0
        while written < total:
            view = memoryview(data)
            while view:
                n = os.write(fd, view)
                view = view[n:]
            os.fdatasync(fd)
            written += chunk
            marks.append((written, time.perf_counter() - t0))
    finally:
        os.close(fd)
        path.unlink(missing_ok=True)
    out = {"all": written / marks[-1][1] / GB}
    split = next(((b, t) for b, t in marks if b >= burst), marks[-1])
    out["burst"] = split[0] / split[1] / GB
    if written > split[0]:
        out["sustained"] = (written - split[0]) / (marks[-1][1] - split[1]) / GB
    return out


#: SeaweedFS volume size cap for the bench's S3 server, MB. A ``weed server`` keeps at most 8
#: volumes (``-volume.max``) and reclaims deleted objects only when it compacts one, so with
#: the default 1 GB volumes a 1B run stops with "no writable volumes" after 8 GB of publishes.
S3_VOLUME_MB = 8192


def s3_server_env(data_dir: Path) -> contextlib.AbstractContextManager[Any]:
    """An embedded S3 server (:class:`ddiloco.store.embedded_s3.EmbeddedS3`, volumes of
    :data:`S3_VOLUME_MB`) in ``data_dir``, its variables in ``os.environ`` (the workers inherit
    them) until exit."""
    from ddiloco.store.embedded_s3 import embedded_s3_env

    return embedded_s3_env(data_dir, volume_mb=S3_VOLUME_MB)

def process_cpu_s(pid: int) -> float:
    """User + system CPU seconds of a live process (every thread), from /proc."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def fill_from_pool(n: int, pool: np.ndarray, offset: int) -> np.ndarray:
    """``n`` float32 values: ``pool`` read cyclically from ``offset`` (a copy per call, as a
    real delta ``anchor - theta`` is a fresh array)."""
    out = np.empty(n, np.float32)
    i, off = 0, offset % pool.size
    while i < n:
        k = min(n - i, pool.size - off)
        out[i:i + k] = pool[off:off + k]
        i += k
        off = 0
    return out


def append_jsonl(path: Path, record: dict[str, Any]) -> None:
    """One JSON line, appended and flushed (a worker killed later keeps what it wrote)."""
    with open(path, "a") as f:
        f.write(json.dumps(record) + "\n")


def read_jsonl(path: Path) -> list[dict[str, Any]]:
    """Every record of a JSON-lines file (none when it does not exist)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


# ------------------------------------------------------------------------------ workers
def worker_init(args: argparse.Namespace) -> int:
    """The init step in its own process, so the 4 GB of a 1B model's initial values leave with
    it; with ``--manifest-only`` the manifest and blob location alone (``--publish-only``
    publishes every fragment itself and needs no initial values)."""
    from ddiloco.workers.cli import open_store
    from ddiloco.workers.run.config import config_from_dict
    from ddiloco.workers.run.manifest import build_manifest, check_blob_location, init_run

    cfg = config_from_dict(json.loads(Path(args.config_json).read_text()))
    store = open_store(args.redis_url, args.run_id)
    if args.manifest_only:
        manifest = build_manifest(cfg, args.run_id)
        check_blob_location(cfg, manifest)
        store.set_blob_location(cfg.store.blobs)
        store.put_manifest(manifest)
    else:
        init_run(store, cfg, args.run_id)
    return 0


def pipeline_cpu() -> float:
    """CPU seconds of the threads that run the merge pipeline: the calling (main) thread and
    the merge engine's worker threads (``merge_*``). ZeroMQ's I/O thread (CURVE, socket copies),
    the lease and ZAP threads and the object store's I/O threads are left out."""
    total = time.thread_time()
    for t in threading.enumerate():
        if t.name.startswith("merge") and t.ident is not None:
            try:
                total += time.clock_gettime(time.pthread_getcpuclockid(t.ident))
            except OSError:  # the thread ended between enumerate and the read
                pass
    return total


def worker_shard(args: argparse.Namespace) -> int:
    """The real syncer shard (``python -m ddiloco.workers syncer``'s body), timed: handle, merge
    and publish calls append wall and thread CPU seconds to ``<out>/shard-<s>.jsonl``."""
    from ddiloco.store.redis_store import RedisStore
    from ddiloco.workers.cli import open_store, setup_jax_from_env
    from ddiloco.workers.roles import serve
    from ddiloco.workers.syncer.core import ShardCore

    out = Path(args.out) / f"shard-{args.shard}.jsonl"
    orig_handle, orig_merge, orig_publish = ShardCore.handle, ShardCore.merge, RedisStore.publish
    handled = {"n": 0, "wall": 0.0, "cpu": 0.0, "pipe": 0.0, "bytes": 0}
    publishes: list[dict[str, Any]] = []

    def handle(self: ShardCore, frames: list[bytes], peer: str | None = None) -> Any:
        w0, c0, t0 = time.perf_counter(), time.process_time(), pipeline_cpu()
        try:
            return orig_handle(self, frames, peer)
        finally:
            if len(frames) > 1 and len(frames[1]):  # a delta (controls carry no payload)
                handled["n"] += 1
                handled["wall"] += time.perf_counter() - w0
                handled["cpu"] += time.process_time() - c0
                handled["pipe"] += pipeline_cpu() - t0
                handled["bytes"] += len(frames[1])

    def merge(self: ShardCore, p: int) -> Any:
        n = len(self.frags[p].contributions)
        w0, c0, t0 = time.perf_counter(), time.process_time(), pipeline_cpu()
        publishes.clear()
        got = orig_merge(self, p)
        rec = {"kind": "merge", "fragment": p, "contributors": n,
               "wall_s": time.perf_counter() - w0, "cpu_s": time.process_time() - c0,
               "pipeline_cpu_s": pipeline_cpu() - t0,
               "version": self.frags[p].version, "t": time.time(),
               "handle_n": handled["n"], "handle_wall_s": handled["wall"],
               "handle_cpu_s": handled["cpu"], "handle_pipeline_cpu_s": handled["pipe"],
               "handle_bytes": handled["bytes"],
               "publish": list(publishes), "published": got is not None}
        handled.update(n=0, wall=0.0, cpu=0.0, pipe=0.0, bytes=0)
        append_jsonl(out, rec)
        return got

    def publish(self: RedisStore, p: int, **kw: Any) -> int:
        w0, c0, t0 = time.perf_counter(), time.process_time(), pipeline_cpu()
        version = orig_publish(self, p, **kw)
        publishes.append({"fragment": p, "version": version,
                          "bytes": _nbytes(kw["value"]) + _nbytes(kw["momentum"]),
                          "wall_s": time.perf_counter() - w0,
                          "cpu_s": time.process_time() - c0,
                          "pipeline_cpu_s": pipeline_cpu() - t0})
        return version

    ShardCore.handle = handle  # type: ignore[method-assign]
    ShardCore.merge = merge  # type: ignore[method-assign]
    RedisStore.publish = publish  # type: ignore[method-assign]
    setup_jax_from_env()
    return serve(open_store(args.redis_url, args.run_id), args.shard)


@dataclass
class LearnerStats:
    """What a synthetic learner reports at exit (``<out>/<id>.json``)."""

    id: str
    steps: int = 0
    sent: int = 0
    bytes_up: int = 0
    send_refused: int = 0
    encode_s: float = 0.0
    adopted: int = 0
    bytes_down: int = 0
    decode_s: float = 0.0
    stall_s: float = 0.0
    stall_timeouts: int = 0
    resyncs: int = 0
    drops: dict[str, int] = field(default_factory=dict)
    keeps_view: bool = False


def worker_learner(args: argparse.Namespace) -> int:
    """A synthetic learner (module docstring): schedule, real deltas, real sockets, adoption."""
    import zmq

    if args.nice:
        os.nice(args.nice)

    from ddiloco.pipeline import wire
    from ddiloco.pipeline.errors import DropError
    from ddiloco.pipeline.fragments import (
        due_fragments,
        fragment_offsets,
        initial_last_sends,
        shard_of,
    )
    from ddiloco.pipeline.security import ClientKeys, load_keys
    from ddiloco.pipeline.transport import DeltaPush, VersionSub, max_message_bytes
    from ddiloco.pipeline.wire import Header, Kind
    from ddiloco.workers.cli import open_store
    from ddiloco.workers.run.blobs import decode_blob
    from ddiloco.workers.run.manifest import (
        manifest_config,
        manifest_layout,
        tokens_per_batch,
        wait_for_manifest,
    )

    lid: str = args.id
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    store = open_store(args.redis_url, args.run_id)
    hb_store = open_store(args.redis_url, args.run_id)
    manifest = wait_for_manifest(store)
    cfg = manifest_config(manifest)
    layout = manifest_layout(manifest)
    P, H, S = layout.n_fragments, cfg.sync.H, cfg.run.shards
    tpb = tokens_per_batch(manifest)
    stats = LearnerStats(lid, keeps_view=bool(args.keep_view))
    inc = store.register_learner(lid)
    state = {"step": 0}

    def heartbeats() -> None:
        # A thread of its own: encoding a large fragment must not make the learner look dead.
        while not stop.is_set():
            hb_store.heartbeat_learner(lid, {"state": "training", "step": state["step"],
                                             "incarnation": inc, "pid": os.getpid()},
                                       int(cfg.run.learner_ttl_s * 1000))
            stop.wait(cfg.run.heartbeat_s)

    threading.Thread(target=heartbeats, daemon=True).start()
    ctx = zmq.Context()
    biggest = max(layout.n_values(p) for p in range(P))
    keys_dir = cfg.security.keys_dir
    curve = (ClientKeys(load_keys(keys_dir, lid), Path(keys_dir))
             if cfg.security.curve and keys_dir is not None else None)
    push = DeltaPush(ctx, max_message_bytes(biggest), curve)
    sub = VersionSub(ctx, max_message_bytes(biggest), curve)
    while not stop.is_set():
        shards = store.shards()
        push.update({int(s): e["pull"] for s, e in shards.items() if "pull" in e})
        sub.update({int(s): e["pub"] for s, e in shards.items() if "pub" in e})
        if len(shards) >= S:
            break
        time.sleep(0.2)
    time.sleep(0.5)  # CURVE handshakes and subscriptions before the snapshot (Clone pattern)
    version = [h.version if h is not None else 0 for h in store.heads(P)]
    view: dict[int, list[np.ndarray]] = {}
    if args.keep_view:
        for blob in store.get_latest_many(range(P)):
            if blob is not None:
                view[blob.fragment] = decode_blob(blob.value, layout.shapes(blob.fragment))
                version[blob.fragment] = blob.version
    adopted_at = [0] * P  # step of the last adoption: counters since then
    sent_at_version = [-1] * P  # the version a fragment's last delta was based on
    pool = (np.random.default_rng(zlib.crc32(lid.encode()))
            .standard_normal(POOL_VALUES, dtype=np.float32) * np.float32(DELTA_SCALE))
    rng = np.random.default_rng(zlib.crc32(lid.encode()) + 1)
    seq = 0
    sent_tokens = 0

    def resync(p: int) -> None:
        blob = store.get_latest(p) if args.keep_view else None
        stats.resyncs += 1
        if blob is not None:
            view[p] = decode_blob(blob.value, layout.shapes(p))
            version[p] = blob.version
        else:
            head = store.head(p)
            if head is not None:
                version[p] = max(version[p], head.version)

    def on_message(frames: list[bytes]) -> None:
        stats.bytes_down += sum(len(f) for f in frames)
        t0 = time.perf_counter()
        try:
            msg = wire.decode(frames, run_id=args.run_id,
                              expected_shapes=lambda h: (layout.shapes(h.frag)
                                                         if 0 <= h.frag < P else None),
                              allowed_codecs=[cfg.sync.codec_down])
        except DropError as exc:
            stats.drops[exc.reason] = stats.drops.get(exc.reason, 0) + 1
            return
        h = msg.header
        if h.kind == Kind.VERSION and msg.tensors is not None and h.ver > version[h.frag]:
            if args.keep_view:
                if h.enc == "diff" and h.base != version[h.frag]:
                    resync(h.frag)
                    return
                cur = view[h.frag]
                view[h.frag] = ([v + d for v, d in zip(cur, msg.tensors, strict=True)]
                                if h.enc == "diff" else msg.tensors)
            version[h.frag] = h.ver
            adopted_at[h.frag] = state["step"]
            stats.adopted += 1
            stats.decode_s += time.perf_counter() - t0
        elif h.kind == Kind.CONTROL and h.extra.get("to") == lid \
                and h.extra.get("action") == "resync":
            resync(h.frag)
        elif h.kind == Kind.HEARTBEAT:
            for key, ver in (h.extra.get("versions") or {}).items():
                if int(ver) > version[int(key)]:
                    resync(int(key))  # a broadcast was missed

    def poll(timeout_ms: int) -> None:
        frames = sub.recv(timeout_ms)
        while frames is not None:
            on_message(frames)
            frames = sub.recv(0)

    last_send = initial_last_sends(fragment_offsets(P, H), H)
    outbox: dict[int, list[bytes]] = {}
    try:
        while not stop.is_set():
            t_step = time.perf_counter()
            state["step"] += 1
            step = state["step"]
            stats.steps = step
            for p in due_fragments(step, last_send, H):
                t0 = time.perf_counter()
                while (sent_at_version[p] >= version[p] and not stop.is_set()
                       and time.perf_counter() - t0 < args.stall_max_s):
                    poll(20)
                waited = time.perf_counter() - t0
                stats.stall_s += waited
                if waited >= args.stall_max_s:
                    stats.stall_timeouts += 1
                if stop.is_set():
                    break
                t0 = time.perf_counter()
                off = int(rng.integers(0, POOL_VALUES))
                tensors = []
                for shape in layout.shapes(p):
                    n = math.prod(shape)
                    tensors.append(fill_from_pool(n, pool, off).reshape(shape))
                    off += n
                c_steps = max(1, min(step - adopted_at[p], step))
                new_tokens = c_steps * tpb
                sent_tokens += new_tokens
                seq += 1
                frames = wire.encode(Header(
                    kind=Kind.DELTA, run=args.run_id, sender=lid, inc=inc, seq=seq, frag=p,
                    base=version[p], c_steps=c_steps, c_tokens=c_steps * tpb,
                    new_tokens=new_tokens, step=step, step_time=max(args.step_s, 1e-3),
                    codec=cfg.sync.codec_up,
                    extra={"fate": [step * tpb * P, sent_tokens, 0, 0]}), tensors)
                del tensors
                stats.encode_s += time.perf_counter() - t0
                if p in outbox:
                    stats.send_refused += 1  # the older one never left: replaced
                outbox[p] = frames
                sent_at_version[p] = version[p]
                last_send[p] = step
            for p in list(outbox):
                if push.send(shard_of(p, S), outbox[p]):
                    stats.sent += 1
                    stats.bytes_up += sum(len(f) for f in outbox.pop(p))
            left = args.step_s - (time.perf_counter() - t_step)
            poll(max(0, int(left * 1000)) if not outbox else 5)
    finally:
        Path(args.out, f"{lid}.json").write_text(json.dumps(stats.__dict__))
        push.close(linger_ms=1000)
        sub.close()
        ctx.term()
    return 0


def worker_rejoin(args: argparse.Namespace) -> int:
    """A fresh process pulls and decodes every fragment's latest version; prints JSON."""
    t0 = time.perf_counter()
    from ddiloco.workers.cli import open_store
    from ddiloco.workers.run.blobs import decode_blob
    from ddiloco.workers.run.manifest import manifest_layout, wait_for_manifest

    t_import = time.perf_counter() - t0
    t0 = time.perf_counter()
    store = open_store(args.redis_url, args.run_id)
    layout = manifest_layout(wait_for_manifest(store))
    blobs = store.get_latest_many(range(layout.n_fragments))
    t_pull = time.perf_counter() - t0
    nbytes = sum(len(b.value) + len(b.momentum) for b in blobs if b is not None)
    values = {b.fragment: decode_blob(b.value, layout.shapes(b.fragment), own=True)
              for b in blobs if b is not None}
    dt = time.perf_counter() - t0
    fp32 = sum(int(a.nbytes) for v in values.values() for a in v)
    print(json.dumps({"rejoin_s": dt, "rejoin_pull_s": t_pull, "rejoin_import_s": t_import,
                      "rejoin_bytes": nbytes, "rejoin_fp32_bytes": fp32,
                      "rejoin_fragments": len(values),
                      "rejoin_versions": [b.version if b else None for b in blobs],
                      "rejoin_peak_rss_bytes": peak_rss(os.getpid())}))
    return 0


# ------------------------------------------------------------------------------ the run
def build_config(args: argparse.Namespace, blobs: str) -> Any:
    """The run configuration of a size and backend (module docstring for what differs from the
    defaults)."""
    from ddiloco.workers.run.config import load_config
    from ddiloco.workers.syncer.fused import default_threads

    overrides: dict[str, Any] = {
        **SIZES[args.size],
        "run.learners": args.learners, "run.shards": args.shards,
        "sync.history": 2, "sync.min_quorum": args.learners,
        "sync.codec_up": args.codec_up, "sync.codec_down": args.codec_down,
        "run.learner_ttl_s": TTL_S, "run.lease_ttl_s": TTL_S,
        "train.steps": 100_000, "store.blobs": blobs,
        "run.merge_threads": args.merge_threads or max(1, default_threads() // args.shards),
    }
    return load_config(None, overrides)


@contextlib.contextmanager
def progress_bar(total: int, label: str) -> Iterator[Any]:
    """A rich progress bar (merges of the slowest fragment), or log lines without a
    terminal."""
    from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn

    if not sys.stderr.isatty():
        state = {"last": -1.0}

        def update(done: int, text: str) -> None:
            if time.monotonic() - state["last"] >= 10 or done >= total:
                state["last"] = time.monotonic()
                print(f"[scale] {label}: {done}/{total} periods; {text}", file=sys.stderr,
                      flush=True)

        yield update
        return
    with Progress(TextColumn("{task.description}"), BarColumn(),
                  TextColumn("{task.completed}/{task.total} periods"), TimeElapsedColumn(),
                  TextColumn("{task.fields[text]}"), transient=False) as prog:
        task = prog.add_task(label, total=total, text="")
        yield lambda done, text: prog.update(task, completed=done, text=text)


def run(args: argparse.Namespace) -> dict[str, Any]:
    """One run of ``args.size`` on ``args.backend``; returns the result record."""
    from ddiloco.store import EmbeddedRedis
    from ddiloco.store.connect import connect
    from ddiloco.store.redis_store import RedisStore
    from ddiloco.workers.run.launch import LocalCluster, Worker, with_run_keys
    from ddiloco.workers.run.manifest import manifest_layout

    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ddl-scale-", dir=args.workdir))
    run_id = f"scale-{args.size.lower()}-{args.backend}-{os.getpid()}"
    run_dir = work / "run"
    run_dir.mkdir(exist_ok=True)
    res: dict[str, Any] = {"bench": "scale", "size": args.size, "backend": args.backend,
                           "learners": args.learners, "shards": args.shards,
                           "codec_up": args.codec_up, "codec_down": args.codec_down,
                           "periods_target": args.periods, "step_s": args.step_s,
                           "learner_nice": args.learner_nice,
                           "history": 2, "workdir": str(work)}
    self_py = [sys.executable, str(Path(__file__).resolve())]
    with contextlib.ExitStack() as stack:
        if not args.keep:
            stack.callback(shutil.rmtree, work, True)
        redis_server = stack.enter_context(EmbeddedRedis(work / "redis"))
        s3 = None
        if args.backend == "s3":
            s3 = stack.enter_context(s3_server_env(work / "s3"))
            blobs, blob_dir = s3.url(run_id), work / "s3"
        elif args.backend == "file":
            blob_dir = work / "blobs"
            blobs = f"file://{blob_dir}"
        else:
            blobs, blob_dir = "redis", work / "redis"
        cfg = with_run_keys(build_config(args, blobs), run_dir)
        res["merge_threads"] = cfg.run.merge_threads
        cfg_json = run_dir / "config.json"
        cfg_json.write_text(json.dumps(cfg.model_dump(mode="json")))
        client = connect(redis_server.url)
        store = RedisStore(client, run_id)
        log(f"{args.size} on {args.backend}: init step (manifest, initial values)")
        t0 = time.perf_counter()
        init = subprocess.run([*self_py, "--worker", "init", "--redis-url", redis_server.url,
                               "--run-id", run_id, "--config-json", str(cfg_json)],
                              capture_output=True, text=True)
        res["init_s"] = round(time.perf_counter() - t0, 2)
        if init.returncode != 0:
            res["error"] = "init: " + (init.stderr.strip().splitlines() or ["?"])[-1]
            return res
        manifest = store.get_manifest()
        assert manifest is not None
        layout = manifest_layout(manifest)
        P = layout.n_fragments
        frag_fp32 = [4 * layout.n_values(p) for p in range(P)]
        res.update(params=int(manifest["task"]["params"]), fragments=P, H=cfg.sync.H,
                   fp32_bytes=sum(frag_fp32), largest_fragment_fp32_bytes=max(frag_fp32))
        # Keep every learner's copy of the global model only where all of them fit easily.
        mem_total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
        keep_view = args.learners * sum(frag_fp32) <= mem_total // 4
        res["learner_keeps_view"] = keep_view
        cluster = LocalCluster(redis_server.url, run_id, run_dir, platform="cpu")
        base = ["--redis-url", redis_server.url, "--run-id", run_id, "--out", str(run_dir)]
        for s in range(args.shards):
            name = f"shard-{s}"
            cluster.workers[name] = Worker(name, [*self_py, "--worker", "shard", "--shard",
                                                  str(s), *base])
        for m in range(args.learners):
            name = f"learner-{m}"
            cluster.workers[name] = Worker(name, [
                *self_py, "--worker", "learner", "--id", name, "--step-s", str(args.step_s),
                "--stall-max-s", str(args.stall_max_s), *(["--keep-view"] if keep_view else []),
                "--nice", str(args.learner_nice), *base])
        stack.callback(cluster.stop_all)
        rss: dict[str, int] = {}
        redis_max = 0

        def sample() -> None:
            nonlocal redis_max
            for name, w in cluster.workers.items():
                if w.pid is not None and (got := peak_rss(w.pid)) is not None:
                    rss[name] = max(rss.get(name, 0), got)
            redis_max = max(redis_max, int(client.info("memory")["used_memory"]))

        cluster.start_all()
        t_start = time.perf_counter()
        deadline = t_start + (args.timeout_s or TIMEOUTS[args.size])
        done = 0
        # The disk's rate under the run's own load, for the publishes' denominator: one short
        # probe at the end of each of the first periods, in a thread (the loop goes on).
        loaded: list[float] = []
        probe: threading.Thread | None = None

        def probe_disk() -> None:
            loaded.append(fdatasync_gbps(blob_dir, LOADED_PROBE_BYTES)["all"])

        log(f"{res['params']:,} params, {P} fragments, {args.learners} learners, "
            f"{args.shards} shards, blobs {blobs}")
        with progress_bar(args.periods, f"{args.size}/{args.backend}") as update:
            while time.perf_counter() < deadline:
                available = mem_available()
                if available is not None and available < args.min_free_mib << 20:
                    sample()
                    res["error"] = (f"host memory nearly exhausted ({available >> 20} MiB "
                                    f"available < --min-free-mib {args.min_free_mib}): stopped;"
                                    f" peak RSS so far {json.dumps(rss)}")
                    break
                dead = [n for n, w in cluster.workers.items()
                        if w.proc is not None and not w.alive]
                if dead:
                    proc = cluster.workers[dead[0]].proc
                    code = None if proc is None else proc.returncode
                    res["error"] = (f"{dead[0]} exited with {code}: "
                                    f"{cluster.log_tail(dead[0], 600)}")
                    break
                versions = [h.version if h is not None else 0 for h in store.heads(P)]
                done = min(versions)
                if (args.loaded_probes and probe is None and 1 <= done < args.periods) or (
                        probe is not None and not probe.is_alive()
                        and len(loaded) < args.loaded_probes and done > len(loaded)
                        and done < args.periods):
                    blob_dir.mkdir(parents=True, exist_ok=True)
                    probe = threading.Thread(target=probe_disk, daemon=True)
                    probe.start()
                sample()
                update(min(done, args.periods),
                       f"versions {min(versions)}..{max(versions)}, "
                       f"{time.perf_counter() - t_start:.0f} s")
                if done >= args.periods:
                    break
                time.sleep(1.0)
        wall = time.perf_counter() - t_start
        if probe is not None:
            probe.join()
        if loaded:
            res["disk_fdatasync_loaded_gbps"] = round(sorted(loaded)[len(loaded) // 2], 3)
            res["disk_fdatasync_loaded_probes"] = [round(x, 3) for x in loaded]
        sample()
        res["wall_s"] = round(wall, 1)
        res["period_wall_s"] = round(wall / done, 2) if done else None
        log("stopping the workers")
        cluster.stop_all()
        versions = [h.version if h is not None else 0 for h in store.heads(P)]
        res["versions"] = versions
        res["periods_completed"] = min(versions)
        info = client.info("memory")
        res["redis_used_memory_bytes"] = int(info["used_memory"])
        res["redis_used_memory_max_bytes"] = max(redis_max, int(info["used_memory"]))
        res["object_store_bytes"] = tree_bytes(blob_dir) if args.backend != "redis" else 0
        res["object_count"] = len(store.object_paths()) if args.backend != "redis" else 0
        res["drops"] = store.counters("drops")
        res.update(shard_metrics(run_dir, args.shards, args.learners, layout, frag_fp32))
        shard_rss = {n: v for n, v in rss.items() if n.startswith("shard")}
        owned = {f"shard-{s}": sum(frag_fp32[p] for p in range(P) if p % args.shards == s)
                 for s in range(args.shards)}
        res["shard_peak_rss_bytes"] = shard_rss
        res["shard_fp32_owned_bytes"] = owned
        res["shard_peak_rss_ratio"] = round(max(
            (shard_rss[n] / owned[n] for n in shard_rss if owned.get(n)), default=0.0), 2)
        res["learner_peak_rss_bytes"] = {n: v for n, v in rss.items() if n.startswith("learn")}
        res["learners_stats"] = learner_totals(run_dir, args.learners)
        log("rejoin: a fresh process pulls every fragment")
        rj = subprocess.run([*self_py, "--worker", "rejoin", "--redis-url", redis_server.url,
                             "--run-id", run_id], capture_output=True, text=True,
                            env={**os.environ})
        if rj.returncode == 0:
            res.update(json.loads(rj.stdout.strip().splitlines()[-1]))
            res["rejoin_s"] = round(res["rejoin_s"], 3)
            res["rejoin_gbps"] = round(res["rejoin_bytes"] / res["rejoin_s"] / GB, 3)
        else:
            res["rejoin_error"] = (rj.stderr.strip().splitlines() or ["?"])[-1]
        log(f"disk: {args.fdatasync_mib} MiB with fdatasync in {blob_dir}")
        blob_dir.mkdir(parents=True, exist_ok=True)
        disk = fdatasync_gbps(blob_dir, args.fdatasync_mib << 20)
        res["disk_fdatasync_gbps"] = round(disk["all"], 3)
        res["disk_fdatasync_burst_gbps"] = round(disk["burst"], 3)
        if "sustained" in disk:
            res["disk_fdatasync_sustained_gbps"] = round(disk["sustained"], 3)
        if res.get("publish_gbps"):
            for key, rate in (("", "disk_fdatasync_gbps"),
                              ("_sustained", "disk_fdatasync_sustained_gbps"),
                              ("_loaded", "disk_fdatasync_loaded_gbps")):
                if res.get(rate):
                    res[f"publish_over_fdatasync{key}"] = round(res["publish_gbps"] / res[rate],
                                                                3)
        del s3
    return res


# ------------------------------------------------------------------------------ publish only
def publish_compare(args: argparse.Namespace) -> dict[str, Any]:
    """``--publish-only`` (module docstring): each size of ``--sizes`` published fragment by
    fragment to the file backend and to S3, alternated, in this process; then rejoins."""
    from obstore.store import from_url

    from ddiloco.store import EmbeddedRedis
    from ddiloco.store.connect import connect
    from ddiloco.store.objects import PART_BYTES, PUT_CONCURRENCY, ObjectBlobs

    if args.workdir:
        Path(args.workdir).mkdir(parents=True, exist_ok=True)
    work = Path(tempfile.mkdtemp(prefix="ddl-scale-publish-", dir=args.workdir))
    res: dict[str, Any] = {"bench": "scale-publish", "backend": args.backend,
                           "baseline": "file", "reps": args.reps, "part_bytes": PART_BYTES,
                           "put_concurrency": PUT_CONCURRENCY, "workdir": str(work),
                           "sizes": {}}
    with contextlib.ExitStack() as stack:
        if not args.keep:
            stack.callback(shutil.rmtree, work, True)
        redis_server = stack.enter_context(EmbeddedRedis(work / "redis"))
        s3 = stack.enter_context(s3_server_env(work / "s3"))
        # one blob straight to the server, in one PUT and as this store's multipart upload
        plain = from_url(s3.url("plain"))  # credentials and endpoint from the environment
        objs = ObjectBlobs(s3.url("plain"))
        stack.callback(objs.close)
        for size in [x.strip() for x in args.sizes.split(",") if x.strip()]:
            one = publish_size(args, size, work, redis_server.url, connect(redis_server.url),
                               s3, plain, objs)
            res["sizes"][size] = one
            if "error" in one:
                res["error"] = f"{size}: {one['error']}"
                break
    return res


def publish_size(args: argparse.Namespace, size: str, work: Path, redis_url: str,
                 client: Any, s3: Any, plain: Any, objs: Any) -> dict[str, Any]:
    """Publishes and rejoins of one model size on both backends (``--publish-only``); the
    largest blob also straight to the S3 server, joined in one plain PUT (``plain``, an
    obstore store) and as :meth:`ddiloco.store.objects.ObjectBlobs.put`'s multipart upload
    (``objs``), alternated."""
    import obstore

    from ddiloco.store.redis_store import RedisStore
    from ddiloco.workers.run.blobs import blob_parts
    from ddiloco.workers.run.manifest import manifest_layout

    self_py = [sys.executable, str(Path(__file__).resolve())]
    locations = {"file": f"file://{work / 'blobs'}", "s3": s3.url("blobs")}
    runs: dict[str, str] = {}
    stores: dict[str, RedisStore] = {}
    manifest: dict[str, Any] | None = None
    for b, location in locations.items():
        run_id = f"pub-{size.lower()}-{b}-{os.getpid()}"
        cfg = build_config(argparse.Namespace(**{**vars(args), "size": size}), location)
        cfg_json = work / f"config-{run_id}.json"
        cfg_json.write_text(json.dumps(cfg.model_dump(mode="json")))
        init = subprocess.run([*self_py, "--worker", "init", "--manifest-only", "--redis-url",
                               redis_url, "--run-id", run_id, "--config-json", str(cfg_json)],
                              capture_output=True, text=True)
        if init.returncode != 0:
            return {"error": "init: " + (init.stderr.strip().splitlines() or ["?"])[-1]}
        runs[b], stores[b] = run_id, RedisStore(client, run_id)
        manifest = stores[b].get_manifest()
    assert manifest is not None
    layout = manifest_layout(manifest)
    P = layout.n_fragments
    noise = np.random.default_rng(0).standard_normal(max(layout.n_values(p) for p in range(P)),
                                                     dtype=np.float32)

    def parts_of(p: int) -> list[memoryview]:
        tensors, off = [], 0
        for shape in layout.shapes(p):
            n = math.prod(shape)
            tensors.append(noise[off:off + n].reshape(shape))
            off += n
        return blob_parts(tensors)  # as a shard publishes: a header, then views of the values

    out: dict[str, Any] = {"params": int(manifest["task"]["params"]), "fragments": P}
    log(f"{size}: {out['params']:,} params, {P} fragments; {args.reps} publishes of each on "
        "file and s3, alternated")
    version = {b: [-1] * P for b in stores}
    # per backend and rep: (bytes, wall s, this process's CPU s, the S3 server's CPU s)
    took: dict[str, list[list[tuple[int, float, float, float]]]] = {
        b: [[] for _ in range(args.reps)] for b in stores}
    direct: dict[str, list[float]] = {"plain": [], "multipart": []}
    biggest = max(range(P), key=layout.n_values)
    for rep in range(args.reps):
        for p in range(P):
            parts = parts_of(p)
            nbytes = sum(x.nbytes for x in parts)
            for b in ("file", "s3") if (rep + p) % 2 == 0 else ("s3", "file"):
                st = stores[b]
                w0, c0, t0 = process_cpu_s(s3.pid), time.process_time(), time.perf_counter()
                version[b][p] = st.publish(p, expected_version=version[b][p], epoch=1,
                                           value=parts, momentum=b"", keep=2)
                took[b][rep].append((nbytes, time.perf_counter() - t0,
                                     time.process_time() - c0, process_cpu_s(s3.pid) - w0))
                st.wait_collected()  # the collection of the version before stays untimed
        # the server's own rate: the largest blob joined, in one plain PUT (the path before
        # multipart uploads), against the same blob's multipart upload, no Redis in either
        big_parts = parts_of(biggest)
        joined = b"".join(big_parts)
        for how in ("plain", "multipart") if rep % 2 == 0 else ("multipart", "plain"):
            key = f"{size}-{rep}-{how}"
            t0 = time.perf_counter()
            if how == "plain":
                obstore.put(plain, key, joined, use_multipart=False)
            else:
                objs.put(key, big_parts)
            direct[how].append(len(joined) / (time.perf_counter() - t0) / GB)
            obstore.delete(plain, key)
        del joined, big_parts
        log(f"{size}: rep {rep + 1}/{args.reps}: file "
            f"{rate_gbps(took['file'][rep]):.3f} GB/s, s3 {rate_gbps(took['s3'][rep]):.3f} GB/s, "
            f"largest blob straight to S3: one PUT {direct['plain'][-1]:.3f} GB/s, multipart "
            f"{direct['multipart'][-1]:.3f} GB/s")
    for b in stores:
        rows = [r for rep_rows in took[b] for r in rep_rows]
        out[f"{b}_publish_gbps"] = round(rate_gbps(rows), 3)
        out[f"{b}_publish_gbps_reps"] = [round(rate_gbps(r), 3) for r in took[b]]
        out[f"{b}_publish_s_max"] = round(max(r[1] for r in rows), 3)
        out[f"{b}_client_cpu_s_per_gb"] = round(sum(r[2] for r in rows)
                                                / sum(r[0] for r in rows) * GB, 2)
    out["publish_bytes_per_rep"] = sum(r[0] for r in took["file"][0])
    out["largest_blob_bytes"] = max(r[0] for r in took["file"][0])
    out["s3_over_file"] = round(out["s3_publish_gbps"] / out["file_publish_gbps"], 3)
    out["s3_over_file_reps"] = [round(s / f, 3) for s, f in zip(
        out["s3_publish_gbps_reps"], out["file_publish_gbps_reps"], strict=True)]
    s3_rows = [r for rep_rows in took["s3"] for r in rep_rows]
    out["s3_server_cpu_s_per_gb"] = round(sum(r[3] for r in s3_rows)
                                          / sum(r[0] for r in s3_rows) * GB, 2)
    out["s3_plain_put_gbps_reps"] = [round(x, 3) for x in direct["plain"]]
    out["s3_multipart_put_gbps_reps"] = [round(x, 3) for x in direct["multipart"]]
    for rep in range(args.reps):
        for b in ("s3", "file") if rep % 2 == 0 else ("file", "s3"):
            rj = subprocess.run([*self_py, "--worker", "rejoin", "--redis-url", redis_url,
                                 "--run-id", runs[b]], capture_output=True, text=True,
                                env={**os.environ})
            if rj.returncode != 0:
                out[f"rejoin_{b}_error"] = (rj.stderr.strip().splitlines() or ["?"])[-1]
                continue
            got = json.loads(rj.stdout.strip().splitlines()[-1])
            out.setdefault(f"rejoin_{b}_s_reps", []).append(round(got["rejoin_s"], 3))
            out.setdefault(f"rejoin_{b}_pull_s_reps", []).append(round(got["rejoin_pull_s"], 3))
            out["rejoin_bytes"] = got["rejoin_bytes"]
        log(f"{size}: rejoin {rep + 1}/{args.reps}: s3 {out.get('rejoin_s3_s_reps')} s, "
            f"file {out.get('rejoin_file_s_reps')} s")
    for b in stores:
        stores[b].flush_run()
    return out


def rate_gbps(rows: list[tuple[int, float, float, float]]) -> float:
    """GB/s of publishes: their bytes over their wall seconds."""
    return sum(r[0] for r in rows) / max(1e-9, sum(r[1] for r in rows)) / GB


def print_publish_table(res: dict[str, Any]) -> None:
    """``--publish-only``'s result as a rich table, one column per size."""
    from rich.console import Console
    from rich.table import Table

    sizes = res["sizes"]
    t = Table(title=f"publish: file vs {res['backend']} (SeaweedFS) on one disk, "
                    f"{res['reps']} publishes of every fragment each, alternated; parts of "
                    f"{res['part_bytes'] >> 20} MiB, {res['put_concurrency']} in flight")
    t.add_column("measure")
    for size in sizes:
        t.add_column(size, justify="right")
    t.add_column("target / note")

    def reps(v: Any) -> str:
        return "-" if not v else " / ".join(str(x) for x in v)

    rows: list[tuple[str, str, Any]] = [
        ("parameters", "", lambda o: f"{o.get('params', 0):,}"),
        ("file publish GB/s", "each rep", lambda o: reps(o.get("file_publish_gbps_reps"))),
        ("s3 publish GB/s", "each rep", lambda o: reps(o.get("s3_publish_gbps_reps"))),
        ("s3 / file", ">= 0.7", lambda o: f"{o.get('s3_over_file')} "
                                          f"({reps(o.get('s3_over_file_reps'))})"),
        ("largest blob, one PUT GB/s", "joined; no Redis",
         lambda o: reps(o.get("s3_plain_put_gbps_reps"))),
        ("largest blob, multipart GB/s", "its parts; no Redis",
         lambda o: reps(o.get("s3_multipart_put_gbps_reps"))),
        ("S3 server CPU s / GB", "SeaweedFS, in publishes",
         lambda o: o.get("s3_server_cpu_s_per_gb")),
        ("publisher CPU s / GB", "file / s3",
         lambda o: f"{o.get('file_client_cpu_s_per_gb')} / {o.get('s3_client_cpu_s_per_gb')}"),
        ("rejoin from s3, s", "<= 15 at 1B", lambda o: reps(o.get("rejoin_s3_s_reps"))),
        ("rejoin from file, s", "", lambda o: reps(o.get("rejoin_file_s_reps"))),
    ]
    for label, note, get in rows:
        t.add_row(label, *(str(get(o)) for o in sizes.values()), note)
    Console(stderr=True).print(t)
    if "error" in res:
        Console(stderr=True).print(f"[red]error:[/red] {res['error']}")


def shard_metrics(run_dir: Path, shards: int, learners: int, layout: Any,
                  frag_fp32: list[int]) -> dict[str, Any]:
    """Merge, decode and publish figures from the shards' JSON-lines records."""
    every = [r for s in range(shards) for r in read_jsonl(run_dir / f"shard-{s}.jsonl")
             if r.get("published")]
    out: dict[str, Any] = {"merges": len(every),
                           "full_rounds": sum(1 for r in every if r["contributors"] >= learners)}
    # A shard's first merge imports the inner lr schedule (JAX): timings start after it.
    firsts = {id(rs[0]) for s in range(shards)
              if (rs := [r for r in every if r["fragment"] % shards == s])}
    merges = [r for r in every if id(r) not in firsts]
    if not merges:
        return out
    pubs = [p for r in merges for p in r["publish"]]
    pub_wall = sum(p["wall_s"] for p in pubs)
    pub_cpu = sum(p["cpu_s"] for p in pubs)
    pub_bytes = sum(p["bytes"] for p in pubs)
    merged_fp32 = sum(r["contributors"] * frag_fp32[r["fragment"]] for r in merges)
    cpu = sum(r["cpu_s"] + r["handle_cpu_s"] for r in merges) - pub_cpu
    pipe = (sum(r.get("pipeline_cpu_s", 0.0) + r.get("handle_pipeline_cpu_s", 0.0)
                for r in merges)
            - sum(p.get("pipeline_cpu_s", 0.0) for p in pubs))
    wall = sum(r["wall_s"] + r["handle_wall_s"] for r in merges) - pub_wall
    n_handle = sum(r["handle_n"] for r in merges)
    # One sync period of a shard: every fragment it owns merged once.
    per_shard_period = []
    for s in range(shards):
        own = [r for r in merges if r["fragment"] % shards == s]
        n_own = len([p for p in range(layout.n_fragments) if p % shards == s])
        if own and n_own:
            busy = sum(r["wall_s"] + r["handle_wall_s"] for r in own)
            per_shard_period.append(busy / (len(own) / n_own))
    out.update({
        "merge_s_per_fragment": round(sum(r["wall_s"] for r in merges) / len(merges), 4),
        "merge_s_per_fragment_max": round(max(r["wall_s"] for r in merges), 4),
        "decode_s_per_contribution": round(
            sum(r["handle_wall_s"] for r in merges) / max(1, n_handle), 4),
        "merge_s_per_period": round(sum(per_shard_period) / len(per_shard_period), 3)
        if per_shard_period else None,
        "merge_fp32_gbps_per_core": round(merged_fp32 / pipe / GB, 3) if pipe > 0 else None,
        "merge_fp32_gbps_per_core_process": round(merged_fp32 / cpu / GB, 3)
        if cpu > 0 else None,
        "merge_fp32_gbps_wall": round(merged_fp32 / wall / GB, 3) if wall > 0 else None,
        "contributors_mean": round(sum(r["contributors"] for r in merges) / len(merges), 2),
        "publish_s": round(pub_wall / max(1, len(pubs)), 4),
        "publish_s_max": round(max((p["wall_s"] for p in pubs), default=0.0), 4),
        "publish_bytes": int(pub_bytes / max(1, len(pubs))),
        "publish_total_bytes": int(pub_bytes),
        "publish_gbps": round(pub_bytes / pub_wall / GB, 3) if pub_wall > 0 else None,
    })
    return out


def learner_totals(run_dir: Path, learners: int) -> dict[str, Any]:
    """The synthetic learners' counters, summed (stall and codec seconds: per learner mean)."""
    got = [json.loads(p.read_text()) for m in range(learners)
           if (p := run_dir / f"learner-{m}.json").exists()]
    if not got:
        return {}
    tot: dict[str, Any] = {k: sum(g[k] for g in got)
                           for k in ("steps", "sent", "bytes_up", "send_refused", "adopted",
                                     "bytes_down", "stall_timeouts", "resyncs")}
    for k in ("encode_s", "decode_s", "stall_s"):
        tot[k + "_mean"] = round(sum(g[k] for g in got) / len(got), 2)
    drops: dict[str, int] = {}
    for g in got:
        for k, v in g["drops"].items():
            drops[k] = drops.get(k, 0) + v
    tot["drops"] = drops
    return tot


def log(text: str) -> None:
    """A progress line on stderr."""
    print(f"[scale] {text}", file=sys.stderr, flush=True)


def print_table(res: dict[str, Any]) -> None:
    """The result as a rich table."""
    from rich.console import Console
    from rich.table import Table

    def gb(x: Any) -> str:
        return "-" if x is None else f"{x / GB:.3f} GB"

    t = Table(title=f"{res['size']} ({res.get('params', 0):,} params) on {res['backend']}: "
                    f"{res['learners']} learners, {res['shards']} shards, "
                    f"{res['codec_up']} up / {res['codec_down']} down, history 2")
    t.add_column("measure")
    t.add_column("value", justify="right")
    t.add_column("target / note")
    rows = [
        ("periods completed", res.get("periods_completed"),
         f">= {res['periods_target']} (versions of the slowest fragment)"),
        ("wall s / period", res.get("period_wall_s"), f"run {res.get('wall_s')} s"),
        ("merges (all learners)", f"{res.get('merges')} ({res.get('full_rounds')})", ""),
        ("merge s / fragment", res.get("merge_s_per_fragment"),
         f"max {res.get('merge_s_per_fragment_max')}"),
        ("merge s / period / shard", res.get("merge_s_per_period"), "decode + merge"),
        ("decode s / contribution", res.get("decode_s_per_contribution"), ""),
        ("merge fp32 GB/s per core", res.get("merge_fp32_gbps_per_core"),
         f">= 1.5; whole process {res.get('merge_fp32_gbps_per_core_process')}, "
         f"wall {res.get('merge_fp32_gbps_wall')}"),
        ("publish s", res.get("publish_s"), f"{gb(res.get('publish_bytes'))} each"),
        ("publish GB/s", res.get("publish_gbps"),
         f">= 0.7 x fdatasync ({res.get('publish_over_fdatasync')})"),
        ("disk fdatasync GB/s", res.get("disk_fdatasync_gbps"),
         f"64 MiB chunks; first GiB {res.get('disk_fdatasync_burst_gbps')}, after it "
         f"{res.get('disk_fdatasync_sustained_gbps')}"),
        ("publish / sustained fdatasync", res.get("publish_over_fdatasync_sustained"),
         f"run published {gb(res.get('publish_total_bytes'))}"),
        ("disk fdatasync GB/s, loaded", res.get("disk_fdatasync_loaded_gbps"),
         f"during the run: {res.get('disk_fdatasync_loaded_probes')}"),
        ("publish / loaded fdatasync", res.get("publish_over_fdatasync_loaded"),
         ">= 0.7"),
        ("Redis used_memory", gb(res.get("redis_used_memory_bytes")),
         f"max {gb(res.get('redis_used_memory_max_bytes'))}"),
        ("object store", gb(res.get("object_store_bytes")), f"{res.get('object_count')} objects"),
        ("rejoin s", res.get("rejoin_s"), f"{gb(res.get('rejoin_bytes'))} pulled"),
        ("shard peak RSS / fp32 owned", res.get("shard_peak_rss_ratio"), "<= 3"),
        ("learner peak RSS", gb(max((res.get("learner_peak_rss_bytes") or {0: 0}).values())),
         f"keeps view: {res.get('learner_keeps_view')}"),
    ]
    for label, value, note in rows:
        t.add_row(label, "-" if value is None else str(value), note)
    Console(stderr=True).print(t)
    if "error" in res:
        Console(stderr=True).print(f"[red]error:[/red] {res['error']}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", choices=list(SIZES), default="10M")
    ap.add_argument("--backend", choices=BACKENDS, default="file")
    ap.add_argument("--json", help="write the result object to this file")
    ap.add_argument("--periods", type=int, default=5,
                    help="stop when every fragment has this many merges")
    ap.add_argument("--learners", type=int, default=4)
    ap.add_argument("--shards", type=int, default=2)
    ap.add_argument("--merge-threads", type=int, default=None,
                    help="merge threads per shard (run.merge_threads; default: this host's "
                         "cores divided by the shards, at least 1)")
    ap.add_argument("--codec-up", default="int4")
    ap.add_argument("--codec-down", default="int4")
    ap.add_argument("--topk", action="store_true", help="uplink codec topk-d2-b4 (top 2%%)")
    ap.add_argument("--step-s", type=float, default=0.0,
                    help="seconds of one virtual inner step (0: as fast as merges allow)")
    ap.add_argument("--stall-max-s", type=float, default=600.0,
                    help="longest wait of a learner for its previous delta's merge")
    ap.add_argument("--timeout-s", type=float, default=None)
    ap.add_argument("--min-free-mib", type=int, default=1536,
                    help="stop the run (an error) when the host has less memory available: "
                    "the kernel's OOM killer would otherwise pick a worker, or anything else")
    ap.add_argument("--fdatasync-mib", type=int, default=3072,
                    help="MiB the disk measurement writes (64 MiB chunks; the first GiB is "
                    "reported apart as the disk's burst)")
    ap.add_argument("--workdir", default=None,
                    help="where the run's directory is made (default: the system's temporary "
                    "directory); the run's directory is removed at the end unless --keep")
    ap.add_argument("--keep", action="store_true", help="keep the work directory")
    ap.add_argument("--loaded-probes", type=int, default=3,
                    help="disk probes during the run (256 MiB with fdatasync each, at the end "
                    "of each of the first periods; 0: none)")
    ap.add_argument("--publish-only", action="store_true",
                    help="no run: publish every fragment of each --sizes to the file backend "
                    "and to --backend s3, alternated, and report both rates and their ratio, "
                    "then rejoin from each (module docstring)")
    ap.add_argument("--sizes", default="100M,1B",
                    help="sizes of --publish-only, comma-separated")
    ap.add_argument("--reps", type=int, default=2,
                    help="--publish-only: publishes of every fragment on each backend")
    ap.add_argument("--learner-nice", type=int, default=10,
                    help="niceness of the synthetic learners (0: the shards' priority); they "
                    "stand for remote hosts, so by default they yield the cores to the shards "
                    "and stores")
    # Internal: the child processes of a run.
    ap.add_argument("--worker", choices=["init", "shard", "learner", "rejoin"],
                    help=argparse.SUPPRESS)
    ap.add_argument("--redis-url", help=argparse.SUPPRESS)
    ap.add_argument("--run-id", help=argparse.SUPPRESS)
    ap.add_argument("--out", help=argparse.SUPPRESS)
    ap.add_argument("--shard", type=int, help=argparse.SUPPRESS)
    ap.add_argument("--id", help=argparse.SUPPRESS)
    ap.add_argument("--config-json", help=argparse.SUPPRESS)
    ap.add_argument("--keep-view", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--manifest-only", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--nice", type=int, default=0, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        return {"init": worker_init, "shard": worker_shard, "learner": worker_learner,
                "rejoin": worker_rejoin}[args.worker](args)
    if args.topk:
        args.codec_up = "topk-d2-b4"
    if args.publish_only:
        if args.backend != "s3":
            ap.error("--publish-only compares --backend s3 with the file backend")
        unknown = [x for x in args.sizes.split(",") if x.strip() and x.strip() not in SIZES]
        if unknown or args.reps < 1:
            ap.error(f"--sizes: unknown {unknown} (of {list(SIZES)}), or --reps below 1")
        res = publish_compare(args)
        print_publish_table(res)
    else:
        res = run(args)
        print_table(res)
    line = json.dumps(res)
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")
    return 0 if "error" not in res else 1


if __name__ == "__main__":
    sys.exit(main())
