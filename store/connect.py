"""Open a redis-py client with retries and backoff, failing with a clear ``StoreUnavailable``.

Every command of the returned client is retried on connection errors and timeouts (including
``BusyLoadingError`` while a restarted Redis replays its AOF) by one redis-py ``Retry`` object with
capped exponential backoff (STYLE, practice 5): no hand-written retry loops elsewhere.
"""

from __future__ import annotations

from urllib.parse import urlsplit, urlunsplit

import redis
from redis.backoff import ExponentialBackoff
from redis.retry import Retry

from ddiloco.pipeline.errors import ConfigError, StoreUnavailable

__all__ = ["connect", "redact_url"]

_SCHEMES = ("redis", "rediss", "unix")
_HINT = (
    "check that redis-server is running and that the URL's host, port, password and scheme "
    "(rediss:// for TLS) are right"
)


def redact_url(url: str) -> str:
    """``url`` with its password replaced by ``***`` (safe for logs and error messages)."""
    parts = urlsplit(url)
    if parts.password is None:
        return url
    user = parts.username or ""
    host = parts.hostname or ""
    if ":" in host:  # IPv6 literal
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port is not None else ""
    return urlunsplit(parts._replace(netloc=f"{user}:***@{host}{port}"))


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
            options such as ``ssl_cert_reqs`` pass through redis-py's ``from_url``), or
            ``unix:///path/to/socket``.
        attempts: tries per command before giving up (>= 1), here and for every later command.
        timeout_s: socket connect and read timeout, seconds. Reads carry whole fragment blobs,
            so keep it well above a blob's transfer time.
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
    if urlsplit(url).scheme not in _SCHEMES:
        raise ConfigError(f"store URL {safe!r}: scheme must be one of {', '.join(_SCHEMES)}")
    password = urlsplit(url).password
    retry = Retry(ExponentialBackoff(cap=backoff_cap_s, base=backoff_base_s), attempts - 1)
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
