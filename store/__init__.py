"""Parameter store of ddiloco (DESIGN §3): versioned, fenced fragment writes on Redis.

Public names:

* :class:`ParameterStore` - the protocol workers depend on; :class:`FragmentHead`,
  :class:`FragmentBlob` - its records;
* :class:`RedisStore` - the Redis implementation, :class:`Keys` - its key layout;
* :func:`connect` - a redis-py client with retry/backoff, or ``StoreUnavailable``;
* :class:`EmbeddedRedis` - a private, AOF-persisted redis-server for single-host runs and tests.
"""

from store.base import FragmentBlob, FragmentHead, ParameterStore
from store.connect import connect, redact_url
from store.embedded import EmbeddedRedis, find_redis_server
from store.redis_store import EVENTS_MAXLEN, GC_SPAN, KEY_PREFIX, Keys, RedisStore

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
