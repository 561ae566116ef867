"""Parameter store of ddiloco (DESIGN §3): versioned, fenced fragment writes on Redis.

Public names:

* :class:`ParameterStore` - the protocol workers depend on; :class:`FragmentHead`,
  :class:`FragmentBlob` - its records;
* :class:`RedisStore` - the Redis implementation, :class:`Keys` - its key layout;
* :func:`connect` - a redis-py client with retry/backoff, or ``StoreUnavailable``;
* :class:`EmbeddedRedis` - a private, AOF-persisted redis-server for single-host runs and tests.
"""

if __name__ != "ddiloco.store":
    # Run from a checkout, the folder is also importable as ``store``: a second copy of every
    # module would then hold a second copy of its state.
    raise ImportError(f"{__name__!r} is the package 'ddiloco.store': import it by that name "
                      "(pip install -e . maps the store/ folder there)")


from ddiloco.store.base import FragmentBlob, FragmentHead, ParameterStore
from ddiloco.store.connect import connect, redact_url
from ddiloco.store.embedded import EmbeddedRedis, find_redis_server
from ddiloco.store.redis_store import EVENTS_MAXLEN, GC_SPAN, KEY_PREFIX, Keys, RedisStore

__all__ = [
    "EVENTS_MAXLEN",
    "GC_SPAN",
    "KEY_PREFIX",
    "EmbeddedRedis",
    "FragmentBlob",
    "FragmentHead",
    "Keys",
    "ParameterStore",
    "RedisStore",
    "connect",
    "find_redis_server",
    "redact_url",
]
