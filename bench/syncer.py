"""Syncer shard merge throughput: MB/s of fp32-equivalent fragment data per core.

One shard owns every fragment of the model; 8 simulated learners each send an int4 delta of
every fragment; the shard decodes, dequantizes, weights, merges (RDA), applies the outer
Nesterov step, quantizes the broadcast, and publishes to a real Redis (embedded). Throughput is
``learners * fragment_bytes_fp32 / time``. Side by side in the same process, as the reference
limits: decoding the same messages alone (the codec's limit) and a numpy copy of the same bytes
(memory's limit).

    python bench/syncer.py [--preset small] [--learners 8] [--rounds 3]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from pipeline import wire
from pipeline.wire import Header, Kind
from store import EmbeddedRedis, RedisStore
from store.connect import connect
from workers.config import load_config
from workers.model import init_params
from workers.runtime import build_manifest
from workers.syncer import ShardCore


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

        def frames_for(r: int) -> list[list[list[bytes]]]:
            out = []
            for p in range(P):
                msgs = []
                for m, lid in enumerate(learners):
                    seq[lid] += 1
                    msgs.append(wire.encode(Header(
                        kind=Kind.DELTA, run="bench-syncer", sender=lid, inc=1, seq=seq[lid],
                        frag=p, base=core.frags[p].version + 0, c_steps=24, c_tokens=24 * 2048,
                        new_tokens=24 * 2048, codec="int4"), deltas[p][m]))
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
        print(json.dumps(res))



if __name__ == "__main__":
    main()
