"""``ddiloco run``: the main job on one machine.

Starts the embedded Redis (unless a URL is given), writes the run manifest, starts S syncer
shards, M learners and the evaluator as separate processes
(:class:`ddiloco.workers.launch.LocalCluster`),
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
from ddiloco.workers.config import EMBEDDED_S3, Config
from ddiloco.workers.launch import LocalCluster, with_redis_users, with_run_keys
from ddiloco.workers.live import (
    ProgressMeter,
    ProgressPrinter,
    live_table,
    start_lines,
    token_budget,
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

    from ddiloco.workers.manifest import init_run
    from ddiloco.workers.task import manifest_loss_unit
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
    progress = ProgressPrinter(
        ProgressMeter(store, cfg.run.mode, manifest_loss_unit(manifest),
                      token_budget(cfg, manifest), t0), cfg.tracking.progress_every_s, say)
    cluster.start_all()
    cluster.write_commands(run_dir / "commands.sh")
    for line in start_lines(run_dir, cfg.run.mode, cfg.tracking.log_level):
        say(line)
    if cluster.metrics_targets():
        write_metrics_targets(cluster, cfg.run.mode, run_dir / "prometheus-targets.json")
    learners = cluster.names("learner")
    try:
        with Live(console=console, refresh_per_second=2, transient=False,
                  auto_refresh=False) as view:
            while not cluster.wait(learners, timeout_s=1.0):
                for name in [*cluster.names("shard"), "evaluator"]:
                    if not cluster.workers[name].alive:
                        raise DDilocoError(f"{name} exited early:\n{cluster.log_tail(name)}")
                if live:
                    view.update(live_table(store, cluster, cfg.run.mode, t0, n_frag),
                                refresh=True)
                else:
                    progress.tick()
            if live:
                view.update(live_table(store, cluster, cfg.run.mode, t0, n_frag), refresh=True)
            # A learner killed by hand and restarted by hand is not ours to wait for: the
            # store's TTL registry is.
            def learners_gone() -> bool:
                if live:
                    view.update(live_table(store, cluster, cfg.run.mode, t0, n_frag),
                                refresh=True)
                else:
                    progress.tick()
                return not store.live_learners()

            poll_until(learners_gone, timeout_s=None, interval_s=1.0)
        crashed = [n for n in learners if cluster.workers[n].proc is not None
                   and (cluster.workers[n].proc.returncode or 0) > 0]  # type: ignore[union-attr]
        if crashed:
            raise DDilocoError(f"{crashed[0]} failed:\n{cluster.log_tail(crashed[0])}")
        wall = time.monotonic() - t0
        # Shards merge the rounds the learners' drains left open when they stop; then the
        # evaluator evaluates once more on SIGTERM: the final model's loss.
        for name in cluster.names("shard"):
            cluster.stop(name, timeout_s=30)
        cluster.stop("evaluator", timeout_s=60)
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
    rows = [("learners", "learners"), ("tokens", "tokens"), ("wall s", "wall_s"),
            ("tokens/s", "tokens_per_s"),
            (f"final val loss ({escape(report_loss_unit(report))})", "final_val_loss"),
            ("wire bytes / token", "wire_bytes_per_token"), ("merges", "merges"),
            ("dropped", "dropped")]
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
              baseline_only: bool = False) -> dict[str, Any]:
    """The main job. Returns the report (also written to ``out/report.json``).

    Args:
        cfg: validated configuration.
        out: run directory (logs, checkpoints, embedded Redis data, report).
        baseline: "dp" to also train the data-parallel baseline.
        baseline_only: train only the baseline (e.g. to tune its learning rate).
        resume: continue the run stored in ``out`` (same run id, same store).
        regions: a topology file: the workers run in emulated regions (network namespaces
            with shaped links, :mod:`ddiloco.chaos.wan.regions`; root), Redis where the topology
            puts
            it.

    Raises:
        DDilocoError: corpus, store or worker failures, with a clear message.
    """
    from ddiloco.store.embedded import EmbeddedRedis
    from ddiloco.workers.data import load_documents

    out.mkdir(parents=True, exist_ok=True)
    info_path = out / "run.json"
    if resume:
        if not info_path.exists():
            raise DDilocoError(f"--resume {out}: no run.json there")
        info = json.loads(info_path.read_text())
    else:
        info = {"run_id": cfg.run.run_id or f"run-{time.strftime('%Y%m%d-%H%M%S')}-"
                f"{uuid.uuid4().hex[:4]}", "redis_url": cfg.run.redis_url}
    # Fail early and clearly if the corpus cannot be had.
    load_documents([Path(p) for p in cfg.data.corpus] or None)
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
        if not url:
            url = stack.enter_context(EmbeddedRedis(out / "redis", **redis_at)).url
            # While the run lives, `ddiloco status/sample --out` talk to its Redis.
            live_info["live_url"] = url
            stack.callback(lambda: info_path.write_text(json.dumps(
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
        info_path.write_text(json.dumps(live_info, indent=2))
        from ddiloco.store.connect import connect
        from ddiloco.store.redis_store import RedisStore

        client = connect(url)
        modes = [] if baseline_only else [("diloco", info["run_id"])]
        if baseline == "dp":
            modes.append(("dp", info["run_id"] + "-dp"))
        for mode, run_id in modes:
            mcfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"mode": mode})})
            store = RedisStore(client, run_id)
            before = wan_counters(wan)
            report[mode] = train_mode(mcfg, store, url, run_id, out / mode, live, placement)
            if wan is not None:
                report[mode].update(wan_traffic(wan, store, before))
    if "dp" in report and "diloco" in report:
        d, b = report["diloco"], report["dp"]
        report["ratios"] = {
            "val_loss_diloco_over_dp": (round(d["final_val_loss"] / b["final_val_loss"], 4)
                                        if d["final_val_loss"] and b["final_val_loss"] else None),
            "wire_bytes_per_token_dp_over_diloco": (
                round(b["wire_bytes_per_token"] / d["wire_bytes_per_token"], 1)
                if d["wire_bytes_per_token"] and b["wire_bytes_per_token"] else None),
        }
    (out / "report.json").write_text(json.dumps(report, indent=2))
    plot_report(report, out / "report.png")
    print_summary(report)
    return report
