"""Open a redis-py client with retries and backoff, failing with a clear ``StoreUnavailable``.

Every command of the returned client is retried on connection errors and timeouts (including
``BusyLoadingError`` while a restarted Redis replays its AOF) by one redis-py ``Retry`` object with
capped exponential backoff (STYLE, practice 5): no hand-written retry loops elsewhere.

High availability: a ``redis+sentinel://h1:26379,h2:26379,h3:26379/SERVICE`` URL connects
through Redis Sentinel (redis-py's ``Sentinel.master_for``): every command goes to the current
primary, and every retry of a connect asks the sentinels again (:class:`AskingConnection`), so
after a failover the next try reaches the new one. Such a client waits, after each publish,
until a replica has it (``WAIT``; :attr:`REPLICAS_ATTR`), so a failover cannot lose an
acknowledged version (docs/RELIABILITY.md).
"""

from __future__ import annotations

from typing import Any
from urllib.parse import parse_qsl, urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry
from redis.sentinel import SentinelManagedConnection

from ddiloco.pipeline.errors import ConfigError, StoreUnavailable

__all__ = [
    "REPLICAS_ATTR",
    "SENTINEL_CONNECT_TIMEOUT_S",
    "SENTINEL_SCHEME",
    "AskingConnection",
    "connect",
    "is_sentinel",
    "redact_url",
]

_SCHEMES = ("redis", "rediss", "unix")
#: The URL scheme of a Sentinel-managed primary.
SENTINEL_SCHEME = "redis+sentinel"
#: Attribute a client carries when its publishes must reach replicas first:
#: ``(replicas, timeout_ms)`` for ``WAIT`` (:meth:`ddiloco.store.versions.RedisVersions.publish`).
REPLICAS_ATTR = "_ddiloco_wait"
#: Connect time-out of a sentinel-managed primary, seconds: a TCP connect to a live Redis
#: takes one round trip (under 0.3 s between continents), while a connect to a primary whose
#: host vanished waits the whole time-out before the next try asks the sentinels again.
SENTINEL_CONNECT_TIMEOUT_S = 2.0
_HINT = (
    "check that redis-server is running and that the URL's host, port, password and scheme "
    "(rediss:// for TLS) are right"
)


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (safe for logs and error messages)."""
    parts = urlsplit(url)
    if parts.scheme == SENTINEL_SCHEME:
        # several hosts: urlsplit's hostname would keep only the first
        creds, at, hosts = parts.netloc.rpartition("@")
        if not at or ":" not in creds:
            return url
        return urlunsplit(parts._replace(netloc=f"{creds.split(':', 1)[0]}:***@{hosts}"))
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port is not None else ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))


def is_sentinel(url: str) -> bool:
    """Whether ``url`` names a Sentinel-managed primary (``redis+sentinel://``)."""
    return urlsplit(url).scheme == SENTINEL_SCHEME


def connect(
    url: str,
    *,
    attempts: int = 8,
    timeout_s: float = 10.0,
    backoff_base_s: float = 0.05,
    backoff_cap_s: float = 2.0,
) -> redis.Redis:
    """Connect to the Redis at ``url`` and check it answers PING.

    Args:
        url: ``redis://[[user]:password@]host[:port][/db]``, ``rediss://...`` for TLS (query
            options such as ``ssl_cert_reqs`` pass through redis-py's ``from_url``),
            ``unix:///path/to/socket``, or
            ``redis+sentinel://[[user]:password@]h1:26379,h2:26379/SERVICE[?replicas=1&wait_ms=2000]``
            (the primary that Sentinel names for ``SERVICE``; each publish waits until
            ``replicas`` replicas have it, at most ``wait_ms`` ms; defaults 1 and 2000).
        attempts: tries per command before giving up (>= 1), here and for every later command.
        timeout_s: socket connect and read timeout, seconds. Reads carry whole fragment blobs,
            so keep it well above a blob's transfer time. A sentinel URL's connects wait at
            most :data:`SENTINEL_CONNECT_TIMEOUT_S` (the next try may name another primary).
        backoff_base_s: the delay after the k-th failed try is ``backoff_base_s * 2**k``
            seconds...
        backoff_cap_s: ...but at most this many seconds. With the defaults, 8 attempts wait
            0.1 + 0.2 + 0.4 + 0.8 + 1.6 + 2 + 2 = 7.1 s in all (plus the tries themselves).

    Returns:
        A client returning bytes (``decode_responses=False``).

    Raises:
        ConfigError: bad ``url`` or arguments.
        StoreUnavailable: Redis did not answer after ``attempts`` tries, or refused the
            credentials. The message names the URL without its password and the cause.
    """
    if attempts < 1:
        raise ConfigError(f"attempts must be >= 1, got {attempts}")
    if timeout_s <= 0:
        raise ConfigError(f"timeout_s must be > 0, got {timeout_s}")
    safe = redact_url(url)
    retry = Retry(ExponentialBackoff(cap=backoff_cap_s, base=backoff_base_s), attempts - 1)
    if is_sentinel(url):
        return _connect_sentinel(url, retry, timeout_s)
    if urlsplit(url).scheme not in _SCHEMES:
        raise ConfigError(f"store URL {safe!r}: scheme must be one of "
                          f"{', '.join((*_SCHEMES, SENTINEL_SCHEME))}")
    password = urlsplit(url).password
    try:
        client = redis.Redis.from_url(
            url,
            retry=retry,
            socket_timeout=timeout_s,
            socket_connect_timeout=timeout_s,
            # Re-check idle pooled connections before use, so a Redis restart costs one retry
            # instead of a failed command.
            health_check_interval=30,
            decode_responses=False,
        )
    except ValueError as exc:
        raise ConfigError(f"store URL {safe!r}: {exc}") from None

    try:
        client.ping()  # connects; the client's Retry backs off between failed attempts
    except redis.AuthenticationError as exc:
        client.close()
        raise StoreUnavailable(
            f"cannot reach Redis at {safe}: authentication failed ({_scrub(exc, password)}); "
            "check the user and password in the URL"
        ) from None
    except redis.RedisError as exc:
        client.close()
        raise StoreUnavailable(
            f"cannot reach Redis at {safe} after {attempts} attempt(s): "
            f"{_scrub(exc, password)}; {_HINT}"
        ) from None
    return client


def _scrub(exc: BaseException, password: str | None) -> str:
    # redis-py's messages do not echo credentials today; make sure that stays true here.
    text = (str(exc) or type(exc).__name__).rstrip(".")
    return text.replace(password, "***") if password else text


class AskingConnection(SentinelManagedConnection):
    """A sentinel-managed connection whose every connect retry asks the sentinels again.

    redis-py (8.1) reconnects a connection that a command found broken through
    ``connect_check_health``, whose retries all go to the address the connection had: after a
    failover, a command whose connection the old primary's death broke tries the dead address
    ``attempts`` times (each waiting the connect time-out when its host vanished) before it
    fails (redis-py #3874; 78.9 s on compose, docs/COMPOSE.md). Here each try of that loop is
    redis-py's own sentinel-managed connect (``_connect_retry``: ask the sentinels, connect
    once to the primary they name).
    """

    # types-redis describes redis-py 4, before connect_check_health and _connect_retry existed
    def connect_check_health(self, check_health: bool = True,
                             retry_socket_connect: bool = True) -> None:
        if self._sock:  # type: ignore[attr-defined]
            return
        if not retry_socket_connect:
            # one try at the address ``connect_to`` just set (called from ``_connect_retry``)
            super().connect_check_health(  # type: ignore[misc]
                check_health=check_health, retry_socket_connect=False)
            return
        self.retry.call_with_retry(self._connect_retry,  # type: ignore[attr-defined]
                                   lambda error: self.disconnect())


def _connect_sentinel(url: str, retry: Retry, timeout_s: float) -> redis.Redis:
    """The primary of a ``redis+sentinel://`` URL (see :func:`connect`).

    Raises:
        ConfigError: no hosts, no service name, or a bad query option.
        StoreUnavailable: no sentinel answered, they know no such service or have no quorum
            on its primary, or the primary did not answer; one line naming the URL.
    """
    from redis.sentinel import MasterNotFoundError, Sentinel

    safe = redact_url(url)
    parts = urlsplit(url)
    creds, _, hosts = parts.netloc.rpartition("@")
    service = parts.path.strip("/")
    if not hosts or not service:
        raise ConfigError(f"store URL {safe!r}: write {SENTINEL_SCHEME}://h1:26379,h2:26379/"
                          "SERVICE")
    nodes = []
    for item in hosts.split(","):
        host, _, port = item.rpartition(":")
        if not host or not port.isdigit():
            raise ConfigError(f"store URL {safe!r}: {item!r} is not host:port")
        nodes.append((host.strip("[]"), int(port)))
    query = dict(parse_qsl(parts.query))
    try:
        replicas = int(query.pop("replicas", "1"))
        wait_ms = int(query.pop("wait_ms", "2000"))
    except ValueError:
        raise ConfigError(f"store URL {safe!r}: replicas and wait_ms must be integers") from None
    if query:
        raise ConfigError(f"store URL {safe!r}: unknown option(s) {', '.join(sorted(query))}; "
                          "the options are replicas and wait_ms")
    user, _, password = creds.partition(":")
    auth: dict[str, Any] = {"username": user or None, "password": password or None}
    connect_s = min(timeout_s, SENTINEL_CONNECT_TIMEOUT_S)
    sentinel = Sentinel(nodes, socket_timeout=timeout_s, socket_connect_timeout=connect_s,
                        retry=retry, health_check_interval=30, decode_responses=False, **auth)
    try:
        sentinel.discover_master(service)
        client = sentinel.master_for(service, socket_timeout=timeout_s,
                                     socket_connect_timeout=connect_s, retry=retry,
                                     connection_class=AskingConnection,
                                     decode_responses=False, **auth)
        client.ping()
    except MasterNotFoundError as exc:
        raise StoreUnavailable(
            f"cannot reach Redis at {safe}: the sentinels name no primary for {service!r} "
            f"({_scrub(exc, password)}); check the service name, that a quorum of sentinels "
            "runs and that they reach each other") from None
    except redis.RedisError as exc:
        raise StoreUnavailable(f"cannot reach Redis at {safe}: {_scrub(exc, password)}; "
                               f"{_HINT}") from None
    setattr(client, REPLICAS_ATTR, (replicas, wait_ms))
    return client
