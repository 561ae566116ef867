"""The Redis implementation of :class:`~ddiloco.store.base.ParameterStore` (DESIGN §3).

:class:`RedisStore` is the one object callers get: it inherits, by concept, from

* :class:`~ddiloco.store.versions.RedisVersions` (:mod:`ddiloco.store.versions`): fragment
  heads and versions, claim and publish, on the run record of
  :class:`~ddiloco.store.run_record.RedisRunRecord` (blob location, manifest, initial blobs)
  and the object collection of :mod:`ddiloco.store.collection`; their guarantees and what a
  crash can lose are documented there;
* :class:`~ddiloco.store.membership.RedisMembership` (:mod:`ddiloco.store.membership`): shard
  leases and endpoints, the learner registry, stop requests;
* :class:`~ddiloco.store.telemetry.RedisTelemetry` (:mod:`ddiloco.store.telemetry`): events,
  counters, wire bytes per peer, token fate;

all three on :class:`~ddiloco.store.core.RedisCore` (run id, client, clock, ``pipeline``,
``flush_run``). The key layout is :mod:`ddiloco.store.keys`; the Lua scripts are the
``store/*.lua`` files, each registered by the part that runs it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from ddiloco.store.membership import RedisMembership
from ddiloco.store.telemetry import RedisTelemetry
from ddiloco.store.versions import RedisVersions

if TYPE_CHECKING:
    from ddiloco.store.base import MembershipStore, ParameterStore, TelemetryStore, VersionStore

__all__ = ["RedisStore"]


class RedisStore(RedisVersions, RedisMembership, RedisTelemetry):
    """Parameter store of one run on a Redis server (DESIGN §3): versions, membership and
    telemetry behind one object.

    Args:
        client: a redis-py client, e.g. from :func:`ddiloco.store.connect`, returning bytes
            (``decode_responses=False``, the default): blobs are binary.
        run_id: the run's id: 1-128 characters from ``[A-Za-z0-9._-]``, not starting with
            ``.``, ``_`` or ``-``.
        clock: wall-clock seconds since the epoch for the times a caller leaves out
            (``time.time`` by default; injectable for tests).

    Raises:
        ConfigError: ``run_id`` is not of that form, or ``client`` decodes responses.

    Each part registers its Lua scripts in its ``__init__`` after
    :class:`~ddiloco.store.core.RedisCore` checked the arguments (cooperative ``__init__`` along
    the MRO: versions, membership, telemetry, core).
    """


if TYPE_CHECKING:
    # Lets mypy prove that each part satisfies its protocol and RedisStore all of them.
    _versions: type[VersionStore] = RedisVersions
    _membership: type[MembershipStore] = RedisMembership
    _telemetry: type[TelemetryStore] = RedisTelemetry
    _conforms: type[ParameterStore] = RedisStore
