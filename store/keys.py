"""The key layout of the Redis store (DESIGN §3): prefixes as constants, :class:`Keys` builds names.

Every key starts with ``ddl:`` and carries a Redis Cluster hash tag (the part in braces), so each
atomic unit lives in one slot.

Per fragment ``p`` (tag ``{<run>:<p>}``; every write of a fragment is one Lua script,
:mod:`ddiloco.store.versions`):

===============================  ==================================================================
``ddl:{<run>:<p>}:head``         hash: ``version``, ``epoch``, ``updated_at`` (seconds),
                                 ``token`` (random id of the publish that wrote it). A fragment
                                 claimed but never published has only ``epoch``: it has no head.
``ddl:{<run>:<p>}:v:<n>``        value blob of version ``n`` (bytes), or a pointer to its object
``ddl:{<run>:<p>}:m:<n>``        outer-momentum blob of version ``n`` (bytes), or a pointer
``ddl:{<run>:<p>}:meta:<n>``     JSON meta of version ``n`` (``{}`` when none was given)
``ddl:{<run>:<p>}:init``         initial value blob, written once (SET NX) by the run's init step;
                                 the owning shard publishes it as version 0
===============================  ==================================================================

Run-wide (tag ``{<run>}``, so several of them compose in one MULTI/EXEC pipeline):

=====================================  ============================================================
``ddl:{<run>}:manifest``               JSON of the run manifest, sorted keys, written once (SET NX)
``ddl:{<run>}:blobs``                  the run's blob location (:mod:`ddiloco.store.objects`),
                                       written once (SET NX) before the manifest; absent: ``redis``
``ddl:{<run>}:epoch``                  INCR counter handing out shard epochs (strictly increasing)
``ddl:{<run>}:lease:<shard>``          owner string, PX TTL
``ddl:{<run>}:shard:<shard>``          JSON endpoints of a shard, PX TTL
``ddl:{<run>}:shards``                 set of shard ids that ever announced (listed without SCAN)
``ddl:{<run>}:learners``               set of learner ids that ever registered
``ddl:{<run>}:learner:<id>``           JSON heartbeat info, PX TTL: present == alive
``ddl:{<run>}:incarnation:<id>``       INCR counter, one per registration of the learner
``ddl:{<run>}:stop:<role>``            JSON stop request ``{"reason", "t"}`` of a worker role
``ddl:{<run>}:events``                 stream, fields ``kind``, ``t`` (seconds), ``data`` (JSON),
                                       ``eid`` (random id that tells a re-sent XADD's copy)
``ddl:{<run>}:counters:<name>``        hash of integer counters; the groups ``received``,
                                       ``wire_fate`` and ``wire_peers`` hold token fate and wire
                                       bytes (:mod:`ddiloco.store.telemetry`)
``ddl:{<run>}:fates``                  set of ``<learner>:<incarnation>`` that wrote a fate record
``ddl:{<run>}:fate:<id>:<inc>``        JSON fate record of one learner incarnation (DESIGN §5)
=====================================  ============================================================

Run ids contain no glob characters, braces or ``:`` (checked by
:class:`~ddiloco.store.core.RedisCore`), so the patterns of :meth:`Keys.patterns` match exactly
one run's keys. :mod:`ddiloco.store.acl` grants per-role access by these same names.
"""

from __future__ import annotations

__all__ = [
    "BLOBS",
    "COUNTERS",
    "EPOCH",
    "EVENTS",
    "FATE",
    "FATES",
    "HEAD",
    "INCARNATION",
    "INIT",
    "KEY_PREFIX",
    "LEARNER",
    "LEARNERS",
    "LEASE",
    "MANIFEST",
    "META",
    "MOMENTUM",
    "SHARD",
    "SHARDS",
    "STOP",
    "VALUE",
    "Keys",
]

KEY_PREFIX = "ddl"
# Fragment keys: ddl:{<run>:<p>}:<suffix>
HEAD = "head"
VALUE = "v"
MOMENTUM = "m"
META = "meta"
INIT = "init"
# Run-wide keys: ddl:{<run>}:<suffix>
MANIFEST = "manifest"
BLOBS = "blobs"
EPOCH = "epoch"
LEASE = "lease"
SHARD = "shard"
SHARDS = "shards"
LEARNERS = "learners"
LEARNER = "learner"
INCARNATION = "incarnation"
STOP = "stop"
EVENTS = "events"
COUNTERS = "counters"
FATES = "fates"
FATE = "fate"


class Keys:
    """Builds every key name of one run (layout in the module docstring).

    Args:
        run_id: the run's id, already checked to be key-safe.
    """

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self.run_prefix = f"{KEY_PREFIX}:{{{run_id}}}:"

    # -- fragments ------------------------------------------------------------------------------
    def fragment_prefix(self, p: int) -> str:
        """``ddl:{<run>:<p>}:``, the prefix of every key of fragment ``p``."""
        return f"{KEY_PREFIX}:{{{self.run_id}:{p}}}:"

    def head(self, p: int) -> str:
        return f"{self.fragment_prefix(p)}{HEAD}"

    def value(self, p: int, version: int) -> str:
        return f"{self.fragment_prefix(p)}{VALUE}:{version}"

    def initial(self, p: int) -> str:
        return f"{self.fragment_prefix(p)}{INIT}"

    def momentum(self, p: int, version: int) -> str:
        return f"{self.fragment_prefix(p)}{MOMENTUM}:{version}"

    def meta(self, p: int, version: int) -> str:
        return f"{self.fragment_prefix(p)}{META}:{version}"

    def blobs(self, p: int, version: int) -> list[str]:
        """Value, momentum and meta keys of one version."""
        return [self.value(p, version), self.momentum(p, version), self.meta(p, version)]

    # -- run-wide -------------------------------------------------------------------------------
    @property
    def manifest(self) -> str:
        return f"{self.run_prefix}{MANIFEST}"

    @property
    def blob_location(self) -> str:
        return f"{self.run_prefix}{BLOBS}"

    @property
    def epoch(self) -> str:
        return f"{self.run_prefix}{EPOCH}"

    def lease(self, shard: int) -> str:
        return f"{self.run_prefix}{LEASE}:{shard}"

    def shard(self, shard: int) -> str:
        return f"{self.run_prefix}{SHARD}:{shard}"

    @property
    def shards(self) -> str:
        return f"{self.run_prefix}{SHARDS}"

    @property
    def learners(self) -> str:
        return f"{self.run_prefix}{LEARNERS}"

    def learner(self, learner_id: str) -> str:
        return f"{self.run_prefix}{LEARNER}:{learner_id}"

    def incarnation(self, learner_id: str) -> str:
        return f"{self.run_prefix}{INCARNATION}:{learner_id}"

    def stop(self, role: str) -> str:
        return f"{self.run_prefix}{STOP}:{role}"

    @property
    def events(self) -> str:
        return f"{self.run_prefix}{EVENTS}"

    def counters(self, name: str) -> str:
        return f"{self.run_prefix}{COUNTERS}:{name}"

    @property
    def fates(self) -> str:
        return f"{self.run_prefix}{FATES}"

    def fate(self, learner_id: str, incarnation: int) -> str:
        return f"{self.run_prefix}{FATE}:{learner_id}:{incarnation}"

    # -- scanning -------------------------------------------------------------------------------
    def patterns(self) -> list[str]:
        """SCAN patterns that together match exactly the keys of this run."""
        # Run ids contain no glob characters, '{', '}' or ':', so these two patterns cannot
        # match keys of another run.
        return [f"{self.run_prefix}*", f"{KEY_PREFIX}:{{{self.run_id}:*}}:*"]
