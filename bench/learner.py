"""Learner-side costs of synchronisation, and the time a killed learner needs to rejoin.

1. Communication overhead: the same cluster (1 syncer shard, M learners, tiny model) run with
   synchronisation on (the defaults: H = 24, int4, CURVE), on over plain TCP
   (``security.curve = false``), and off (H larger than the run, so nothing is ever due and
   nothing adopted); the learners' steady-state mean step time of each, and the ratios. Runs
   alternate (off, plain, on, off, plain, on) and the best of each is kept.
2. Rejoin: in the synchronised cluster, ``kill -9`` one learner and start it again; the time
   from process spawn to its first completed inner step on the newest versions (everything
   included: interpreter, imports, store reads, compilation from the persistent cache), and
   its stages as the learner stamped them (``first_step`` event's ``stages_s``). Workers are
   forked from the fork server (``run.fork_server``, the default); the same rejoins are
   measured again with every worker a process of its own, and with standby learners, in the
   same bench run, each as a ratio.

    python bench/learner.py [--learners 2] [--steps 240] [--reps 2] [--rejoins 1]
    python bench/learner.py --rejoin-only --rejoins 5   # the rejoin alone, median of 5:
                                                        # forked, processes, a standby
    python bench/learner.py --rejoin-only --no-fork-server  # processes of their own only
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ddiloco.store import EmbeddedRedis, RedisStore
from ddiloco.store.connect import connect
from ddiloco.workers.run.config import load_config
from ddiloco.workers.run.launch import LocalCluster, fork_warm, with_run_keys
from ddiloco.workers.run.manifest import init_run


def first_steps(store: RedisStore, learner: str, incarnation: int) -> list[dict[str, Any]]:
    return [e for _, e in store.events(kinds={"first_step"})
            if e["learner"] == learner and e["incarnation"] >= incarnation]


def rejoin_once(cluster: LocalCluster, store: RedisStore, incarnation: int,
                gap_s: float) -> dict[str, Any]:
    """``kill -9`` learner-1 once its incarnation ``incarnation - 1`` has trained ``gap_s``
    seconds, start it again, and time spawn to its first step on the newest versions."""
    deadline = time.monotonic() + 300
    while not first_steps(store, "learner-1", incarnation - 1):
        if time.monotonic() > deadline:
            raise RuntimeError(cluster.log_tail("learner-1"))
        time.sleep(0.2)
    time.sleep(gap_s)
    cluster.kill("learner-1")
    spawn = time.time()
    cluster.start("learner-1")
    while True:
        got = first_steps(store, "learner-1", incarnation)
        if got:
            heads = store.heads(len(store.get_manifest()["layout"]))  # type: ignore[index]
            return {"rejoin_s": round(got[-1]["t"] - spawn, 3),
                    # where the time went: process start, imports, join, store reads, compile
                    "stages_s": got[-1].get("stages_s", {}),
                    "versions_lag": sum((h.version if h else 0) - v for h, v in
                                        zip(heads, got[-1]["versions"], strict=True))}
        if time.monotonic() > deadline:
            raise RuntimeError(cluster.log_tail("learner-1"))
        time.sleep(0.05)


def run_cluster(url: str, run_dir: Path, run_id: str, overrides: dict[str, Any],
                learners: int, rejoins: int = 0, standby: int = 0,
                gap_s: float = 8.0, fork_server: bool = False) -> dict[str, Any]:
    cfg = load_config(None, {**overrides, "run.shards": 1, "run.learners": learners})
    cfg = with_run_keys(cfg, run_dir)
    store = RedisStore(connect(url), run_id)
    init_run(store, cfg, run_id)
    cluster = LocalCluster(url, run_id, run_dir, standby=standby, fork_server=fork_server,
                           fork_warm=fork_warm(cfg))
    cluster.add_syncer(0)
    for m in range(learners):
        cluster.add_learner(m)
    cluster.start_all()
    out: dict[str, Any] = {"rejoins": []}
    try:
        for k in range(rejoins):
            out["rejoins"].append(rejoin_once(cluster, store, k + 2, gap_s))
        out["handovers"] = cluster.handovers
        if not cluster.wait(cluster.names("learner"), timeout_s=600):
            raise RuntimeError("learners did not finish")
        leaves = [e for _, e in store.events(kinds={"leave"})]
        means = [e["step_time_mean_s"] for e in leaves if e.get("step_time_mean_s")]
        if not means:
            raise RuntimeError("no learner reported a step time:\n"
                               + cluster.log_tail("learner-0") + cluster.log_tail("shard-0"))
        out["step_time_s"] = sum(means) / len(means)
        out["deltas_sent"] = sum(e.get("deltas_sent", 0) for e in leaves)
        out["merges"] = len(store.events(kinds={"merge"}))
    finally:
        cluster.stop_all()
        store.flush_run()
    return out


#: the rejoin's stages (:func:`ddiloco.workers.learner.report.stage_durations`), as printed
STAGE_NAMES = {
    "main": "process start to main: interpreter, imports, JAX set-up",
    "joined": "join: manifest, registration, comms thread, CURVE sockets",
    "synced": "sync: task, store reads, checkpoint restore, inner step traced",
    "first_step": "first inner step: compilation (or the cache) and the step",
    "total": "process start to the first step",
}


def median_stages(rejoins: list[dict[str, Any]]) -> dict[str, float]:
    """Each start-up stage's median over ``rejoins`` (a stage a rejoin lacks counts 0)."""
    return {name: round(statistics.median(r["stages_s"].get(name, 0.0) for r in rejoins), 3)
            for name in STAGE_NAMES}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--learners", type=int, default=2)
    ap.add_argument("--steps", type=int, default=240)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--rejoins", type=int, default=1,
                    help="kill -9 and restart learner-1 this many times (one cluster)")
    ap.add_argument("--rejoin-only", action="store_true",
                    help="measure the rejoins only, not the step times")
    ap.add_argument("--gap", type=float, default=8.0,
                    help="seconds a rejoined learner trains before the next kill (a standby "
                    "started at the last handover needs them to warm up)")
    ap.add_argument("--standby", type=int, default=1,
                    help="also measure the rejoins with this many standby learners "
                    "(run.standby_learners), in the same bench run; 0: without only")
    ap.add_argument("--fork-server", action=argparse.BooleanOptionalAction, default=True,
                    help="start every worker from a fork server (run.fork_server, on by "
                    "default): a rejoin skips the interpreter and imports")
    ap.add_argument("--processes-leg", action=argparse.BooleanOptionalAction, default=True,
                    help="with the fork server on, also measure the rejoins with every "
                    "worker a process of its own (run.fork_server = false), in the same "
                    "bench run: the baseline of the fork server's ratio")
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    results: dict[str, list[dict[str, Any]]] = {"off": [], "plain": [], "on": []}
    with tempfile.TemporaryDirectory() as tmp, EmbeddedRedis(Path(tmp) / "redis") as server:
        for rep in range(0 if args.rejoin_only else args.reps):
            for mode in ("off", "plain", "on"):
                overrides: dict[str, Any] = {"train.steps": args.steps}
                if mode == "off":
                    overrides["sync.H"] = 10 * args.steps
                if mode == "plain":
                    overrides["security.curve"] = False
                run_id = f"bench-{mode}-{rep}"
                res = run_cluster(server.url, Path(tmp) / run_id, run_id, overrides,
                                  args.learners, fork_server=args.fork_server)
                results[mode].append(res)
                Console().print(f"rep {rep} sync {mode}: {res}")
        rejoins = run_cluster(server.url, Path(tmp) / "run-rejoin", "bench-rejoin",
                              {"train.steps": args.steps + 200 * args.rejoins}, args.learners,
                              rejoins=args.rejoins, gap_s=args.gap,
                              fork_server=args.fork_server)["rejoins"]
        processes: list[dict[str, Any]] = []
        if args.fork_server and args.processes_leg:
            processes = run_cluster(server.url, Path(tmp) / "run-processes", "bench-processes",
                                    {"train.steps": args.steps + 200 * args.rejoins},
                                    args.learners, rejoins=args.rejoins, gap_s=args.gap,
                                    fork_server=False)["rejoins"]
        warm: list[dict[str, Any]] = []
        if args.standby:
            got = run_cluster(server.url, Path(tmp) / "run-standby", "bench-standby",
                              {"train.steps": args.steps + 200 * args.rejoins},
                              args.learners, rejoins=args.rejoins, standby=args.standby,
                              gap_s=args.gap, fork_server=args.fork_server)
            if got["handovers"] != args.rejoins:
                raise RuntimeError(f"{got['handovers']} of {args.rejoins} rejoins were handed "
                                   "to a standby")
            warm = got["rejoins"]
    for k, r in enumerate(rejoins):
        Console().print(f"rejoin {k + 1}: {r}")
    times = [r["rejoin_s"] for r in rejoins]
    stages = median_stages(rejoins)
    res_json: dict[str, Any] = {
        "bench": "learner", "learners": args.learners, "steps": args.steps,
        "fork_server": args.fork_server,
        "rejoin_s": round(statistics.median(times), 3), "rejoin_s_all": times,
        "rejoin_versions_lag": [r["versions_lag"] for r in rejoins],
        "rejoin_stages_s": stages,
    }
    for k, r in enumerate(processes):
        Console().print(f"rejoin {k + 1}, processes of their own: {r}")
    if processes:
        proc_times = [r["rejoin_s"] for r in processes]
        res_json.update({
            "rejoin_processes_s": round(statistics.median(proc_times), 3),
            "rejoin_processes_s_all": proc_times,
            "rejoin_processes_stages_s": median_stages(processes),
            "rejoin_fork_ratio": round(statistics.median(times)
                                       / statistics.median(proc_times), 3)})
    for k, r in enumerate(warm):
        Console().print(f"rejoin {k + 1} with a standby: {r}")
    if warm:
        warm_times = [r["rejoin_s"] for r in warm]
        res_json.update({
            "standby": args.standby,
            "rejoin_standby_s": round(statistics.median(warm_times), 3),
            "rejoin_standby_s_all": warm_times,
            "rejoin_standby_stages_s": median_stages(warm),
            "rejoin_standby_ratio": round(statistics.median(warm_times)
                                          / statistics.median(times), 3)})
    t = Table(title=f"learner costs: {args.learners} learners + 1 shard, tiny model, "
                    f"best of {args.reps} runs, median of {len(times)} rejoins")
    t.add_column("figure")
    t.add_column("value", justify="right")
    if not args.rejoin_only:
        off = min(r["step_time_s"] for r in results["off"])
        on = min(r["step_time_s"] for r in results["on"])
        plain = min(r["step_time_s"] for r in results["plain"])
        res_json.update({
            "step_time_sync_off_ms": round(off * 1e3, 3),
            "step_time_sync_on_ms": round(on * 1e3, 3),
            "overhead_pct": round((on / off - 1) * 100, 2),
            "step_time_plain_tcp_ms": round(plain * 1e3, 3),
            "curve_overhead_pct": round((on / plain - 1) * 100, 2),
            "deltas_sent": results["on"][-1]["deltas_sent"],
            "merges": results["on"][-1]["merges"]})
        t.add_row("step time, sync off (ms)", f"{off * 1e3:.2f}")
        t.add_row("step time, sync on, plain TCP (ms)", f"{plain * 1e3:.2f}")
        t.add_row("step time, sync on, CURVE (ms)", f"{on * 1e3:.2f}")
        t.add_row("communication overhead (CURVE vs sync off)",
                  f"{res_json['overhead_pct']:+.2f} %")
        t.add_row("CURVE overhead (vs plain TCP)", f"{res_json['curve_overhead_pct']:+.2f} %")
    how = "forked" if args.fork_server else "processes of their own"
    t.add_row(f"kill -9 -> first step on newest versions, {how} (s)",
              f"{res_json['rejoin_s']} (all: {times})")
    for stage, what in STAGE_NAMES.items():
        t.add_row(f"  {what} (s)", f"{stages[stage]:.3f}")
    if processes:
        t.add_row("kill -9 -> first step, processes of their own (s)",
                  f"{res_json['rejoin_processes_s']} (all: {res_json['rejoin_processes_s_all']})")
        for stage, what in STAGE_NAMES.items():
            t.add_row(f"  {what} (s)", f"{res_json['rejoin_processes_stages_s'][stage]:.3f}")
        t.add_row("  forked / processes", f"{res_json['rejoin_fork_ratio']:.3f}x")
    if warm:
        t.add_row(f"kill -9 -> first step, {args.standby} standby learner(s) (s)",
                  f"{res_json['rejoin_standby_s']} (all: {res_json['rejoin_standby_s_all']})")
        for stage, what in STAGE_NAMES.items():
            t.add_row(f"  {what} (s)", f"{res_json['rejoin_standby_stages_s'][stage]:.3f}")
        t.add_row("  with a standby / without", f"{res_json['rejoin_standby_ratio']:.3f}x")
    Console().print(t)
    print(json.dumps(res_json))


if __name__ == "__main__":
    main()
