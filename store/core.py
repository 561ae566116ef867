"""What every part of the Redis store shares (DESIGN §3): the run, the client, the clock, helpers.

:class:`RedisCore` implements :class:`~ddiloco.store.base.RunStore`; the parts
(:class:`~ddiloco.store.versions.RedisVersions`,
:class:`~ddiloco.store.membership.RedisMembership`,
:class:`~ddiloco.store.telemetry.RedisTelemetry`) subclass it, and
:class:`~ddiloco.store.redis_store.RedisStore` inherits from all three. Each part's
``__init__`` takes the same arguments and calls ``super().__init__`` first (cooperative
inheritance), then registers its own Lua scripts.

Errors: connection failures that survive the client's redis-py ``Retry``
(:func:`ddiloco.store.connect`), and a primary's refusal to take writes (too few replicas, a
replica after a failover), are raised as ``StoreUnavailable`` by every method decorated with
:func:`unavailable`.
"""

from __future__ import annotations

import functools
import json
import re
import time
from collections.abc import Callable
from importlib import resources
from typing import Any, ParamSpec, TypeVar

import redis
from redis.client import Pipeline
from redis.commands.core import Script

from ddiloco.pipeline.errors import ConfigError, StoreUnavailable
from ddiloco.store.keys import Keys

__all__ = ["Batch", "ReadOnlyScript", "RedisCore", "as_str", "dumps", "load_script",
           "shutdown_server", "unavailable"]

#: Keys deleted per DEL call in :meth:`RedisCore.flush_run`.
_DELETE_BATCH = 500

# Run ids become part of key names and SCAN patterns: keep them free of glob characters, braces
# (hash tags) and ':' (so one run's patterns never match another run's keys).
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

#: Error replies that mean "the primary cannot take writes now" (HA: docs/RELIABILITY.md),
#: also inside a script's or a pipeline's error message.
_OUTAGE_REPLY = re.compile(r"\b(NOREPLICAS|READONLY|MASTERDOWN)\b")

P = ParamSpec("P")
T = TypeVar("T")


def load_script(client: redis.Redis, name: str) -> Script:
    """Register ``store/<name>.lua`` on ``client`` (EVALSHA, loaded on first use)."""
    text = resources.files("ddiloco.store").joinpath(f"{name}.lua").read_text(encoding="utf-8")
    return client.register_script(text)


class ReadOnlyScript:
    """A read-only Lua script, run with EVALSHA_RO where the server has it (Redis >= 7).

    EVALSHA declares its keys read-write, so an ACL user that may only read them (a learner
    reading versions, docs/SECURITY.md) is refused it; EVALSHA_RO declares them read-only.
    On Redis 6 it falls back to redis-py's EVALSHA ``Script``.
    """

    def __init__(self, client: redis.Redis, name: str) -> None:
        # Any: the typeshed stubs predate EVALSHA_RO and Script.sha / Script.script
        self.client: Any = client
        self.script: Any = load_script(client, name)
        self._ro: bool | None = None
        self._loaded = False

    def _has_ro(self) -> bool:
        if self._ro is None:
            try:
                major = int(str(self.client.info("server")["redis_version"]).split(".")[0])
            except redis.ResponseError:
                major = 0
            self._ro = major >= 7
        return self._ro

    def load(self) -> None:
        """(Re)load the script into the server (after a restart flushed it)."""
        self.client.script_load(self.script.script)
        self._loaded = True

    def __call__(self, keys: list[str], args: list[Any], client: Any = None) -> Any:
        c = client if client is not None else self.client
        if not self._has_ro():
            return self.script(keys=keys, args=args, client=c)
        if not self._loaded:
            self.load()
        if client is not None:  # a pipeline: NoScriptError surfaces at execute()
            return c.evalsha_ro(self.script.sha, len(keys), *keys, *args)
        try:
            return c.evalsha_ro(self.script.sha, len(keys), *keys, *args)
        except redis.exceptions.NoScriptError:
            self.load()
            return c.evalsha_ro(self.script.sha, len(keys), *keys, *args)


def _json_default(obj: Any) -> Any:
    # numpy scalars and arrays (weights, norms) show up in events and meta; they know how to
    # become plain Python values.
    if hasattr(obj, "tolist"):
        return obj.tolist()
    raise TypeError(f"{type(obj).__name__} is not JSON serialisable")


def dumps(obj: Any) -> str:
    """Canonical JSON: sorted keys, no spaces (stable bytes for equal dicts).

    Raises:
        TypeError: ``obj`` holds something neither JSON-able nor with a ``tolist()``.
    """
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=_json_default)


def as_str(raw: bytes | str) -> str:
    """A Redis reply as text (replies are bytes: the client does not decode)."""
    return raw.decode() if isinstance(raw, bytes) else raw


def unavailable(fn: Callable[P, T]) -> Callable[P, T]:
    """Turn connection failures that survived the client's retries into ``StoreUnavailable``."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return fn(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise StoreUnavailable(f"Redis unavailable during {fn.__name__}: {exc}") from exc
        except redis.ResponseError as exc:
            # A primary short of replicas (min-replicas-to-write) or demoted by a failover
            # refuses writes: an outage to wait out, not a bug.
            if _OUTAGE_REPLY.search(str(exc)):
                raise StoreUnavailable(f"Redis refused {fn.__name__}: {exc}") from exc
            raise

    return wrapper


class Batch(Pipeline):
    """Store writes queued for one MULTI/EXEC round trip: pass it as ``pipe`` to the write
    methods, then :meth:`execute` it. Like every store method, :meth:`execute` raises
    ``StoreUnavailable`` when Redis is away (after the client's retries) or refuses writes
    for want of replicas, so callers outside the store never see a Redis error."""

    def execute(self, raise_on_error: bool = True) -> list[Any]:
        """Send the queued writes; their replies, in order.

        Raises:
            StoreUnavailable: Redis did not answer, or refused the writes (an outage).
        """
        return unavailable(super().execute)(raise_on_error)


def shutdown_server(client: redis.Redis) -> None:
    """``SHUTDOWN SAVE`` on ``client``'s server, on one connection of its own: the client's
    retries would reconnect to the server that is going away, and the connection closing is the
    success reply."""
    conn = client.connection_pool.make_connection()
    try:
        conn.connect()
        conn.send_command("SHUTDOWN", "SAVE")
        conn.read_response()
    except (redis.ConnectionError, OSError):
        pass
    finally:
        conn.disconnect()


class RedisCore:
    """The run, client and clock shared by every part of the store (:class:`RunStore`).

    Args:
        client: a redis-py client, e.g. from :func:`ddiloco.store.connect`, returning bytes
            (``decode_responses=False``, the default): blobs are binary.
        run_id: the run's id: 1-128 characters from ``[A-Za-z0-9._-]``, not starting with
            ``.``, ``_`` or ``-``.
        clock: wall-clock seconds since the epoch, read where a caller gives no time (a
            publish's ``updated_at``, an event's or a stop request's ``t``); injectable for
            tests. TTLs are not computed here: Redis expires keys by its own clock (PX).

    Raises:
        ConfigError: ``run_id`` is not of that form, or ``client`` decodes responses.
    """

    def __init__(
        self, client: redis.Redis, run_id: str, *, clock: Callable[[], float] = time.time
    ) -> None:
        if not _RUN_ID.fullmatch(run_id):
            raise ConfigError(
                f"run_id {run_id!r}: use 1-128 characters from [A-Za-z0-9._-], starting with a "
                "letter or digit (it becomes part of Redis key names)"
            )
        if client.get_connection_kwargs().get("decode_responses"):
            raise ConfigError("store client: decode_responses must be False (blobs are bytes)")
        self.run_id = run_id
        self.keys = Keys(run_id)
        self.clock = clock
        self._r = client

    def __repr__(self) -> str:
        return f"{type(self).__name__}(run_id={self.run_id!r}, client={self._r!r})"

    @property
    def client(self) -> redis.Redis:
        """The underlying redis-py client."""
        return self._r

    def pipeline(self) -> Batch:
        """A transactional (MULTI/EXEC) batch to pass as ``pipe`` to the write methods.

        Run-wide keys share one hash tag, so a batch of them is atomic even on Redis Cluster;
        do not mix fragment keys into the same batch there.
        """
        return Batch(self._r.connection_pool, self._r.response_callbacks, True, None)

    def shutdown_server(self) -> None:
        """Shut the Redis server down, saving its data (:func:`shutdown_server`): the end of a
        deployment whose store has no other owner (``ddiloco finish --shutdown-store``)."""
        shutdown_server(self._r)

    @unavailable
    def flush_run(self) -> int:
        """Delete every key of this run (SCAN by the run's two prefixes); return how many.

        Other runs on the same Redis are untouched. Not atomic: do not run it while workers of
        the run are writing.
        """
        deleted = 0
        for pattern in self.keys.patterns():
            batch: list[Any] = []
            for key in self._r.scan_iter(match=pattern, count=_DELETE_BATCH):
                batch.append(key)
                if len(batch) >= _DELETE_BATCH:
                    deleted += int(self._r.delete(*batch))
                    batch.clear()
            if batch:
                deleted += int(self._r.delete(*batch))
        return deleted
