"""Membership of a run in the Redis store (DESIGN §3, §4): who takes part and who should stop.

:class:`RedisMembership` implements :class:`~ddiloco.store.base.MembershipStore`:

* syncer shard leases (``lease_acquire.lua``, ``lease_renew.lua``, ``lease_release.lua``): an
  owner string with a PX TTL, handed out with a fresh epoch from one run-wide counter, so a shard
  whose lease expired is fenced out of the fragments its successor claimed
  (:meth:`~ddiloco.store.versions.RedisVersions.claim_fragment`);
* shard endpoints and learner heartbeats: JSON under a PX TTL, listed through a set of every id
  that ever announced or registered (no SCAN); liveness is the key's presence;
* stop requests: how a deployment without a supervisor ends a finished run.

Expiry is Redis's: a TTL runs on the server's clock, so no expiry is computed here.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any, cast

import redis
from redis.client import Pipeline

from ddiloco.store.base import STOP_ROLES
from ddiloco.store.core import RedisCore, as_str, dumps, load_script, unavailable

__all__ = ["STOP_ROLES", "RedisMembership"]


class RedisMembership(RedisCore):
    """Leases, shard endpoints, the learner registry and stop requests (:class:`MembershipStore`).

    Args and errors as :class:`~ddiloco.store.core.RedisCore`.
    """

    def __init__(
        self, client: redis.Redis, run_id: str, *, clock: Callable[[], float] = time.time
    ) -> None:
        super().__init__(client, run_id, clock=clock)
        self._lease_acquire = load_script(client, "lease_acquire")
        self._lease_renew = load_script(client, "lease_renew")
        self._lease_release = load_script(client, "lease_release")

    # -- syncer shard leases and endpoints -------------------------------------------------------
    @unavailable
    def acquire_lease(self, shard: int, owner: str, ttl_ms: int) -> int | None:
        """Take syncer shard ``shard``'s lease for ``ttl_ms`` ms and return a fresh epoch.

        Epochs come from one run-wide INCR counter, so they strictly increase across all
        acquisitions of all shards. Re-acquiring a lease one already holds extends it and returns
        a new epoch (safe: the new epoch only fences the caller's own older writes).

        Returns:
            The new epoch, or None when another owner holds the lease.
        """
        epoch = self._lease_acquire(
            keys=[self.keys.lease(shard), self.keys.epoch], args=[owner, ttl_ms]
        )
        return None if epoch is None else int(epoch)

    @unavailable
    def renew_lease(self, shard: int, owner: str, ttl_ms: int) -> bool:
        """Set the lease's TTL to ``ttl_ms`` ms if ``owner`` holds it; False if it was lost."""
        return bool(self._lease_renew(keys=[self.keys.lease(shard)], args=[owner, ttl_ms]))

    @unavailable
    def release_lease(self, shard: int, owner: str) -> None:
        """Delete the lease if ``owner`` holds it (a no-op otherwise)."""
        self._lease_release(keys=[self.keys.lease(shard)], args=[owner])

    @unavailable
    def announce_shard(
        self, shard: int, endpoints: dict[str, Any], ttl_ms: int, pipe: Pipeline | None = None
    ) -> None:
        """Publish ``endpoints`` (JSON-able, e.g. ``{"pull": "tcp://..", "pub": ".."}``) of a
        shard for ``ttl_ms`` ms; re-announce before it expires."""
        p = pipe if pipe is not None else self._r.pipeline(transaction=True)
        p.set(self.keys.shard(shard), dumps(endpoints), px=ttl_ms)
        p.sadd(self.keys.shards, shard)
        if pipe is None:
            p.execute()

    @unavailable
    def shard_endpoints(self, shard: int) -> dict[str, Any] | None:
        """Endpoints of ``shard``, or None if never announced or expired."""
        raw = self._r.get(self.keys.shard(shard))
        return None if raw is None else cast(dict[str, Any], json.loads(raw))

    @unavailable
    def shards(self) -> dict[int, dict[str, Any]]:
        """Endpoints of every shard whose announcement has not expired, by shard id."""
        ids = sorted(int(s) for s in self._r.smembers(self.keys.shards))
        if not ids:
            return {}
        raws = self._r.mget([self.keys.shard(s) for s in ids])
        return {s: json.loads(raw) for s, raw in zip(ids, raws, strict=True) if raw is not None}

    # -- learners --------------------------------------------------------------------------------
    @unavailable
    def register_learner(self, learner_id: str) -> int:
        """Add ``learner_id`` to the registry and return its new incarnation (1 the first time).

        The incarnation tells a restarted learner's messages from its previous life's
        (DESIGN §2, duplicate detection by (sender, incarnation, sequence)).
        """
        pipe = self._r.pipeline(transaction=True)
        pipe.incr(self.keys.incarnation(learner_id))
        pipe.sadd(self.keys.learners, learner_id)
        incarnation, _ = pipe.execute()
        return int(incarnation)

    @unavailable
    def heartbeat_learner(
        self, learner_id: str, info: dict[str, Any], ttl_ms: int, pipe: Pipeline | None = None
    ) -> None:
        """Mark the learner alive for ``ttl_ms`` ms with JSON-able ``info`` (DESIGN §4: liveness
        is a TTL key in the store, not heartbeats over the data sockets).

        Each heartbeat also (re)adds the learner to the registry: a Redis rebuilt from the
        object store (:mod:`ddiloco.store.rebuild`) knows only the learners its merge ledgers
        name, and a shard refuses deltas of a learner the registry does not know."""
        p = pipe if pipe is not None else self._r.pipeline(transaction=False)
        p.set(self.keys.learner(learner_id), dumps(info), px=ttl_ms)
        p.sadd(self.keys.learners, learner_id)
        if pipe is None:
            p.execute()

    @unavailable
    def live_learners(self) -> dict[str, dict[str, Any]]:
        """Heartbeat info of every registered learner whose heartbeat has not expired."""
        ids = sorted(as_str(m) for m in self._r.smembers(self.keys.learners))
        if not ids:
            return {}
        raws = self._r.mget([self.keys.learner(i) for i in ids])
        return {i: json.loads(raw) for i, raw in zip(ids, raws, strict=True) if raw is not None}

    @unavailable
    def known_learner(self, learner_id: str) -> bool:
        """Whether ``learner_id`` ever registered in this run (alive or not)."""
        return bool(self._r.sismember(self.keys.learners, learner_id))

    @unavailable
    def remove_learner(self, learner_id: str, pipe: Pipeline | None = None) -> None:
        """Mark the learner dead now (deletes its heartbeat); it stays known to the run."""
        (pipe if pipe is not None else self._r).delete(self.keys.learner(learner_id))

    # -- end of run ------------------------------------------------------------------------------
    @unavailable
    def request_stop(self, role: str, reason: str, t: float | None = None) -> None:
        """Ask every worker of ``role`` (one of :data:`STOP_ROLES`) to stop cleanly, as on
        SIGTERM: how a deployment without a supervisor (compose) ends a finished run.

        ``t`` (seconds since the epoch, ``self.clock()`` by default) is the request's time: a
        worker obeys only a request newer than its own start (:meth:`stop_requested`), so a
        later restart of the same run is not stopped by an old request.

        Raises:
            ValueError: ``role`` is not one of :data:`STOP_ROLES`.
        """
        if role not in STOP_ROLES:
            raise ValueError(f"stop role {role!r} is not one of {STOP_ROLES}")
        self._r.set(self.keys.stop(role),
                    dumps({"reason": reason, "t": self.clock() if t is None else t}))

    @unavailable
    def stop_requested(self, role: str, since: float) -> bool:
        """Whether a stop of ``role`` was requested at or after ``since`` (epoch seconds)."""
        raw = self._r.get(self.keys.stop(role))
        if raw is None:
            return False
        try:
            t = float(json.loads(raw)["t"])
        except (ValueError, KeyError, TypeError):
            return False  # a malformed request stops nothing
        return t >= since
