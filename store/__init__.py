"""Parameter store of ddiloco (DESIGN §3): versioned, fenced fragment writes on Redis.

Public names:

* :class:`ParameterStore` - the protocol workers depend on, the union of :class:`VersionStore`,
  :class:`MembershipStore` and :class:`TelemetryStore` (:mod:`ddiloco.store.base`);
  :class:`FragmentHead`, :class:`FragmentBlob` - its records;
* :class:`RedisStore` - the Redis implementation, :class:`Keys` - its key layout;
* :func:`connect` - a redis-py client with retry/backoff, or ``StoreUnavailable``;
* :class:`EmbeddedRedis` - a private, AOF-persisted redis-server for single-host runs and tests.
"""

if __name__ != "ddiloco.store":
    # Run from a checkout, the folder is also importable as ``store``: a second copy of every
    # module would then hold a second copy of its state.
    raise ImportError(f"{__name__!r} is the package 'ddiloco.store': import it by that name "
                      "(pip install -e . maps the store/ folder there)")


from ddiloco.store.base import (
    STOP_ROLES,
    FragmentBlob,
    FragmentHead,
    MembershipStore,
    ParameterStore,
    RunStore,
    TelemetryStore,
    VersionStore,
)
from ddiloco.store.connect import connect, redact_url
from ddiloco.store.embedded import EmbeddedRedis, find_redis_server
from ddiloco.store.keys import KEY_PREFIX, Keys
from ddiloco.store.redis_store import RedisStore
from ddiloco.store.telemetry import EVENTS_MAXLEN
from ddiloco.store.versions import GC_SPAN

__all__ = [
    "EVENTS_MAXLEN",
    "GC_SPAN",
    "KEY_PREFIX",
    "STOP_ROLES",
    "EmbeddedRedis",
    "FragmentBlob",
    "FragmentHead",
    "Keys",
    "MembershipStore",
    "ParameterStore",
    "RedisStore",
    "RunStore",
    "TelemetryStore",
    "VersionStore",
    "connect",
    "find_redis_server",
    "redact_url",
]
