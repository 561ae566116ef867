"""``ddiloco``: the command line.

``run`` is the main job (a local multi-learner run); ``learner``, ``syncer`` and ``evaluator``
run one worker each against a shared Redis URL (separate hosts); ``status``, ``sample`` and
``export`` read a run's store. Errors of ddiloco (bad config, unreachable Redis, missing corpus)
end with a one-line message and exit code 2, not a traceback.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from enum import Enum
from pathlib import Path
from typing import Annotated, Any

import typer

from ddiloco.config_cli import config_app
from ddiloco.keys_cli import keys_app
from ddiloco.pipeline.errors import DDilocoError
from ddiloco.store_cli import store_app
from ddiloco.workers import cli as workers_cli
from ddiloco.workers.cli import (
    ConfigOpt,
    InsecureOpt,
    LogLevel,
    LogLevelOpt,
    RedisOpt,
    RunIdOpt,
    SetOpt,
    guard,
    new_app,
    open_store,
    setup_jax_from_env,
)


class Baseline(str, Enum):
    """The baselines a run can train beside Decoupled DiLoCo."""

    dp = "dp"  # data-parallel (ddiloco.workers.dp)


class ExportFormat(str, Enum):
    """The file formats of ``ddiloco export`` (ddiloco.export.FORMATS)."""

    safetensors = "safetensors"
    npz = "npz"
    msgpack = "msgpack"


app = new_app("Decoupled DiLoCo: asynchronous, fault-tolerant, low-bandwidth training.")


def _print_version(value: bool) -> None:
    """``--version``: print ``ddiloco <version>`` (the installed distribution's) and exit 0."""
    if value:
        from ddiloco import __version__

        typer.echo(f"ddiloco {__version__}")
        raise typer.Exit(0)


@app.callback()
def _root(
    version: Annotated[bool, typer.Option(
        "--version", callback=_print_version, is_eager=True,
        help="print the installed version (ddiloco X.Y.Z) and exit")] = False,
) -> None:
    """Decoupled DiLoCo: asynchronous, fault-tolerant, low-bandwidth training."""


ProgressEveryOpt = Annotated[float | None, typer.Option(
    "--progress-every", min=0.1, help="with --no-live: seconds between two progress lines "
    "(mode, tokens done / budget, tokens/s, validation loss, merges, drops, ETA); "
    "tracking.progress_every_s, default 30")]


def _follow_overrides(log_level: LogLevel | None, progress_every: float | None) -> list[str]:
    """The ``tracking`` overrides of ``--log-level`` and ``--progress-every``."""
    out = []
    if log_level is not None:
        out.append(f"tracking.log_level={LogLevel(log_level).value}")
    if progress_every is not None:
        out.append(f"tracking.progress_every_s={progress_every}")
    return out


def _cluster_overrides(set_: list[str] | None, learners: int | None,
                       shards: int | None) -> list[str]:
    """``--set`` overrides plus the ``-M`` / ``-S`` shortcuts."""
    overrides = list(set_ or [])
    if learners is not None:
        overrides.append(f"run.learners={learners}")
    if shards is not None:
        overrides.append(f"run.shards={shards}")
    return overrides


@contextmanager
def _store_for(redis_url: str | None, run_id: str | None, out: Path | None) -> Iterator[Any]:
    """A store from a URL, or from a run directory (starting its embedded Redis if needed)."""
    from ddiloco.store.embedded import EmbeddedRedis

    info: dict[str, Any] = {}
    if out is not None:
        path = out / "run.json"
        if not path.exists():
            raise DDilocoError(f"{out} is not a run directory (no run.json)")
        info = json.loads(path.read_text())
    run_id = run_id or info.get("run_id")
    if run_id is None:
        raise DDilocoError("no run id: pass --run-id or --out RUN_DIR")
    url = redis_url or info.get("redis_url")
    if not url and info.get("live_url"):
        # The run is live: use its embedded Redis (or start ours if it has gone since).
        from ddiloco.store.connect import connect

        try:
            connect(info["live_url"], attempts=1)
            url = info["live_url"]
        except DDilocoError:
            url = None
    if url:
        yield open_store(url, run_id)
        return
    if out is None:
        raise DDilocoError("no Redis: pass --redis-url or --out RUN_DIR")
    with EmbeddedRedis(out / "redis") as server:
        yield open_store(server.url, run_id)


@app.command()
def run(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    baseline: Annotated[Baseline | None, typer.Option(
        "--baseline", help="also train this baseline: dp (data-parallel)")] = None,
    out: Annotated[Path, typer.Option(
        "--out", "-o", help="run directory: store, keys, logs, report.json and "
        ".png")] = Path("out"),
    redis_url: RedisOpt = None,
    redis_ha: Annotated[bool, typer.Option(
        "--redis-ha", help="start a highly available Redis: a primary, two replicas and three "
        "sentinels (run.redis_ha)")] = False,
    resume: Annotated[Path | None, typer.Option("--resume", help="resume RUN_DIR")] = None,
    force: Annotated[bool, typer.Option(
        "--force", help="replace the run --out holds: its checkpoints, Redis data, logs and "
        "report are removed first")] = False,
    learners: Annotated[int | None, typer.Option(
        "--learners", "-M", help="number of learners (run.learners)")] = None,
    shards: Annotated[int | None, typer.Option(
        "--shards", "-S", help="number of syncer shards (run.shards)")] = None,
    steps: Annotated[int | None, typer.Option(
        "--steps", help="inner steps per learner (train.steps)")] = None,
    corpus: Annotated[list[Path] | None, typer.Option(
        "--corpus", metavar="PATH", help="text file or dir (repeat for several)")] = None,
    live: Annotated[bool, typer.Option(
        "--live/--no-live", help="a live view of the run in the terminal")] = True,
    regions: Annotated[Path | None, typer.Option(
        "--regions", help="topology file: run the workers in emulated regions (root)")] = None,
    baseline_only: Annotated[bool, typer.Option(
        "--baseline-only", help="train only the --baseline (e.g. to tune it)")] = False,
    insecure: InsecureOpt = False,
    task: Annotated[str | None, typer.Option(
        "--task", help="your model: a task factory 'path/to/file.py:function' or "
        "'package.module:function' (docs/API.md); default: the built-in GPT")] = None,
    metrics: Annotated[bool, typer.Option(
        "--metrics", help="workers serve Prometheus metrics (run.metrics_port, default 9400; "
        "targets in OUT/<mode>/prometheus-targets.json, docs/METRICS.md)")] = False,
    log_level: LogLevelOpt = None,
    progress_every: ProgressEveryOpt = None,
) -> None:
    """Train M learners and S syncer shards on this machine; write OUT/report.json and .png."""
    def go() -> int:
        from ddiloco.localrun import run_local
        from ddiloco.workers.run.bundled import resolve_config
        from ddiloco.workers.run.config import load_config

        overrides = _cluster_overrides(set_, learners, shards)
        overrides += _follow_overrides(log_level, progress_every)
        if insecure:
            overrides.append("security.curve=false")
        if steps is not None:
            overrides.append(f"train.steps={steps}")
        if metrics and not any(o.startswith("run.metrics_port=") for o in overrides):
            overrides.append("run.metrics_port=9400")
        if task is not None:
            from ddiloco.api import task_reference

            overrides.append("model.task=" + json.dumps(task_reference(task)))
        if corpus:
            overrides.append("data.corpus=" + json.dumps([str(p.resolve()) for p in corpus]))
        if redis_url:
            overrides.append(f"run.redis_url={redis_url}")
        if redis_ha:
            overrides.append("run.redis_ha=true")
        if baseline_only and baseline is None:
            raise DDilocoError("--baseline-only needs --baseline dp")
        if resume is not None and config is None:
            # Resume with the run's own configuration; overrides (e.g. --steps) still apply.
            from ddiloco.workers.run.rundir import read_run_info

            base = read_run_info(resume).get("config") or {}
            cfg = load_config(None, overrides, base=base)
        else:
            cfg = load_config(config, overrides)
        run_local(cfg, resume or out, baseline=None if baseline is None else baseline.value,
                  resume=resume is not None, live=live,
                  regions=None if regions is None else resolve_config(regions),
                  baseline_only=baseline_only, force=force)
        return 0

    guard(go, sigterm_interrupts=True)


@app.command()
def finish(
    out: Annotated[Path, typer.Option("--out", "-o", help="where report.json/.png go")] = Path(
        "out-finish"),
    redis_url: RedisOpt = None,
    run_id: RunIdOpt = None,
    timeout: Annotated[float, typer.Option("--timeout", help="seconds to wait for the "
                                           "learners")] = 3600.0,
    shutdown_store: Annotated[bool, typer.Option(
        "--shutdown-store", help="then shut Redis down (compose: `up` returns)")] = False,
) -> None:
    """Wait for every learner of a run to finish, stop its shards, evaluator and routers
    through the store, write the report and print the summary (compose's end of run)."""
    def go() -> int:
        if not redis_url or not run_id:
            raise DDilocoError("finish needs --redis-url and --run-id")
        from ddiloco.finish import finish_run
        from ddiloco.localrun import print_summary

        report = finish_run(open_store(redis_url, run_id), out, learners_timeout_s=timeout,
                            shutdown_store=shutdown_store)
        print_summary(report)
        return 0

    guard(go, sigterm_interrupts=True)


@app.command()
def router(
    topology: Annotated[Path, typer.Option("--topology", help="topology file (docs/REGIONS.md)")],
    region: Annotated[str, typer.Option("--region", help="this router's region")],
    lan: Annotated[str, typer.Option("--lan", help="the region's subnet (CIDR)")],
    wan: Annotated[str, typer.Option("--wan", help="the hub's subnet (CIDR)")],
    hub: Annotated[str, typer.Option("--hub", help="region of Redis and the shards")] = "hub",
    redis_url: RedisOpt = None,
    run_id: RunIdOpt = None,
) -> None:
    """Shape the links between a region's network and the hub's inside a container (rate,
    delay, loss of the topology file) and forward between them; stops on SIGTERM or when the
    run's store asks routers to stop. Needs NET_ADMIN and net.ipv4.ip_forward=1."""
    def go() -> int:
        import time as _time

        from ddiloco.chaos.wan.router import serve_router
        from ddiloco.chaos.wan.topology import load_topology

        stop = None
        if redis_url and run_id:
            store = open_store(redis_url, run_id)
            started = _time.time()

            def stop() -> bool:
                return bool(store.stop_requested("routers", since=started))
        return serve_router(load_topology(topology), region, hub, lan, wan,
                            stop_requested=stop)

    guard(go)


def run_ended(redis_url: str, run_id: str, since: float) -> Callable[[], bool]:
    """A check of whether run ``run_id`` has ended, for a server that must outlive every
    reader (compose's object store): True once ``finish`` has asked the routers to stop (at or
    after ``since``) and the store no longer answers, which is how ``finish --shutdown-store``
    ends. Redis away before the request (a fault) is not the end."""
    from ddiloco.store.connect import connect
    from ddiloco.store.redis_store import RedisStore

    state: dict[str, Any] = {"store": None, "requested": False}

    def ended() -> bool:
        try:  # asks Redis every time: its absence is the signal
            if state["store"] is None:
                state["store"] = RedisStore(connect(redis_url, attempts=1, timeout_s=2.0),
                                            run_id)
            if state["store"].stop_requested("routers", since=since):
                state["requested"] = True
            return False
        except (DDilocoError, OSError):
            return bool(state["requested"])
    return ended


@app.command("blobs-server")
def blobs_server(
    data_dir: Annotated[Path, typer.Option(
        "--data-dir", help="the server's data: volumes, filer metadata, weed.log")],
    secrets: Annotated[Path, typer.Option(
        "--secrets", help="env file of the S3 client variables, credentials included: kept "
        "when it exists, else written with new random keys (mode 0600); never printed")],
    endpoint: Annotated[str, typer.Option(
        "--endpoint", help="the URL clients reach the server at (written to --secrets)")],
    port: Annotated[int, typer.Option("--port", help="the S3 port")] = 8333,
    bind: Annotated[str, typer.Option("--bind", help="the S3 port's address")] = "0.0.0.0",
    bucket: Annotated[str, typer.Option("--bucket", help="created at start")] = "ddiloco",
    ready_file: Annotated[Path | None, typer.Option(
        "--ready-file", help="written once the bucket exists (a healthcheck's test)")] = None,
    redis_url: RedisOpt = None,
    run_id: RunIdOpt = None,
) -> None:
    """Serve fragment blobs over S3 (SeaweedFS, `pip install 'ddiloco[objects]'`) in the
    foreground: compose's `blobs` service. Stops on SIGTERM or, given the run's store, once the
    run has ended (finish asked the routers to stop) and the store has been shut down."""
    def go() -> int:
        import time as _time

        from ddiloco.store.embedded_s3 import serve_forever

        stop = run_ended(redis_url, run_id, _time.time()) if redis_url and run_id else None
        return serve_forever(data_dir, secrets, endpoint, port=port, bind=bind, bucket=bucket,
                             ready_file=ready_file, stop_requested=stop)

    guard(go)


@app.command()
def status(
    out: Annotated[Path | None, typer.Option("--out", "-o", help="run directory")] = None,
    redis_url: RedisOpt = None,
    run_id: RunIdOpt = None,
    as_json: Annotated[bool, typer.Option("--json", help="print JSON instead of "
                                          "tables")] = False,
) -> None:
    """Manifest, fragment versions, live learners and shards, merges and drops of a run."""
    def go() -> int:
        from ddiloco.report import render_status, store_status

        with _store_for(redis_url, run_id, out) as store:
            st = store_status(store)
        if as_json:
            print(json.dumps(st, indent=2, default=str))
        else:
            render_status(st)
        return 0

    guard(go)


@app.command()
def sample(
    out: Annotated[Path | None, typer.Option("--out", "-o", help="run directory")] = None,
    redis_url: RedisOpt = None,
    run_id: RunIdOpt = None,
    prompt: Annotated[str, typer.Option("--prompt", help="text the sample starts "
                                        "from")] = "ROMEO.\n",
    n: Annotated[int, typer.Option("--bytes", "-n", help="bytes to generate")] = 300,
    temperature: Annotated[float, typer.Option(
        "--temperature", help="sampling temperature (lower: more likely bytes)")] = 0.8,
    seed: Annotated[int, typer.Option("--seed", help="random seed of the sampling")] = 0,
) -> None:
    """Generate text from the latest global model in the store."""
    def go() -> int:
        setup_jax_from_env(xla_threads=0)
        from ddiloco.report import load_global_params
        from ddiloco.workers.task.model import generate

        with _store_for(redis_url, run_id, out) as store:
            params, cfg = load_global_params(store)
        if cfg.model.task is not None:
            raise DDilocoError(f"sample generates with the built-in GPT; this run trains "
                               f"{cfg.model.task} (export its parameters with `ddiloco "
                               "export` and sample with your own code)")
        text = generate(params, cfg.model_config_obj(), prompt.encode(), n, temperature, seed)
        sys.stdout.write((prompt.encode() + text).decode("utf-8", errors="replace") + "\n")
        return 0

    guard(go)


@app.command()
def export(
    path: Annotated[Path, typer.Argument(help="the file to write, e.g. model.safetensors, "
                                         "model.npz or model.msgpack")],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="run directory")] = None,
    redis_url: RedisOpt = None,
    run_id: RunIdOpt = None,
    fmt: Annotated[ExportFormat | None, typer.Option(
        "--format", "-f", help="safetensors, npz or msgpack (flax.serialization; needs flax); "
        "default: by PATH's suffix, else safetensors")] = None,
) -> None:
    """Write the latest global model, one float32 tensor per leaf path, with the run's
    metadata (model, versions, loss unit). Load it back into your task's parameter tree with
    ddiloco.load_params(PATH, like=params) (docs/API.md)."""
    def go() -> int:
        from ddiloco.export import export_run

        with _store_for(redis_url, run_id, out) as store:
            done = export_run(store, path, None if fmt is None else fmt.value)
        typer.echo(f"wrote {path} ({done['format']}, {done['tensors']} tensors, versions "
                   f"{done['versions']})")
        return 0

    guard(go)


app.add_typer(keys_app, name="keys")
app.add_typer(config_app, name="config")
app.add_typer(store_app, name="store")


@app.command("redis-users")
def redis_users(
    redis_url: RedisOpt = None,
    run_id: RunIdOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    out: Annotated[Path, typer.Option("--out", help="one NAME.redis-url file per worker "
                                      "(mode 0600)")] = Path("redis-users"),
) -> None:
    """Create a Redis ACL user per worker of the run (learners read versions and write their
    own keys; a shard writes only its own fragments; the evaluator reads). --redis-url is an
    admin URL; needs Redis >= 7 (docs/SECURITY.md)."""
    def go() -> int:
        if not redis_url or not run_id:
            raise DDilocoError("redis-users needs --redis-url and --run-id")
        from ddiloco.store.acl import create_users
        from ddiloco.store.connect import connect
        from ddiloco.workers.run.config import load_config

        cfg = load_config(config, set_)
        workers = ([f"learner-{m}" for m in range(cfg.run.learners)]
                   + [f"shard-{s}" for s in range(cfg.run.shards)] + ["evaluator"])
        users = create_users(connect(redis_url), redis_url, run_id, workers,
                             cfg.sync.fragments, cfg.run.shards, out_dir=out)
        for u in users.values():
            typer.echo(f"{u.worker}\t{u.username}\t{out / (u.worker + '.redis-url')}")
        return 0

    guard(go)


chaos_app = new_app("Fault injection: goodput, token fate and an audit of the run under a "
                    "seeded fault script.")
app.add_typer(chaos_app, name="chaos")


@chaos_app.command("run")
def chaos_run(
    script: Annotated[Path, typer.Argument(help="fault script: a bundled script's name (gentle; "
                                           "`ddiloco chaos scripts` lists them) or a YAML "
                                           "file, e.g. chaos/scripts/gentle.yaml")],
    config: ConfigOpt = None,
    set_: SetOpt = None,
    baseline: Annotated[Baseline | None, typer.Option(
        "--baseline", help="also run this baseline under the same faults: dp "
        "(data-parallel)")] = None,
    out: Annotated[Path, typer.Option(
        "--out", "-o", help="where the runs, chaos.json and chaos.png go")] = Path("out-chaos"),
    seed: Annotated[int | None, typer.Option("--seed", help="overrides the script's")] = None,
    learners: Annotated[int | None, typer.Option(
        "--learners", "-M", help="number of learners (run.learners)")] = None,
    shards: Annotated[int | None, typer.Option(
        "--shards", "-S", help="number of syncer shards (run.shards)")] = None,
    reference: Annotated[bool, typer.Option("--reference/--no-reference",
                                            help="also run each mode without faults")] = False,
    isolate: Annotated[bool, typer.Option(
        "--isolate/--no-isolate", help="limit each learner to cores/M (cgroup CPU quota; "
        "root): surviving learners do not speed up on cores a failed one left idle")] = False,
    regions: Annotated[Path | None, typer.Option(
        "--regions", help="topology file: run the workers in emulated regions (root)")] = None,
    live: Annotated[bool, typer.Option(
        "--live/--no-live", help="a live view of the run in the terminal")] = True,
    insecure: InsecureOpt = False,
    compose: Annotated[str | None, typer.Option(
        "--compose", help="a running compose project (e.g. 'ddiloco'): apply the faults to its "
        "containers through the Docker Engine API instead of a local cluster")] = None,
    log_level: LogLevelOpt = None,
    progress_every: ProgressEveryOpt = None,
    force: Annotated[bool, typer.Option(
        "--force", help="replace the earlier chaos run OUT holds (its chaos.json, Redis data, "
        "checkpoints and logs)")] = False,
) -> None:
    """Run the local cluster under SCRIPT (or a compose deployment, --compose); write
    OUT/chaos.json and OUT/chaos.png.

    Exits 1 when an invariant of the audit fails, 2 on bad input."""
    def go() -> int:
        from ddiloco.bundled import resolve_chaos_script
        from ddiloco.chaos.invariants import InvariantViolation
        from ddiloco.chaos.runner import run_chaos
        from ddiloco.workers.run.bundled import resolve_config
        from ddiloco.workers.run.config import load_config

        script_path = resolve_chaos_script(script)  # a name (gentle) or a file; a file wins
        if compose is not None:
            local_only = {"--config": config, "--set": set_, "--baseline": baseline,
                          "--learners": learners, "--shards": shards, "--reference": reference,
                          "--isolate": isolate, "--regions": regions, "--insecure": insecure}
            given = [k for k, v in local_only.items() if v]
            if given:
                raise DDilocoError(f"--compose takes the deployment as it runs: {given} "
                                   "apply to local runs only")
            from ddiloco.chaos.compose import run_compose_chaos

            try:
                run_compose_chaos(script_path, out, project=compose, seed=seed)
            except InvariantViolation as exc:
                typer.secho(f"audit failed: {exc}", fg=typer.colors.RED, err=True)
                return 1
            return 0

        overrides = _cluster_overrides(set_, learners, shards)
        overrides += _follow_overrides(log_level, progress_every)
        if insecure:
            overrides.append("security.curve=false")
        cfg = load_config(config, overrides)
        try:
            run_chaos(cfg, script_path, out,
                      baseline=None if baseline is None else baseline.value,
                      seed=seed, live=live,
                      reference=reference, isolate=isolate,
                      regions=None if regions is None else resolve_config(regions),
                      force=force)
        except InvariantViolation as exc:
            typer.secho(f"audit failed: {exc}", fg=typer.colors.RED, err=True)
            return 1
        return 0

    guard(go, sigterm_interrupts=True)


@chaos_app.command("scripts")
def chaos_scripts(
    configs: Annotated[bool, typer.Option(
        "--configs", help="list the bundled configs instead (--config NAME reads one)")] = False,
    as_json: Annotated[bool, typer.Option("--json", help="print {name: description} as "
                                          "JSON")] = False,
) -> None:
    """List the fault scripts installed with ddiloco, each with its one-line description
    (`ddiloco chaos run NAME` runs one), or with --configs the bundled configs."""
    def go() -> int:
        from ddiloco.bundled import bundled_chaos_scripts, bundled_configs, listing

        entries = bundled_configs() if configs else bundled_chaos_scripts()
        typer.echo(json.dumps(entries, indent=2) if as_json else listing(entries))
        return 0

    guard(go)


@chaos_app.command("report")
def chaos_report(
    out: Annotated[Path, typer.Argument(help="directory of a finished chaos run")],
) -> None:
    """Recompute the accounting and the audit of a finished chaos run from its store and
    rewrite OUT/chaos.json and OUT/chaos.png. Exits 1 when an invariant fails."""
    def go() -> int:
        from ddiloco.chaos.chaos_report import report_stored
        from ddiloco.chaos.invariants import InvariantViolation

        try:
            report_stored(out)
        except InvariantViolation as exc:
            typer.secho(f"audit failed: {exc}", fg=typer.colors.RED, err=True)
            return 1
        return 0

    guard(go)


@app.command()
def regions(
    action: Annotated[str, typer.Argument(help="up | down | status")],
    topology: Annotated[Path | None, typer.Argument(help="topology YAML (for up)")] = None,
    tag: Annotated[str | None, typer.Option(
        "--tag", help="the regions' run tag, [a-z0-9]{1,8} (up: random when omitted)")] = None,
    json_out: Annotated[bool, typer.Option("--json", help="print JSON instead of a "
                                           "table")] = False,
) -> None:
    """Emulated wide-area regions on this machine (network namespaces, shaped links; root):
    up sets them up and measures every link, down removes them, status lists them."""
    def go() -> int:
        from ddiloco.chaos.wan.regions_cli import regions_command
        from ddiloco.workers.run.bundled import resolve_config

        # a bundled topology's name (regions-4) or a file; a file wins
        return regions_command(action, None if topology is None else resolve_config(topology),
                               tag, json_out)

    guard(go)


@app.command()
def simulate(
    json_out: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
    seed: Annotated[int, typer.Option("--seed", help="seed of --monte-carlo traces and of "
                                      "--calibrate's Poisson draws")] = 0,
    chips: Annotated[list[int] | None, typer.Option(
        "--chips", metavar="N", help="total chips (repeat for several; default: the paper's "
        "Table 1)")] = None,
    learners: Annotated[list[int] | None, typer.Option(
        "--learners", "-M", metavar="M", help="learners of Decoupled DiLoCo (repeat for "
        "several; default: the paper's Table 1)")] = None,
    chip_mtbi_s: Annotated[float | None, typer.Option(
        "--chip-mtbi-s", help="mean time between interruptions of one chip, seconds")] = None,
    slice_repair_s: Annotated[float | None, typer.Option(
        "--slice-repair-s", help="time to repair a failed slice, seconds")] = None,
    chips_per_slice: Annotated[int | None, typer.Option(
        "--chips-per-slice", help="chips in one slice (the unit that fails)")] = None,
    param: Annotated[list[str] | None, typer.Option(
        "--param", metavar="NAME=VALUE", help="any model parameter, e.g. detect_s=10 "
        "(docs/SIMULATOR.md)")] = None,
    monte_carlo: Annotated[bool, typer.Option(
        "--monte-carlo", help="simulate one week of failures event by event instead of the "
        "closed form")] = False,
    sensitivity: Annotated[bool, typer.Option(
        "--sensitivity", help="also: goodput of M=8 at 1.2M chips with each parameter "
        "halved and doubled")] = False,
    calibrate: Annotated[Path | None, typer.Option(
        "--calibrate", help="a chaos run's chaos.json: fit the model to it and print "
        "predicted vs measured goodput per mode")] = None,
) -> None:
    """Goodput and uptime of DP, elastic DP and Decoupled DiLoCo at scale, next to the paper's
    Table 1 (closed form of a failure and recovery model; parameters and sources in
    docs/SIMULATOR.md), or the model fitted to a chaos run (--calibrate)."""
    def go() -> int:
        from ddiloco.chaos.simulator_cli import main as sim_main
        from ddiloco.chaos.simulator_cli import parse_params

        named = {"chip_mtbi_s": chip_mtbi_s, "slice_repair_s": slice_repair_s,
                 "chips_per_slice": chips_per_slice}
        overrides = {**parse_params(param or []),
                     **{k: v for k, v in named.items() if v is not None}}
        sim_main(json_out, seed, chips, learners, monte_carlo=monte_carlo,
                 show_sensitivity=sensitivity,
                 calibrate_path=None if calibrate is None else str(calibrate), **overrides)
        return 0

    guard(go)


# The worker commands are the workers layer's own (python -m ddiloco.workers).
app.command()(workers_cli.learner)
app.command()(workers_cli.syncer)
app.command()(workers_cli.evaluator)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
