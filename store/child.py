"""Server child processes of the store layer, supervised one way: spawn, ready, stop, crash.

The embedded Redis (:class:`~ddiloco.store.embedded.EmbeddedRedis`), the Sentinels of its
high-availability group (:mod:`ddiloco.store.embedded_ha`) and the embedded S3 server
(:class:`~ddiloco.store.embedded_s3.EmbeddedS3`) each run a server binary as a child process.
:class:`ChildServer` is what they share:

* :meth:`ChildServer.spawn` starts the binary with its stdout and stderr appended to a log
  file, by default in a session (and so a process group) of its own: a Ctrl-C at the terminal
  then reaches the orchestrator only, whose clean-up lets the workers drain into a live store
  before it stops the servers;
* :meth:`ChildServer.wait_ready` polls a readiness probe until it passes, and fails at once,
  with the log's tail, when the child exits instead;
* :meth:`ChildServer.stop` sends SIGTERM (a graceful shutdown for redis-server and SeaweedFS),
  then SIGKILL after a grace period; :meth:`ChildServer.crash` sends SIGKILL at once (a fault).
  With a session of its own the signals go to the whole process group, so that a process the
  server forked (Redis's AOF rewrite) dies with it instead of writing on into a data folder.

One :class:`ChildServer` is one run of the binary: a restart spawns a new one, since its port
or arguments may differ.
"""

from __future__ import annotations

import os
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

from ddiloco.pipeline.errors import StoreUnavailable
from ddiloco.pipeline.waiting import WaitTimeout, wait_until

__all__ = ["LOG_TAIL_BYTES", "ChildExited", "ChildNotReady", "ChildServer", "log_tail"]

#: How much of a log's end error messages carry, bytes.
LOG_TAIL_BYTES = 2_000


class ChildExited(StoreUnavailable):
    """The child exited while it was expected to run; the message ends with its log's tail.

    Attributes:
        returncode: its exit status (negative: killed by that signal).
    """

    def __init__(self, message: str, returncode: int) -> None:
        super().__init__(message)
        self.returncode = returncode


class ChildNotReady(StoreUnavailable):
    """The child runs, but its readiness probe did not pass in time; the message ends with its
    log's tail."""


def log_tail(path: Path, n_bytes: int = LOG_TAIL_BYTES) -> str:
    """The last ``n_bytes`` bytes of the file at ``path``, decoded leniently; a note in
    parentheses instead when it cannot be read. Never raises ``OSError``."""
    try:
        with open(path, "rb") as f:
            # Seek instead of reading it all: a server's log grows for as long as a run lasts.
            f.seek(max(0, f.seek(0, os.SEEK_END) - n_bytes))
            return f.read().decode(errors="replace")
    except OSError as exc:
        return f"(log unreadable: {exc})"


class ChildServer:
    """One run of a server binary as a child process, its output appended to a log file.

    Make one with :meth:`spawn`. The methods that wait (:meth:`wait_ready`, :meth:`stop`,
    :meth:`crash`) are meant for one thread at a time.

    Args:
        proc: the child, started with its output on ``log_path``.
        name: what messages call it, e.g. ``"redis-server on port 6379"``.
        log_path: the log file its stdout and stderr go to.
        own_session: whether it leads a session (and process group) of its own; signals then
            go to the group.
    """

    def __init__(self, proc: subprocess.Popen[bytes], name: str, log_path: Path, *,
                 own_session: bool) -> None:
        self.proc = proc
        self.name = name
        self.log_path = log_path
        self.own_session = own_session

    def __repr__(self) -> str:
        return f"ChildServer({self.name!r}, pid={self.pid}, returncode={self.returncode})"

    @classmethod
    def spawn(cls, argv: Sequence[str], log_path: Path, *, name: str | None = None,
              own_session: bool = True, banner: str | None = None,
              env: Mapping[str, str] | None = None) -> ChildServer:
        """Start ``argv`` with stdin from ``/dev/null`` and stdout and stderr appended to
        ``log_path``; do not wait for it to be ready (:meth:`wait_ready`).

        Args:
            argv: the command line, the binary first.
            log_path: the log file, created if missing, appended to otherwise (a restart keeps
                the earlier runs' lines); its folder must exist.
            name: what messages call the child; default: the binary's file name.
            own_session: run it in a session of its own (see the module's docstring); False
                leaves it in ours, e.g. for a child that must die with a Ctrl-C.
            banner: a line written to the log just before the child starts (marks where this
                run's lines begin), or None.
            env: the child's environment; None inherits ours.

        Returns:
            The running child.

        Raises:
            OSError: the log cannot be opened, or the binary cannot be executed (e.g.
                ``FileNotFoundError``, ``PermissionError``).
        """
        with open(log_path, "ab") as log:
            if banner is not None:
                log.write(banner.rstrip("\n").encode() + b"\n")
                log.flush()  # before the child's first line: both append to the same file
            proc = subprocess.Popen(
                list(argv), stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                start_new_session=own_session, env=None if env is None else dict(env))
        # Our copy of the log's descriptor is closed on leaving the block: the child holds its
        # own, so nothing is left open in this process for a crash or a stop to forget.
        return cls(proc, name or Path(argv[0]).name, log_path, own_session=own_session)

    @property
    def pid(self) -> int:
        """The child's process id (still its id once it has exited)."""
        return self.proc.pid

    @property
    def returncode(self) -> int | None:
        """The child's exit status, None while it runs (negative: killed by that signal)."""
        return self.proc.poll()

    def log_tail(self, n_bytes: int = LOG_TAIL_BYTES) -> str:
        """The last ``n_bytes`` bytes of the child's log (:func:`log_tail`)."""
        return log_tail(self.log_path, n_bytes)

    def ensure_running(self) -> None:
        """Return if the child runs.

        Raises:
            ChildExited: it has exited; the message has its exit status and its log's tail.
        """
        code = self.proc.poll()
        if code is not None:
            raise ChildExited(f"{self.name} exited with code {code}; log {self.log_path}:\n"
                              f"{self.log_tail()}", code)

    def wait_ready(self, ready: Callable[[], bool], *, timeout_s: float, what: str,
                   interval_s: float = 0.05, retry_on: tuple[type[BaseException], ...] = (),
                   clock: Callable[[], float] = time.monotonic,
                   sleep: Callable[[float], None] = time.sleep) -> None:
        """Call ``ready`` every ``interval_s`` seconds until it returns True, checking before
        each call that the child still runs.

        Args:
            ready: the probe, e.g. "answers PING"; an exception it raises ends the wait and
                propagates, unless it is one of ``retry_on``.
            timeout_s: give up after this many seconds.
            what: what the probe waits for, as a verb phrase for the error ("answer PING").
            interval_s: pause between two probes, seconds.
            retry_on: exception types of ``ready`` that mean "not yet" (e.g. a refused
                connection while the server starts).
            clock: monotonic clock, seconds (injectable for tests).
            sleep: how to pause (injectable for tests).

        Raises:
            ChildExited: the child exited before the probe passed (its exit status and log's
                tail in the message). It is not waited for or killed: :meth:`stop` does that.
            ChildNotReady: the probe did not pass within ``timeout_s`` (the log's tail in the
                message). The child is left running: the caller decides whether to stop it.
        """
        def probe() -> bool:
            self.ensure_running()  # not in retry_on: an exit ends the wait at once
            return ready()

        try:
            wait_until(probe, timeout_s=timeout_s, what=f"{self.name} to {what}",
                       interval_s=interval_s, retry_on=retry_on, clock=clock, sleep=sleep)
        except WaitTimeout as exc:
            # An exit at the deadline is the better explanation of the two.
            self.ensure_running()
            raise ChildNotReady(f"{self.name} did not {what} within {timeout_s:g} s; log "
                                f"{self.log_path}:\n{self.log_tail()}") from exc

    def stop(self, grace_s: float = 5.0) -> int:
        """Stop the child: SIGTERM (and SIGCONT, should it be paused), then SIGKILL if it still
        runs after ``grace_s`` seconds; wait for it (so no zombie is left). Idempotent.

        Returns:
            Its exit status (negative: killed by that signal).
        """
        if self.proc.poll() is None:
            self._signal(signal.SIGTERM)
            # A paused server (SIGSTOP, a chaos fault) acts on SIGTERM only once resumed.
            self._signal(signal.SIGCONT)
            try:
                self.proc.wait(timeout=grace_s)
            except subprocess.TimeoutExpired:
                self._signal(signal.SIGKILL)
                self.proc.wait()
        return self.proc.returncode

    def crash(self) -> None:
        """SIGKILL the child at once (a fault: the server flushes nothing) and wait for it.
        Idempotent."""
        if self.proc.poll() is None:
            self._signal(signal.SIGKILL)
        self.proc.wait()

    def _signal(self, sig: signal.Signals) -> None:
        """Send ``sig`` to the child, or to its whole group when it leads one."""
        try:
            if self.own_session:
                # The child is not reaped yet (only our wait does that), so its pid, which is
                # also its group's id, cannot have been reused by another process.
                os.killpg(self.proc.pid, sig)
            else:
                self.proc.send_signal(sig)
        except ProcessLookupError:
            pass  # it exited (and left no group) since the poll: nothing to signal
