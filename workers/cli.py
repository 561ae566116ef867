"""``python -m ddiloco.workers``: one worker process of a run (learner, syncer shard or
evaluator), and the error handling every command line of ddiloco shares.

This is the workers layer's own entry point: :class:`~ddiloco.workers.run.launch.LocalCluster`
starts its workers through it, and ``ddiloco learner`` / ``syncer`` / ``evaluator`` are the same
commands. Errors a user can cause (bad config, unreachable Redis, a path that cannot be
written) end with a one-line message and exit code 2, not a traceback (:func:`guard`); Ctrl-C
exits 130. Help and errors are printed as written: no rich markup (:func:`new_app`).
"""

from __future__ import annotations

import errno
import os
import signal
import sys
from collections.abc import Callable
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, NoReturn

import typer

from ddiloco.pipeline.errors import DDilocoError
from ddiloco.store.redis_store import RedisStore

RedisOpt = Annotated[str | None, typer.Option("--redis-url", envvar="DDILOCO_REDIS_URL",
                                              help="redis:// or rediss:// URL")]
RunIdOpt = Annotated[str | None, typer.Option(
    "--run-id", envvar="DDILOCO_RUN_ID",
    help="the run's id in the store (run_id in OUT/run.json)")]
ConfigOpt = Annotated[Path | None, typer.Option(
    "--config", "-c", help="TOML or YAML file, or a bundled config's name (ci-tiny; `ddiloco "
    "chaos scripts --configs` lists them)")]
SetOpt = Annotated[list[str] | None, typer.Option(
    "--set", metavar="KEY=VALUE", help="override a config key, e.g. sync.H=12 (repeat for "
    "several)")]
MetricsPortOpt = Annotated[int | None, typer.Option(
    "--metrics-port", help="serve Prometheus metrics on this port (/metrics)")]


class LogLevel(str, Enum):
    """The log levels of ``--log-level`` (:data:`ddiloco.workers.run.runtime.LOG_LEVELS`)."""

    debug = "debug"
    info = "info"
    warning = "warning"
    error = "error"


LogLevelOpt = Annotated[LogLevel | None, typer.Option(
    "--log-level", envvar="DDILOCO_LOG_LEVEL", case_sensitive=False,
    help="Python logging level of the worker processes (debug, info, warning, error; "
    "default info); a local run passes it to its workers as DDILOCO_LOG_LEVEL, and their logs "
    "are OUT/<mode>/logs/<worker>.log")]
InsecureOpt = Annotated[bool, typer.Option(
    "--insecure", help="plain TCP instead of CURVE (security.curve=false): anyone who reaches "
    "a shard's port can change the model; refused on a non-loopback bind")]


def new_app(help: str, **settings: Any) -> typer.Typer:
    """A ddiloco command group: help printed as written (no rich markup, so ``[...]`` such as
    ``'ddiloco[wan]'`` survives), and "Did you mean 'run'?" for a mistyped command (typer's
    own difflib suggestions). The root app's settings apply to every group added under it."""
    base: dict[str, Any] = {"add_completion": False, "no_args_is_help": True,
                            "rich_markup_mode": None, "suggest_commands": True}
    return typer.Typer(help=help, **{**base, **settings})


app = new_app("One worker of a ddiloco run (started by `ddiloco run`, or by hand).")


def _yaml_problem(exc: Exception) -> str:
    """One line for a YAML error: ``file:line:column: problem`` where PyYAML marks it."""
    mark = getattr(exc, "problem_mark", None)
    problem = getattr(exc, "problem", None) or " ".join(str(exc).split())
    if mark is None:
        return str(problem)
    return f"{mark.name}:{mark.line + 1}:{mark.column + 1}: {problem}"


def user_error_message(exc: BaseException) -> str | None:
    """The one-line message of an error the user caused, or None for anything else (a bug,
    which keeps its traceback).

    User errors: a :class:`DDilocoError` (its text); an :class:`OSError` of the file system
    (``<path>: <reason>``, e.g. ``/dev/null/out: Not a directory``); and a pydantic
    ``ValidationError`` or a YAML error that no module turned into a :class:`DDilocoError`
    (field paths and reasons on one line). A broken pipe is not one: typer exits quietly."""
    if isinstance(exc, DDilocoError):
        return str(exc)
    if isinstance(exc, OSError):
        if exc.errno == errno.EPIPE:
            return None
        reason = exc.strerror or str(exc)
        if exc.filename is None:
            return reason
        if isinstance(exc, FileExistsError) and os.path.lexists(exc.filename) \
                and not os.path.isdir(exc.filename):
            # mkdir(exist_ok=True) on a file (export /dev/null/x): "File exists" hides the fix.
            reason = "exists and is not a directory"
        where = str(exc.filename)
        if exc.filename2 is not None:
            where += f" -> {exc.filename2}"
        return f"{where}: {reason}"
    # Only modules already imported can have raised these: no import cost on the error path.
    pydantic = sys.modules.get("pydantic")
    if pydantic is not None and isinstance(exc, pydantic.ValidationError):
        problems = "; ".join(
            f"{'.'.join(str(part) for part in err['loc']) or exc.title}: {err['msg']}"
            for err in exc.errors())
        return f"invalid {exc.title}: {problems}"
    yaml = sys.modules.get("yaml")
    if yaml is not None and isinstance(exc, yaml.YAMLError):
        return f"malformed YAML: {_yaml_problem(exc)}"
    return None


def fail(exc: BaseException | str) -> NoReturn:
    """Print ``error: <message>`` on stderr and exit 2. The text is printed literally
    (``typer.secho``, not rich: ``[a-z0-9]{1,8}`` stays as written)."""
    message = exc if isinstance(exc, str) else user_error_message(exc) or str(exc)
    typer.secho(f"error: {message}", fg=typer.colors.RED, err=True)
    raise typer.Exit(2)


def interrupt(signum: int, frame: Any) -> None:
    """A signal handler that turns the signal into Ctrl-C."""
    raise KeyboardInterrupt


def guard(fn: Callable[[], int | None], *, sigterm_interrupts: bool = False) -> None:
    """Run a command body: a user error (:func:`user_error_message`: a :class:`DDilocoError`,
    a file-system ``OSError``, a stray pydantic or YAML error) exits 2 with one line, Ctrl-C
    exits 130, anything else (a bug) keeps its traceback. ``sigterm_interrupts``: SIGTERM acts
    as Ctrl-C (for the commands that own workers, Redis or regions: ``kill PID`` then stops and
    removes them as Ctrl-C does).

    Raises:
        typer.Exit: always, with the body's return code (0 for None), 2 or 130.
    """
    if sigterm_interrupts:
        signal.signal(signal.SIGTERM, interrupt)
    try:
        code = fn()
    except Exception as exc:
        message = user_error_message(exc)
        if message is None:
            raise
        fail(message)
    except KeyboardInterrupt:
        # Ctrl-C: the context managers below have already stopped the workers, the embedded
        # Redis and the emulated regions on the way out.
        typer.secho("interrupted", fg=typer.colors.YELLOW, err=True)
        raise typer.Exit(130) from None
    raise typer.Exit(code or 0)


def open_store(redis_url: str, run_id: str, worker: str | None = None) -> RedisStore:
    """The store of run ``run_id`` at ``redis_url`` (retrying client). A worker process
    (``worker``: its name) gets it through the failpoints ``DDILOCO_FAILPOINTS`` arms for it
    (:mod:`ddiloco.store.failpoints`; the store itself when none are).

    Raises:
        StoreUnavailable: Redis cannot be reached.
        UnknownFailpoint: ``DDILOCO_FAILPOINTS`` names an unknown point or place.
    """
    from ddiloco.store.connect import connect
    from ddiloco.store.failpoints import with_failpoints

    store = RedisStore(connect(redis_url), run_id)
    return store if worker is None else with_failpoints(store, worker=worker)


def setup_jax_from_env(xla_threads: int | None = None, cpu: int | None = None) -> None:
    """Set JAX up from the variables a launcher sets (``DDILOCO_XLA_THREADS``,
    ``DDILOCO_JAX_CACHE``); ``cpu``: pin this process to that core."""
    from ddiloco.workers.run.runtime import setup_jax

    if xla_threads is None:
        xla_threads = int(os.environ.get("DDILOCO_XLA_THREADS", "1"))
    cache = os.environ.get("DDILOCO_JAX_CACHE")
    setup_jax(Path(cache) if cache else None, xla_threads, cpu)


def apply_log_level(level: LogLevel | str | None) -> None:
    """Make ``level`` (``--log-level``) this worker's log level: the environment variable
    :func:`ddiloco.workers.run.runtime.setup_logging` reads (None: leave it as it is)."""
    if level is not None:
        from ddiloco.workers.run.runtime import LOG_LEVEL_ENV

        os.environ[LOG_LEVEL_ENV] = LogLevel(level).value


@app.command()
def learner(
    id: Annotated[str, typer.Option("--id", help="learner id, e.g. learner-0")],
    redis_url: RedisOpt = None,
    run_id: RunIdOpt = None,
    run_dir: Annotated[Path, typer.Option(
        "--run-dir", help="where this learner keeps its checkpoints (RUN_DIR/learners/ID) "
        "and the compilation cache")] = Path("out"),
    steps: Annotated[int | None, typer.Option(
        "--steps", help="stop after this many inner steps (default: the run's "
        "train.steps)")] = None,
    pin: Annotated[bool, typer.Option("--pin/--no-pin", help="pin to core (index mod cores)")]
    = False,
    coordinator: Annotated[str | None, typer.Option(
        "--coordinator", help="host:port of process 0: this learner spans --num-processes "
        "jax.distributed processes (docs/API.md)")] = None,
    num_processes: Annotated[int, typer.Option(
        "--num-processes", help="number of processes this learner spans (with "
        "--coordinator)")] = 1,
    process_id: Annotated[int, typer.Option(
        "--process-id", help="this process's index, 0 .. --num-processes - 1 (0 talks to "
        "the shards and the store)")] = 0,
    metrics_port: MetricsPortOpt = None,
    log_level: LogLevelOpt = None,
) -> None:
    """Run one learner against the run's store (only the Redis URL and its id are needed).
    With --coordinator, run process --process-id of a learner that spans several processes or
    hosts: process 0 talks to the shards and the store, the others compute."""
    def go() -> int:
        if not redis_url or not run_id:
            raise DDilocoError("learner needs --redis-url and --run-id")
        apply_log_level(log_level)
        from ddiloco.workers.run.runtime import pin_core

        setup_jax_from_env(cpu=pin_core(id, pin))
        if coordinator is not None:
            from ddiloco.workers.learner.multihost import Distributed, initialize

            initialize(Distributed(coordinator, num_processes, process_id))
        from ddiloco.workers.roles import run_learner

        return run_learner(open_store(redis_url, run_id, id), open_store(redis_url, run_id, id),
                           id,
                           run_dir, steps, multiprocess=coordinator is not None,
                           metrics_port=metrics_port)

    guard(go)


@app.command()
def standby(
    redis_url: RedisOpt = None,
    run_id: RunIdOpt = None,
    run_dir: Annotated[Path, typer.Option(
        "--run-dir", help="where the learner it becomes keeps its checkpoints "
        "(RUN_DIR/learners/ID) and the compilation cache")] = Path("out"),
    log_level: LogLevelOpt = None,
) -> None:
    """A standby learner: build the run's task and compile its inner step, then wait for one
    line of JSON on standard input naming the learner to become ({"id": "learner-1",
    "redis_url": "redis://...", "log": null, "steps": null, "cpu": null, "metrics_port": null})
    and run as that learner. It exits 0 if standard input ends first. `ddiloco run` keeps
    run.standby_learners of them."""
    def go() -> int:
        import time

        if not redis_url or not run_id:
            raise DDilocoError("standby needs --redis-url and --run-id")
        apply_log_level(log_level)
        setup_jax_from_env()
        from ddiloco.workers.learner.standby import STANDBY_NAME, become, read_handover, warm
        from ddiloco.workers.roles import run_learner
        from ddiloco.workers.run.manifest import wait_for_manifest
        from ddiloco.workers.run.runtime import setup_logging

        log = setup_logging(STANDBY_NAME)
        manifest = wait_for_manifest(open_store(redis_url, run_id))
        prepared = warm(manifest, log)
        handover = read_handover(sys.stdin)
        if handover is None:
            log.info("standby: standard input closed before a handover; exiting")
            return 0
        handed_over = time.time()
        become(handover)
        return run_learner(open_store(handover.redis_url, run_id, handover.id),
                           open_store(handover.redis_url, run_id, handover.id), handover.id,
                           run_dir, handover.steps, metrics_port=handover.metrics_port,
                           prepared=prepared, handed_over=handed_over)

    guard(go)


@app.command()
def syncer(
    shard: Annotated[int, typer.Option("--shard", help="this shard's index, 0 .. "
                                       "run.shards - 1")],
    redis_url: RedisOpt = None,
    run_id: RunIdOpt = None,
    config: ConfigOpt = None,
    set_: SetOpt = None,
    bind: Annotated[str | None, typer.Option(
        "--bind", help="bind address (default: run.bind_host of --config, else "
        "127.0.0.1)")] = None,
    advertise: Annotated[str | None, typer.Option(
        "--advertise", help="address learners connect to, announced in the store (default: "
        "run.advertise_host of --config, else the bind address)")] = None,
    pull_port: Annotated[int, typer.Option(
        "--pull-port", help="port learners send fragment deltas to (0: any free port; the "
        "shard announces it in the store)")] = 0,
    pub_port: Annotated[int, typer.Option(
        "--pub-port", help="port new versions are broadcast on (0: any free port; the "
        "shard announces it in the store)")] = 0,
    metrics_port: MetricsPortOpt = None,
    log_level: LogLevelOpt = None,
) -> None:
    """Run one syncer shard. With --config it writes the run manifest if the run has none."""
    def go() -> int:
        if not redis_url or not run_id:
            raise DDilocoError("syncer needs --redis-url and --run-id")
        apply_log_level(log_level)
        setup_jax_from_env()
        from ddiloco.workers.roles import serve

        store = open_store(redis_url, run_id, f"shard-{shard}")
        host, announce = bind or "127.0.0.1", advertise
        if config is not None or set_:
            from ddiloco.pipeline.fragments import fragments_of_shard
            from ddiloco.workers.run.config import load_config
            from ddiloco.workers.run.manifest import init_run

            cfg = load_config(config, set_)
            # The init step, for this shard's fragments only: each shard may write just
            # its own fragments' keys (store/acl.py).
            init_run(store, cfg, run_id, fragments_of_shard(
                shard, cfg.sync.fragments, cfg.run.shards))
            # The options win over the file (one file may serve shards on several hosts).
            host, announce = bind or cfg.run.bind_host, advertise or cfg.run.advertise_host
        return serve(store, shard, bind_host=host, advertise_host=announce,
                     pull_port=pull_port, pub_port=pub_port, metrics_port=metrics_port)

    guard(go)


@app.command()
def evaluator(
    redis_url: RedisOpt = None,
    run_id: RunIdOpt = None,
    every: Annotated[float | None, typer.Option(
        "--every", help="seconds between evaluations (default: the run's "
        "run.eval_every_s)")] = None,
    once: Annotated[bool, typer.Option("--once", help="evaluate once, then exit")] = False,
    metrics_port: MetricsPortOpt = None,
    run_dir: Annotated[Path, typer.Option(
        "--run-dir", help="where the tracking section's files go: RUN_DIR/tensorboard/, "
        "RUN_DIR/wandb/")] = Path("out"),
    log_level: LogLevelOpt = None,
) -> None:
    """Evaluate the global model in the store every N seconds (and log it to TensorBoard or
    W&B when the run's tracking section asks for it)."""
    def go() -> int:
        if not redis_url or not run_id:
            raise DDilocoError("evaluator needs --redis-url and --run-id")
        apply_log_level(log_level)
        setup_jax_from_env()
        from ddiloco.workers.evaluator import run_evaluator

        return run_evaluator(open_store(redis_url, run_id, "evaluator"), every, once,
                             metrics_port=metrics_port, run_dir=run_dir)

    guard(go)



def main() -> None:
    """``python -m ddiloco.workers``."""
    app()
