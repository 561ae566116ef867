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

    python bench/syncer.py [--preset small] [--learners 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import threading
import time
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
from ddiloco.workers.config import load_config
from ddiloco.workers.manifest import build_manifest
from ddiloco.workers.model import init_params
from ddiloco.workers.syncer import ShardCore


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="small")
    ap.add_argument("--learners", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--fragments", type=int, default=12)
    args = ap.parse_args()

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
        print(json.dumps(res))


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
