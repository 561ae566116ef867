"""``ddiloco run``: the main job on one machine.

Starts the embedded Redis (unless a URL is given), writes the run manifest, starts S syncer
shards, M learners and the evaluator as separate processes
(:class:`ddiloco.workers.run.launch.LocalCluster`),
shows a live view, and when the learners have spent their token budget stops everything and
writes ``OUT/report.json`` and ``OUT/report.png``. ``--baseline dp`` then trains the
data-parallel baseline on the same data and token budget, in the same Redis under its own run id.
"""

from __future__ import annotations

import json
import time
import uuid
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from ddiloco.chaos.wan.session import enter_regions, link_bytes_table, wan_counters, wan_traffic
from ddiloco.pipeline.errors import DDilocoError
from ddiloco.pipeline.waiting import poll_until
from ddiloco.report import mode_report, plot_report
from ddiloco.store.base import ParameterStore
from ddiloco.workers.run.config import EMBEDDED_S3, Config
from ddiloco.workers.run.launch import LocalCluster, with_redis_users, with_run_keys
from ddiloco.workers.run.live import (
    ProgressMeter,
    ProgressPrinter,
    live_table,
    start_lines,
    token_budget,
)
from ddiloco.workers.run.resume import FieldChange
from ddiloco.workers.run.rundir import (
    RunFolder,
    RunFolderError,
    check_out,
    clear_run,
    read_run_info,
)


def train_mode(cfg: Config, store: ParameterStore, redis_url: str, run_id: str, run_dir: Path,
               live: bool, placement: dict[str, tuple[list[str], str | None]] | None = None
               ) -> dict[str, Any]:
    """Run one mode to completion on a local cluster; returns its report block. Says where
    the worker logs are at the start; then shows the live table (``live``) or prints a
    progress line every ``tracking.progress_every_s`` seconds.

    Raises:
        DDilocoError: a worker failed (its log tail is in the message).
        TrackingUnavailable: the tracking section asks for a package that is not installed
            (before any worker starts).
    """
    from rich.console import Console
    from rich.live import Live

    from ddiloco.workers.run.manifest import init_run
    from ddiloco.workers.task.api import manifest_loss_unit
    from ddiloco.workers.tracking import check_tracking

    check_tracking(cfg.tracking)
    cfg = with_run_keys(cfg, run_dir)
    manifest = init_run(store, cfg, run_id)
    n_frag = len(manifest["layout"])
    cluster = LocalCluster.for_run(cfg, redis_url, run_id, run_dir,
                                   redis_urls=with_redis_users(store.client, redis_url, cfg,
                                                               run_id))
    cluster.placement = dict(placement or {})
    console = Console()

    def say(line: str) -> None:
        # literal text (paths may hold brackets), never wrapped: one line per message in logs
        console.print(line, markup=False, highlight=False, soft_wrap=True)

    t0 = time.monotonic()
    unit = manifest_loss_unit(manifest)
    meter = ProgressMeter(store, cfg.run.mode, unit, token_budget(cfg, manifest), t0)
    progress = ProgressPrinter(meter, cfg.tracking.progress_every_s, say)
    cluster.start_all()
    cluster.write_commands(run_dir / "commands.sh")
    for line in start_lines(run_dir, cfg.run.mode, cfg.tracking.log_level):
        say(line)
    if cluster.metrics_targets():
        write_metrics_targets(cluster, cfg.run.mode, run_dir / "prometheus-targets.json")
    learners = cluster.names("learner")
    # the evaluator, when it runs beside the learners (run.evaluator = during)
    during = [n for n in cluster.names("evaluator") if n not in cluster.deferred]
    try:
        with Live(console=console, refresh_per_second=2, transient=False,
                  auto_refresh=False) as view:
            while not cluster.wait(learners, timeout_s=1.0):
                for name in [*cluster.names("shard"), *during]:
                    if not cluster.workers[name].alive:
                        raise DDilocoError(cluster.failure(name, "exited early"))
                if live:
                    view.update(live_table(store, cluster, cfg.run.mode, t0, n_frag, unit, meter),
                                refresh=True)
                else:
                    progress.tick()
            if live:
                view.update(live_table(store, cluster, cfg.run.mode, t0, n_frag, unit, meter),
                            refresh=True)
            # A learner killed by hand and restarted by hand is not ours to wait for: the
            # store's TTL registry is.
            def learners_gone() -> bool:
                if live:
                    view.update(live_table(store, cluster, cfg.run.mode, t0, n_frag, unit, meter),
                                refresh=True)
                else:
                    progress.tick()
                return not store.live_learners()

            poll_until(learners_gone, timeout_s=None, interval_s=1.0)
        crashed = [n for n in learners if cluster.workers[n].proc is not None
                   and (cluster.workers[n].proc.returncode or 0) > 0]  # type: ignore[union-attr]
        if crashed:
            raise DDilocoError(cluster.failure(crashed[0], "failed"))
        wall = time.monotonic() - t0
        # Shards merge the rounds the learners' drains left open when they stop; then the
        # evaluator evaluates the final model (once more on SIGTERM, or its one evaluation
        # with run.evaluator = after).
        for name in cluster.names("shard"):
            cluster.stop(name, timeout_s=30)
        cluster.finish_evaluator()
        if not live:
            progress.tick(force=True)  # the final model's loss
    finally:
        cluster.stop_all()
    return mode_report(store, wall)


def write_metrics_targets(cluster: LocalCluster, mode: str, path: Path) -> None:
    """The workers' metrics endpoints as a Prometheus ``file_sd_configs`` file (one target per
    worker, labelled ``worker`` and ``mode``); docs/METRICS.md has a scrape config."""
    entries = [{"targets": [addr], "labels": {"worker": name, "mode": mode}}
               for name, addr in sorted(cluster.metrics_targets().items())]
    path.write_text(json.dumps(entries, indent=2))


def print_summary(report: dict[str, Any]) -> None:
    """The summary table of a report (``report.json``) on the console."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    from ddiloco.report import report_loss_unit

    t = Table(title="ddiloco run summary")
    t.add_column("")
    modes = [m for m in ("diloco", "dp") if m in report]
    for m in modes:
        t.add_column(m)
    rows = [("learners", "learners"), ("steps per learner", "steps"), ("tokens", "tokens"),
            ("wall s", "wall_s"),
            ("tokens/s", "tokens_per_s"),
            (f"final val loss ({escape(report_loss_unit(report))})", "final_val_loss"),
            ("wire bytes / token", "wire_bytes_per_token"), ("merges", "merges"),
            ("dropped", "dropped")]
    # A report of another runner (compose's finish) may not know the step budget.
    rows = [r for r in rows if r[1] != "steps" or any("steps" in report[m] for m in modes)]
    for label, key in rows:
        cells = []
        for m in modes:
            v = report[m].get(key)
            cells.append(f"{v:.4f}" if isinstance(v, float) and key == "final_val_loss"
                         else f"{v:,}" if isinstance(v, int) else str(v))
        t.add_row(label, *cells)
    Console().print(t)
    for m in modes:
        if "link_bytes" in report[m]:
            Console().print(link_bytes_table(report[m]["link_bytes"],
                                             f"{m}: bytes per link, application vs link counter"))
    if "ratios" in report:
        Console().print(f"ratios: {report['ratios']}")


def run_local(cfg: Config, out: Path, *, baseline: str | None = None, resume: bool = False,
              live: bool = True, regions: Path | None = None,
              baseline_only: bool = False, force: bool = False) -> dict[str, Any]:
    """The main job. Returns the report (also written to ``out/report.json``).

    Everything that can be checked is checked before ``out`` is touched; a start that fails
    before the run exists in its store leaves ``out`` as it was (a folder it created is
    removed, :class:`ddiloco.workers.run.rundir.RunFolder`).

    Args:
        cfg: validated configuration.
        out: run directory (logs, checkpoints, embedded Redis data, report).
        baseline: "dp" to also train the data-parallel baseline.
        baseline_only: train only the baseline (e.g. to tune its learning rate).
        resume: continue the run stored in ``out`` (same run id, same store). The fields of
            ``cfg`` that differ from the run's and are safe to change
            (:mod:`ddiloco.workers.run.resume`; e.g. ``train.steps``) take effect and are recorded
            in ``run.json``'s ``resumes``.
        force: replace the run ``out`` holds (its checkpoints, Redis data, logs, report).
        regions: a topology file: the workers run in emulated regions (network namespaces
            with shaped links, :mod:`ddiloco.chaos.wan.regions`; root), Redis where the topology
            puts it.

    Raises:
        RunFolderError: ``out`` holds another run (``OutHoldsRun``: pass ``resume`` or
            ``force``), cannot be created or written, or is not a run to resume.
        ResumeRefused: the resume changes a field that cannot change (named).
        ConfigError: ``run.deterministic`` with ``regions`` or ``resume``
            (:func:`ddiloco.workers.run.deterministic.check_local_run`); ``TaskError``:
            ``run.torch_learners`` without torch installed.
        DDilocoError: corpus, store or worker failures, with a clear message.
    """
    from ddiloco.store.connect import connect
    from ddiloco.workers.run.deterministic import check_local_run
    from ddiloco.workers.run.resume import check_resume, resume_changes
    from ddiloco.workers.task.data import load_documents

    check_local_run(cfg.run.deterministic, regions=regions is not None, resume=resume)
    if cfg.run.torch_learners:
        from ddiloco.workers.task.torch_api import import_torch

        import_torch()  # one line naming the extra, before anything starts
    if resume and force:
        raise RunFolderError(f"--resume {out} and --force: pass one (--resume continues the "
                             "run, --force replaces it)")
    changes: list[FieldChange] = []
    if resume:
        info = read_run_info(out)
        if isinstance(info.get("config"), dict):
            changes = check_resume(str(out), resume_changes(info["config"],
                                                            cfg.model_dump(mode="json")))
    else:
        check_out(out, force=force)
        info = {"run_id": cfg.run.run_id or f"run-{time.strftime('%Y%m%d-%H%M%S')}-"
                f"{uuid.uuid4().hex[:4]}", "redis_url": cfg.run.redis_url}
    # Fail early and clearly if the corpus or the Redis cannot be had.
    load_documents([Path(p) for p in cfg.data.corpus] or None)
    url = info.get("redis_url") or cfg.run.redis_url
    if url:
        connect(url)
    if force:
        clear_run(out)
    if resume:
        info["resumes"] = [*info.get("resumes", []), {
            "time": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "changes": {c.path: [c.old, c.new] for c in changes}}]
        _say(f"resuming run {info['run_id']}"
             + (": " + ", ".join(c.describe() for c in changes) if changes else ""))
    folder = RunFolder.open(out, "--resume" if resume else "--out")
    folder.keep(["run.json"])
    try:
        report = _train_modes(cfg, folder, info, changes, baseline=baseline, live=live,
                              regions=regions, baseline_only=baseline_only)
    except BaseException:
        if not folder.started:
            folder.rollback()
        raise
    if "dp" in report and "diloco" in report:
        d, b = report["diloco"], report["dp"]
        report["ratios"] = {
            "val_loss_diloco_over_dp": (round(d["final_val_loss"] / b["final_val_loss"], 4)
                                        if d["final_val_loss"] and b["final_val_loss"] else None),
            "wire_bytes_per_token_dp_over_diloco": (
                round(b["wire_bytes_per_token"] / d["wire_bytes_per_token"], 1)
                if d["wire_bytes_per_token"] and b["wire_bytes_per_token"] else None),
        }
    if info.get("resumes"):
        report["resumes"] = info["resumes"]
    (out / "report.json").write_text(json.dumps(report, indent=2))
    plot_report(report, out / "report.png")
    print_summary(report)
    return report


def _say(line: str) -> None:
    from rich.console import Console

    Console().print(line, markup=False, highlight=False, soft_wrap=True)


def _stored(store: ParameterStore) -> bool:
    """Whether the run exists in its store (its manifest is written); True when the store
    cannot tell: then nothing is taken back."""
    try:
        return store.get_manifest() is not None
    except DDilocoError:
        return True


def _train_modes(cfg: Config, folder: RunFolder, info: dict[str, Any],
                 changes: list[FieldChange], *, baseline: str | None, live: bool,
                 regions: Path | None, baseline_only: bool) -> dict[str, Any]:
    """The stores, servers and regions of a run, and its modes trained in turn; sets
    ``folder.started`` once the run exists in its store (for :func:`run_local`)."""
    from ddiloco.store.connect import connect
    from ddiloco.store.embedded import EmbeddedRedis
    from ddiloco.store.embedded_ha import EmbeddedRedisHA
    from ddiloco.store.redis_store import RedisStore
    from ddiloco.workers.run.manifest import amend_manifest

    out = folder.path
    report: dict[str, Any] = {}
    with ExitStack() as stack:
        url = info.get("redis_url") or cfg.run.redis_url
        live_info = {**info, "config": cfg.model_dump(mode="json")}
        placement: dict[str, tuple[list[str], str | None]] = {}
        redis_at: dict[str, Any] = {}
        wan = None
        if regions is not None:
            wan, placement, redis_at = enter_regions(stack, regions, cfg, info["run_id"])
            from ddiloco.chaos.wan.regions_cli import link_checks_json

            report["regions_tag"] = wan.tag
            live_info["regions_tag"] = wan.tag
            report["links"] = link_checks_json(wan.link_checks)
        if not url and cfg.run.redis_ha:
            if regions is not None:
                raise DDilocoError("run.redis_ha runs on this host's loopback, which the "
                                   "regions cannot reach: give a redis+sentinel:// URL")
            url = stack.enter_context(EmbeddedRedisHA(out / "redis-ha")).url
            live_info["live_url"] = url
        if not url:
            url = stack.enter_context(EmbeddedRedis(out / "redis", **redis_at)).url
            # While the run lives, `ddiloco status/sample --out` talk to its Redis.
            live_info["live_url"] = url
            stack.callback(lambda: folder.write("run.json", json.dumps(
                {k: v for k, v in live_info.items() if k != "live_url"}, indent=2)))
        if cfg.store.blobs == EMBEDDED_S3:
            if regions is not None:
                raise DDilocoError("store.blobs = 'embedded-s3' serves on this host's loopback, "
                                   "which the regions cannot reach: give an s3:// URL")
            from ddiloco.store.embedded_s3 import embedded_s3_env

            s3 = stack.enter_context(embedded_s3_env(out / "s3"))
            cfg = cfg.model_copy(update={"store": cfg.store.model_copy(
                update={"blobs": s3.url()})})
            live_info["blobs"] = cfg.store.blobs
        folder.write("run.json", json.dumps(live_info, indent=2))
        client = connect(url)
        modes = [] if baseline_only else [("diloco", info["run_id"])]
        if baseline == "dp":
            modes.append(("dp", info["run_id"] + "-dp"))
        for mode, run_id in modes:
            mcfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"mode": mode})})
            store = RedisStore(client, run_id)
            if changes:
                # Into the stored manifest, where every worker reads its configuration (also
                # one restarted by hand from commands.sh); a run without one yet gets them
                # from its init step.
                amend_manifest(store, {c.path: c.new for c in changes})
            before = wan_counters(wan)
            try:
                report[mode] = train_mode(mcfg, store, url, run_id, out / mode, live, placement)
            finally:
                folder.started = folder.started or _stored(store)
            report[mode]["steps"] = mcfg.train.steps
            if wan is not None:
                report[mode].update(wan_traffic(wan, store, before))
    return report
