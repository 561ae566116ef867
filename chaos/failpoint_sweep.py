"""The failpoint sweep: a real shard process fed a fixed sequence of deltas while one store
call fails once, audited against a fault-free shard fed the same deltas (docs/RELIABILITY.md).

For each case the harness starts a real syncer shard (``python -m ddiloco.workers syncer``)
on a real Redis with ``DDILOCO_FAILPOINTS`` set to the case's spec, and plays ``M`` learners
from this process over plain ZeroMQ: every round, each learner sends one delta per fragment
(fixed tensors, seeded by round, learner and fragment) anchored at the version of the previous
round; one frame is sent twice (the shard must drop the copy as ``duplicate``). The next round
starts when every fragment's head moved on. A shard that exits non-zero is restarted without
the failpoints, as a supervisor would.

The audit of a case: every delta merged exactly once or dropped with a named reason (the
event log and the stored versions' metas, :func:`ddiloco.chaos.invariants.check_exactly_once`),
versions consecutive and never reused, every fragment-token sent received and merged or
dropped, and the final fragments bit-identical to the fault-free case's.

``python -m ddiloco.chaos.failpoint_sweep`` runs every case and prints a table and a JSON line.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ddiloco.chaos.invariants import check_exactly_once, check_versions, stored_metas
from ddiloco.pipeline import wire
from ddiloco.pipeline.waiting import poll_until
from ddiloco.pipeline.wire import Header, Kind
from ddiloco.store.connect import connect
from ddiloco.store.failpoints import ENV, PLACES
from ddiloco.store.redis_store import RedisStore
from ddiloco.workers.run.config import load_config
from ddiloco.workers.run.manifest import init_run, manifest_layout, tokens_per_batch

__all__ = ["MERGE_RECEIVE_POINTS", "CaseResult", "Sweep", "cases", "main", "run_case"]

#: The points a shard's merge and receive paths reach in this harness, each swept at every
#: place, with the call that fails: file a delta and record its tokens (the first
#: ``received_total`` and ``note_received``), drop a duplicate (the first ``incr_counter``),
#: publish (the third publish: the first two write the fragments' version 0 at start-up;
#: ``@6``: a later round's), record the merge (the second ``add_event``: the first is
#: ``shard_start``).
MERGE_RECEIVE_POINTS = ("store.publish@3", "store.publish@6", "store.add_event@2",
                        "store.add_event@4", "store.incr_counter@1", "store.note_received@1",
                        "store.note_received@5", "store.received_total@1")
#: Points swept with blobs in an object store (``file://``): the first merge's value object
#: and its version record, the last object before the head moves (the version 0 publishes of
#: the two fragments write objects 1-6: value, momentum and record each).
OBJECT_POINTS = ("objects.put@7", "objects.put@9")
#: Cases on the recovery paths themselves: the settle after an unknown publish, a reload, the
#: store down for several calls in a row, and start-up (the shard exits and is restarted).
COMPOUND = ("store.publish=after-effect@3,store.head=before",
            "store.publish=before@3,store.head=after-effect",
            "store.publish=after-effect@3,store.head=after",
            "store.publish=after@4,store.add_event=before:3@3",
            "store.note_received=before:4@2",
            "store.publish=before@1")

CONFIG = {"model.d_model": 16, "model.n_layers": 1, "model.n_heads": 2, "model.d_ff": 32,
          "model.seq_len": 16, "sync.fragments": 2, "run.shards": 1,
          "run.learners": 2, "sync.min_quorum": 2, "sync.merge_every": 0.0,
          "sync.partial_merge": "full", "train.batch_size": 4, "security.curve": False,
          "run.heartbeat_s": 0.2, "sync.H": 4}


@dataclass
class CaseResult:
    """One case's outcome.

    Attributes:
        spec: the failpoint spec (``""``: fault-free).
        blobs: where the run kept its blobs.
        ok: every check held.
        checks: each check's verdict and evidence.
        fired: whether the armed point fired (from the shard's log).
        restarts: shard restarts the case needed.
        wall_s: seconds the case took.
        digest: a hash of the final fragments' bytes.
    """

    spec: str
    blobs: str
    ok: bool
    checks: dict[str, Any] = field(default_factory=dict)
    fired: bool = False
    restarts: int = 0
    wall_s: float = 0.0
    digest: str = ""


def cases(points: Sequence[str] = MERGE_RECEIVE_POINTS, compound: bool = True) -> list[str]:
    """Every ``point=place:once@nth`` spec of ``points`` (``point@nth``), then the compound
    cases."""
    out = []
    for item in points:
        point, _, nth = item.partition("@")
        out += [f"{point}={place}:once{'@' + nth if nth else ''}" for place in PLACES]
    return out + (list(COMPOUND) if compound else [])


def _point_place(item: str) -> str:
    """``point:place`` of one spec item, as the shard logs a firing."""
    point, _, rest = item.partition("=")
    return f"{point.rpartition('/')[2]}:{rest.split(':')[0].split('@')[0]}"


def _tensors(shapes: list[tuple[int, ...]], r: int, i: int, p: int) -> list[np.ndarray]:
    rng = np.random.default_rng(1000 * r + 10 * i + p)
    return [rng.normal(scale=1e-2, size=s).astype(np.float32) for s in shapes]


@contextmanager
def _shard(url: str, run_id: str, spec: str, log: Path) -> Iterator[dict[str, Any]]:
    env = {**os.environ, "DDILOCO_LOG_LEVEL": "INFO"}
    if spec:
        env[ENV] = spec
    else:
        env.pop(ENV, None)
    cmd = [sys.executable, "-m", "ddiloco.workers", "syncer", "--shard", "0",
           "--redis-url", url, "--run-id", run_id]
    state: dict[str, Any] = {"restarts": 0}

    def start(e: dict[str, str]) -> subprocess.Popen[bytes]:
        with log.open("ab") as out:
            return subprocess.Popen(cmd, env=e, stdout=out, stderr=subprocess.STDOUT)

    state["proc"] = start(env)
    clean = {k: v for k, v in env.items() if k != ENV}

    def supervise() -> None:
        proc = state["proc"]
        if proc.poll() is not None and proc.returncode != 0:
            state["restarts"] += 1
            state["proc"] = start(clean)

    state["supervise"] = supervise
    try:
        yield state
    finally:
        proc = state["proc"]
        if proc.poll() is None:
            proc.terminate()
            try:
                proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def run_case(url: str, run_id: str, spec: str, workdir: Path, *, rounds: int = 4,
             blobs: str = "redis", timeout_s: float = 60.0) -> tuple[CaseResult, bytes]:
    """Run one case; returns its result and the final fragments' bytes.

    Raises:
        TimeoutError: a round did not merge within ``timeout_s`` seconds.
    """
    import zmq

    t0 = time.monotonic()
    workdir.mkdir(parents=True, exist_ok=True)
    store = RedisStore(connect(url), run_id)
    store.flush_run()
    cfg = load_config(None, {**CONFIG, "store.blobs": blobs})
    manifest = init_run(store, cfg, run_id)
    layout = manifest_layout(manifest)
    P, M = layout.n_fragments, cfg.run.learners
    learners = [f"learner-{i}" for i in range(M)]
    incs = {lid: store.register_learner(lid) for lid in learners}
    for lid in learners:
        store.heartbeat_learner(lid, {"step": 0}, 600_000)
    tpb = tokens_per_batch(manifest)
    H = cfg.sync.H
    log = workdir / "shard.log"
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    sent_tokens = 0
    with _shard(url, run_id, spec, log) as shard:
        def started() -> bool:  # announced, and through its start-up (shard_start written)
            shard["supervise"]()
            ep = store.shard_endpoints(0)
            return ep is not None and any(e.get("endpoints", {}).get("pull") == ep["pull"]
                                          for _, e in store.events(kinds={"shard_start"}))

        if not poll_until(started, timeout_s=timeout_s, interval_s=0.05):
            raise TimeoutError(f"{spec or 'fault-free'}: the shard did not start (log: {log})")
        ep = store.shard_endpoints(0)
        assert ep is not None
        push.connect(ep["pull"])
        seq = {lid: 0 for lid in learners}
        for r in range(rounds):
            for i, lid in enumerate(learners):
                for p in range(P):
                    seq[lid] += 1
                    h = Header(kind=Kind.DELTA, run=run_id, sender=lid, inc=incs[lid],
                               seq=seq[lid], frag=p, base=r, c_steps=H, c_tokens=H * tpb,
                               new_tokens=H * tpb, step=H * (r + 1), step_time=0.01,
                               codec=cfg.sync.codec_up)
                    frames = wire.encode(h, _tensors(layout.shapes(p), r, i, p))
                    push.send_multipart(frames)
                    sent_tokens += H * tpb
                    if r == 1 and i == 0 and p == 0:
                        push.send_multipart(frames)  # a copy: dropped as "duplicate"

            def merged(r: int = r) -> bool:
                shard["supervise"]()
                heads = store.heads(P)
                return all(hd is not None and hd.version >= r + 1 for hd in heads)

            if not poll_until(merged, timeout_s=timeout_s, interval_s=0.02):
                raise TimeoutError(f"{spec or 'fault-free'}: round {r} did not merge in "
                                   f"{timeout_s} s (log: {log})")
        shard["proc"].terminate()
        shard["proc"].wait(timeout=30)
        restarts = shard["restarts"]
    push.close(linger=0)
    ctx.term()
    events = store.events()
    heads = {p: (h.version if h is not None else None) for p, h in enumerate(store.heads(P))}
    metas = stored_metas(store, heads, cfg.sync.history)
    checks = [check_versions(events, heads), check_exactly_once(events, metas)]
    evs = [e for _, e in events]
    merged_tokens = sum(int(e.get("tokens", 0)) for e in evs if e["kind"] == "merge")
    dropped = sum(int(e.get("tokens") or 0) for e in evs if e["kind"] == "drop"
                  and e.get("learner") is not None and e.get("reason") != "duplicate")
    received = sum(int(v) for k, v in store.counters("received").items())
    versions_ok = all(v == rounds for v in heads.values())
    fate_ok = merged_tokens + dropped == sent_tokens and received == sent_tokens
    final = b"".join(bytes(b.value) for b in store.get_latest_many(range(P), momentum=True)
                     if b is not None)
    text = log.read_text(errors="replace") if log.exists() else ""
    fired = all(f"failpoint {_point_place(item)} fired" in text
                for item in spec.split(",") if item)
    result = CaseResult(
        spec=spec, blobs=blobs,
        ok=all(c.ok for c in checks) and versions_ok and fate_ok and fired,
        checks={**{c.name: {"ok": c.ok, **c.evidence} for c in checks},
                "rounds": {"ok": versions_ok, "heads": heads},
                "token_fate": {"ok": fate_ok, "sent": sent_tokens, "received": received,
                               "merged": merged_tokens, "dropped": dropped}},
        fired=fired, restarts=restarts, wall_s=round(time.monotonic() - t0, 2),
        digest=hashlib.sha256(final).hexdigest()[:16])
    store.flush_run()
    return result, final


@dataclass
class Sweep:
    """A sweep's results against its fault-free reference."""

    reference: CaseResult
    results: list[CaseResult]
    identical: dict[str, bool]

    @property
    def ok(self) -> bool:
        """Every case passed its audit and ended bit-identical to the reference."""
        return self.reference.ok and all(r.ok and self.identical[r.spec + r.blobs]
                                         for r in self.results)

    def to_json(self) -> dict[str, Any]:
        """``{"ok", "points", "cases", "failed", "double_merges", "results"}``."""
        failed = [r.spec for r in self.results
                  if not (r.ok and self.identical[r.spec + r.blobs])]
        twice = sum(int(r.checks["exactly_once"]["n_merged_twice"]) for r in self.results)
        points = sorted({s.split("=")[0] for r in self.results for s in r.spec.split(",")})
        return {"ok": self.ok, "points": len(points), "cases": len(self.results),
                "failed": failed, "double_merges": twice,
                "results": [{"spec": r.spec, "blobs": r.blobs, "ok": r.ok,
                             "identical": self.identical[r.spec + r.blobs],
                             "restarts": r.restarts, "wall_s": r.wall_s}
                            for r in self.results]}


def sweep(url: str, workdir: Path, specs: Sequence[str], *, blobs: str = "redis",
          rounds: int = 4, progress: Any = None, parallel: int = 1) -> Sweep:
    """Run the fault-free reference, then every spec (``parallel`` cases at a time, each its
    own run and shard process), on the Redis at ``url``."""
    from concurrent.futures import ThreadPoolExecutor

    tag = "file" if blobs != "redis" else "redis"
    ref, ref_bytes = run_case(url, f"sweep-{tag}-ref", "", workdir / "ref", rounds=rounds,
                              blobs=blobs)

    def one(k: int, spec: str) -> tuple[CaseResult, bool]:
        res, final = run_case(url, f"sweep-{tag}-{k}", spec, workdir / f"case-{k}",
                              rounds=rounds, blobs=blobs)
        if progress is not None:
            progress(res, final == ref_bytes)
        return res, final == ref_bytes

    with ThreadPoolExecutor(max_workers=parallel) as pool:
        done = list(pool.map(one, range(len(specs)), specs))
    return Sweep(ref, [r for r, _ in done], {r.spec + r.blobs: same for r, same in done})


def main(argv: Sequence[str] | None = None) -> int:
    """Run the whole sweep (every merge and receive point at every place, the compound cases,
    the object-store points with ``file://`` blobs) on a private Redis; print a table and a
    JSON line. Exit 0 when every case passed."""
    import argparse
    import tempfile

    from ddiloco.store.embedded import EmbeddedRedis

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="also write the JSON here")
    ap.add_argument("--parallel", type=int, default=1, help="cases at a time")
    args = ap.parse_args(argv)
    with tempfile.TemporaryDirectory(prefix="ddiloco-sweep-") as tmp, \
            EmbeddedRedis(Path(tmp) / "redis") as server:

        def show(res: CaseResult, same: bool) -> None:
            print(f"{res.spec:<58} {res.blobs[:6]:<6} {'ok' if res.ok else 'FAIL':<4} "
                  f"{'same' if same else 'DIFF':<4} {res.restarts:>2} {res.wall_s:>6.1f}s",
                  flush=True)

        print(f"{'case':<58} {'blobs':<6} {'audit':<4} {'bits':<4} rs   wall")
        main_sweep = sweep(server.url, Path(tmp) / "redis-blobs", cases(), progress=show,
                           parallel=args.parallel)
        blob_dir = Path(tmp) / "objects"
        obj_sweep = sweep(server.url, Path(tmp) / "file-blobs",
                          [*cases(OBJECT_POINTS, compound=False),
                           "store.publish=after-effect@3"],
                          blobs=f"file://{blob_dir}", progress=show, parallel=args.parallel)
    out = {"redis": main_sweep.to_json(), "file": obj_sweep.to_json(),
           "ok": main_sweep.ok and obj_sweep.ok}
    line = json.dumps(out, sort_keys=True)
    print(line)
    if args.json:
        args.json.write_text(line + "\n")
    return 0 if out["ok"] else 1


if __name__ == "__main__":
    raise SystemExit(main())
