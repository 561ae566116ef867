"""``ddiloco chaos run``: a local cluster under a seeded fault script, for both modes.

Starts the embedded Redis (``appendfsync always``: a killed Redis loses no acknowledged
version), then for each mode (Decoupled DiLoCo, and with ``--baseline dp`` the data-parallel
baseline under the same fault schedule) starts the shards, the evaluator and M learners, waits
until every learner trains, applies the script's faults at their times, restarts what it killed
after its down time, and after ``duration_s`` stops everything cleanly. Every fault, restart and
detection is an event in the run's stream. Afterwards the pure functions of
:mod:`chaos.accounting` compute goodput, token fate, downtime and recovery times, and
:mod:`chaos.invariants` audits the stream and the store. ``OUT/chaos.json`` and
``OUT/chaos.png`` hold the result; a failed invariant fails the run (after the report is written).

Data-parallel has no elasticity: a killed learner or shard fails the whole job (every DP worker
is killed), which restarts when the failed part is back and resumes from the last checkpoint in
the store (``run.dp_publish_every`` steps). Pauses, slowdowns and partitions need no special
case: a synchronous job waits for its slowest member by construction.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import time
import uuid
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddiloco.chaos.faults import ChaosError, Injector
from ddiloco.chaos.script import FaultAction, FaultKind, describe, expand, load_script
from ddiloco.pipeline.errors import DDilocoError, StoreUnavailable
from ddiloco.workers.config import Config
from ddiloco.workers.launch import LocalCluster, with_redis_users, with_run_keys

log = logging.getLogger(__name__)

#: a chaos run's learners train until the script ends, not to a step budget
_NO_BUDGET = 10**9


@dataclass
class _Pending:
    """Events observed while the store may be down, written when it answers again."""

    events: list[tuple[str, dict[str, Any], float]] = field(default_factory=list)

    def add(self, kind: str, fields: dict[str, Any]) -> None:
        # A write whose reply was lost (Redis paused mid-command) is retried and may land
        # twice: readers keep the first event of each uid (:func:`dedupe`).
        self.events.append((kind, {**fields, "uid": uuid.uuid4().hex[:16]}, time.time()))

    def flush(self, store: Any) -> None:
        while self.events:
            kind, fields, t = self.events[0]
            try:
                store.add_event(kind, fields, t=t)
            except StoreUnavailable:
                return
            self.events.pop(0)


@dataclass
class _LiveStats:
    """Running totals for the live view, read incrementally from the event stream."""

    t0: float
    cursor: str = "-"
    merged_ft: int = 0
    faults: int = 0

    def update(self, store: Any, pending: _Pending) -> None:
        """Read new events; record the stored digests of every version a (re)joining learner
        adopted while the store still keeps them (the audit compares them afterwards)."""
        from ddiloco.chaos.invariants import adoption_digests

        adopted = []
        for eid, e in store.events(self.cursor):
            self.cursor = f"({eid}"
            if e["kind"] == "merge" and e["t"] >= self.t0:
                self.merged_ft += sum(int(c["tokens"]) for c in e.get("contributions", []))
            elif e["kind"] == "fault" and e.get("phase") == "inject":
                self.faults += 1
            elif e["kind"] == "adopted":
                adopted.append(e)
        if adopted:
            digests = adoption_digests(adopted, store)
            pending.add("stored_digests", {"pairs": [[p, v, d] for (p, v), d in
                                                     sorted(digests.items())]})


@dataclass
class ModeRun:
    """What one mode's chaos run leaves for the accounting."""

    mode: str
    run_id: str
    t0: float
    t_end: float
    restarts: dict[str, int]


def _schedule(actions: list[FaultAction],
              duration_s: float) -> list[tuple[float, str, FaultAction]]:
    """(time, "inject"|"heal", action), time-sorted; heals after the end are left out."""
    out: list[tuple[float, str, FaultAction]] = []
    for a in actions:
        if a.at_s >= duration_s:
            continue
        out.append((a.at_s, "inject", a))
        end = a.end_s
        if end is not None and end < duration_s:
            out.append((end, "heal", a))
    return sorted(out, key=lambda x: (x[0], x[1] != "heal"))


def _wait_training(store: Any, cluster: LocalCluster, n: int, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        for name in cluster.workers:
            w = cluster.workers[name]
            if w.proc is not None and not w.alive:
                raise DDilocoError(f"{name} exited during start-up:\n{cluster.log_tail(name)}")
        started = {e["learner"] for _, e in store.events(kinds={"first_step"})}
        if len(started) >= n:
            return
        time.sleep(0.25)
    raise DDilocoError(f"learners did not all start training within {timeout_s:.0f} s")


def run_mode(cfg: Config, mode: str, store: Any, redis: Any, redis_url: str, run_id: str,
             run_dir: Path, actions: list[FaultAction], duration_s: float,
             live: bool, learner_cores: float | None = None,
             placement: dict[str, tuple[list[str], str | None]] | None = None,
             wan: Any = None) -> ModeRun:
    """Run one mode under the fault schedule; returns the times the accounting needs.

    ``placement``: where each worker runs (emulated regions, see
    :meth:`workers.launch.LocalCluster.command`); None: all on this machine's loopback.
    ``wan``: the :class:`chaos.regions.Regions` the workers run in (partition and congest
    faults act on its region pairs), or None.

    In DiLoCo mode, a learner that was alive and is under no fault, yet has no live heartbeat
    entry in the store, gets a ``looked_dead`` event (once per episode): the control plane
    failed a healthy learner, e.g. on a saturated link.

    Raises:
        ChaosError: a fault cannot be injected on this machine.
        DDilocoError: a worker failed to start.
    """
    from rich.console import Console
    from rich.live import Live

    from ddiloco.workers.live import live_table
    from ddiloco.workers.manifest import init_run

    cfg = with_run_keys(cfg, run_dir)
    manifest = init_run(store, cfg, run_id)
    n_frag = len(manifest["layout"])
    cluster = LocalCluster.for_run(cfg, redis_url, run_id, run_dir, max_steps=_NO_BUDGET,
                                   redis_urls=with_redis_users(store.client, redis_url, cfg,
                                                               run_id))
    cluster.placement = dict(placement or {})
    learners = cluster.names("learner")
    shards = cluster.names("shard")
    redis_port = int(redis_url.rsplit(":", 1)[1].split("/")[0]) if redis is not None else None
    injector = Injector(cluster, redis, store, actions, redis_port, learner_cores, wan=wan,
                        region_of=wan.topology.workers if wan is not None else None)
    injector.assign_gids()
    pending = _Pending()
    #: workers the runner keeps down on purpose (killed, waiting for their restart)
    down: set[str] = set()
    restarts: dict[str, int] = {}
    #: fault id -> (target, "learner"|"shard", the shard's lease owner when it was hit)
    watch: dict[str, tuple[str, str, str | None]] = {}
    owners: dict[str, str] = {}  # shard -> current lease owner, as last read
    health = _Health(wan.topology.workers if wan is not None else None)
    try:
        cluster.start_all()
        injector.limit_all()
        cluster.write_commands(run_dir / "commands.sh")
        _wait_training(store, cluster, len(learners), timeout_s=300)
        t0 = time.time()
        m0 = time.monotonic()
        store.add_event("chaos_start", {"mode": mode, "duration_s": duration_s}, t=t0)
        plan = _schedule(actions, duration_s)
        stats = _LiveStats(t0)
        console = Console()
        with Live(console=console, refresh_per_second=2, auto_refresh=False) as view:
            last_view = last_stats = last_detect = 0.0
            while True:
                now = time.monotonic() - m0
                if now >= duration_s:
                    break
                _play_due(mode, now, plan, injector, cluster, learners, shards, down, pending,
                          watch, owners, health)
                _supervise(cluster, down, restarts, pending)
                if now - last_detect > 0.25:
                    last_detect = now
                    _watch_health(mode, store, watch, pending, owners, health, learners, down)
                pending.flush(store)
                if now - last_stats > 0.5:
                    last_stats = now
                    try:
                        stats.update(store, pending)
                    except StoreUnavailable:
                        pass
                if live and now - last_view > 1.0:
                    last_view = now
                    try:
                        table = live_table(store, cluster, f"{mode} chaos", m0, n_frag)
                        table.caption = (table.caption or "") + (
                            f"\nfaults injected {stats.faults}, "
                            f"{sum(1 for p in plan if p[1] == 'inject')} to come; "
                            f"down now: {sorted(down) or '-'}; merged tokens/s in the window "
                            f"{stats.merged_ft / n_frag / max(now, 1e-9):,.0f}")
                        view.update(table, refresh=True)
                    except StoreUnavailable:
                        pass
                time.sleep(0.05)
        t_end = time.time()
        injector.resume_all()
        _wait_store(store, pending)
        _record_recoveries(store, t0)
        store.add_event("chaos_end", {"mode": mode}, t=t_end)
        # Learners drain (send substantial unsent work), then the final evaluation.
        for name in learners:
            if cluster.workers[name].alive:
                cluster.signal(name, 15)
        cluster.wait(learners, timeout_s=60)
        for name in shards:  # a stopping shard merges the rounds the drains left open
            if cluster.workers[name].alive:
                cluster.stop(name, timeout_s=30)
        cluster.stop("evaluator", timeout_s=120)
    finally:
        injector.resume_all()
        cluster.stop_all()
        injector.close()
    _wait_store(store, pending)
    return ModeRun(mode, run_id, t0, t_end, restarts)


def _play_due(mode: str, now: float, plan: list[tuple[float, str, FaultAction]],
              injector: Any, cluster: Any, learners: list[str], shards: list[str],
              down: set[str], pending: _Pending, watch: dict[str, tuple[str, str, str | None]],
              owners: dict[str, str], health: _Health) -> None:
    """Inject or heal every planned fault whose time (seconds into the window) has come.
    ``injector``: a :class:`chaos.faults.Injector` or :class:`chaos.compose.ComposeInjector`."""
    while plan and plan[0][0] <= now:
        _, phase, a = plan.pop(0)
        _apply(mode, phase, a, injector, cluster, learners, shards, down, pending, watch, owners)
        health.on_fault(phase, a, learners)


def _watch_health(mode: str, store: Any, watch: dict[str, tuple[str, str, str | None]],
                  pending: _Pending, owners: dict[str, str], health: _Health,
                  learners: list[str], down: set[str]) -> None:
    """Record detections of watched faults and, in DiLoCo mode, healthy learners that look
    dead."""
    live_now = _detect(store, watch, pending, owners)
    if live_now is not None and mode == "diloco":
        health.check(live_now, learners, down, pending)


def _apply(mode: str, phase: str, a: FaultAction, injector: Injector, cluster: LocalCluster,
           learners: list[str], shards: list[str], down: set[str], pending: _Pending,
           watch: dict[str, tuple[str, str, str | None]], owners: dict[str, str]) -> None:
    fields: dict[str, Any] = {"id": a.id, "fault": a.kind.value, "target": a.target,
                              "phase": phase if not (phase == "heal" and a.kind is FaultKind.KILL)
                              else "restart",
                              "duration_s": a.duration_s, "mode": mode}
    if a.factor is not None:
        fields["factor"] = a.factor
    if a.peer is not None:
        fields["peer"] = a.peer
    gang = (mode == "dp" and a.kind is FaultKind.KILL and a.target != "redis")
    if phase == "inject":
        log.info("inject %s", a.id)
        pending.add("fault", fields)
        if gang:
            # No elasticity: the failure of one member fails the synchronous job.
            for name in [*learners, *shards]:
                cluster.kill(name)
                down.add(name)
            pending.add("gang_failure", {"id": a.id, "killed": [*learners, *shards]})
        else:
            if a.kind is FaultKind.KILL and a.target != "redis":
                down.add(a.target)
            injector.inject(a)
        if a.kind in (FaultKind.KILL, FaultKind.PAUSE) and a.target != "redis":
            watch[a.id] = (a.target, "shard" if a.target.startswith("shard") else "learner",
                           owners.get(a.target))
        elif a.target == "redis":
            pending.add("detected", {"id": a.id, "target": a.target, "how": "store requests "
                                     "fail at once"})
    else:
        log.info("heal %s", a.id)
        if gang:
            for name in [*shards, *learners]:
                down.discard(name)
                injector.restart(name)
            pending.add("gang_restart", {"id": a.id})
        else:
            down.discard(a.target)
            injector.heal(a)
        pending.add("fault", fields)
        if a.kind is not FaultKind.KILL:
            # A restarted worker is still noticed as gone when its old lease or TTL entry
            # expires; a resumed one that was never noticed is not.
            watch.pop(a.id, None)


def _record_recoveries(store: Any, t0: float) -> None:
    """Write each observed recovery as a ``recovered`` event at the time it happened."""
    from ddiloco.chaos.recoveries import recoveries

    events = dedupe(sorted((e for _, e in store.events()), key=lambda e: e["t"]))
    for r in recoveries(events):
        if r.recover_s is not None and r.injected_t >= t0:
            store.add_event("recovered", {"id": r.id, "target": r.target, "fault": r.kind,
                                          "recover_s": r.recover_s, "detect_s": r.detect_s},
                            t=r.injected_t + r.recover_s)


def _supervise(cluster: LocalCluster, down: set[str], restarts: dict[str, int],
               pending: _Pending) -> None:
    """Restart a worker that exited on its own (e.g. a shard that lost its lease), as a
    process supervisor would; killed workers stay down until their fault heals."""
    for name, w in cluster.workers.items():
        if name in down or w.proc is None or w.alive:
            continue
        restarts[name] = restarts.get(name, 0) + 1
        pending.add("worker_restart", {"worker": name, "exit_code": w.proc.returncode})
        cluster.start(name)


class _Health:
    """Tells a healthy learner that looks dead from one a fault rightly took down."""

    _EXCUSED = (FaultKind.KILL, FaultKind.PAUSE, FaultKind.PARTITION)

    def __init__(self, region_of: dict[str, str] | None = None) -> None:
        #: with emulated regions, a partition cuts every worker of the target's region
        self.region_of = dict(region_of or {})
        self.faulted: dict[str, int] = {}
        self.seen: set[str] = set()  # alive since its last fault ended
        self.dead: set[str] = set()  # looking dead now (reported once)

    def on_fault(self, phase: str, a: FaultAction, learners: list[str]) -> None:
        if a.kind not in self._EXCUSED and a.target != "redis":
            return
        hit = learners if a.target == "redis" else [a.target]
        region = self.region_of.get(a.target)
        if a.kind is FaultKind.PARTITION and region is not None:
            hit = [n for n in learners if n == a.target or self.region_of.get(n) == region]
        for name in hit:
            if phase == "inject":
                self.faulted[name] = self.faulted.get(name, 0) + 1
            else:
                self.faulted[name] = max(0, self.faulted.get(name, 0) - 1)
                self.seen.discard(name)  # must come back before it can look dead again

    def check(self, live: set[str], learners: list[str], down: set[str],
              pending: _Pending) -> None:
        for name in learners:
            if name in live:
                self.seen.add(name)
                self.dead.discard(name)
            elif (name in self.seen and name not in down and not self.faulted.get(name)
                  and name not in self.dead):
                self.dead.add(name)
                pending.add("looked_dead", {"learner": name})


def _detect(store: Any, watch: dict[str, tuple[str, str, str | None]], pending: _Pending,
            owners: dict[str, str]) -> set[str] | None:
    """Emit ``detected`` when the store notices a fault: the learner's TTL entry expired, or
    the shard's lease expired (its announcement vanished or a new owner holds it). Returns the
    live learners (None when the store cannot be read)."""
    try:
        live = set(store.live_learners())
        announced = {f"shard-{k}": str(v.get("owner")) for k, v in store.shards().items()}
    except StoreUnavailable:
        return None
    owners.clear()
    owners.update(announced)
    for fid, (target, what, owner) in list(watch.items()):
        if what == "learner":
            gone = target not in live
        else:
            gone = target not in announced or announced[target] != owner
        if gone:
            pending.add("detected", {"id": fid, "target": target})
            del watch[fid]
    return live


def _wait_store(store: Any, pending: _Pending, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        pending.flush(store)
        if not pending.events:
            return
        time.sleep(0.2)


# ------------------------------------------------------------------------------------------
# Accounting
# ------------------------------------------------------------------------------------------


def effective_fates(records: list[dict[str, Any]], mode: str,
                    final_resume_step: int) -> list[dict[str, Any]]:
    """Fate records for :mod:`chaos.accounting`: per incarnation, the latest consistent
    snapshot among its heartbeat record and the send-time snapshots shards received.

    An incarnation that did not drain was killed. DP: a killed incarnation's committed work
    ends where the job resumed (the next incarnation's first step).
    """
    out = []
    for rec in records:
        cands: list[tuple[int, ...]] = []
        if "processed" in rec:
            cands.append((int(rec["processed"]), int(rec["sent"]),
                          int(rec["discarded"]["overwritten"]), int(rec["discarded"]["drain"])))
        cands += [tuple(int(x) for x in w) for w in rec.get("wire", [])]
        best = max(cands) if cands else (0, 0, 0, 0)
        out.append({
            "learner": rec["learner"], "incarnation": int(rec["incarnation"]),
            "ended": "drained" if rec.get("ended") == "drained" else "killed",
            "processed": best[0], "sent": best[1],
            "discarded": {"overwritten": best[2], "drain": best[3]},
            "start_step": int(rec.get("start_step", 0)), "step": int(rec.get("step", 0)),
            "committed_step": None, "step_time_mean_s": rec.get("step_time_mean_s"),
        })
    if mode == "dp":
        by_learner: dict[str, list[dict[str, Any]]] = {}
        for f in out:
            by_learner.setdefault(f["learner"], []).append(f)
        for incs in by_learner.values():
            incs.sort(key=lambda f: f["incarnation"])
            for i, f in enumerate(incs):
                if f["ended"] == "drained":
                    f["committed_step"] = f["step"]
                elif i + 1 < len(incs):
                    f["committed_step"] = max(f["start_step"], incs[i + 1]["start_step"])
                else:
                    f["committed_step"] = max(f["start_step"], final_resume_step)
    return out


def _fates_and_fate(store: Any, events: list[dict[str, Any]]) -> tuple[
        list[dict[str, Any]], Any]:
    """The learner incarnations' effective fate records and the run's token fate
    (:class:`chaos.accounting.TokenFate`), from the store and the run's ``events``."""
    from ddiloco.chaos import accounting as acc
    from ddiloco.workers.blobs import dp_step_of
    from ddiloco.workers.manifest import manifest_layout, tokens_per_batch

    manifest = store.get_manifest()
    P = manifest_layout(manifest).n_fragments
    records = store.fate_records()
    heads = store.get_latest_many(list(range(P)))
    final_resume = min((dp_step_of(b.meta) if b is not None else -1) for b in heads) + 1
    fates = effective_fates(records, manifest["mode"], final_resume)
    if manifest["mode"] == "dp":
        return fates, acc.dp_token_fate(fates, tokens_per_batch(manifest), P)
    received = {(r["learner"], int(r["incarnation"])): int(r.get("received", 0))
                for r in records}
    return fates, acc.token_fate(fates, [e for e in events if e["kind"] == "merge"],
                                 [e for e in events if e["kind"] == "drop"], received, P)


def store_token_fate(store: Any) -> Any:
    """The token fate (:class:`chaos.accounting.TokenFate`) of a finished run in ``store``."""
    return _fates_and_fate(store, [e for _, e in store.events(kinds={"merge", "drop"})])[1]


def mode_block(store: Any, run: ModeRun, cfg: Config,
               ref_step_s: float | None = None) -> dict[str, Any]:
    """Goodput, token fate, downtime, recoveries and the audit of one mode's chaos run.

    Args:
        ref_step_s: the mode's fault-free step time (from a reference run); None: the median
            over this run's learner incarnations.
    """
    from ddiloco.chaos import accounting as acc
    from ddiloco.chaos import invariants as inv
    from ddiloco.chaos import recoveries as rec
    from ddiloco.workers.manifest import manifest_layout, tokens_per_batch

    manifest = store.get_manifest()
    P = manifest_layout(manifest).n_fragments
    events = dedupe(sorted((e for _, e in store.events()), key=lambda e: e["t"]))
    merges = [e for e in events if e["kind"] == "merge"]
    heads_blobs = store.get_latest_many(list(range(P)))
    fates, fate = _fates_and_fate(store, events)
    # One learner step's tokens, from the run's task (accumulated micro-batches included).
    tokens_per_step = tokens_per_batch(manifest) * cfg.train.accumulate
    wall_s = run.t_end - run.t0
    step_means = [f["step_time_mean_s"] for f in fates if f["step_time_mean_s"]]
    own_step_s = statistics.median(step_means) if step_means else None
    step_source = "reference" if ref_step_s else ("own" if own_step_s else None)
    ref_step_s = ref_step_s or own_step_s
    # Goodput counts tokens merged during the scripted window: learner-time after t0.
    merged_window = _merged_in_window(run.mode, merges, fates, run, tokens_per_step, P)
    gp = (acc.goodput(merged_window, P, tokens_per_step, ref_step_s, cfg.run.learners, wall_s)
          if ref_step_s else None)
    window_merges = [m["t"] for m in merges if run.t0 <= m["t"] <= run.t_end]
    downtime, d_start, d_end = acc.global_downtime(window_merges, run.t0, run.t_end)
    recs = rec.recoveries(events)
    down = {e["id"]: e.get("duration_s") for e in events
            if e["kind"] == "fault" and e.get("phase") == "inject"}
    evals = [e for e in events if e["kind"] == "eval"]
    heads = {p: (b.version if b is not None else None) for p, b in enumerate(heads_blobs)}
    # Digests read during the run first (old versions leave the store), then what is left.
    stored: dict[tuple[int, int], str | None] = inv.adoption_digests(events, store)
    for e in events:
        if e["kind"] == "stored_digests":
            for p, v, d in e["pairs"]:
                if d is not None:
                    stored[(int(p), int(v))] = d
    checks = [inv.check_versions(events, heads), inv.check_exactly_once(events),
              inv.check_token_fate(fate), inv.check_adoptions(events, stored),
              inv.check_final_store(store, P), inv.check_no_nan(events, store, P)]
    audit = inv.audit(checks)
    versions: dict[str, list[list[float]]] = {}
    for m in merges:
        versions.setdefault(str(m["fragment"]), []).append(
            [round(m["t"] - run.t0, 3), m["version"]])
    faults = [{"at_s": round(e["t"] - run.t0, 3), "kind": e["fault"], "target": e["target"]}
              for e in events if e["kind"] == "fault" and e.get("phase") == "inject"]
    return {
        "mode": run.mode,
        "run_id": run.run_id,
        "learners": cfg.run.learners,
        "wall_s": round(wall_s, 2),
        "ref_step_s": ref_step_s,
        "step_time_source": step_source,
        "own_step_s": own_step_s,
        "tokens_per_step": tokens_per_step,
        "goodput": round(gp, 4) if gp is not None else None,
        "merged_tokens_in_window": merged_window / P,
        "tokens_per_s": round(merged_window / P / wall_s, 1) if wall_s > 0 else None,
        "token_fate": fate.to_json(),
        "global_downtime_s": round(downtime, 3),
        "downtime_interval_s": [round(d_start - run.t0, 3), round(d_end - run.t0, 3)],
        "recovery_s": rec.percentile_summary([r.recover_s for r in recs
                                              if r.recover_s is not None]),
        # For kills, recovery less the scripted down time: how long the restarted worker took
        # to take part again.
        "rejoin_s": rec.percentile_summary([
            r.recover_s - (down.get(r.id) or 0.0) for r in recs
            if r.recover_s is not None and r.kind == "kill"]),
        "availability": _availability(gp, fate),
        "detect_s": rec.percentile_summary([r.detect_s for r in recs
                                            if r.detect_s is not None]),
        "recoveries": [r.__dict__ for r in recs],
        "faults_injected": rec.fault_counts(events),
        "worker_restarts": run.restarts,
        # healthy learners whose heartbeat entry lapsed (DiLoCo mode): control-plane failures
        "looked_dead": [{"at_s": round(e["t"] - run.t0, 3), "learner": e["learner"]}
                        for e in events if e["kind"] == "looked_dead"],
        "final_val_loss": evals[-1]["loss"] if evals else None,
        "val_loss": [[round(e["t"] - run.t0, 3), e["loss"]] for e in evals],
        "merges_per_fragment": {str(k): v for k, v in rec.merges_per_fragment(merges).items()},
        "participation": rec.participation(merges),
        "timeline": _with_gang_failures(rec.timeline(events, run.t0), events, run),
        "faults": faults,
        "versions": versions,
        "invariants": audit,
    }


def _availability(goodput: float | None, fate: Any) -> float | None:
    """Goodput counting every token that was not lost to a fault (merged or discarded by the
    algorithm, e.g. overwritten): the share of learner-time the faults left usable. This is
    what :mod:`chaos.simulator` models; goodput also charges the algorithm's discards."""
    if goodput is None or fate.merged <= 0:
        return None
    return round(goodput * (fate.merged + sum(fate.discarded.values())) / fate.merged, 4)


def dedupe(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop repeated runner events (same ``uid``), keeping the first."""
    seen: set[str] = set()
    out = []
    for e in events:
        uid = e.get("uid")
        if uid is not None:
            if uid in seen:
                continue
            seen.add(uid)
        out.append(e)
    return out


def _with_gang_failures(tl: dict[str, list[Any]], events: list[dict[str, Any]],
                        run: ModeRun) -> dict[str, list[Any]]:
    """DP: a gang failure takes every worker down until the job restarts."""
    restarts = {e["id"]: e["t"] for e in events if e["kind"] == "gang_restart"}
    for e in events:
        if e["kind"] != "gang_failure":
            continue
        end = restarts.get(e["id"], run.t_end)
        for name in e["killed"]:
            lane = tl.setdefault(name, [])
            interval = (round(e["t"] - run.t0, 3), round(end - run.t0, 3), "down")
            if interval not in lane:
                lane.append(interval)
    return tl


def _merged_in_window(mode: str, merges: list[dict[str, Any]], fates: list[dict[str, Any]],
                      run: ModeRun, tokens_per_step: int, P: int) -> int:
    """Fragment-tokens that entered the model between the start and the end of the script."""
    if mode == "dp":
        # Committed DP steps: the final common checkpoint minus the step where the window
        # opened; a data-parallel step of M learners merges M batches into every fragment.
        first = [m for m in merges if m["t"] >= run.t0 and "dp_step" in m]
        last = [m for m in merges if m["t"] <= run.t_end and "dp_step" in m]
        if not last:
            return 0
        start = min((m["dp_step"] for m in first), default=0)
        by_frag: dict[int, int] = {}
        for m in last:
            by_frag[m["fragment"]] = max(by_frag.get(m["fragment"], -1), m["dp_step"])
        end = min(by_frag.values()) if len(by_frag) == P else max(by_frag.values())
        n_learners = len({f["learner"] for f in fates})
        return max(0, end - start) * tokens_per_step * P * n_learners
    total = 0
    for m in merges:
        if run.t0 <= m["t"] <= run.t_end:
            total += sum(int(c["tokens"]) for c in m.get("contributions", []))
    return total


def run_chaos(cfg: Config, script_path: Path, out: Path, *, baseline: str | None = None,
              seed: int | None = None, live: bool = True, reference: bool = False,
              isolate: bool = False, regions: Path | None = None) -> dict[str, Any]:
    """The chaos job; returns the report (also ``out/chaos.json`` and ``out/chaos.png``).

    ``isolate`` limits each learner to cores / M of this machine's cores (cgroup CPU quota), so
    learners sharing cores do not speed up while others are down. ``regions``: a topology file;
    every worker and Redis run in their emulated regions (:mod:`chaos.regions`).

    Raises:
        ScriptError: the script is invalid. ChaosError: a fault cannot be injected here.
        InvariantViolation: the audit failed (the report is written first).
    """
    from ddiloco.store.connect import connect
    from ddiloco.store.embedded import EmbeddedRedis
    from ddiloco.store.redis_store import RedisStore
    from ddiloco.workers.data import load_documents

    script = load_script(script_path)
    actions = expand(script, cfg.run.learners, cfg.run.shards, seed)
    load_documents([Path(p) for p in cfg.data.corpus] or None)
    out.mkdir(parents=True, exist_ok=True)
    run_id = cfg.run.run_id or f"chaos-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:4]}"
    report: dict[str, Any] = {
        "script": {"name": script.name, "seed": script.seed if seed is None else seed,
                   "duration_s": script.duration_s, "path": str(script_path)},
        "actions": [a.to_json() for a in actions],
        "faults_planned": describe(actions),
        "config": cfg.model_dump(mode="json"),
        "modes": {},
    }
    learner_cores = None
    if isolate:
        cores = len(os.sched_getaffinity(0))
        learner_cores = min(1.0, cores / cfg.run.learners)
        report["learner_cores"] = learner_cores
    modes = [("diloco", run_id)]
    if baseline == "dp":
        modes.append(("dp", run_id + "-dp"))
    with ExitStack() as stack:
        redis = None
        url = cfg.run.redis_url
        placement: dict[str, tuple[list[str], str | None]] = {}
        redis_at: dict[str, Any] = {}
        wan = None
        if regions is not None:
            from ddiloco.chaos.wan.session import enter_regions

            wan, placement, redis_at = enter_regions(stack, regions, cfg, run_id)
            report["regions_tag"] = wan.tag
            from ddiloco.chaos.wan.regions_cli import link_checks_json

            report["regions"] = str(regions)
            report["links"] = link_checks_json(wan.link_checks)
        if not url:
            redis = stack.enter_context(EmbeddedRedis(out / "redis", fsync="always",
                                                      **redis_at))
            url = redis.url
        # The runner's own calls must fail fast while Redis is killed or paused: one try,
        # a one-second timeout (workers keep their patient clients).
        client = connect(url, attempts=1, timeout_s=1.0)
        for mode, rid in modes:
            mcfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"mode": mode})})
            from ddiloco.chaos.wan.session import wan_counters, wan_traffic

            before = wan_counters(wan)
            run_mode(mcfg, mode, RedisStore(client, rid), redis, url, rid, out / mode, actions,
                     script.duration_s, live, learner_cores, placement, wan)
            report["modes"][mode] = {"run_id": rid}
            if wan is not None:
                # what crossed each region's eth0 and each link during the mode (floods of
                # congest faults too, which the application bytes do not count)
                report["modes"][mode].update(wan_traffic(
                    wan, RedisStore(connect(url), rid), before))
        if reference:
            report["fault_free"] = {}
            for mode, rid in modes:
                mcfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"mode": mode})})
                store = RedisStore(client, rid + "-ref")
                run_mode(mcfg, mode, store, redis, url, rid + "-ref", out / f"{mode}-ref", [],
                         script.duration_s, live, learner_cores, placement, wan)
                report["fault_free"][mode] = {"run_id": rid + "-ref"}
        (out / "chaos.json").write_text(json.dumps(report, indent=2, default=str))
        _account(report, client, cfg)
    return _finish(report, cfg, out)


def _stored_run(store: Any, mode: str) -> ModeRun:
    """The window of a stored chaos run, from its ``chaos_start``/``chaos_end`` events."""
    from ddiloco.pipeline.errors import DDilocoError

    ev = {e["kind"]: e for _, e in store.events(kinds={"chaos_start", "chaos_end"})}
    if "chaos_start" not in ev or "chaos_end" not in ev:
        raise DDilocoError(f"run {store.run_id!r} has no complete chaos window in the store")
    restarts: dict[str, int] = {}
    for _, e in store.events(kinds={"worker_restart"}):
        restarts[e["worker"]] = restarts.get(e["worker"], 0) + 1
    return ModeRun(mode, store.run_id, float(ev["chaos_start"]["t"]),
                   float(ev["chaos_end"]["t"]), restarts)


def _account(report: dict[str, Any], client: Any, cfg: Config) -> None:
    """Fill the report's mode blocks from the store (fault-free references first: their step
    time is the goodput reference of the chaos runs)."""
    from ddiloco.chaos import accounting as acc
    from ddiloco.store.redis_store import RedisStore

    ref_step: dict[str, float | None] = {}
    for mode, info in report.get("fault_free", {}).items():
        mcfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"mode": mode})})
        store = RedisStore(client, info["run_id"])
        blk = mode_block(store, _stored_run(store, mode), mcfg)
        ref_step[mode] = blk["ref_step_s"]
        report["fault_free"][mode] = {"run_id": info["run_id"], **{k: blk[k] for k in (
            "final_val_loss", "goodput", "tokens_per_s", "wall_s", "ref_step_s",
            "invariants")}}
    for mode, info in list(report["modes"].items()):
        mcfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"mode": mode})})
        store = RedisStore(client, info["run_id"])
        extra = {k: info[k] for k in ("region_tx_bytes", "link_bytes") if k in info}
        report["modes"][mode] = {**mode_block(store, _stored_run(store, mode), mcfg,
                                              ref_step.get(mode)), **extra}
    # A mode that never reached a fault-free stretch borrows another mode's step time.
    report["modes"] = acc.complete_goodput(report["modes"])


def report_stored(out: Path) -> dict[str, Any]:
    """``ddiloco chaos report OUT``: recompute the accounting and the audit of a finished chaos
    run from its store (the embedded Redis in ``OUT/redis``) and rewrite the report.

    Raises:
        DDilocoError: no ``OUT/chaos.json`` or no stored run.
        InvariantViolation: the audit failed (the report is written first).
    """
    from ddiloco.pipeline.errors import DDilocoError
    from ddiloco.store.connect import connect
    from ddiloco.store.embedded import EmbeddedRedis

    path = out / "chaos.json"
    if not path.exists():
        raise DDilocoError(f"{path}: no chaos report there")
    report = json.loads(path.read_text())
    cfg = Config.model_validate(report["config"])
    with ExitStack() as stack:
        url = cfg.run.redis_url
        if not url:
            url = stack.enter_context(EmbeddedRedis(out / "redis", fsync="always")).url
        _account(report, connect(url, attempts=1, timeout_s=5.0), cfg)
    return _finish(report, cfg, out)


def _finish(report: dict[str, Any], cfg: Config, out: Path) -> dict[str, Any]:
    from ddiloco.chaos.invariants import raise_if_failed
    from ddiloco.chaos.plot import plot_chaos

    report["ok"] = all(b["invariants"]["ok"] for b in report["modes"].values())
    report["simulator"] = predicted_goodput(report, cfg)
    (out / "chaos.json").write_text(json.dumps(report, indent=2, default=str))
    plot_chaos(report, out / "chaos.png")
    _summary(report)
    for b in report["modes"].values():
        raise_if_failed(b["invariants"])
    return report


def predicted_goodput(report: dict[str, Any], cfg: Config) -> dict[str, Any] | None:
    """The simulator's goodput for this run: its model fitted to the run's learner faults,
    detection, rejoin, restart and step times (:func:`chaos.simulator.calibrate_report`; the
    report carries the run's config). None when the report has no mode to predict."""
    from ddiloco.chaos.calibration import calibrate_report
    from ddiloco.pipeline.errors import ConfigError

    del cfg
    try:
        return calibrate_report(report).to_json()
    except ConfigError:
        return None


def _summary(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"ddiloco chaos: {report['script']['name']} (seed {report['script']['seed']})")
    t.add_column("")
    modes = list(report["modes"])
    for m in modes:
        t.add_column(m)

    def row(label: str, fn: Any) -> None:
        t.add_row(label, *[str(fn(report["modes"][m])) for m in modes])

    row("goodput", lambda b: f"{b['goodput']:.1%}" if b["goodput"] is not None else "-")
    row("merged tokens/s", lambda b: f"{b['tokens_per_s']:,}")
    row("token fate (tokens)", lambda b: _fate_line(b["token_fate"]))
    row("global downtime s", lambda b: b["global_downtime_s"])
    row("recovery s p50/max", lambda b: f"{b['recovery_s']['p50']}/{b['recovery_s']['max']}")
    row("faults", lambda b: b["faults_injected"])
    row("final val loss", lambda b: b["final_val_loss"])
    row("invariants", lambda b: "pass" if b["invariants"]["ok"] else "FAIL")
    Console().print(t)
    if report.get("simulator"):
        Console().print(f"simulator: {report['simulator']['predicted']} "
                        f"measured: {report['simulator']['measured']}")


def _fate_line(f: dict[str, Any]) -> str:
    tok = f.get("tokens", f)
    return (f"processed {tok['processed']:,.0f} merged {tok['merged']:,.0f} "
            f"discarded {sum(tok['discarded'].values()):,.0f} "
            f"lost {sum(tok['lost'].values()):,.0f}")


__all__ = ["ChaosError", "effective_fates", "mode_block", "run_chaos", "run_mode"]
