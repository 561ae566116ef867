"""The Redis implementation of :class:`~store.base.ParameterStore` (DESIGN §3).

Key layout
----------
Every key starts with ``ddl:`` and carries a Redis Cluster hash tag (the part in braces), so each
atomic unit lives in one slot:

Per fragment ``p`` (tag ``{<run>:<p>}``; every write of a fragment is one Lua script):

===============================  ==================================================================
``ddl:{<run>:<p>}:head``         hash: ``version``, ``epoch``, ``updated_at`` (seconds),
                                 ``token`` (random id of the publish that wrote it). A fragment
                                 claimed but never published has only ``epoch``: it has no head.
``ddl:{<run>:<p>}:v:<n>``        value blob of version ``n`` (bytes)
``ddl:{<run>:<p>}:m:<n>``        outer-momentum blob of version ``n`` (bytes)
``ddl:{<run>:<p>}:meta:<n>``     JSON meta of version ``n`` (``{}`` when none was given)
``ddl:{<run>:<p>}:init``         initial value blob, written once (SET NX) by the run's init step;
                                 the owning shard publishes it as version 0
===============================  ==================================================================

Run-wide (tag ``{<run>}``, so several of them compose in one MULTI/EXEC pipeline):

===================================  ==============================================================
``ddl:{<run>}:manifest``             JSON of the run manifest, sorted keys, written once (SET NX)
``ddl:{<run>}:epoch``                INCR counter handing out shard epochs (strictly increasing)
``ddl:{<run>}:lease:<shard>``        owner string, PX TTL
``ddl:{<run>}:shard:<shard>``        JSON endpoints of a shard, PX TTL
``ddl:{<run>}:shards``               set of shard ids that ever announced (to list them w/o SCAN)
``ddl:{<run>}:learners``             set of learner ids that ever registered
``ddl:{<run>}:learner:<id>``         JSON heartbeat info, PX TTL: present == alive
``ddl:{<run>}:incarnation:<id>``     INCR counter, one per registration of the learner
``ddl:{<run>}:events``               stream, fields ``kind``, ``t`` (seconds), ``data`` (JSON)
``ddl:{<run>}:counters:<name>``      hash of integer counters
===================================  ==============================================================

Guarantees
----------
* :meth:`RedisStore.publish` is a compare-and-set on the head version, fenced by the shard epoch,
  and writes value, momentum, meta and head and deletes the versions that leave the kept window
  in one Lua script: readers see all of a version or none of it.
* :meth:`RedisStore.get_latest` reads head and blobs in one Lua script (no torn read).
* Garbage collection deletes, on each publish, the versions in
  ``(new - keep - GC_SPAN, new - keep]``. With a constant ``keep`` that is exactly the version
  leaving the window; if ``keep`` shrinks by more than ``GC_SPAN`` between two publishes, the
  older surplus versions stay until :meth:`RedisStore.flush_run`.
* Connection errors are retried by the client's redis-py ``Retry`` (see :func:`store.connect`);
  what still fails is raised as ``StoreUnavailable``. A publish re-sent after a lost reply is
  recognised by its token and answered as a success, not as a conflict.

What a crash can lose
---------------------
The store is as durable as the Redis behind it. With the configuration of
:class:`store.embedded.EmbeddedRedis` (AOF, ``appendfsync always``) a ``kill -9`` of Redis loses
no acknowledged write: heads are consistent after a restart (each Lua script is logged as a
whole). With ``appendfsync everysec`` a crash loses about the last second of writes; the heads
may then be a version behind what shards published and broadcast, and a re-published version
number would carry other contents than the one learners adopted: run the parameter store with
``appendfsync always``. A Redis with an eviction policy other than ``noeviction`` may drop
blobs; reads then raise ``StoreError`` instead of returning torn data.
"""

from __future__ import annotations

import functools
import json
import re
import time
import uuid
from collections.abc import Callable, Iterable
from importlib import resources
from typing import TYPE_CHECKING, Any, ParamSpec, TypeVar, cast, overload

import redis
from redis.client import Pipeline
from redis.commands.core import Script

from ddiloco.pipeline.errors import (
    ConfigError,
    FencedOut,
    ManifestMismatch,
    StoreError,
    StoreUnavailable,
    VersionConflict,
)
from ddiloco.store.base import FragmentBlob, FragmentHead, ParameterStore

__all__ = ["EVENTS_MAXLEN", "GC_SPAN", "KEY_PREFIX", "Keys", "RedisStore"]

KEY_PREFIX = "ddl"
# Fragment keys: ddl:{<run>:<p>}:<suffix>
HEAD = "head"
VALUE = "v"
MOMENTUM = "m"
META = "meta"
INIT = "init"
# Run-wide keys: ddl:{<run>}:<suffix>
MANIFEST = "manifest"
EPOCH = "epoch"
LEASE = "lease"
SHARD = "shard"
SHARDS = "shards"
LEARNERS = "learners"
LEARNER = "learner"
INCARNATION = "incarnation"
EVENTS = "events"
COUNTERS = "counters"
FATES = "fates"
FATE = "fate"
STOP = "stop"
#: Roles :meth:`RedisStore.request_stop` can ask to stop (the end of a deployment's run).
STOP_ROLES = ("shards", "evaluator", "routers")

#: Approximate cap on the event stream (XADD MAXLEN ~): enough for a long run's joins, merges and
#: drops while bounding memory to a few hundred MB at worst.
EVENTS_MAXLEN = 200_000
#: How many versions below the kept window one publish deletes (see module docstring).
GC_SPAN = 8
#: Entries read per XRANGE call when :meth:`RedisStore.events` has to filter or page.
_EVENTS_PAGE = 1_000
#: Keys deleted per DEL call in :meth:`RedisStore.flush_run`.
_DELETE_BATCH = 500

# Run ids become part of key names and SCAN patterns: keep them free of glob characters, braces
# (hash tags) and ':' (so one run's patterns never match another run's keys).
_RUN_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")

P = ParamSpec("P")
T = TypeVar("T")


def _load_script(client: redis.Redis, name: str) -> Script:
    """Register ``store/<name>.lua`` on ``client`` (EVALSHA, loaded on first use)."""
    text = resources.files("ddiloco.store").joinpath(f"{name}.lua").read_text(encoding="utf-8")
    return client.register_script(text)


class _ReadOnlyScript:
    """A read-only Lua script, run with EVALSHA_RO where the server has it (Redis >= 7).

    EVALSHA declares its keys read-write, so an ACL user that may only read them (a learner
    reading versions, docs/SECURITY.md) is refused it; EVALSHA_RO declares them read-only.
    On Redis 6 it falls back to redis-py's EVALSHA ``Script``.
    """

    def __init__(self, client: redis.Redis, name: str) -> None:
        # Any: the typeshed stubs predate EVALSHA_RO and Script.sha / Script.script
        self.client: Any = client
        self.script: Any = _load_script(client, name)
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


def _dumps(obj: Any) -> str:
    """Canonical JSON: sorted keys, no spaces (stable bytes for equal dicts)."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=_json_default)


def _str(raw: bytes | str) -> str:
    return raw.decode() if isinstance(raw, bytes) else raw


def _unavailable(fn: Callable[P, T]) -> Callable[P, T]:
    """Turn connection failures that survived the client's retries into ``StoreUnavailable``."""

    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> T:
        try:
            return fn(*args, **kwargs)
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise StoreUnavailable(f"Redis unavailable during {fn.__name__}: {exc}") from exc

    return wrapper


class Keys:
    """Builds every key name of one run (layout in the module docstring)."""

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

    def stop(self, role: str) -> str:
        return f"{self.run_prefix}{STOP}:{role}"

    # -- scanning -------------------------------------------------------------------------------
    def patterns(self) -> list[str]:
        """SCAN patterns that together match exactly the keys of this run."""
        # Run ids contain no glob characters, '{', '}' or ':' (checked by RedisStore), so these
        # two patterns cannot match keys of another run.
        return [f"{self.run_prefix}*", f"{KEY_PREFIX}:{{{self.run_id}:*}}:*"]


class RedisStore:
    """Parameter store of one run on a Redis server (DESIGN §3).

    Args:
        client: a redis-py client, e.g. from :func:`store.connect`, returning bytes
            (``decode_responses=False``, the default): blobs are binary.
        run_id: the run's id: 1-128 characters from ``[A-Za-z0-9._-]``, not starting with
            ``.``, ``_`` or ``-``.

    Raises:
        ConfigError: ``run_id`` is not of that form, or ``client`` decodes responses.
    """

    def __init__(self, client: redis.Redis, run_id: str) -> None:
        if not _RUN_ID.fullmatch(run_id):
            raise ConfigError(
                f"run_id {run_id!r}: use 1-128 characters from [A-Za-z0-9._-], starting with a "
                "letter or digit (it becomes part of Redis key names)"
            )
        if client.get_connection_kwargs().get("decode_responses"):
            raise ConfigError("store client: decode_responses must be False (blobs are bytes)")
        self.run_id = run_id
        self.keys = Keys(run_id)
        self._r = client
        self._publish = _load_script(client, "publish")
        self._claim = _load_script(client, "claim")
        self._latest = _ReadOnlyScript(client, "latest")
        self._lease_acquire = _load_script(client, "lease_acquire")
        self._lease_renew = _load_script(client, "lease_renew")
        self._lease_release = _load_script(client, "lease_release")

    def __repr__(self) -> str:
        return f"RedisStore(run_id={self.run_id!r}, client={self._r!r})"

    @property
    def client(self) -> redis.Redis:
        """The underlying redis-py client."""
        return self._r

    def pipeline(self) -> Pipeline:
        """A transactional (MULTI/EXEC) pipeline to pass as ``pipe`` to the write methods.

        Run-wide keys share one hash tag, so a batch of them is atomic even on Redis Cluster;
        do not mix fragment keys into the same batch there.
        """
        return self._r.pipeline(transaction=True)

    # -- manifest -------------------------------------------------------------------------------
    @_unavailable
    def put_manifest(self, manifest: dict[str, Any]) -> dict[str, Any]:
        """Store the run manifest unless one exists (SET NX); return the stored manifest.

        The first writer wins. A later worker whose ``schema_hash`` equals the stored one gets the
        stored manifest back (as decoded JSON), even if other fields differ: the stored one is the
        run's truth.

        Raises:
            ConfigError: ``manifest`` has no ``schema_hash``.
            ManifestMismatch: the stored manifest has another ``schema_hash``; the message shows
                both hashes and the top-level fields that differ.
        """
        if "schema_hash" not in manifest:
            raise ConfigError("manifest.schema_hash: required to compare workers of a run")
        encoded = _dumps(manifest)
        # A loop, not a single SET NX + GET: the key may be flushed between the two (--fresh).
        for _ in range(3):
            if self._r.set(self.keys.manifest, encoded, nx=True):
                return cast(dict[str, Any], json.loads(encoded))
            raw = self._r.get(self.keys.manifest)
            if raw is None:
                continue
            stored = cast(dict[str, Any], json.loads(raw))
            if stored.get("schema_hash") != manifest["schema_hash"]:
                mine = cast(dict[str, Any], json.loads(encoded))
                differ = sorted(
                    k for k in set(stored) | set(mine) if stored.get(k, ...) != mine.get(k, ...)
                )
                raise ManifestMismatch(
                    f"run {self.run_id!r}: manifest schema_hash {manifest['schema_hash']!r} "
                    f"differs from the stored {stored.get('schema_hash')!r}; differing fields: "
                    f"{', '.join(differ)}. Use the run's configuration, another run id, or "
                    "start the run afresh."
                )
            return stored
        raise StoreError(f"run {self.run_id!r}: manifest key deleted while being written")

    @_unavailable
    def get_manifest(self) -> dict[str, Any] | None:
        """The stored run manifest, or None."""
        raw = self._r.get(self.keys.manifest)
        return None if raw is None else cast(dict[str, Any], json.loads(raw))

    @_unavailable
    def put_initial(self, p: int, value: bytes) -> bool:
        """Store fragment ``p``'s initial value blob unless it has one (SET NX). Returns True
        if this call stored it."""
        return bool(self._r.set(self.keys.initial(p), value, nx=True))

    @_unavailable
    def get_initial(self, p: int) -> bytes | None:
        """Fragment ``p``'s initial value blob, or None before the init step."""
        raw = self._r.get(self.keys.initial(p))
        return None if raw is None else bytes(raw)

    # -- fragments ------------------------------------------------------------------------------
    @staticmethod
    def _head(raw: list[Any]) -> FragmentHead | None:
        version, epoch, updated_at = raw
        if version is None:  # never published (possibly claimed: then only `epoch` is set)
            return None
        return FragmentHead(int(version), int(epoch), float(updated_at))

    @_unavailable
    def head(self, p: int) -> FragmentHead | None:
        """Head of fragment ``p``; None if no version was published (claimed or not)."""
        return self._head(self._r.hmget(self.keys.head(p), ["version", "epoch", "updated_at"]))

    @_unavailable
    def heads(self, n_fragments: int) -> list[FragmentHead | None]:
        """Heads of fragments ``0 .. n_fragments-1``, one pipelined round trip."""
        pipe = self._r.pipeline(transaction=False)
        for p in range(n_fragments):
            pipe.hmget(self.keys.head(p), ["version", "epoch", "updated_at"])
        return [self._head(raw) for raw in pipe.execute()]

    def _blob(
        self, p: int, version: int, value: Any, momentum: Any, meta: Any
    ) -> FragmentBlob | None:
        if value is None and momentum is None:
            return None
        if value is None or momentum is None:
            # publish writes both and GC deletes both in one script: only eviction or a hand
            # edit can split them. Say so rather than hand back half a version.
            raise StoreError(
                f"run {self.run_id!r} fragment {p} version {version}: value or momentum blob "
                "missing (evicted? the Redis must run with maxmemory-policy noeviction)"
            )
        return FragmentBlob(
            fragment=p,
            version=version,
            value=bytes(value),
            momentum=bytes(momentum),
            meta=json.loads(meta) if meta is not None else {},
        )

    @_unavailable
    def get_version(self, p: int, version: int) -> FragmentBlob | None:
        """Version ``version`` of fragment ``p``, or None if never written or garbage-collected.

        Raises:
            StoreError: only one of value and momentum is present (evicted).
        """
        pipe = self._r.pipeline(transaction=True)  # MULTI: the three reads see one state
        for key in self.keys.blobs(p, version):
            pipe.get(key)
        value, momentum, meta = pipe.execute()
        return self._blob(p, version, value, momentum, meta)

    def _latest_from(self, p: int, raw: Any) -> FragmentBlob | None:
        if not raw:
            return None
        version, _epoch, _updated_at, value, momentum, meta = raw
        return self._blob(p, int(version), value, momentum, meta)

    def _latest_call(self, p: int, client: Any = None) -> Any:
        return self._latest(
            keys=[self.keys.head(p)], args=[self.keys.fragment_prefix(p)], client=client
        )

    @_unavailable
    def get_latest(self, p: int) -> FragmentBlob | None:
        """Head version of ``p`` with its blobs, read atomically by one Lua script.

        Returns None when nothing was published.

        Raises:
            StoreError: the head's blobs are missing (evicted).
        """
        return self._latest_from(p, self._latest_call(p))

    @_unavailable
    def get_latest_many(self, ps: Iterable[int]) -> list[FragmentBlob | None]:
        """:meth:`get_latest` of each fragment in ``ps``, one pipelined round trip.

        Each fragment is read atomically; different fragments may be read at slightly different
        moments (they are independent, DESIGN §2).
        """
        ps = list(ps)
        for attempt in (0, 1):
            pipe = self._r.pipeline(transaction=False)
            for p in ps:
                self._latest_call(p, client=pipe)
            try:
                raws = pipe.execute()
                break
            except redis.exceptions.NoScriptError:
                if attempt:
                    raise
                self._latest.load()  # the server restarted and lost its scripts
        return [self._latest_from(p, raw) for p, raw in zip(ps, raws, strict=True)]

    @_unavailable
    def claim_fragment(self, p: int, epoch: int) -> None:
        """Raise fragment ``p``'s epoch to ``epoch`` (a shard does this on taking its lease).

        After the claim, :meth:`publish` with a lower epoch fails with ``FencedOut``, so a shard
        whose lease expired while it was paused cannot overwrite its successor's versions. An
        unpublished fragment records the epoch in its head hash without a version: it still has
        no head (:meth:`head` returns None) and the next publish expects version -1.
        Re-claiming with the same epoch is a no-op.

        Raises:
            FencedOut: a higher epoch already claimed or wrote the fragment.
        """
        try:
            self._claim(keys=[self.keys.head(p)], args=[epoch])
        except redis.ResponseError as exc:
            if "FENCED" in str(exc):
                raise FencedOut(f"run {self.run_id!r} fragment {p}: {exc}") from exc
            raise

    @_unavailable
    def publish(
        self,
        p: int,
        *,
        expected_version: int,
        epoch: int,
        value: bytes,
        momentum: bytes,
        keep: int,
        meta: dict[str, Any] | None = None,
        now: float | None = None,
    ) -> int:
        """Write version ``expected_version + 1`` of fragment ``p`` (DESIGN §2 step 6).

        One Lua script checks the fence (``epoch`` >= the fragment's epoch) and then the head
        (``version == expected_version``, -1 when nothing was published), writes value,
        momentum, meta and head and deletes the versions ``<= new - keep`` (see ``GC_SPAN``).

        Args:
            p: fragment index.
            expected_version: the head version the new one is built on; -1 for the first.
            epoch: the writer's shard epoch from :meth:`acquire_lease`.
            value: Theta_p, opaque bytes.
            momentum: the outer momentum of the fragment, opaque bytes.
            keep: how many latest versions stay readable, >= 1 (the new one included).
            meta: small JSON-able dict stored with the version.
            now: wall-clock seconds for ``updated_at``; ``time.time()`` when None.

        Returns:
            The new version.

        Raises:
            ValueError: ``keep < 1`` or ``expected_version < -1``.
            FencedOut: a higher epoch claimed the fragment; nothing written.
            VersionConflict: the head is not ``expected_version``; nothing written.
        """
        if keep < 1:
            raise ValueError(f"keep must be >= 1 (the new version is kept), got {keep}")
        if expected_version < -1:
            raise ValueError(f"expected_version must be >= -1, got {expected_version}")
        new = expected_version + 1
        oldest_gone = new - keep
        gc_keys = [
            key
            for n in range(max(0, oldest_gone - GC_SPAN + 1), oldest_gone + 1)
            for key in self.keys.blobs(p, n)
        ]
        try:
            result = self._publish(
                keys=[self.keys.head(p), *self.keys.blobs(p, new), *gc_keys],
                args=[
                    expected_version,
                    epoch,
                    value,
                    momentum,
                    _dumps(meta or {}),
                    repr(time.time() if now is None else now),
                    uuid.uuid4().hex,
                ],
            )
        except redis.ResponseError as exc:
            message = f"run {self.run_id!r} fragment {p}: {exc}"
            if "VERSION_CONFLICT" in str(exc):
                raise VersionConflict(message) from exc
            if "FENCED" in str(exc):
                raise FencedOut(message) from exc
            raise
        return int(result)

    # -- syncer shard leases and endpoints -------------------------------------------------------
    @_unavailable
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

    @_unavailable
    def renew_lease(self, shard: int, owner: str, ttl_ms: int) -> bool:
        """Set the lease's TTL to ``ttl_ms`` ms if ``owner`` holds it; False if it was lost."""
        return bool(self._lease_renew(keys=[self.keys.lease(shard)], args=[owner, ttl_ms]))

    @_unavailable
    def release_lease(self, shard: int, owner: str) -> None:
        """Delete the lease if ``owner`` holds it (a no-op otherwise)."""
        self._lease_release(keys=[self.keys.lease(shard)], args=[owner])

    @_unavailable
    def announce_shard(
        self, shard: int, endpoints: dict[str, Any], ttl_ms: int, pipe: Pipeline | None = None
    ) -> None:
        """Publish ``endpoints`` (JSON-able, e.g. ``{"pull": "tcp://..", "pub": ".."}``) of a
        shard for ``ttl_ms`` ms; re-announce before it expires."""
        p = pipe if pipe is not None else self._r.pipeline(transaction=True)
        p.set(self.keys.shard(shard), _dumps(endpoints), px=ttl_ms)
        p.sadd(self.keys.shards, shard)
        if pipe is None:
            p.execute()

    @_unavailable
    def shard_endpoints(self, shard: int) -> dict[str, Any] | None:
        """Endpoints of ``shard``, or None if never announced or expired."""
        raw = self._r.get(self.keys.shard(shard))
        return None if raw is None else cast(dict[str, Any], json.loads(raw))

    @_unavailable
    def shards(self) -> dict[int, dict[str, Any]]:
        """Endpoints of every shard whose announcement has not expired, by shard id."""
        ids = sorted(int(s) for s in self._r.smembers(self.keys.shards))
        if not ids:
            return {}
        raws = self._r.mget([self.keys.shard(s) for s in ids])
        return {s: json.loads(raw) for s, raw in zip(ids, raws, strict=True) if raw is not None}

    # -- learners --------------------------------------------------------------------------------
    @_unavailable
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

    @_unavailable
    def heartbeat_learner(
        self, learner_id: str, info: dict[str, Any], ttl_ms: int, pipe: Pipeline | None = None
    ) -> None:
        """Mark the learner alive for ``ttl_ms`` ms with JSON-able ``info`` (DESIGN §4: liveness
        is a TTL key in the store, not heartbeats over the data sockets)."""
        (pipe if pipe is not None else self._r).set(
            self.keys.learner(learner_id), _dumps(info), px=ttl_ms
        )

    @_unavailable
    def live_learners(self) -> dict[str, dict[str, Any]]:
        """Heartbeat info of every registered learner whose heartbeat has not expired."""
        ids = sorted(_str(m) for m in self._r.smembers(self.keys.learners))
        if not ids:
            return {}
        raws = self._r.mget([self.keys.learner(i) for i in ids])
        return {i: json.loads(raw) for i, raw in zip(ids, raws, strict=True) if raw is not None}

    @_unavailable
    def known_learner(self, learner_id: str) -> bool:
        """Whether ``learner_id`` ever registered in this run (alive or not)."""
        return bool(self._r.sismember(self.keys.learners, learner_id))

    @_unavailable
    def remove_learner(self, learner_id: str, pipe: Pipeline | None = None) -> None:
        """Mark the learner dead now (deletes its heartbeat); it stays known to the run."""
        (pipe if pipe is not None else self._r).delete(self.keys.learner(learner_id))

    # -- end of run ------------------------------------------------------------------------------
    @_unavailable
    def request_stop(self, role: str, reason: str, t: float | None = None) -> None:
        """Ask every worker of ``role`` (one of :data:`STOP_ROLES`) to stop cleanly, as on
        SIGTERM: how a deployment without a supervisor (compose) ends a finished run.

        ``t`` (seconds since the epoch, now by default) is the request's time: a worker obeys
        only a request newer than its own start (:meth:`stop_requested`), so a later restart of
        the same run is not stopped by an old request.

        Raises:
            ValueError: ``role`` is not one of :data:`STOP_ROLES`.
        """
        if role not in STOP_ROLES:
            raise ValueError(f"stop role {role!r} is not one of {STOP_ROLES}")
        self._r.set(self.keys.stop(role),
                    _dumps({"reason": reason, "t": time.time() if t is None else t}))

    @_unavailable
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

    # -- events and counters ---------------------------------------------------------------------
    @overload
    def add_event(self, kind: str, fields: dict[str, Any], pipe: None = None,
                  t: float | None = None) -> str: ...

    @overload
    def add_event(self, kind: str, fields: dict[str, Any], pipe: Pipeline,
                  t: float | None = None) -> None: ...

    @_unavailable
    def add_event(
        self, kind: str, fields: dict[str, Any], pipe: Pipeline | None = None,
        t: float | None = None,
    ) -> str | None:
        """Append an event (XADD, stream trimmed to about ``EVENTS_MAXLEN`` entries).

        Stored as fields ``kind``, ``t`` (wall-clock seconds; ``t`` backdates an event recorded
        late, e.g. a fault observed while Redis was down) and ``data`` (``fields`` as JSON).

        Returns:
            The stream id (``"<ms>-<seq>"``); None when queued on ``pipe`` (the id is then in
            ``pipe.execute()``'s results).

        Raises:
            ValueError: ``fields`` uses the reserved names ``kind`` or ``t``.
            TypeError: ``fields`` is not JSON-able.
        """
        reserved = {"kind", "t"} & fields.keys()
        if reserved:
            raise ValueError(f"event fields {sorted(reserved)} are reserved")
        # A command re-sent by the client's retry after a lost reply (Redis killed between
        # executing it and answering) is appended twice; the id lets readers drop the copy.
        entry: dict[Any, Any] = {"kind": kind, "t": repr(time.time() if t is None else t),
                                 "data": _dumps(fields), "eid": uuid.uuid4().hex[:16]}
        target = pipe if pipe is not None else self._r
        event_id = target.xadd(self.keys.events, entry, maxlen=EVENTS_MAXLEN, approximate=True)
        return None if pipe is not None else _str(event_id)

    @staticmethod
    def _event(raw: dict[Any, Any]) -> dict[str, Any]:
        fields = {_str(k): v for k, v in raw.items()}
        event: dict[str, Any] = json.loads(fields["data"])
        event["kind"] = _str(fields["kind"])
        event["t"] = float(fields["t"])
        return event

    @_unavailable
    def events(
        self, start: str = "-", count: int | None = None, kinds: set[str] | None = None
    ) -> list[tuple[str, dict[str, Any]]]:
        """Events from stream id ``start`` on, oldest first.

        Args:
            start: first id, inclusive (``"-"``: the beginning); ``"(<id>"`` excludes ``<id>``,
                which is how to continue after the last event read.
            count: at most this many events are returned (after filtering); None: all.
            kinds: only events of these kinds; None: every kind.

        Returns:
            ``[(id, {"kind": .., "t": seconds, **fields}), ...]``.
        """
        if count is not None and count <= 0:
            return []
        page = count if count is not None and kinds is None else _EVENTS_PAGE
        out: list[tuple[str, dict[str, Any]]] = []
        seen: set[Any] = set()
        cursor = start
        while True:
            batch = cast(
                list[Any], self._r.xrange(self.keys.events, min=cursor, max="+", count=page)
            )
            for raw_id, raw in batch:
                eid = raw.get(b"eid", raw.get("eid"))
                if eid is not None:
                    if eid in seen:
                        continue
                    seen.add(eid)
                event = self._event(raw)
                if kinds is None or event["kind"] in kinds:
                    out.append((_str(raw_id), event))
                    if count is not None and len(out) >= count:
                        return out
            if len(batch) < page:
                return out
            cursor = f"({_str(batch[-1][0])}"

    @_unavailable
    def incr_counter(
        self, name: str, field: str, amount: int = 1, pipe: Pipeline | None = None
    ) -> None:
        """Add ``amount`` to ``field`` of counter group ``name`` (HINCRBY), e.g. drops by reason."""
        (pipe if pipe is not None else self._r).hincrby(self.keys.counters(name), field, amount)

    @_unavailable
    def counters(self, name: str) -> dict[str, int]:
        """All fields of counter group ``name`` ({} if none)."""
        raw = self._r.hgetall(self.keys.counters(name))
        return {_str(k): int(v) for k, v in raw.items()}

    @_unavailable
    def set_wire_peers(self, learner_id: str, incarnation: int, totals: dict[str, int],
                       pipe: Pipeline | None = None) -> None:
        """Store one learner incarnation's cumulative bytes per directed pair ``"src>dst"``
        (HSET of absolute values in the counter group ``wire_peers``, one field per
        ``learner:incarnation|src>dst``: a write retried after a lost reply is harmless)."""
        if not totals:
            return
        mapping: dict[str | bytes, bytes | float | int | str] = {
            f"{learner_id}:{incarnation}|{pair}": int(n) for pair, n in totals.items()}
        (pipe if pipe is not None else self._r).hset(
            self.keys.counters("wire_peers"), mapping=mapping)

    @_unavailable
    def wire_peers(self) -> dict[str, int]:
        """Bytes per directed pair ``"src>dst"``, summed over learner incarnations."""
        out: dict[str, int] = {}
        for k, v in self._r.hgetall(self.keys.counters("wire_peers")).items():
            pair = _str(k).split("|", 1)[-1]
            out[pair] = out.get(pair, 0) + int(v)
        return out

    # -- token fate (DESIGN §5) ---------------------------------------------------------------
    @_unavailable
    def set_fate(self, learner_id: str, incarnation: int, record: dict[str, Any],
                 pipe: Pipeline | None = None) -> None:
        """Overwrite the fate record of one learner incarnation (absolute cumulative values,
        so a repeated write is harmless).

        Args:
            record: JSON-able fields, e.g. ``processed``, ``sent`` (fragment-tokens),
                ``ended`` ("running" | "drained").
        """
        target = pipe if pipe is not None else self._r.pipeline(transaction=False)
        target.sadd(self.keys.fates, f"{learner_id}:{incarnation}")
        target.set(self.keys.fate(learner_id, incarnation), _dumps(record))
        if pipe is None:
            target.execute()

    @_unavailable
    def received_total(self, learner_id: str, incarnation: int, shard: str) -> int:
        """What :meth:`note_received` last stored for this learner incarnation and shard."""
        raw = self._r.hget(self.keys.counters("received"),
                          f"{learner_id}:{incarnation}:{shard}")
        return int(raw) if raw is not None else 0

    @_unavailable
    def note_received(self, learner_id: str, incarnation: int, total: int, shard: str,
                      snapshot: list[int] | None) -> None:
        """Shard ``shard`` has received ``total`` fragment-tokens of deltas in all from
        ``learner_id``'s incarnation (an absolute value: a write retried after a lost reply
        cannot count twice).

        ``snapshot`` is the learner's cumulative fate at the time it sent the latest delta
        (carried in the header): ``[processed, sent, overwritten, drain]``. The latest one per
        shard is kept, so the fate of a learner killed between two heartbeats is still known up
        to its last send.
        """
        member = f"{learner_id}:{incarnation}:{shard}"
        pipe = self._r.pipeline(transaction=False)
        pipe.hset(self.keys.counters("received"), member, total)
        if snapshot is not None:
            pipe.hset(self.keys.counters("wire_fate"), member, _dumps(snapshot))
        pipe.execute()

    @_unavailable
    def fate_records(self) -> list[dict[str, Any]]:
        """Every learner incarnation's fate record, each with ``learner``, ``incarnation``,
        ``wire`` (the send-time snapshots shards saw: list of ``[processed, sent, overwritten,
        drain]``) and ``received`` (fragment-tokens that reached a shard)."""
        members = sorted(_str(m) for m in self._r.smembers(self.keys.fates))
        received: dict[str, int] = {}
        for a, b in self._r.hgetall(self.keys.counters("received")).items():
            learner_inc = _str(a).rsplit(":", 1)[0]  # summed over shards
            received[learner_inc] = received.get(learner_inc, 0) + int(b)
        wire: dict[str, list[list[int]]] = {}
        for k, v in self._r.hgetall(self.keys.counters("wire_fate")).items():
            learner, inc, _shard = _str(k).rsplit(":", 2)
            wire.setdefault(f"{learner}:{inc}", []).append(json.loads(v))
        # Deltas can arrive from an incarnation that never wrote a record (killed at once).
        members = sorted(set(members) | set(received) | set(wire))
        keys = [self.keys.fate(m.rsplit(":", 1)[0], int(m.rsplit(":", 1)[1])) for m in members]
        raws = cast(list[Any], self._r.mget(keys)) if keys else []
        out = []
        for m, raw in zip(members, raws, strict=True):
            learner, inc = m.rsplit(":", 1)
            rec = json.loads(raw) if raw else {}
            rec.update(learner=learner, incarnation=int(inc), wire=wire.get(m, []),
                       received=received.get(m, 0))
            out.append(rec)
        return out

    # -- housekeeping ----------------------------------------------------------------------------
    @_unavailable
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


if TYPE_CHECKING:
    # Lets mypy prove that RedisStore satisfies the ParameterStore protocol.
    _conforms: type[ParameterStore] = RedisStore
