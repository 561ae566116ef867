"""``ddiloco``: the command line.

``run`` is the main job (a local multi-learner run); ``learner``, ``syncer`` and ``evaluator``
run one worker each against a shared Redis URL (separate hosts); ``status``, ``sample`` and
``export`` read a run's store. Errors of ddiloco (bad config, unreachable Redis, missing corpus)
end with a one-line message and exit code 2, not a traceback.
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any

import typer

from pipeline.errors import DDilocoError

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Decoupled DiLoCo: asynchronous, fault-tolerant, low-bandwidth training.")

RedisOpt = Annotated[str | None, typer.Option("--redis-url", envvar="DDILOCO_REDIS_URL",
                                              help="redis:// or rediss:// URL")]
RunIdOpt = Annotated[str | None, typer.Option("--run-id", envvar="DDILOCO_RUN_ID")]
ConfigOpt = Annotated[Path | None, typer.Option("--config", "-c", help="TOML or YAML file")]
SetOpt = Annotated[list[str] | None, typer.Option("--set", help="override, e.g. sync.H=12")]
MetricsPortOpt = Annotated[int | None, typer.Option(
    "--metrics-port", help="serve Prometheus metrics on this port (/metrics)")]
InsecureOpt = Annotated[bool, typer.Option(
    "--insecure", help="plain TCP instead of CURVE (security.curve=false): anyone who reaches "
    "a shard's port can change the model; refused on a non-loopback bind")]


def _fail(exc: BaseException) -> None:
    typer.secho(f"error: {exc}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def _guard(fn: Callable[[], int | None], *, sigterm_interrupts: bool = False) -> None:
    """Run a command body: a :class:`DDilocoError` exits 2 with its message, Ctrl-C exits 130.
    ``sigterm_interrupts``: SIGTERM acts as Ctrl-C (for the commands that own workers, Redis
    or regions: ``kill PID`` then stops and removes them as Ctrl-C does)."""
    if sigterm_interrupts:
        signal.signal(signal.SIGTERM, _interrupt)
    try:
        code = fn()
    except DDilocoError as exc:
        _fail(exc)
    except KeyboardInterrupt:
        # Ctrl-C: the context managers below have already stopped the workers, the embedded
        # Redis and the emulated regions on the way out.
        typer.secho("interrupted", fg=typer.colors.YELLOW, err=True)
        raise typer.Exit(130) from None
    raise typer.Exit(code or 0)


def _cluster_overrides(set_: list[str] | None, learners: int | None,
                       shards: int | None) -> list[str]:
    """``--set`` overrides plus the ``-M`` / ``-S`` shortcuts."""
    overrides = list(set_ or [])
    if learners is not None:
        overrides.append(f"run.learners={learners}")
    if shards is not None:
        overrides.append(f"run.shards={shards}")
    return overrides


def _open_store(redis_url: str, run_id: str) -> Any:
    from store.connect import connect
    from store.redis_store import RedisStore

    return RedisStore(connect(redis_url), run_id)


@contextmanager
def _store_for(redis_url: str | None, run_id: str | None, out: Path | None) -> Iterator[Any]:
    """A store from a URL, or from a run directory (starting its embedded Redis if needed)."""
    from store.embedded import EmbeddedRedis

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
        from store.connect import connect

        try:
            connect(info["live_url"], attempts=1)
            url = info["live_url"]
        except DDilocoError:
            url = None
    if url:
        yield _open_store(url, run_id)
        return
    if out is None:
        raise DDilocoError("no Redis: pass --redis-url or --out RUN_DIR")
    with EmbeddedRedis(out / "redis") as server:
        yield _open_store(server.url, run_id)


def _jax(xla_threads: int | None = None, cpu: int | None = None) -> None:
    from workers.runtime import setup_jax

    if xla_threads is None:
        xla_threads = int(os.environ.get("DDILOCO_XLA_THREADS", "1"))
    cache = os.environ.get("DDILOCO_JAX_CACHE")
    setup_jax(Path(cache) if cache else None, xla_threads, cpu)


def _pin_core(learner_id: str, pin: bool) -> int | None:
    """Core for learner ``name-<i>``: i mod usable cores (None when not pinning)."""
    if not pin or not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    tail = learner_id.rsplit("-", 1)[-1]
    return cores[int(tail) % len(cores)] if tail.isdigit() else None


@app.command()
def run(
    config: ConfigOpt = None,
    set_: SetOpt = None,
    baseline: Annotated[str | None, typer.Option("--baseline", help="'dp': also train the "
                                                 "data-parallel baseline")] = None,
    out: Annotated[Path, typer.Option("--out", "-o")] = Path("out"),
    redis_url: RedisOpt = None,
    resume: Annotated[Path | None, typer.Option("--resume", help="resume RUN_DIR")] = None,
    learners: Annotated[int | None, typer.Option("--learners", "-M")] = None,
    shards: Annotated[int | None, typer.Option("--shards", "-S")] = None,
    steps: Annotated[int | None, typer.Option("--steps")] = None,
    corpus: Annotated[list[Path] | None, typer.Option("--corpus", help="text file or dir")] = None,
    live: Annotated[bool, typer.Option("--live/--no-live")] = True,
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
) -> None:
    """Train M learners and S syncer shards on this machine; write OUT/report.json and .png."""
    def go() -> int:
        from ddiloco.localrun import run_local
        from workers.config import load_config

        overrides = _cluster_overrides(set_, learners, shards)
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
        if baseline not in (None, "dp"):
            raise DDilocoError(f"--baseline: unknown {baseline!r} (only 'dp')")
        if baseline_only and baseline is None:
            raise DDilocoError("--baseline-only needs --baseline dp")
        if resume is not None and config is None:
            # Resume with the run's own configuration; overrides (e.g. --steps) still apply.
            info_path = resume / "run.json"
            if not info_path.exists():
                raise DDilocoError(f"--resume {resume}: no run.json there")
            base = json.loads(info_path.read_text()).get("config", {})
            cfg = load_config(None, overrides, base=base)
        else:
            cfg = load_config(config, overrides)
        run_local(cfg, resume or out, baseline=baseline, resume=resume is not None, live=live,
                  regions=regions, baseline_only=baseline_only)
        return 0

    _guard(go, sigterm_interrupts=True)


@app.command()
def learner(
    id: Annotated[str, typer.Option("--id", help="learner id, e.g. learner-0")],
    redis_url: RedisOpt = None,
    run_id: RunIdOpt = None,
    run_dir: Annotated[Path, typer.Option("--run-dir")] = Path("out"),
    steps: Annotated[int | None, typer.Option("--steps")] = None,
    pin: Annotated[bool, typer.Option("--pin/--no-pin", help="pin to core (index mod cores)")]
    = False,
    coordinator: Annotated[str | None, typer.Option(
        "--coordinator", help="host:port of process 0: this learner spans --num-processes "
        "jax.distributed processes (docs/API.md)")] = None,
    num_processes: Annotated[int, typer.Option("--num-processes")] = 1,
    process_id: Annotated[int, typer.Option("--process-id")] = 0,
    metrics_port: MetricsPortOpt = None,
) -> None:
    """Run one learner against the run's store (only the Redis URL and its id are needed).
    With --coordinator, run process --process-id of a learner that spans several processes or
    hosts: process 0 talks to the shards and the store, the others compute."""
    def go() -> int:
        if not redis_url or not run_id:
            raise DDilocoError("learner needs --redis-url and --run-id")
        _jax(cpu=_pin_core(id, pin))
        if coordinator is not None:
            from workers.multihost import Distributed, initialize

            initialize(Distributed(coordinator, num_processes, process_id))
        from workers.learner import run_learner

        return run_learner(_open_store(redis_url, run_id), _open_store(redis_url, run_id), id,
                           run_dir, steps, multiprocess=coordinator is not None,
                           metrics_port=metrics_port)

    _guard(go)


@app.command()
def syncer(
    shard: Annotated[int, typer.Option("--shard")],
    redis_url: RedisOpt = None,
    run_id: RunIdOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    bind: Annotated[str, typer.Option("--bind", help="bind address")] = "127.0.0.1",
    advertise: Annotated[str | None, typer.Option("--advertise",
                                                  help="address learners connect to")] = None,
    pull_port: Annotated[int, typer.Option("--pull-port")] = 0,
    pub_port: Annotated[int, typer.Option("--pub-port")] = 0,
    metrics_port: MetricsPortOpt = None,
) -> None:
    """Run one syncer shard. With --config it writes the run manifest if the run has none."""
    def go() -> int:
        if not redis_url or not run_id:
            raise DDilocoError("syncer needs --redis-url and --run-id")
        _jax()
        from workers.syncer import serve

        store = _open_store(redis_url, run_id)
        if config is not None or set_:
            from pipeline.fragments import fragments_of_shard
            from workers.config import load_config
            from workers.runtime import init_run

            cfg = load_config(config, set_)
            # The init step, for this shard's fragments only: each shard may write just
            # its own fragments' keys (store/acl.py).
            init_run(store, cfg, run_id, fragments_of_shard(
                shard, cfg.sync.fragments, cfg.run.shards))
        return serve(store, shard, bind_host=bind, advertise_host=advertise,
                     pull_port=pull_port, pub_port=pub_port, metrics_port=metrics_port)

    _guard(go)


@app.command()
def evaluator(
    redis_url: RedisOpt = None,
    run_id: RunIdOpt = None,
    every: Annotated[float | None, typer.Option("--every", help="seconds")] = None,
    once: Annotated[bool, typer.Option("--once")] = False,
    metrics_port: MetricsPortOpt = None,
) -> None:
    """Evaluate the global model in the store every N seconds."""
    def go() -> int:
        if not redis_url or not run_id:
            raise DDilocoError("evaluator needs --redis-url and --run-id")
        _jax()
        from workers.evaluator import run_evaluator

        return run_evaluator(_open_store(redis_url, run_id), every, once,
                             metrics_port=metrics_port)

    _guard(go)


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

        report = finish_run(_open_store(redis_url, run_id), out, learners_timeout_s=timeout,
                            shutdown_store=shutdown_store)
        print_summary(report)
        return 0

    _guard(go, sigterm_interrupts=True)


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

        from chaos.router import serve_router
        from chaos.topology import load_topology

        stop = None
        if redis_url and run_id:
            store = _open_store(redis_url, run_id)
            started = _time.time()

            def stop() -> bool:
                return bool(store.stop_requested("routers", since=started))
        return serve_router(load_topology(topology), region, hub, lan, wan,
                            stop_requested=stop)

    _guard(go)


@app.command()
def status(
    out: Annotated[Path | None, typer.Option("--out", "-o", help="run directory")] = None,
    redis_url: RedisOpt = None,
    run_id: RunIdOpt = None,
    as_json: Annotated[bool, typer.Option("--json")] = False,
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

    _guard(go)


@app.command()
def sample(
    out: Annotated[Path | None, typer.Option("--out", "-o", help="run directory")] = None,
    redis_url: RedisOpt = None,
    run_id: RunIdOpt = None,
    prompt: Annotated[str, typer.Option("--prompt")] = "ROMEO.\n",
    n: Annotated[int, typer.Option("--bytes", "-n")] = 300,
    temperature: Annotated[float, typer.Option("--temperature")] = 0.8,
    seed: Annotated[int, typer.Option("--seed")] = 0,
) -> None:
    """Generate text from the latest global model in the store."""
    def go() -> int:
        _jax(xla_threads=0)
        from ddiloco.report import load_global_params
        from workers.model import generate

        with _store_for(redis_url, run_id, out) as store:
            params, cfg = load_global_params(store)
        if cfg.model.task is not None:
            raise DDilocoError(f"sample generates with the built-in GPT; this run trains "
                               f"{cfg.model.task} (export its parameters with `ddiloco "
                               "export` and sample with your own code)")
        text = generate(params, cfg.model_config_obj(), prompt.encode(), n, temperature, seed)
        sys.stdout.write((prompt.encode() + text).decode("utf-8", errors="replace") + "\n")
        return 0

    _guard(go)


@app.command()
def export(
    path: Annotated[Path, typer.Argument(help="output .safetensors file")],
    out: Annotated[Path | None, typer.Option("--out", "-o", help="run directory")] = None,
    redis_url: RedisOpt = None,
    run_id: RunIdOpt = None,
) -> None:
    """Write the latest global model as a safetensors checkpoint (with the model config)."""
    def go() -> int:
        from dataclasses import asdict

        from safetensors.numpy import save_file

        from ddiloco.report import load_global_params

        with _store_for(redis_url, run_id, out) as store:
            params, cfg = load_global_params(store)
            versions = [h.version if h else -1
                        for h in store.heads(len(store.get_manifest()["layout"]))]
        model = (asdict(cfg.model_config_obj()) if cfg.model.task is None
                 else {"task": cfg.model.task})
        meta = {"model": json.dumps(model),
                "versions": json.dumps(versions), "format": "ddiloco"}
        path.parent.mkdir(parents=True, exist_ok=True)
        save_file({k: v for k, v in params.items()}, str(path), metadata=meta)
        typer.echo(f"wrote {path} ({len(params)} tensors, versions {versions})")
        return 0

    _guard(go)


keys_app = typer.Typer(no_args_is_help=True, help="CURVE key pairs of workers "
                       "(docs/SECURITY.md)")
app.add_typer(keys_app, name="keys")


@keys_app.command("new")
def keys_new(
    names: Annotated[list[str], typer.Argument(help="worker ids, e.g. learner-0 shard-0")],
    keys_dir: Annotated[Path, typer.Option("--dir", help="key directory")] = Path("keys"),
    force: Annotated[bool, typer.Option("--force", help="replace existing keys")] = False,
    exist_ok: Annotated[bool, typer.Option("--exist-ok", help="keep existing keys (e.g. a "
                                           "deployment's init step run again)")] = False,
) -> None:
    """Create a key pair per worker: DIR/NAME.key (public, the allow-list) and
    DIR/private/NAME.key_secret (mode 0600; give it to that worker only)."""
    def go() -> int:
        from pipeline.security import create_keys, load_keys

        for name in names:
            if exist_ok and not force and (keys_dir / "private" / f"{name}.key_secret").exists():
                kp = load_keys(keys_dir, name)
            else:
                kp = create_keys(keys_dir, name, overwrite=force)
            typer.echo(f"{name}: {kp.public.decode()}  ({keys_dir}/{name}.key)")
        return 0

    _guard(go)


@keys_app.command("list")
def keys_list(
    keys_dir: Annotated[Path, typer.Option("--dir", help="key directory")] = Path("keys"),
) -> None:
    """The allow-list: every public certificate in DIR, by worker id."""
    def go() -> int:
        from pipeline.security import allow_list

        for public, name in sorted(allow_list(keys_dir).items(), key=lambda kv: kv[1]):
            typer.echo(f"{name}\t{public.decode()}")
        return 0

    _guard(go)


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
        from store.acl import create_users
        from store.connect import connect
        from workers.config import load_config

        cfg = load_config(config, set_)
        workers = ([f"learner-{m}" for m in range(cfg.run.learners)]
                   + [f"shard-{s}" for s in range(cfg.run.shards)] + ["evaluator"])
        users = create_users(connect(redis_url), redis_url, run_id, workers,
                             cfg.sync.fragments, cfg.run.shards, out_dir=out)
        for u in users.values():
            typer.echo(f"{u.worker}\t{u.username}\t{out / (u.worker + '.redis-url')}")
        return 0

    _guard(go)


chaos_app = typer.Typer(no_args_is_help=True, help="Fault injection: goodput, token fate and "
                        "an audit of the run under a seeded fault script.")
app.add_typer(chaos_app, name="chaos")


@chaos_app.command("run")
def chaos_run(
    script: Annotated[Path, typer.Argument(help="fault script (YAML), e.g. "
                                           "chaos/scripts/gentle.yaml")],
    config: ConfigOpt = None,
    set_: SetOpt = None,
    baseline: Annotated[str | None, typer.Option("--baseline", help="'dp': the data-parallel "
                                                 "baseline under the same faults")] = None,
    out: Annotated[Path, typer.Option("--out", "-o")] = Path("out-chaos"),
    seed: Annotated[int | None, typer.Option("--seed", help="overrides the script's")] = None,
    learners: Annotated[int | None, typer.Option("--learners", "-M")] = None,
    shards: Annotated[int | None, typer.Option("--shards", "-S")] = None,
    reference: Annotated[bool, typer.Option("--reference/--no-reference",
                                            help="also run each mode without faults")] = False,
    isolate: Annotated[bool, typer.Option(
        "--isolate/--no-isolate", help="limit each learner to cores/M (cgroup CPU quota; "
        "root): surviving learners do not speed up on cores a failed one left idle")] = False,
    regions: Annotated[Path | None, typer.Option(
        "--regions", help="topology file: run the workers in emulated regions (root)")] = None,
    live: Annotated[bool, typer.Option("--live/--no-live")] = True,
    insecure: InsecureOpt = False,
    compose: Annotated[str | None, typer.Option(
        "--compose", help="a running compose project (e.g. 'ddiloco'): apply the faults to its "
        "containers through the Docker Engine API instead of a local cluster")] = None,
) -> None:
    """Run the local cluster under SCRIPT (or a compose deployment, --compose); write
    OUT/chaos.json and OUT/chaos.png.

    Exits 1 when an invariant of the audit fails, 2 on bad input."""
    def go() -> int:
        from chaos.invariants import InvariantViolation
        from chaos.runner import run_chaos
        from workers.config import load_config

        if compose is not None:
            local_only = {"--config": config, "--set": set_, "--baseline": baseline,
                          "--learners": learners, "--shards": shards, "--reference": reference,
                          "--isolate": isolate, "--regions": regions, "--insecure": insecure}
            given = [k for k, v in local_only.items() if v]
            if given:
                raise DDilocoError(f"--compose takes the deployment as it runs: {given} "
                                   "apply to local runs only")
            from chaos.compose import run_compose_chaos

            try:
                run_compose_chaos(script, out, project=compose, seed=seed)
            except InvariantViolation as exc:
                typer.secho(f"audit failed: {exc}", fg=typer.colors.RED, err=True)
                return 1
            return 0

        overrides = _cluster_overrides(set_, learners, shards)
        if insecure:
            overrides.append("security.curve=false")
        if baseline not in (None, "dp"):
            raise DDilocoError(f"--baseline: unknown {baseline!r} (only 'dp')")
        cfg = load_config(config, overrides)
        try:
            run_chaos(cfg, script, out, baseline=baseline, seed=seed, live=live,
                      reference=reference, isolate=isolate, regions=regions)
        except InvariantViolation as exc:
            typer.secho(f"audit failed: {exc}", fg=typer.colors.RED, err=True)
            return 1
        return 0

    _guard(go, sigterm_interrupts=True)


@chaos_app.command("report")
def chaos_report(
    out: Annotated[Path, typer.Argument(help="directory of a finished chaos run")],
) -> None:
    """Recompute the accounting and the audit of a finished chaos run from its store and
    rewrite OUT/chaos.json and OUT/chaos.png. Exits 1 when an invariant fails."""
    def go() -> int:
        from chaos.invariants import InvariantViolation
        from chaos.runner import report_stored

        try:
            report_stored(out)
        except InvariantViolation as exc:
            typer.secho(f"audit failed: {exc}", fg=typer.colors.RED, err=True)
            return 1
        return 0

    _guard(go)


@app.command()
def regions(
    action: Annotated[str, typer.Argument(help="up | down | status")],
    topology: Annotated[Path | None, typer.Argument(help="topology YAML (for up)")] = None,
    tag: Annotated[str | None, typer.Option("--tag", help="the regions' run tag")] = None,
    json_out: Annotated[bool, typer.Option("--json")] = False,
) -> None:
    """Emulated wide-area regions on this machine (network namespaces, shaped links; root):
    up sets them up and measures every link, down removes them, status lists them."""
    def go() -> int:
        from chaos.regions import regions_command

        return regions_command(action, topology, tag, json_out)

    _guard(go)


@app.command()
def simulate(
    json_out: Annotated[bool, typer.Option("--json", help="print JSON")] = False,
    seed: Annotated[int, typer.Option("--seed", help="seed of --monte-carlo traces and of "
                                      "--calibrate's Poisson draws")] = 0,
    chips: Annotated[list[int] | None, typer.Option("--chips")] = None,
    learners: Annotated[list[int] | None, typer.Option("--learners", "-M")] = None,
    chip_mtbi_s: Annotated[float | None, typer.Option("--chip-mtbi-s")] = None,
    slice_repair_s: Annotated[float | None, typer.Option("--slice-repair-s")] = None,
    chips_per_slice: Annotated[int | None, typer.Option("--chips-per-slice")] = None,
    param: Annotated[list[str] | None, typer.Option(
        "--param", help="any model parameter, e.g. detect_s=10 (docs/SIMULATOR.md)")] = None,
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
        from chaos.simulator import main as sim_main
        from chaos.simulator import parse_params

        named = {"chip_mtbi_s": chip_mtbi_s, "slice_repair_s": slice_repair_s,
                 "chips_per_slice": chips_per_slice}
        overrides = {**parse_params(param or []),
                     **{k: v for k, v in named.items() if v is not None}}
        sim_main(json_out, seed, chips, learners, monte_carlo=monte_carlo,
                 show_sensitivity=sensitivity,
                 calibrate_path=None if calibrate is None else str(calibrate), **overrides)
        return 0

    _guard(go)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
