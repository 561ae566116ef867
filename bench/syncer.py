"""Syncer shard merge throughput: MB/s of fp32-equivalent fragment data per core.

One shard owns every fragment of the model; 8 simulated learners each send an int4 delta of
every fragment; the shard decodes, dequantizes, weights, merges (RDA), applies the outer
Nesterov step, quantizes the broadcast, and publishes to a real Redis (embedded). Throughput is
``learners * fragment_bytes_fp32 / time``. Side by side in the same process, as the reference
limits: decoding the same messages alone (the codec's limit) and a numpy copy of the same bytes
(memory's limit).

Then the shard's receive path over real sockets on loopback: the same deltas sent by a learner
PUSH and taken from the shard's PULL into the core, plain TCP against CURVE (each learner with
its own key, the shard's ZAP handler admitting them), and the core alone without a socket:
``curve_recv_loss_pct`` is CURVE's cost on the receive path alone, and
``curve_throughput_loss_pct`` on the shard's whole pipeline (receive, merge, outer step,
publish) over sockets (docs/SECURITY.md).

Then the merge alone (no store, no sockets) at ``--fragment-mb`` of float32 per fragment, the
shard's fused path (:mod:`ddiloco.workers.syncer.fused`: each delta decoded straight into one
accumulator, threaded) against the reference path (``wire.decode`` of each delta,
``merge_fragment``, ``OuterOptimizer.step``, ``quantize_roundtrip``, ``codec.encode``), from
the received messages to the broadcast payload: ``merge_fp32_gbps_per_core`` is GB/s of
fp32-equivalent delta data divided by the threads each path uses; ``peak_rss_ratio`` the
growth of peak RSS over that section divided by the fragment's float32 bytes.
``merge_fp32_gbps_per_cpu_s`` divides by the process's CPU seconds instead of wall seconds
times threads: the figure that holds on a machine shared with other work.

Then where the fused path's time goes, on one thread (``merge_stage_ms``, CPU milliseconds,
best of ``--rounds``): zstd decompression of the deltas, their validation (which sums each
tensor's squares), the RDA norms from those sums,
the weighted accumulation (with the merged norm), the outer step's one pass (outer Nesterov,
guard norm, error feedback, int4 downlink and its broadcast re-quantization, state updated)
and the broadcast's zstd compression.

    python bench/syncer.py [--preset small] [--learners 8] [--rounds 3] [--fragment-mb 64]
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import zmq

from ddiloco.pipeline import wire
from ddiloco.pipeline.security import Authenticator, ClientKeys, create_keys, load_keys
from ddiloco.pipeline.transport import DeltaPush, ShardSockets, max_message_bytes
from ddiloco.pipeline.wire import Header, Kind
from ddiloco.store import EmbeddedRedis, RedisStore
from ddiloco.store.connect import connect
from ddiloco.workers.run.config import load_config
from ddiloco.workers.run.manifest import build_manifest
from ddiloco.workers.syncer.core import ShardCore
from ddiloco.workers.task.model import init_params


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--learners", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fragments", type=int, default=12)
    ap.add_argument("--fragment-mb", type=float, default=64.0,
                    help="float32 MB of the fragment of the merge-only comparison")
    ap.add_argument("--threads", type=int, default=None,
                    help="merge threads of the fused path (default: available cores)")
    ap.add_argument("--skip-store", action="store_true",
                    help="only the merge-only comparison")
    args = ap.parse_args()
    merge_res = _merge_only(args)
    if args.skip_store:
        print(json.dumps({"bench": "syncer", **merge_res}))
        return

    from rich.console import Console
    from rich.table import Table

    cfg = load_config(None, {"model.preset": args.preset, "run.shards": 1,
                             "sync.fragments": args.fragments, "sync.grace": False})
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp)) as server:
        store = RedisStore(connect(server.url), "bench-syncer")
        manifest = store.put_manifest(build_manifest(cfg, "bench-syncer"))
        epoch = store.acquire_lease(0, "bench", 60_000)
        assert epoch is not None
        core = ShardCore(manifest, 0, store, epoch)
        core.load(lambda: init_params(cfg.model_config_obj(), 0))
        learners = [f"learner-{m}" for m in range(args.learners)]
        for lid in learners:
            store.register_learner(lid)
        core.set_live(set(learners))
        rng = np.random.default_rng(0)
        layout = core.layout
        P = layout.n_fragments
        total_values = sum(layout.n_values(p) for p in range(P))
        deltas = {p: [[rng.normal(scale=1e-3, size=s).astype(np.float32)
                       for s in layout.shapes(p)] for _ in learners] for p in range(P)}
        seq = {lid: 0 for lid in learners}
        tpb = cfg.train.batch_size * cfg.model_config_obj().seq_len

        def frames_for(r: int) -> list[list[list[bytes]]]:
            out = []
            for p in range(P):
                msgs = []
                for m, lid in enumerate(learners):
                    seq[lid] += 1
                    msgs.append(wire.encode(Header(
                        kind=Kind.DELTA, run="bench-syncer", sender=lid, inc=1, seq=seq[lid],
                        frag=p, base=core.frags[p].version + 0, c_steps=24, c_tokens=24 * tpb,
                        new_tokens=24 * tpb, step=24 * (r + 1), codec="int4"),
                        deltas[p][m]))
                out.append(msgs)
            return out

        best_merge = best_decode = best_copy = float("inf")
        for r in range(args.rounds):
            rounds = frames_for(r)
            t0 = time.perf_counter()
            for p, msgs in enumerate(rounds):
                for f in msgs:
                    core.handle(f)
                assert core.merge(p) is not None
            best_merge = min(best_merge, time.perf_counter() - t0)
            t0 = time.perf_counter()
            for msgs in rounds:
                for f in msgs:
                    wire.decode(f, run_id="bench-syncer",
                                expected_shapes=lambda h: layout.shapes(h.frag))
            best_decode = min(best_decode, time.perf_counter() - t0)
            flat = [np.concatenate([t.ravel() for t in deltas[p][m]])
                    for p in range(P) for m in range(len(learners))]
            t0 = time.perf_counter()
            for a in flat:
                a.copy()
            best_copy = min(best_copy, time.perf_counter() - t0)
        assert core.drops == {}, core.drops
        mb = args.learners * total_values * 4 / 1e6
        res = {
            "bench": "syncer", "preset": args.preset, "params": total_values,
            "learners": args.learners, "fragments": P,
            "merge_MBps": round(mb / best_merge, 1),
            "decode_only_MBps": round(mb / best_decode, 1),
            "memcpy_MBps": round(mb / best_copy, 1),
            "merge_over_decode": round(best_decode / best_merge, 3),
            "merge_over_memcpy": round(best_copy / best_merge, 4),
            "versions": [core.frags[p].version for p in range(P)],
        }
        t = Table(title=f"one shard, {args.learners} learners, {total_values:,} params, "
                        f"{P} fragments, int4 up/down, real Redis (best of {args.rounds})")
        t.add_column("pipeline")
        t.add_column("MB/s fp32-equiv", justify="right")
        t.add_column("ratio to merge", justify="right")
        t.add_row("full merge (decode..store)", f"{res['merge_MBps']:,}", "1.00")
        t.add_row("decode only (codec limit)", f"{res['decode_only_MBps']:,}",
                  f"{best_merge / best_decode:.2f}")
        t.add_row("numpy copy (memory limit)", f"{res['memcpy_MBps']:,}",
                  f"{best_merge / best_copy:.2f}")
        Console().print(t)

        # The receive path over real sockets: plain TCP against CURVE (encrypted, keyed).
        recv_rows = []
        sends = [f for msgs in frames_for(args.rounds) for f in msgs]
        direct = min(_handle_direct(core, [f for msgs in frames_for(args.rounds) for f in msgs])
                     for _ in range(args.rounds))
        recv_rows.append(("handle only (no socket)", direct))
        best: dict[str, float] = {}
        keys_dir = Path(tmp) / "keys"
        for name in ["shard-0", *learners]:
            create_keys(keys_dir, name)
        for _ in range(args.rounds):
            for mode in ("plain", "curve", "plain+merge", "curve+merge"):
                batch = [f for msgs in frames_for(args.rounds) for f in msgs]
                dt = _over_sockets(core, batch, keys_dir if "curve" in mode else None,
                                   layout, merge="merge" in mode)
                best[mode] = min(best.get(mode, float("inf")), dt)
        recv_rows += [("PUSH -> PULL -> handle, plain TCP", best["plain"]),
                      ("PUSH -> PULL -> handle, CURVE", best["curve"]),
                      ("... -> handle -> merge -> store, plain TCP", best["plain+merge"]),
                      ("... -> handle -> merge -> store, CURVE", best["curve+merge"])]
        n_mb = len(sends) * total_values * 4 / (P * 1e6)
        t2 = Table(title=f"shard receive path: {len(sends)} int4 deltas, loopback "
                         f"(best of {args.rounds})")
        t2.add_column("path")
        t2.add_column("MB/s fp32-equiv", justify="right")
        t2.add_column("ratio to plain TCP", justify="right")
        for label, dt in recv_rows:
            ref = best["plain+merge"] if "merge" in label else best["plain"]
            t2.add_row(label, f"{n_mb / dt:,.1f}", f"{ref / dt:.3f}")
        Console().print(t2)
        res.update({
            "recv_handle_MBps": round(n_mb / direct, 1),
            "recv_plain_MBps": round(n_mb / best["plain"], 1),
            "recv_curve_MBps": round(n_mb / best["curve"], 1),
            "curve_recv_loss_pct": round((1 - best["plain"] / best["curve"]) * 100, 2),
            "merge_plain_MBps": round(n_mb / best["plain+merge"], 1),
            "merge_curve_MBps": round(n_mb / best["curve+merge"], 1),
            "curve_throughput_loss_pct": round(
                (1 - best["plain+merge"] / best["curve+merge"]) * 100, 2),
        })
        res.update(merge_res)
        print(json.dumps(res))


def _rss_bytes() -> int:
    """Resident set size now, bytes."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize()


class _PeakRSS:
    """Peak RSS growth over a section, sampled every millisecond by a thread."""

    def __init__(self) -> None:
        self.base = self.peak = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.wait(0.001):
            self.peak = max(self.peak, _rss_bytes())

    def __enter__(self) -> _PeakRSS:
        self.base = self.peak = _rss_bytes()
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.peak = max(self.peak, _rss_bytes())

    @property
    def growth(self) -> int:
        return self.peak - self.base


def _merge_only(args: argparse.Namespace) -> dict[str, Any]:
    """The merge alone on one fragment of ``--fragment-mb``: fused against reference."""
    from rich.console import Console
    from rich.table import Table

    from ddiloco.pipeline import codec
    from ddiloco.pipeline.accumulate import unpack
    from ddiloco.pipeline.codec_spec import raw_size
    from ddiloco.workers.syncer.fused import MergeEngine
    from ddiloco.workers.syncer.merge import OuterConfig, OuterOptimizer, merge_fragment

    n_total = int(args.fragment_mb * 1e6 / 4)
    # A few tensors, as a fragment of whole layers: one large, the rest split evenly.
    shapes = [(n_total // 2,), *[(n_total // 8,)] * 4]
    n = sum(s[0] for s in shapes)
    mask = [False] * len(shapes)
    rng = np.random.default_rng(1)
    value = rng.normal(scale=2e-2, size=n).astype(np.float32)
    momentum = np.zeros(n, np.float32)
    residual = np.zeros(n, np.float32)
    deltas = []
    for _ in range(args.learners):
        d = rng.normal(scale=1e-3, size=n).astype(np.float32)
        deltas.append(codec.encode([d], "int4"))
    del d
    split = np.cumsum([s[0] for s in shapes])[:-1]
    weights = [float(m + 1) for m in range(args.learners)]
    outer_cfg = OuterConfig(lr=0.7, momentum=0.9)
    opt = OuterOptimizer(outer_cfg)
    engine = MergeEngine(args.threads)

    def fused() -> bytes:
        packed = [[unpack(p, shapes, "int4")] for p in deltas]
        acc = engine.merge(packed, weights, shapes, mask, "rda")
        raw_d = np.empty(raw_size(n, "int4"), np.uint8)
        raw_b = np.empty(raw_size(n, "int4"), np.uint8)
        args_ = (acc, value, momentum, residual, outer_cfg.lr, outer_cfg.momentum, "int4", 64)
        engine.outer_int(*args_, raw_d, raw_b)
        return codec._compressor(1).compress(raw_b.data)

    def reference() -> bytes:
        ds = [np.split(codec.decode(p, [(n,)], "int4")[0], split) for p in deltas]
        vs, ms = np.split(value, split), np.split(momentum, split)
        g = merge_fragment(ds, weights, mask, "rda")
        target, _mom = opt.step(vs, g, ms)
        diff = [(t - v) + r for t, v, r in zip(target, vs, np.split(residual, split),
                                               strict=True)]
        diff_q = codec.quantize_roundtrip(diff, "int4")
        _new = [v + q for v, q in zip(vs, diff_q, strict=True)]
        return codec.encode(diff_q, "int4")

    fused()  # compiles the kernels
    reference()  # compiles the outer step
    best = {"fused": float("inf"), "reference": float("inf")}
    rss: dict[str, int] = {}
    cpu = {"fused": float("inf"), "reference": float("inf")}
    for name, fn in (("fused", fused), ("reference", reference)):
        for _ in range(args.rounds):
            c0, t0 = time.process_time(), time.perf_counter()
            fn()
            best[name] = min(best[name], time.perf_counter() - t0)
            cpu[name] = min(cpu[name], time.process_time() - c0)
        # one more run for the memory: the sampling thread would otherwise share the timed CPU
        with _PeakRSS() as peak:
            fn()
        rss[name] = peak.growth
    gb = args.learners * n * 4 / 1e9
    threads = {"fused": engine.threads, "reference": 1}
    # The fragment's state (value, momentum, residual) is allocated before the section:
    # the ratio adds it back, so it reads as the shard's peak over the fragment's bytes.
    state = 3 * n * 4
    res = {
        "fragment_mb": round(n * 4 / 1e6, 1),
        "merge_threads": engine.threads,
        "merge_fp32_gbps_per_core": round(gb / best["fused"] / threads["fused"], 3),
        "merge_fp32_gbps_per_core_reference": round(gb / best["reference"], 3),
        "merge_fp32_gbps": round(gb / best["fused"], 3),
        "merge_fp32_gbps_per_cpu_s": round(gb / cpu["fused"], 3),
        "merge_fp32_gbps_per_cpu_s_reference": round(gb / cpu["reference"], 3),
        "merge_speedup_per_core": round(
            best["reference"] * threads["reference"] / (best["fused"] * threads["fused"]), 2),
        "peak_rss_ratio": round((state + rss["fused"]) / (n * 4), 2),
        "peak_rss_ratio_reference": round((state + rss["reference"]) / (n * 4), 2),
    }
    t = Table(title=f"merge only: {args.learners} int4 deltas of one {res['fragment_mb']} MB "
                    f"fragment, RDA, Nesterov, int4 broadcast (best of {args.rounds})")
    t.add_column("path")
    t.add_column("threads", justify="right")
    t.add_column("GB/s fp32-equiv per core", justify="right")
    t.add_column("GB/s per CPU second", justify="right")
    t.add_column("ratio to reference", justify="right")
    t.add_column("peak RSS / fragment fp32", justify="right")
    t.add_row("fused (shard)", str(threads["fused"]), f"{res['merge_fp32_gbps_per_core']}",
              f"{res['merge_fp32_gbps_per_cpu_s']}", f"{res['merge_speedup_per_core']}",
              f"{res['peak_rss_ratio']}")
    t.add_row("reference (pure functions)", "1",
              f"{res['merge_fp32_gbps_per_core_reference']}",
              f"{res['merge_fp32_gbps_per_cpu_s_reference']}", "1.00",
              f"{res['peak_rss_ratio_reference']}")
    Console().print(t)
    engine.close()

    stage_s = _stages(deltas, shapes, weights, value, momentum, residual, outer_cfg, args.rounds)
    res["merge_stage_ms"] = {k: round(v * 1e3, 2) for k, v in stage_s.items()}
    res["merge_stage_gbps"] = {k: round(gb / v, 2) for k, v in stage_s.items() if v > 0}
    total = sum(stage_s.values())
    res["merge_stages_fp32_gbps_per_core"] = round(gb / total, 3)
    t = Table(title=f"fused merge by stage: one thread, CPU time (best of {args.rounds})")
    t.add_column("stage")
    t.add_column("ms", justify="right")
    t.add_column("share", justify="right")
    t.add_column("GB/s fp32-equiv", justify="right")
    for k, v in stage_s.items():
        t.add_row(k, f"{v * 1e3:.1f}", f"{v / total:.0%}", f"{gb / v:.2f}" if v > 0 else "-")
    t.add_row("all stages", f"{total * 1e3:.1f}", "100%", f"{gb / total:.2f}")
    Console().print(t)
    return res


def _stages(deltas: list[bytes], shapes: Sequence[tuple[int, ...]], weights: list[float],
            value: np.ndarray, momentum: np.ndarray, residual: np.ndarray, outer_cfg: Any,
            rounds: int) -> dict[str, float]:
    """CPU seconds of each stage of the fused path on one thread, best of ``rounds``: the
    engine's own steps, called one stage at a time over the whole fragment."""
    from ddiloco.pipeline import accumulate, codec
    from ddiloco.pipeline.codec_spec import raw_size
    from ddiloco.workers.syncer import fused as fz
    from ddiloco.workers.syncer.merge import NORM_FLOOR

    n = value.size
    engine = fz.MergeEngine(1)
    expected = raw_size(n, "int4")
    sizes = [s[0] for s in shapes]
    offsets = np.concatenate([[0], np.cumsum(sizes)])
    items = [(i, int(offsets[i]) + a, int(offsets[i]) + min(a + fz.CHUNK, sizes[i]))
             for i in range(len(sizes)) for a in range(0, sizes[i], fz.CHUNK)]
    total_w = sum(weights)
    best: dict[str, float] = {}

    def clock(name: str, fn: Any, *fn_args: Any) -> Any:
        t0 = time.thread_time()
        out = fn(*fn_args)
        best[name] = min(best.get(name, float("inf")), time.thread_time() - t0)
        return out

    def decompress() -> list[np.ndarray]:
        return [codec.decompress_checked(p, expected, "int4")
                for p in deltas]

    def validate(arrs: list[np.ndarray]) -> list[list[Any]]:
        return [[accumulate.Packed(a, "int4", tuple(shapes), n, 64,
                                   accumulate._validate(a, n, "int4", 64, sizes))]
                for a in arrs]

    def norms(cs: list[list[Any]]) -> np.ndarray:
        sq = np.zeros((len(sizes), len(cs)))
        for k, c in enumerate(cs):
            if c[0].sumsq is not None:  # taken by the validation
                sq[:, k] = c[0].sumsq
            else:
                for i, a, b in items:
                    sq[i, k] += fz._sumsq(c, a, b)
        return np.sqrt(sq)

    def accumulate_all(cs: list[list[Any]], coefs: np.ndarray) -> np.ndarray:
        acc = engine.accumulator(n)
        for i, a, b in items:
            fz._accumulate(acc, cs, coefs[i], a, b, True)
        return acc

    for _ in range(rounds):
        arrs = clock("decompress", decompress)
        cs = clock("validate", validate, arrs)
        coefs = np.array([[w / (total_w * x) if x > NORM_FLOOR else 0.0
                           for w, x in zip(weights, row, strict=True)]
                          for row in clock("rda_norms", norms, cs)], np.float32)
        acc = clock("accumulate", accumulate_all, cs, coefs)
        raw_d = np.empty(expected, np.uint8)
        raw_b = np.empty(expected, np.uint8)
        step = (acc, value.copy(), momentum.copy(), residual.copy(), outer_cfg.lr,
                outer_cfg.momentum, "int4", 64)
        clock("outer_step", engine.outer_int, *step, raw_d, raw_b)
        clock("broadcast_zstd", codec._compressor(1).compress, raw_b.data)
    engine.close()
    return best


def _handle_direct(core: ShardCore, sends: list[list[bytes]]) -> float:
    """Seconds for the shard core to take ``sends`` without sockets (fresh seqs each time)."""
    t0 = time.perf_counter()
    for f in sends:
        core.handle(f)
    dt = time.perf_counter() - t0
    assert not core.drops, core.drops
    for st in core.frags.values():
        core._reset_round(st)
    return dt


def _over_sockets(core: ShardCore, sends: list[list[bytes]], keys_dir: Path | None,
                  layout: Any, merge: bool = False) -> float:
    """Seconds from the first send to the last message handled by the shard core, over a real
    learner PUSH and shard PULL on loopback (CURVE when ``keys_dir`` is given; each learner
    id sends with its own key, as in a run); with ``merge``, until every fragment's round is
    merged and published too (the shard's whole pipeline)."""
    ctx = zmq.Context()
    auth = None
    server_keys = None
    if keys_dir is not None:
        auth = Authenticator(ctx, keys_dir)
        auth.start()
        server_keys = load_keys(keys_dir, "shard-0")
    biggest = max(layout.n_values(p) for p in range(layout.n_fragments))
    socks = ShardSockets(ctx, max_message_bytes(biggest), curve=server_keys)
    senders = sorted({wire.decode_header(f[0]).sender for f in sends})
    pushes = {}
    for lid in senders:
        curve = ClientKeys(load_keys(keys_dir, lid), keys_dir) if keys_dir else None
        pushes[lid] = DeltaPush(ctx, max_message_bytes(biggest), curve)
        pushes[lid].update({0: socks.pull_endpoint})
    by_sender = [(wire.decode_header(f[0]).sender, f) for f in sends]

    def send_all() -> None:
        for lid, f in by_sender:
            while not pushes[lid].send(0, f):
                time.sleep(0.0002)

    # Connections (and CURVE handshakes) are made before the clock starts.
    time.sleep(0.5)
    thread = threading.Thread(target=send_all)
    t0 = time.perf_counter()
    thread.start()
    for _ in range(len(sends)):
        frames = socks.recv(10_000)
        if frames is None:
            raise RuntimeError("a delta did not arrive within 10 s")
        core.handle(frames, socks.last_peer)
    if merge:
        for p in range(layout.n_fragments):
            assert core.merge(p) is not None
    dt = time.perf_counter() - t0
    thread.join()
    assert not core.drops, core.drops
    for st in core.frags.values():
        core._reset_round(st)
    for push in pushes.values():
        push.close()
    socks.close()
    if auth is not None:
        auth.stop()
    ctx.term()
    return dt



if __name__ == "__main__":
    main()
