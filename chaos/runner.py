"""``ddiloco chaos run``: a local cluster under a seeded fault script, for both modes.

Starts the embedded Redis (``appendfsync always``: a killed Redis loses no acknowledged
version) and, with ``store.blobs = "embedded-s3"``, the embedded object-store server (SeaweedFS
in ``OUT/s3``, one server for every mode: each run id is its own prefix; the script target
``blobs`` kills or pauses it), then for each mode (Decoupled DiLoCo, and with ``--baseline dp``
the data-parallel baseline under the same fault schedule) starts the shards, the evaluator and
M learners, waits until every learner trains, applies the script's faults at their times,
restarts what it killed after its down time, and after ``duration_s`` stops everything cleanly.
Every fault, restart and detection is an event in the run's stream. Afterwards the pure functions of
:mod:`ddiloco.chaos.accounting` compute goodput, token fate, downtime and recovery times, and
:mod:`ddiloco.chaos.invariants` audits the stream and the store. ``OUT/chaos.json`` and
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
import time
import uuid
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

from ddiloco.chaos.chaos_report import ModeRun, account_modes, finish_report
from ddiloco.chaos.fault_loop import (
    FaultWindow,
    Health,
    LiveStats,
    Pending,
    play_window,
    record_recoveries,
    schedule,
    wait_store,
)
from ddiloco.chaos.faults import ChaosError, Injector, check_blobs_faults
from ddiloco.chaos.script import FaultAction, FaultKind, describe, expand, load_script
from ddiloco.pipeline.errors import DDilocoError
from ddiloco.pipeline.waiting import wait_until
from ddiloco.store.base import ParameterStore
from ddiloco.workers.run.config import EMBEDDED_S3, Config
from ddiloco.workers.run.launch import LocalCluster, with_redis_users, with_run_keys
from ddiloco.workers.run.rundir import check_out, clear_run

log = logging.getLogger(__name__)

#: a chaos run's learners train until the script ends, not to a step budget


_NO_BUDGET = 10**9


def _wait_training(store: ParameterStore, cluster: LocalCluster, n: int,
                   timeout_s: float) -> None:
    """Wait until ``n`` learners have taken a step (compiled, synced, training).

    Raises:
        DDilocoError: a worker exited during start-up (with its log's tail).
        WaitTimeout: not every learner trains after ``timeout_s`` seconds.
    """
    def training() -> bool:
        for name, w in cluster.workers.items():
            if w.proc is not None and not w.alive:
                raise DDilocoError(cluster.failure(name, "exited during start-up"))
        return len({e["learner"] for _, e in store.events(kinds={"first_step"})}) >= n

    wait_until(training, timeout_s=timeout_s, interval_s=0.25,
               what=f"{n} learners to start training")


def run_mode(cfg: Config, mode: str, store: ParameterStore, redis: Any, redis_url: str, run_id: str,
             run_dir: Path, actions: list[FaultAction], duration_s: float,
             live: bool, learner_cores: float | None = None,
             placement: dict[str, tuple[list[str], str | None]] | None = None,
             wan: Any = None, blobs: Any = None) -> ModeRun:
    """Run one mode under the fault schedule; returns the times the accounting needs.

    ``placement``: where each worker runs (emulated regions, see
    :meth:`ddiloco.workers.run.launch.LocalCluster.command`); None: all on this machine's loopback.
    ``wan``: the :class:`ddiloco.chaos.wan.regions.Regions` the workers run in (partition and
    congest faults act on its region pairs), or None. ``blobs``: the embedded object-store
    server (:class:`ddiloco.store.embedded_s3.EmbeddedS3`) that ``blobs`` faults kill and pause,
    or None.

    In DiLoCo mode, a learner that was alive and is under no fault, yet has no live heartbeat
    entry in the store, gets a ``looked_dead`` event (once per episode): the control plane
    failed a healthy learner, e.g. on a saturated link.

    Raises:
        ChaosError: a fault cannot be injected on this machine.
        DDilocoError: a worker failed to start.
    """
    from rich.console import Console
    from rich.live import Live

    from ddiloco.workers.run.live import ProgressMeter, ProgressPrinter, live_table, start_lines
    from ddiloco.workers.run.manifest import init_run
    from ddiloco.workers.task.api import manifest_loss_unit

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
                        region_of=wan.topology.workers if wan is not None else None,
                        blobs=blobs)
    injector.assign_gids()
    restarts: dict[str, int] = {}
    window = FaultWindow(mode, schedule(actions, duration_s), learners, shards,
                         Health(wan.topology.workers if wan is not None else None),
                         LiveStats(0.0))
    pending = window.pending
    try:
        cluster.start_all()
        injector.limit_all()
        cluster.write_commands(run_dir / "commands.sh")
        console = Console()

        def say(line: str) -> None:
            console.print(line, markup=False, highlight=False, soft_wrap=True)

        for line in start_lines(run_dir, f"{mode} chaos", cfg.tracking.log_level):
            say(line)
        _wait_training(store, cluster, len(learners), timeout_s=300)
        t0 = time.time()
        m0 = time.monotonic()
        window.stats.t0 = t0
        store.add_event("chaos_start", {"mode": mode, "duration_s": duration_s}, t=t0)
        # --no-live: a progress line every tracking.progress_every_s; the run lasts the
        # script's window, so the ETA is the window's end
        progress = ProgressPrinter(
            ProgressMeter(store, f"{mode} chaos", manifest_loss_unit(manifest), None, m0,
                          deadline_s=duration_s), cfg.tracking.progress_every_s, say)
        with Live(console=console, refresh_per_second=2, auto_refresh=False) as view:

            def show(now: float, w: FaultWindow) -> None:
                table = live_table(store, cluster, f"{mode} chaos", m0, n_frag,
                                   manifest_loss_unit(manifest), progress.meter)
                table.caption = (table.caption or "") + (
                    f"\nfaults injected {w.stats.faults}, {w.to_come} to come; "
                    f"down now: {sorted(w.down) or '-'}; merged tokens/s in the window "
                    f"{w.stats.merged_ft / n_frag / max(now, 1e-9):,.0f}")
                view.update(table, refresh=True)

            def quiet(_now: float, _w: FaultWindow) -> None:
                progress.tick()

            play_window(window, store, injector, cluster, duration_s,
                        supervise=lambda w: _supervise(cluster, w.down, restarts, w.pending),
                        report=show if live else quiet, report_every_s=1.0)
        t_end = time.time()
        injector.resume_all()
        wait_store(store, pending)
        record_recoveries(store, t0)
        store.add_event("chaos_end", {"mode": mode}, t=t_end)
        # Learners drain (send substantial unsent work), then the final evaluation.
        for name in learners:
            if cluster.workers[name].alive:
                cluster.signal(name, 15)
        cluster.wait(learners, timeout_s=60)
        for name in shards:  # a stopping shard merges the rounds the drains left open
            if cluster.workers[name].alive:
                cluster.stop(name, timeout_s=30)
        cluster.finish_evaluator()
    finally:
        injector.resume_all()
        cluster.stop_all()
        injector.close()
    wait_store(store, pending)
    return ModeRun(mode, run_id, t0, t_end, restarts)


def _supervise(cluster: LocalCluster, down: set[str], restarts: dict[str, int],
               pending: Pending) -> None:
    """Restart a worker that exited on its own (e.g. a shard that lost its lease), as a
    process supervisor would; killed workers stay down until their fault heals."""
    # A copy: starting a learner again may hand it to a standby, which replaces the standby's
    # entry with a new one. A standby that died is not restarted: restarted learners then
    # start fresh.
    for name, w in list(cluster.workers.items()):
        if name in down or w.proc is None or w.alive or name.startswith("standby-"):
            continue
        restarts[name] = restarts.get(name, 0) + 1
        pending.add("worker_restart", {"worker": name, "exit_code": w.proc.returncode})
        cluster.start(name)


#: what a chaos run writes at the top of its folder, and its per-mode folders (``--force``
#: removes them; anything else in the folder is left alone)
CHAOS_TOP = ("chaos.json", "chaos.png", "redis", "s3")
CHAOS_MODES = ("diloco", "dp", "diloco-ref", "dp-ref")


def check_cpu_limits(actions: Sequence[FaultAction], isolate: bool,
                     euid: int | None = None) -> None:
    """Refuse, before anything starts, what needs cgroup CPU quotas without root: ``--isolate``
    and ``slow`` faults (``euid``: the effective user id, this process's by default).

    Raises:
        ChaosError: naming the option or the fault, and the fix.
    """
    if (os.geteuid() if euid is None else euid) == 0:
        return
    if isolate:
        raise ChaosError("--isolate needs root (it limits each learner with a cgroup CPU "
                         "quota): run with sudo -E, or leave --isolate out")
    if any(a.kind == FaultKind.SLOW for a in actions):
        raise ChaosError("slow faults need root (they write cgroup CPU quotas): run with "
                         "sudo -E, or remove the slow faults from the script")


def check_diagnostics(cfg: Config) -> None:
    """Refuse, before anything starts, a configuration meant for fault-free diagnostics:
    ``sync.blocking`` waits for every learner's round (min_quorum = run.learners), which a
    killed or paused learner would hold until the timeout, round after round; and
    ``run.deterministic`` (which sets it) stops at the first round a fault delays.

    Raises:
        ChaosError: naming the setting and the fix.
    """
    if cfg.run.deterministic:
        raise ChaosError("run.deterministic replays a run step for step from its seed, which "
                         "faults break (a killed learner stops it): set "
                         "run.deterministic=false for chaos runs")
    if cfg.sync.blocking:
        raise ChaosError("sync.blocking is a diagnostic that waits for every learner's round, "
                         "which faults break: set sync.blocking=false for chaos runs")


def run_chaos(cfg: Config, script_path: Path, out: Path, *, baseline: str | None = None,
              seed: int | None = None, live: bool = True, reference: bool = False,
              isolate: bool = False, regions: Path | None = None,
              force: bool = False) -> dict[str, Any]:
    """The chaos job; returns the report (also ``out/chaos.json`` and ``out/chaos.png``).

    ``isolate`` limits each learner to cores / M of this machine's cores (cgroup CPU quota), so
    learners sharing cores do not speed up while others are down. ``regions``: a topology file;
    every worker and Redis run in their emulated regions (:mod:`ddiloco.chaos.wan.regions`).
    With ``cfg.store.blobs = "embedded-s3"`` the runner starts the object-store server in
    ``out/s3`` for the whole run (``report["blobs"]`` names its location).

    Raises:
        ScriptError: the script is invalid. ChaosError: ``sync.blocking`` or
            ``run.deterministic`` is set (:func:`check_diagnostics`), or a fault cannot be
            injected here (``blobs`` faults without ``store.blobs = "embedded-s3"``;
            ``embedded-s3`` with ``regions``). InvariantViolation: the audit failed (the
            report is written first).
        OutHoldsRun: ``out`` holds an earlier chaos run and ``force`` is False (its learners
            would otherwise meet that run's checkpoints).
    """
    from ddiloco.store.connect import connect
    from ddiloco.store.embedded import EmbeddedRedis
    from ddiloco.store.redis_store import RedisStore
    from ddiloco.workers.task.data import load_documents

    check_diagnostics(cfg)
    script = load_script(script_path)
    actions = expand(script, cfg.run.learners, cfg.run.shards, seed)
    embedded_s3 = cfg.store.blobs == EMBEDDED_S3
    # Before anything starts: a script cannot set the configuration, so name the setting.
    check_blobs_faults(actions, True if embedded_s3 else None)
    if embedded_s3 and regions is not None:
        raise ChaosError("store.blobs = 'embedded-s3' serves on this host's loopback, which the "
                         "regions cannot reach: give an s3:// URL")
    check_cpu_limits(actions, isolate)
    load_documents([Path(p) for p in cfg.data.corpus] or None)
    check_out(out, force=force, top=CHAOS_TOP, modes=CHAOS_MODES)
    clear_run(out, top=CHAOS_TOP, modes=CHAOS_MODES)
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
        redis: Any = None  # EmbeddedRedis, or EmbeddedRedisHA (the same fault interface)
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
        if not url and cfg.run.redis_ha:
            from ddiloco.store.embedded_ha import EmbeddedRedisHA

            # a "redis" fault hits the current primary; the sentinels fail over
            redis = stack.enter_context(EmbeddedRedisHA(out / "redis-ha"))
            url = redis.url
        if not url:
            redis = stack.enter_context(EmbeddedRedis(out / "redis", fsync="always",
                                                      **redis_at))
            url = redis.url
        # The runner's own calls must fail fast while Redis is killed or paused: one try,
        # a one-second timeout (workers keep their patient clients).
        client = connect(url, attempts=1, timeout_s=1.0)
        blobs = None
        run_cfg = cfg
        if embedded_s3:
            from ddiloco.store.embedded_s3 import embedded_s3_env

            blobs = stack.enter_context(embedded_s3_env(out / "s3"))
            run_cfg = cfg.model_copy(update={"store": cfg.store.model_copy(
                update={"blobs": blobs.url()})})
            report["blobs"] = run_cfg.store.blobs
        for mode, rid in modes:
            mcfg = run_cfg.model_copy(update={"run": run_cfg.run.model_copy(
                update={"mode": mode})})
            from ddiloco.chaos.wan.session import wan_counters, wan_traffic

            before = wan_counters(wan)
            with armed(script.failpoints):
                run_mode(mcfg, mode, RedisStore(client, rid), redis, url, rid, out / mode,
                         actions, script.duration_s, live, learner_cores, placement, wan, blobs)
            report["modes"][mode] = {"run_id": rid}
            if "loss_unit" not in report:
                from ddiloco.workers.task.api import manifest_loss_unit

                report["loss_unit"] = manifest_loss_unit(
                    RedisStore(connect(url), rid).get_manifest() or {})
            if wan is not None:
                # what crossed each region's eth0 and each link during the mode (floods of
                # congest faults too, which the application bytes do not count)
                report["modes"][mode].update(wan_traffic(
                    wan, RedisStore(connect(url), rid), before))
        if reference:
            report["fault_free"] = {}
            for mode, rid in modes:
                mcfg = run_cfg.model_copy(update={"run": run_cfg.run.model_copy(
                    update={"mode": mode})})
                store = RedisStore(client, rid + "-ref")
                run_mode(mcfg, mode, store, redis, url, rid + "-ref", out / f"{mode}-ref", [],
                         script.duration_s, live, learner_cores, placement, wan, blobs)
                report["fault_free"][mode] = {"run_id": rid + "-ref"}
        (out / "chaos.json").write_text(json.dumps(report, indent=2, default=str))
        account_modes(report, client, cfg)
    return finish_report(report, cfg, out)


@contextmanager
def armed(spec: str | None) -> Iterator[None]:
    """The workers started (and restarted) inside arm the script's failpoints
    (``DDILOCO_FAILPOINTS``, :mod:`ddiloco.store.failpoints`); the fault-free reference runs
    outside, unarmed."""
    from ddiloco.store.failpoints import ENV

    if not spec:
        yield
        return
    before = os.environ.get(ENV)
    os.environ[ENV] = spec
    try:
        yield
    finally:
        if before is None:
            os.environ.pop(ENV, None)
        else:
            os.environ[ENV] = before


__all__ = ["ChaosError", "armed", "run_chaos", "run_mode"]
