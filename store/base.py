"""The parameter-store interface (DESIGN §3): records and one protocol per concept of the store.

The store is the snapshot server of the recovery path (DESIGN §2, "Recovery"): it holds the run
manifest, the last ``keep`` versions of every fragment with their outer-momentum state, the syncer
shard leases that fence writers, the learner registry with TTL liveness, counters and the
append-only event stream. :class:`~ddiloco.store.redis_store.RedisStore` is the implementation; the
protocols exist so workers and tests depend on behaviour, not on the one class:

* :class:`RunStore`: what every part shares: ``run_id``, ``client``, :meth:`~RunStore.pipeline`,
  :meth:`~RunStore.flush_run`;
* :class:`VersionStore`: the run manifest, initial blobs, fragment heads and versions (read,
  claim, publish), implemented in ``ddiloco.store.versions``;
* :class:`MembershipStore`: syncer shard leases and endpoints, the learner registry, stop
  requests, implemented in ``ddiloco.store.membership``;
* :class:`TelemetryStore`: the event stream, counters, wire bytes per peer, token fate,
  implemented in ``ddiloco.store.telemetry``;
* :class:`ParameterStore`: all of the above, what a worker, the chaos runner or the report is
  given.

Conventions shared by every implementation:

* fragments ``p`` and shard ids are non-negative ints; versions start at 0 and a fragment with no
  published version has version -1 (it has no head);
* times are wall-clock seconds since the epoch (``time.time()``), TTLs are milliseconds;
* blobs are opaque ``bytes`` (the syncer chooses their encoding);
* every state-changing method that can be batched takes an optional ``pipe`` (a pipeline from
  :meth:`RunStore.pipeline`); when given, the command is only queued and its result is part of
  ``pipe.execute()``'s list (the rq idiom, so callers compose atomic batches);
* errors (all from :mod:`ddiloco.pipeline.errors`): ``StoreUnavailable`` when the backend cannot
  be reached after retrying (every method); the others are named on the methods that raise them.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, overload, runtime_checkable

import redis
from redis.client import Pipeline

from ddiloco.store.core import Batch

__all__ = [
    "STOP_ROLES",
    "FragmentBlob",
    "FragmentHead",
    "MembershipStore",
    "ParameterStore",
    "RunStore",
    "TelemetryStore",
    "VersionStore",
]

#: Roles :meth:`MembershipStore.request_stop` can ask to stop (the end of a deployment's run).
STOP_ROLES = ("shards", "evaluator", "routers")


@dataclass(frozen=True)
class FragmentHead:
    """The published head of one fragment.

    Attributes:
        version: latest published version (>= 0).
        epoch: highest shard epoch that claimed or wrote the fragment; writers with a lower
            epoch are fenced out.
        updated_at: wall-clock seconds of the last publish.
        token: the write token of the publish that made this version (a round's token when
            the writer gave one; :meth:`VersionStore.publish`); ``""`` when unknown. Not
            part of equality: two heads are equal when they name the same version.
    """

    version: int
    epoch: int
    updated_at: float
    token: str = field(default="", compare=False)


@dataclass(frozen=True)
class FragmentBlob:
    """One stored version of a fragment.

    Attributes:
        fragment: fragment index ``p``.
        version: the version these blobs belong to.
        value: the fragment's parameters Theta_p, opaque bytes (a ``bytearray`` where an
            object store's large object was read in ranges: writable, so it decodes without a
            copy).
        momentum: the outer optimizer's momentum buffer for the fragment, opaque bytes (as
            ``value``).
        meta: small JSON-able dict written with the version (e.g. contributors, codec); ``{}``
            when the writer gave none.
    """

    fragment: int
    version: int
    value: bytes
    momentum: bytes
    meta: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class RunStore(Protocol):
    """What every part of the store shares: the run, the Redis client and batching (DESIGN §3)."""

    run_id: str

    @property
    def client(self) -> redis.Redis:
        """The Redis client under the store, for server administration (ACL users, SHUTDOWN);
        store data goes through the methods."""
        ...

    def pipeline(self) -> Batch:
        """A transactional (MULTI/EXEC) batch for the ``pipe`` arguments; its ``execute()``
        raises ``StoreUnavailable`` in an outage (:class:`ddiloco.store.core.Batch`)."""
        ...

    def shutdown_server(self) -> None:
        """Shut the server down, saving its data (the end of a deployment)."""
        ...

    def flush_run(self) -> int:
        """Delete every key of the run; return how many were deleted. Not atomic."""
        ...


@runtime_checkable
class VersionStore(RunStore, Protocol):
    """The run manifest and the versioned fragments (DESIGN §2 step 6, §3).

    Errors: ``VersionConflict`` and ``FencedOut`` from :meth:`publish` and
    :meth:`claim_fragment`, ``ManifestMismatch`` from :meth:`put_manifest`, ``StoreError`` when a
    version's blobs are half gone (an evicting Redis).
    """

    # -- manifest -------------------------------------------------------------------------------
    def put_manifest(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Store the run manifest if the run has none; return the stored one.

        Raises:
            ManifestMismatch: the stored manifest has a different ``schema_hash``.
            ConfigError: ``manifest`` has no ``schema_hash``.
        """
        ...

    def get_manifest(self) -> dict[str, Any] | None:
        """The run manifest, or None if none was stored."""
        ...

    def update_manifest(
        self, change: Callable[[dict[str, Any]], dict[str, Any]]
    ) -> dict[str, Any] | None:
        """Replace the stored manifest by ``change(manifest)``, atomically against concurrent
        writers (read, change, compare-and-set, retried); return the new one, or None when the
        run has no manifest.

        Raises:
            StoreError: the manifest kept changing under the update.
        """
        ...

    # -- blob location --------------------------------------------------------------------------
    def set_blob_location(self, location: str) -> str:
        """Record where the run keeps its blobs (``redis``, ``file:///dir``,
        ``s3://bucket/prefix``; :mod:`ddiloco.store.objects`) unless recorded; return it.
        ``ConfigError`` if the run keeps them elsewhere."""
        ...

    @property
    def blob_location(self) -> str:
        """Where the run keeps its blobs (``redis`` until the init step records another)."""
        ...

    def object_paths(self) -> list[str]:
        """Paths of every object the run holds in its object store (empty on ``redis``)."""
        ...

    def wait_collected(self) -> None:
        """Wait for the garbage collections of objects that publishes started in the
        background (the versions that left the kept window)."""
        ...

    # -- fragments ------------------------------------------------------------------------------
    def put_initial(self, p: int, value: bytes) -> bool:
        """Store fragment ``p``'s initial value blob once (the init step); True if stored."""
        ...

    def get_initial(self, p: int) -> bytes | None:
        """Fragment ``p``'s initial value blob, or None before the init step."""
        ...

    def head(self, p: int) -> FragmentHead | None:
        """Head of fragment ``p``, or None if no version was published."""
        ...

    def heads(self, n_fragments: int) -> list[FragmentHead | None]:
        """Heads of fragments ``0 .. n_fragments-1`` in one round trip."""
        ...

    def get_version(self, p: int, version: int) -> FragmentBlob | None:
        """Version ``version`` of fragment ``p``, or None if never written or garbage-collected.

        Raises:
            StoreError: only one of value and momentum is present (evicted).
        """
        ...

    def version_meta(self, p: int, version: int) -> dict[str, Any] | None:
        """The meta of version ``version`` of ``p`` alone (no blobs), or None if never written
        or garbage-collected."""
        ...

    def stored_versions(self, p: int) -> list[int]:
        """Every version of ``p`` whose value is stored, ascending (an audit's read: a scan of
        the fragment's keys, not for a hot path)."""
        ...

    def get_latest(self, p: int) -> FragmentBlob | None:
        """The head version of ``p`` read atomically with its blobs, or None if unpublished.

        Raises:
            StoreError: the head's blobs are missing (evicted).
        """
        ...

    def get_latest_many(self, ps: Iterable[int], momentum: bool = True,
                        ) -> list[FragmentBlob | None]:
        """:meth:`get_latest` for several fragments in one round trip, in the order of ``ps``;
        ``momentum=False`` leaves every record's momentum empty and unread."""
        ...

    def claim_fragment(self, p: int, epoch: int) -> None:
        """Raise the fragment's epoch to ``epoch`` so older writers are fenced out.

        Raises:
            FencedOut: the fragment's epoch is already higher than ``epoch``.
        """
        ...

    def publish(
        self,
        p: int,
        *,
        expected_version: int,
        epoch: int,
        value: bytes | Sequence[memoryview],
        momentum: bytes | Sequence[memoryview],
        keep: int,
        meta: dict[str, Any] | None = None,
        now: float | None = None,
        token: str | None = None,
        ledger: Sequence[tuple[str, int, int]] = (),
    ) -> int:
        """Write version ``expected_version + 1`` of ``p`` atomically; return it.

        ``value`` and ``momentum`` are opaque blobs, as bytes or as their parts in order
        (written without a joined copy where the backend allows). ``now`` is the publish time
        in wall-clock seconds (``time.time()`` when None). ``token`` (a fresh one when None) is
        kept in the head: the same call repeated after a lost reply is answered as a success,
        and a writer that does not know whether its publish took effect compares it with
        :meth:`head`'s. ``ledger`` names the merged deltas as ``(learner:incarnation, first
        seq, last seq)``: the store refuses a publish that would merge one a second time.

        Raises:
            VersionConflict: the head is not ``expected_version`` (-1: no head); nothing written.
            FencedOut: ``epoch`` is lower than the fragment's epoch; nothing written.
            AlreadyMerged: the ledger shows one of ``ledger``'s deltas merged before; nothing
                written.
            ValueError: ``keep < 1`` or ``expected_version < -1``.
        """
        ...


@runtime_checkable
class MembershipStore(RunStore, Protocol):
    """Who takes part in the run: syncer shard leases and endpoints, learners, stop requests
    (DESIGN §3 "a lease per syncer shard", "learner registry with TTL heartbeats"; §4 liveness).
    """

    # -- syncer shard leases and endpoints -------------------------------------------------------
    def acquire_lease(self, shard: int, owner: str, ttl_ms: int) -> int | None:
        """Take the shard's lease for ``ttl_ms`` ms; return a fresh epoch, or None if held."""
        ...

    def renew_lease(self, shard: int, owner: str, ttl_ms: int) -> bool:
        """Extend the lease to ``ttl_ms`` ms from now if ``owner`` still holds it."""
        ...

    def release_lease(self, shard: int, owner: str) -> None:
        """Drop the lease if ``owner`` holds it; a no-op otherwise."""
        ...

    def announce_shard(
        self, shard: int, endpoints: dict[str, Any], ttl_ms: int, pipe: Pipeline | None = None
    ) -> None:
        """Publish the shard's endpoints for ``ttl_ms`` ms."""
        ...

    def shard_endpoints(self, shard: int) -> dict[str, Any] | None:
        """Endpoints of ``shard``, or None if not announced or expired."""
        ...

    def shards(self) -> dict[int, dict[str, Any]]:
        """Endpoints of every shard whose announcement has not expired."""
        ...

    # -- learners --------------------------------------------------------------------------------
    def register_learner(self, learner_id: str) -> int:
        """Add the learner to the registry; return its new incarnation (1, 2, ...)."""
        ...

    def heartbeat_learner(
        self, learner_id: str, info: dict[str, Any], ttl_ms: int, pipe: Pipeline | None = None
    ) -> None:
        """Mark the learner alive for ``ttl_ms`` ms with ``info``."""
        ...

    def live_learners(self) -> dict[str, dict[str, Any]]:
        """Info of every registered learner whose heartbeat has not expired."""
        ...

    def known_learner(self, learner_id: str) -> bool:
        """Whether the learner ever registered in this run."""
        ...

    def remove_learner(self, learner_id: str, pipe: Pipeline | None = None) -> None:
        """Mark the learner dead now; it stays known."""
        ...

    # -- end of run ------------------------------------------------------------------------------
    def request_stop(self, role: str, reason: str, t: float | None = None) -> None:
        """Ask every worker of ``role`` (one of :data:`STOP_ROLES`) to stop cleanly; ``t`` is
        the request's wall-clock time in seconds (now when None).

        Raises:
            ValueError: ``role`` is not one of :data:`STOP_ROLES`.
        """
        ...

    def stop_requested(self, role: str, since: float) -> bool:
        """Whether a stop of ``role`` was requested at or after ``since`` (epoch seconds)."""
        ...


@runtime_checkable
class TelemetryStore(RunStore, Protocol):
    """What the run reports about itself: the event stream, counters, wire bytes per peer and
    token fate (DESIGN §3 "append-only event stream", §5 goodput and token fate)."""

    # -- events and counters ---------------------------------------------------------------------
    @overload
    def add_event(self, kind: str, fields: dict[str, Any], pipe: None = None,
                  t: float | None = None, eid: str | None = None) -> str: ...

    @overload
    def add_event(self, kind: str, fields: dict[str, Any], pipe: Pipeline,
                  t: float | None = None, eid: str | None = None) -> None: ...

    def add_event(
        self, kind: str, fields: dict[str, Any], pipe: Pipeline | None = None,
        t: float | None = None, eid: str | None = None,
    ) -> str | None:
        """Append an event at wall-clock time ``t`` seconds (now when None); return its stream
        id (None when queued on ``pipe``). ``eid`` names the event (a fresh id when None):
        readers keep one event per ``eid``, so a writer that repeats a write whose reply was
        lost passes the same one.

        Raises:
            ValueError: ``fields`` uses the reserved names ``kind`` or ``t``.
            TypeError: ``fields`` is not JSON-able.
        """
        ...

    def events(
        self, start: str = "-", count: int | None = None, kinds: Collection[str] | None = None
    ) -> list[tuple[str, dict[str, Any]]]:
        """Events from ``start`` on, oldest first, as ``(id, {"kind", "t", **fields})``."""
        ...

    def incr_counter(
        self, name: str, field: str, amount: int = 1, pipe: Pipeline | None = None
    ) -> None:
        """Add ``amount`` to counter ``field`` of the counter group ``name``."""
        ...

    def counters(self, name: str) -> dict[str, int]:
        """Every field of the counter group ``name``."""
        ...

    def set_wire_peers(self, learner_id: str, incarnation: int, totals: dict[str, int],
                       pipe: Pipeline | None = None) -> None:
        """Store one learner incarnation's cumulative application bytes per directed worker
        pair (``{"learner-1>shard-0": bytes, ...}``; absolute values, so a retried write
        cannot count twice)."""
        ...

    def wire_peers(self) -> dict[str, int]:
        """Application bytes per directed worker pair ``"src>dst"``, summed over every
        learner incarnation's :meth:`set_wire_peers` totals."""
        ...

    # -- token fate (DESIGN §5) ------------------------------------------------------------------
    def set_fate(self, learner_id: str, incarnation: int, record: dict[str, Any],
                 pipe: Pipeline | None = None) -> None:
        """Overwrite the fate record of one learner incarnation (absolute cumulative values)."""
        ...

    def received_total(self, learner_id: str, incarnation: int, shard: str) -> int:
        """Fragment-tokens :meth:`note_received` last stored for this incarnation and shard."""
        ...

    def note_received(self, learner_id: str, incarnation: int, total: int, shard: str,
                      snapshot: list[int] | None) -> None:
        """Shard ``shard`` has received ``total`` fragment-tokens from the learner incarnation
        (absolute); ``snapshot`` is the learner's ``[processed, sent, overwritten, drain]`` at
        its latest send, or None."""
        ...

    def fate_records(self) -> list[dict[str, Any]]:
        """Every learner incarnation's fate record with ``learner``, ``incarnation``, ``wire``
        and ``received`` (DESIGN §5)."""
        ...


@runtime_checkable
class ParameterStore(VersionStore, MembershipStore, TelemetryStore, Protocol):
    """The whole store: versions, membership and telemetry of one run (DESIGN §3).

    What workers, the chaos runner and the report are given; a caller that needs one concept
    only may ask for :class:`VersionStore`, :class:`MembershipStore` or :class:`TelemetryStore`.
    """
