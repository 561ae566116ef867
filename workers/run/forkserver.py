"""A fork server: one process imports the workers' modules once, and every local worker is
forked from it instead of starting an interpreter of its own.

A worker's process spends its first seconds before ``main`` on the interpreter and its imports:
1.3-1.6 s of a quiet core for a JAX learner or shard (JAX alone 0.7 s), 3.3 s more for a
PyTorch learner (``torch`` and the ``torch._dynamo`` its first optimizer imports). A local run
starts seven or more of them at once on a few cores, where each waits for the others' imports
too, and a restarted learner pays them again before it trains. The fork server pays them once:
a forked worker starts with every module already imported and reaches ``main`` in
milliseconds; until a page is written, its memory is the server's (copy on write).

What may be imported before a fork is what has started no thread and no accelerator runtime:
the server checks after its imports that JAX's backends are not initialised (each worker sets
its own XLA flags, platform and CPU affinity before its first JAX computation, exactly as a
fresh process) and it never runs a computation. NumPy's OpenBLAS thread pool, which exists at
import, handles fork itself (``pthread_atfork``).

Protocol (one JSON object per line, this module only; nothing is pickled): the launcher writes
a :class:`Spawn` on the server's standard input; the server answers ``{"pid": N}`` or
``{"error": "..."}`` on its standard output, after a first ``{"ready": true, ...}`` line once
its imports are done. A worker is forked twice (the middle process exits at once), so that it
is reparented to the launcher, which marks itself a child subreaper
(``PR_SET_CHILD_SUBREAPER``): the launcher waits for, signals and reaps it as its own child
(:class:`ForkedProcess`), and a worker outlives the server. The server exits when its standard
input closes.

Linux only (fork, the subreaper); :func:`available` says whether this machine has both.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import json
import logging
import os
import random
import select
import signal
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ddiloco.pipeline.errors import DDilocoError

__all__ = [
    "PRELOAD",
    "PRELOAD_TORCH",
    "ForkServer",
    "ForkServerError",
    "ForkedProcess",
    "Spawn",
    "Warm",
    "available",
    "serve",
]

#: What every worker of a JAX run imports before its first step: the worker command line, the
#: learner and shard cores and the evaluator (with the store, ZeroMQ, the codecs), JAX, optax,
#: the built-in task (model, data), the inner-step engine, orbax and tensorstore (the
#: checkpoint), the MLIR dialects a first compilation lowers to. Measured: 1.6-2.0 s of a quiet
#: core, about 1,850 modules; a learner forked from it imports about 12 ms more before its
#: first step (``python -X importtime``), against 0.57 s with the worker modules alone.
PRELOAD: tuple[str, ...] = (
    "ddiloco.workers.cli",
    "ddiloco.workers.roles",
    "ddiloco.workers.learner.core",
    "ddiloco.workers.learner.checkpoint",
    "ddiloco.workers.learner.inner",
    "ddiloco.workers.syncer.core",
    "ddiloco.workers.evaluator",
    "ddiloco.workers.task.loader",
    "ddiloco.workers.task.model",
    "ddiloco.workers.task.data",
    "ddiloco.store.failpoints",
    "jax",
    "jax.numpy",
    "jaxlib.mlir.dialects.mhlo",
    "optax",
    "orbax.checkpoint",
    "typer._adapters",
)

#: Added for a run with PyTorch learners (``run.torch_learners``): about 3.3 s of a quiet core.
PRELOAD_TORCH: tuple[str, ...] = ("torch", "torch.optim", "torch._dynamo",
                                  "ddiloco.workers.learner.torch_inner")

#: prctl(2) option: orphaned descendants are reparented to the nearest subreaper ancestor.
_PR_SET_CHILD_SUBREAPER = 36

#: Environment variables read at import time by what the server preloads (JAX's config
#: flags): a request whose values differ cannot be served by a fork.
_IMPORT_TIME_PREFIXES = ("JAX_",)


class ForkServerError(DDilocoError):
    """The fork server could not start, died, or refused a request (the reason)."""


class Spawn(BaseModel):
    """One request to the fork server: start a worker.

    Attributes:
        argv: the worker's arguments after ``python -m ddiloco.workers`` (role first).
        log: the file its standard output and error go to (appended; created 0644).
        env: its whole environment.
        title: its process title (``ps``, ``/proc/PID/cmdline``) where ``setproctitle`` is
            installed; None: the server's.
        module: what it runs as ``__main__`` (``python -m MODULE ARGV``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    argv: list[str]
    log: str = Field(min_length=1)
    env: dict[str, str]
    title: str | None = None
    module: str = Field(default="ddiloco.workers", pattern=r"^[A-Za-z_][A-Za-z0-9_.]*$")


class Warm(BaseModel):
    """Work the fork server does once, before its first fork, so that every forked worker
    inherits the result (copy on write) instead of doing it: the server's second argument,
    one JSON object.

    Attributes:
        corpus: the built-in task's corpus to read and clean (``data.corpus``: files and
            directories; None: the Shakespeare corpus):
            :func:`ddiloco.workers.task.data.warm_corpus`.
        config: the part of the run's configuration the built-in task reads (``model``,
            ``train``, ``sync``, ``data`` and four ``run`` fields, as JSON:
            :func:`ddiloco.workers.run.launch.fork_warm`), whose task the server builds
            (:func:`ddiloco.workers.task.loader.prebuild_task`) and whose inner-step
            programs it traces for the learners
            (:func:`ddiloco.workers.learner.programs.pretrace`); None: neither.
        codecs: the run's codec names (``sync.codec_up``, ``codec_dp``, ``codec_down``),
            whose merge kernels the server compiles for the shards
            (:func:`ddiloco.workers.syncer.fused.warm_up`; 0.7 s of a core each, loaded from
            numba's cache); None: each shard compiles its own.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    corpus: list[str] | None = None
    config: dict[str, Any] | None = None
    codecs: list[str] | None = None


def available() -> bool:
    """True where a fork server can run: Linux, ``os.fork`` and a libc with ``prctl``."""
    return sys.platform.startswith("linux") and hasattr(os, "fork") and _libc() is not None


def _libc() -> Any:
    name = ctypes.util.find_library("c")
    if name is None:
        return None
    libc = ctypes.CDLL(name, use_errno=True)
    return libc if hasattr(libc, "prctl") else None


def become_subreaper() -> None:
    """Make this process a child subreaper (Linux 3.4+), so that the workers the fork server
    double-forks become its children.

    Raises:
        ForkServerError: ``prctl`` failed or is missing.
    """
    libc = _libc()
    if libc is None or libc.prctl(_PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        errno = ctypes.get_errno() if libc is not None else 0
        raise ForkServerError(f"cannot become a child subreaper (prctl errno {errno})")


# ---- the server process ---------------------------------------------------------------------


def _write(fd: int, obj: dict[str, Any]) -> None:
    data = (json.dumps(obj) + "\n").encode()
    while data:
        data = data[os.write(fd, data):]


def _preload(modules: Sequence[str]) -> dict[str, Any]:
    """Import ``modules``; raises ForkServerError if that started a JAX backend."""
    start = time.perf_counter()
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    for name in modules:
        importlib.import_module(name)
    # A library that sets up logging when imported (orbax.checkpoint adds a stderr handler to
    # the root logger) would give every forked worker its format: basicConfig in the worker's
    # setup_logging does nothing once the root logger has a handler. A process of its own
    # sets its logging up before it imports that library, so the fork starts as it would.
    for handler in [h for h in root.handlers if h not in handlers]:
        root.removeHandler(handler)
    root.setLevel(level)
    if "jax" in sys.modules:
        from jax._src import xla_bridge  # private: the one way to ask without starting one

        if xla_bridge.backends_are_initialized():
            raise ForkServerError("a preloaded module started a JAX backend: a fork would "
                                  "share its threads and device state")
    return {"preloaded_s": round(time.perf_counter() - start, 3), "modules": len(sys.modules)}


def _warm(warm: Warm) -> dict[str, Any]:
    """Do ``warm``'s work before the first fork; what it did, for the ready line. A failure
    is reported, not raised: a worker that needs the same thing does it itself (and says
    why it fails)."""
    from ddiloco.workers.task.data import warm_corpus

    start = time.perf_counter()
    try:
        paths = None if warm.corpus is None else [Path(p) for p in warm.corpus]
        kept = warm_corpus(paths)
    except Exception as exc:  # a corpus error is the workers' to report
        return {"warm_error": f"{type(exc).__name__}: {exc}"}
    out: dict[str, Any] = {"corpus_bytes": kept,
                           "corpus_s": round(time.perf_counter() - start, 3)}
    if warm.config is not None:
        out.update(_pretrace(warm.config))
    if warm.codecs:
        out.update(_warm_merge(warm.codecs))
    return out


def _warm_merge(codecs: Sequence[str]) -> dict[str, Any]:
    """Compile (or load from numba's on-disk cache) the shards' merge kernels for the run's
    codecs (:func:`ddiloco.workers.syncer.fused.warm_up`), so that a forked shard announces
    itself without doing it: a run's learners wait for the shards' first versions. An error
    is reported, not raised: each shard then warms its own, as a shard of its own process
    does."""
    from ddiloco.workers.syncer.fused import warm_up

    try:
        return {"merge_kernels_s": round(warm_up(codecs), 3)}
    except Exception as exc:  # the shard's own warm-up says what is wrong
        return {"merge_kernels_error": f"{type(exc).__name__}: {exc}"}


def _pretrace(config: dict[str, Any]) -> dict[str, Any]:
    """Build the run's built-in task and trace its inner-step programs (no device). An error
    is reported, not raised: each learner then builds and traces its own. Raises
    ForkServerError only if the trace started a JAX backend (nothing may be forked then)."""
    from jax._src import xla_bridge

    from ddiloco.workers.learner.programs import host_device_count, pretrace
    from ddiloco.workers.run.config import Config
    from ddiloco.workers.task.api import DataShard
    from ddiloco.workers.task.loader import forget_prebuilt, prebuild_task

    platform = os.environ.get("JAX_PLATFORMS", "")
    if platform != "cpu":  # a trace names the device kind, which only a backend knows
        return {"pretrace": f"skipped: JAX_PLATFORMS={platform!r}"}
    start = time.perf_counter()
    try:
        cfg = Config.model_validate(config)
        task = prebuild_task(cfg)
        batch = next(iter(task.batches(DataShard(0, cfg.run.learners, 0, cfg.train.seed))))
        out = pretrace(task, batch, n_devices=cfg.run.devices or host_device_count(),
                       sharding=cfg.run.sharding, dp=cfg.run.mode == "dp",
                       compute_dtype=cfg.train.compute_dtype, accumulate=cfg.train.accumulate)
    except Exception as exc:  # the learners' own build says what is wrong
        forget_prebuilt()
        return {"pretrace_error": f"{type(exc).__name__}: {exc}"}
    if xla_bridge.backends_are_initialized():
        raise ForkServerError("tracing the inner step started a JAX backend: a fork would "
                              "share its threads and device state")
    return {**out, "task_s": round(time.perf_counter() - start, 3)}


def serve(modules: Sequence[str], warm: Warm | None = None) -> Spawn | None:
    """The server's loop, on this process's standard input and output. Returns only in a
    forked worker (its request, with its standard streams, session and environment already
    its own: :func:`_become`), or None in the server once its input closes. ``warm``: work
    done once before the first fork (:class:`Warm`).

    Nothing a request holds changes the server: a bad line is answered with an error and the
    next one read.
    """
    # The channel moves off fds 0 and 1, so that whatever a library prints goes to the log,
    # not into the replies, and a worker's standard streams are its own.
    ctl_in, ctl_out = os.dup(0), os.dup(1)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.close(null)
    os.dup2(2, 1)
    try:
        info = _preload(modules)
        if warm is not None:
            info.update(_warm(warm))
    except Exception as exc:  # an import that fails: the launcher starts processes instead
        _write(ctl_out, {"error": f"preload failed: {type(exc).__name__}: {exc}"})
        return None
    _write(ctl_out, {"ready": True, **info})
    pending = b""
    while True:
        chunk = os.read(ctl_in, 65536)
        if not chunk:
            return None
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            try:
                spawn = Spawn.model_validate_json(line)
            except ValidationError as exc:
                _write(ctl_out, {"error": f"bad request: {exc.errors()[0]['msg']}"})
                continue
            differs = _import_time_difference(spawn.env)
            if differs is not None:
                _write(ctl_out, {"error": f"{differs} differs from the fork server's"})
                continue
            try:
                pid = _double_fork(ctl_in, ctl_out)
            except OSError as exc:
                _write(ctl_out, {"error": f"fork failed: {exc}"})
                continue
            if pid == 0:
                try:
                    _become(spawn)
                except BaseException as exc:  # its log cannot be opened, say: exit 127
                    os.write(2, f"fork server: worker set-up failed: {exc}\n".encode())
                    os._exit(127)
                return spawn
            _write(ctl_out, {"pid": pid})


def _import_time_difference(env: dict[str, str]) -> str | None:
    keys = {k for k in (*env, *os.environ) if k.startswith(_IMPORT_TIME_PREFIXES)}
    for key in sorted(keys):
        if env.get(key) != os.environ.get(key):
            return key
    return None


def _double_fork(ctl_in: int, ctl_out: int) -> int:
    """Fork a worker through a middle process that exits at once. Returns the worker's pid in
    the server, 0 in the worker."""
    r, w = os.pipe()
    middle = os.fork()
    if middle == 0:
        me = os.getpid()
        try:
            pid = os.fork()
        except BaseException:
            os._exit(1)  # the server reads no pid: its fork "failed"
        if pid == 0:
            for fd in (r, w, ctl_in, ctl_out):
                os.close(fd)
            _await_reparent(me)
            return 0
        try:
            os.write(w, pid.to_bytes(8, "little"))
        finally:
            os._exit(0)
    os.close(w)
    try:
        data = b""
        while len(data) < 8:
            part = os.read(r, 8 - len(data))
            if not part:
                raise OSError("the middle process exited before naming the worker")
            data += part
    finally:
        os.close(r)
        os.waitpid(middle, 0)
    return int.from_bytes(data, "little")


def _await_reparent(middle: int, timeout_s: float = 5.0) -> None:
    """In the worker: wait until the middle process has exited and the worker is the
    subreaper's child. The kernel closes a dying process's files before it reparents its
    children, so no pipe can say this; the parent pid can. Usually already true, else a few
    hundred microseconds. Gives up after ``timeout_s`` seconds (the worker then starts as the
    middle's child, which changes only who reaps it)."""
    deadline = time.monotonic() + timeout_s
    while os.getppid() == middle and time.monotonic() < deadline:
        time.sleep(0.0002)


def _become(spawn: Spawn) -> None:
    """In the forked worker: its own session, standard streams, signals, environment, random
    state and title, as a fresh ``python -m ddiloco.workers`` process would have."""
    os.setsid()
    log = os.open(spawn.log, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    for sig, handler in ((signal.SIGINT, signal.default_int_handler),
                         (signal.SIGTERM, signal.SIG_DFL), (signal.SIGCHLD, signal.SIG_DFL),
                         (signal.SIGPIPE, signal.SIG_IGN)):
        signal.signal(sig, handler)
    os.environ.clear()
    os.environ.update(spawn.env)
    random.seed()  # the server's state is every worker's otherwise
    sys.argv = [sys.argv[0], *spawn.argv]
    if spawn.title is not None:
        try:
            import setproctitle  # type: ignore[import-not-found, unused-ignore]
        except ImportError:
            pass
        else:
            setproctitle.setproctitle(spawn.title)


def main(argv: list[str] | None = None) -> int:
    """``python -m ddiloco.workers.run.forkserver MODULE,... [WARM]``: serve, or (in a forked
    worker) run its request's module (``python -m ddiloco.workers ARGV``) and exit with its
    code."""
    args = sys.argv[1:] if argv is None else argv
    modules = [m for m in (args[0].split(",") if args else []) if m]
    warm = Warm.model_validate_json(args[1]) if len(args) > 1 else None
    spawn = serve(modules, warm)
    if spawn is None:
        return 0
    import runpy

    runpy.run_module(spawn.module, run_name="__main__", alter_sys=True)
    return 0


# ---- the launcher's side --------------------------------------------------------------------


class ForkedProcess:
    """A worker the fork server started, reaped by this process (its subreaper): the part
    of :class:`subprocess.Popen` that :class:`~ddiloco.workers.run.launch.LocalCluster` uses.

    Attributes:
        pid: its process id.
        returncode: None while it runs; its exit code, or -N when signal N ended it.
        stdin: always None (a forked worker reads nothing).
    """

    stdin: IO[bytes] | None = None

    def __init__(self, pid: int) -> None:
        self.pid = pid
        self.returncode: int | None = None

    def _reap(self, options: int) -> int | None:
        """``waitpid`` with ``options`` (0: block), unless reaped already; its code or None."""
        if self.returncode is None:
            try:
                pid, status = os.waitpid(self.pid, options)
            except ChildProcessError:  # reaped elsewhere: the code is lost
                self.returncode = -255
                return self.returncode
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def poll(self) -> int | None:
        """Its exit code if it has exited (reaping it), else None."""
        return self._reap(os.WNOHANG)

    def wait(self, timeout: float | None = None) -> int:
        """Wait for it to exit; its exit code.

        Raises:
            subprocess.TimeoutExpired: it still runs after ``timeout`` seconds.
        """
        if timeout is None:
            code = self._reap(0)
            assert code is not None
            return code
        deadline = time.monotonic() + timeout
        fd = _pidfd(self.pid)
        try:
            while self.poll() is None:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise subprocess.TimeoutExpired(f"pid {self.pid}", timeout)
                if fd is not None:
                    select.select([fd], [], [], left)
                else:
                    time.sleep(min(left, 0.02))
        finally:
            if fd is not None:
                os.close(fd)
        assert self.returncode is not None
        return self.returncode

    def send_signal(self, sig: int) -> None:
        """Send ``sig`` unless it has been reaped (its pid may be another's by then)."""
        if self.poll() is None:
            os.kill(self.pid, sig)

    def kill(self) -> None:
        """SIGKILL."""
        self.send_signal(signal.SIGKILL)

    def terminate(self) -> None:
        """SIGTERM."""
        self.send_signal(signal.SIGTERM)


def _pidfd(pid: int) -> int | None:
    try:
        return os.pidfd_open(pid)
    except (AttributeError, OSError):
        return None


class ForkServer:
    """The launcher's handle on its fork server process.

    Args:
        env: the server's environment: the workers' (their JAX settings must match it).
        log: the server's own log file (its imports' warnings; appended).
        modules: what it imports before it forks (:data:`PRELOAD`, :data:`PRELOAD_TORCH`).
        ready_timeout_s: how long :meth:`spawn` waits for the imports, seconds.
        warm: work the server does once before its first fork (:class:`Warm`); None: none.
    """

    def __init__(self, env: dict[str, str], log: Path, modules: Sequence[str],
                 ready_timeout_s: float = 120.0, warm: Warm | None = None) -> None:
        self.env = dict(env)
        self.log = log
        self.modules = tuple(modules)
        self.warm = warm
        self.ready_timeout_s = ready_timeout_s
        self.proc: subprocess.Popen[bytes] | None = None
        self.ready: dict[str, Any] | None = None
        self._pending = b""

    def start(self) -> None:
        """Start the server process (its imports run while the caller goes on).

        Raises:
            ForkServerError: this process cannot be a subreaper.
        """
        become_subreaper()
        self.log.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "ddiloco.workers.run.forkserver",
                 ",".join(self.modules),
                 *([self.warm.model_dump_json()] if self.warm is not None else [])],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=self.env,
                start_new_session=True)

    def _reply(self, timeout_s: float) -> dict[str, Any]:
        assert self.proc is not None and self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        while b"\n" not in self._pending:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([fd], [], [], left)[0]:
                raise ForkServerError(f"no answer from the fork server in {timeout_s:g} s "
                                      f"(its log: {self.log})")
            chunk = os.read(fd, 65536)
            if not chunk:
                raise ForkServerError(f"the fork server exited (its log: {self.log})")
            self._pending += chunk
        line, self._pending = self._pending.split(b"\n", 1)
        reply: dict[str, Any] = json.loads(line)
        return reply

    def spawn(self, argv: list[str], log: Path, env: dict[str, str],
              title: str | None = None, module: str = "ddiloco.workers") -> ForkedProcess:
        """Fork worker ``python -m MODULE ARGV`` with ``env``, its output appended to
        ``log``. Blocks until the server's imports are done (the first call) and it has
        forked.

        Raises:
            ForkServerError: the server is not running, died, timed out or refused (the
                caller starts the worker as a process of its own instead).
        """
        if self.proc is None or self.proc.stdin is None or self.proc.poll() is not None:
            raise ForkServerError("the fork server is not running")
        if self.ready is None:
            first = self._reply(self.ready_timeout_s)
            if not first.get("ready"):
                raise ForkServerError(str(first.get("error", first)))
            self.ready = first
        request = Spawn(argv=argv, log=str(log), env=env, title=title, module=module)
        try:
            self.proc.stdin.write(request.model_dump_json().encode() + b"\n")
            self.proc.stdin.flush()
        except OSError as exc:
            raise ForkServerError(f"the fork server exited: {exc}") from exc
        reply = self._reply(30.0)
        if "pid" not in reply:
            raise ForkServerError(str(reply.get("error", reply)))
        return ForkedProcess(int(reply["pid"]))

    def close(self, timeout_s: float = 5.0) -> None:
        """End the server (its standard input closes); the workers it forked go on."""
        if self.proc is None:
            return
        if self.proc.stdin is not None:
            try:
                self.proc.stdin.close()
            except OSError:
                pass
        try:
            self.proc.wait(timeout_s)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


if __name__ == "__main__":
    sys.exit(main())
