"""The audit after a chaos run: invariants checked against the event log and the store.

In the manner of Jepsen: a run under faults is only as good as the history it leaves, so every
claim the system makes (DESIGN §2, §3, §5) is checked against that history afterwards:

* :func:`check_versions`: per fragment, versions strictly increase and are never reused, and the
  store's head is the newest version the log knows of;
* :func:`check_exactly_once`: no delta (learner, incarnation, sequence, fragment) has two fates;
* :func:`check_token_fate`: every processed fragment-token has exactly one fate (DESIGN §5);
* :func:`check_adoptions`: a (re)joining learner adopted exactly the store's bytes, and nothing
  older than what was merged before it joined (the Clone pattern's promise);
* :func:`check_final_store`: every fragment's head is readable, decodes to the manifest's
  shapes, is finite, and no version newer than the head is stored;
* :func:`check_objects`: no head, kept version or initial blob points at a missing or damaged
  object (blobs in an object store: the store writes objects before it moves a head and
  collects them after, and an outage of the object store must not change that);
* :func:`check_rebuilds`: a Redis lost with its data and rebuilt from the object store still
  holds every head it had acknowledged;
* :func:`check_no_nan`: losses in the log and the final parameters are finite.

Each check returns an :class:`Invariant` whose ``evidence`` is JSON-able: counts and the first
few offending items. :func:`audit` gathers them into the report block; :func:`raise_if_failed`
turns a failed audit into :class:`InvariantViolation`.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ddiloco.chaos.accounting import EventLike, TokenFate, payloads
from ddiloco.pipeline.errors import DDilocoError, NonFinite, StoreError, StoreUnavailable
from ddiloco.store.base import ParameterStore
from ddiloco.store.objects import REDIS, CorruptObject, MissingObject
from ddiloco.workers.run.blobs import decode_blob, digest
from ddiloco.workers.run.manifest import manifest_layout

__all__ = [
    "DANGLING_PROBE",
    "Invariant",
    "InvariantViolation",
    "adoption_digests",
    "audit",
    "check_adoptions",
    "check_exactly_once",
    "check_final_store",
    "check_no_nan",
    "check_objects",
    "check_rebuilds",
    "check_token_fate",
    "check_versions",
    "raise_if_failed",
    "stored_metas",
]

#: Offending items kept in an invariant's evidence (the counts are always complete).
EXAMPLES = 5
#: Versions above the head probed for dangling blobs when the store cannot be scanned.
DANGLING_PROBE = 3


@dataclass
class Invariant:
    """The outcome of one check.

    Attributes:
        name: the check's name, e.g. ``"versions"``.
        ok: whether the invariant held.
        evidence: JSON-able counts and the first few offending items.
    """

    name: str
    ok: bool
    evidence: dict[str, Any]

    def to_json(self) -> dict[str, Any]:
        """``{"name", "ok", "evidence"}``."""
        return {"name": self.name, "ok": self.ok, "evidence": self.evidence}


class InvariantViolation(DDilocoError):
    """A chaos run broke at least one invariant; the message lists each with its evidence.

    Attributes:
        report: the :func:`audit` report that failed.
    """

    def __init__(self, report: dict[str, Any]) -> None:
        self.report = report
        failed = [i for i in report.get("invariants", []) if not i.get("ok")]
        lines = [f"{len(failed)} invariant(s) violated:"]
        for inv in failed:
            evidence = json.dumps(inv.get("evidence"), sort_keys=True, default=str)
            if len(evidence) > 2000:
                evidence = evidence[:2000] + "..."
            lines.append(f"  {inv.get('name')}: {evidence}")
        super().__init__("\n".join(lines))


class _Offenders:
    """A count of offending items and the first :data:`EXAMPLES` of them."""

    def __init__(self) -> None:
        self.n = 0
        self.examples: list[Any] = []

    def add(self, item: Any) -> None:
        self.n += 1
        if len(self.examples) < EXAMPLES:
            self.examples.append(item)

    def put(self, evidence: dict[str, Any], name: str) -> None:
        evidence[f"n_{name}"] = self.n
        evidence[name] = self.examples


def _per_fragment(versions: Any) -> list[tuple[int, int]]:
    """``(fragment, version)`` pairs of an event's ``versions`` (a list, or a dict by "<p>")."""
    if isinstance(versions, Mapping):
        return sorted((int(p), int(v)) for p, v in versions.items())
    return [(p, int(v)) for p, v in enumerate(versions or [])]


# ------------------------------------------------------------------------------------------
# Event-log invariants
# ------------------------------------------------------------------------------------------


def check_versions(events: Iterable[EventLike], heads: Mapping[int, int | None]) -> Invariant:
    """Fragment versions are strictly increasing, never reused, and the head is the newest.

    Per fragment, in event order, every ``merge`` version must exceed every earlier merge
    version of that fragment (a repeat is counted as ``reused``, a smaller one as
    ``decreasing``). A ``dp_rollback`` (the data-parallel baseline re-publishing its common
    checkpoint as a new version) is a publish too and takes part in the same order. A
    ``shard_start`` loading a version below one already merged is a ``restart_regression``
    (the store lost a published version).

    The store head must equal the newest version the log knows of: the highest merge (or
    rollback) version, or a higher version a ``shard_start`` loaded (a publish whose ``merge``
    event was lost because the shard was killed between the two writes; counted as
    ``unlogged_publishes``, not a failure), or 0 (the initial version) when the fragment never
    merged. A fragment with no head (None) passes only if it never merged. Gaps between
    consecutive merge versions are counted in ``gaps`` for information.

    Args:
        events: the run's event stream.
        heads: fragment -> the store's head version (None: never published).
    """
    evs = payloads(events)
    newest: dict[int, int] = {}  # highest merge version so far
    loaded: dict[int, int] = {}  # highest version a shard_start loaded
    seen: dict[int, set[int]] = {}
    reused, decreasing, regressions, mismatch = (_Offenders() for _ in range(4))
    gaps = unlogged = n_merges = n_rollbacks = 0
    for e in evs:
        if e.get("kind") in ("merge", "dp_rollback"):
            n_merges += e.get("kind") == "merge"
            n_rollbacks += e.get("kind") == "dp_rollback"
            p, v = int(e["fragment"]), int(e["version"])
            mine = seen.setdefault(p, set())
            item = {"fragment": p, "version": v, "shard": e.get("shard"), "t": e.get("t")}
            if v in mine:
                reused.add(item)
            elif p in newest and v < newest[p]:
                decreasing.add({**item, "after": newest[p]})
            elif p in newest and v > newest[p] + 1:
                gaps += 1
            mine.add(v)
            newest[p] = max(newest.get(p, v), v)
        elif e.get("kind") == "shard_start":
            for key, raw in (e.get("versions") or {}).items():
                p, v = int(key), int(raw)
                if v < newest.get(p, -1):
                    regressions.add({"fragment": p, "loaded": v, "merged": newest[p],
                                     "shard": e.get("shard"), "t": e.get("t")})
                elif v > newest.get(p, 0) and v > loaded.get(p, 0):
                    unlogged += 1
                loaded[p] = max(loaded.get(p, v), v)
    for p in sorted(set(heads) | set(newest)):
        head = heads.get(p)
        if head is None:
            if p in newest:
                mismatch.add({"fragment": p, "head": None, "expected": newest[p]})
            continue
        expected = max(newest.get(p, 0), loaded.get(p, 0))
        if head != expected:
            mismatch.add({"fragment": p, "head": head, "expected": expected,
                          "merged": newest.get(p), "loaded": loaded.get(p)})
    evidence: dict[str, Any] = {
        "merges": n_merges,
        "dp_rollbacks": n_rollbacks,
        "fragments": len(set(heads) | set(newest)),
        "gaps": gaps,
        "unlogged_publishes": unlogged,
    }
    reused.put(evidence, "reused")
    decreasing.put(evidence, "decreasing")
    regressions.put(evidence, "restart_regressions")
    mismatch.put(evidence, "head_mismatch")
    ok = not (reused.n or decreasing.n or regressions.n or mismatch.n)
    return Invariant("versions", ok, evidence)


def check_rebuilds(events: Iterable[EventLike]) -> Invariant:
    """Every Redis wiped and rebuilt from the object store (the chaos ``wipe`` fault, its
    ``rebuilt`` event: :class:`~ddiloco.store.wipe.WipeCheck`) still holds each head it had
    acknowledged before the loss."""
    rebuilt = [e for e in payloads(events) if e.get("kind") == "rebuilt"]
    lost = _Offenders()
    for e in rebuilt:
        for item in e.get("lost", []):
            lost.add({"id": e.get("id"), "version": item})
    evidence: dict[str, Any] = {"rebuilds": len(rebuilt),
                                "rebuild_s": [e.get("rebuild_s") for e in rebuilt],
                                "down_s": [e.get("down_s") for e in rebuilt]}
    lost.put(evidence, "lost")
    return Invariant("rebuilds", lost.n == 0, evidence)


def check_exactly_once(events: Iterable[EventLike],
                       metas: Mapping[tuple[int, int], Mapping[str, Any]] | None = None,
                       ) -> Invariant:
    """No delta ``(learner, inc, seq, fragment)`` has two fates.

    ``metas`` are the stored metas of the kept versions, ``(fragment, version) -> meta``
    (:meth:`~ddiloco.store.base.VersionStore.version_meta`): a version's meta names its
    contributions and is written atomically with it, so a merge whose event was never
    written (the shard died, or the store failed, between the publish and the event) still
    has its fate filed, counted in ``unlogged_merges``. A round merged twice therefore shows
    up even when only one of its two versions has an event.

    A delta may appear in one ``merge`` (its contribution's ``seqs``) or in one ``drop``, never
    in two merges (``merged_twice``), a merge and a drop (``merged_and_dropped``) or two drops
    (``dropped_twice``). Drops with reason ``duplicate`` are the shard rejecting a second copy
    of a delta it already had: they are the deduplication working, counted in
    ``duplicate_drops`` and not a second fate. A drop names its delta by ``seq``, or by ``seqs``
    when it drops an accepted contribution that folded several deltas. Contributions and drops
    naming no sequence cannot be checked; they are counted in ``unchecked``.
    """
    fates: dict[tuple[str, int, int, int], str] = {}
    merged_twice, merged_and_dropped, dropped_twice = _Offenders(), _Offenders(), _Offenders()
    n_deltas = duplicates = unchecked = 0

    def file(key: tuple[str, int, int, int], fate: str) -> None:
        nonlocal n_deltas
        first = fates.get(key)
        item = {"learner": key[0], "inc": key[1], "seq": key[2], "fragment": key[3],
                "first": first, "then": fate}
        if first is None:
            fates[key] = fate
            n_deltas += 1
        elif first.startswith("merge") and fate.startswith("merge"):
            merged_twice.add(item)
        elif first.startswith("drop") and fate.startswith("drop"):
            dropped_twice.add(item)
        else:
            merged_and_dropped.add(item)

    for e in payloads(events):
        kind = e.get("kind")
        if kind == "merge":
            p = int(e["fragment"])
            for c in e.get("contributions") or []:
                seqs = c.get("seqs")
                if not seqs:
                    unchecked += 1
                    continue
                for seq in seqs:
                    file((str(c["learner"]), int(c["inc"]), int(seq), p),
                         f"merge v{e.get('version')} by {e.get('shard')}")
        elif kind == "drop" and e.get("learner") is not None:
            if e.get("reason") == "duplicate":
                duplicates += 1
                continue
            # A delta dropped on arrival names its ``seq``; an accepted contribution dropped
            # later (fenced publish, shard stop) names every folded delta in ``seqs``.
            seqs = e.get("seqs") or ([] if e.get("seq") is None else [e["seq"]])
            if e.get("inc") is None or not seqs or e.get("fragment") is None:
                unchecked += 1
                continue
            for seq in seqs:
                file((str(e["learner"]), int(e["inc"]), int(seq), int(e["fragment"])),
                     f"drop {e.get('reason')} by {e.get('shard')}")
    logged = {(int(e["fragment"]), int(e["version"])) for e in payloads(events)
              if e.get("kind") == "merge"}
    unlogged = 0
    for (p, v), meta in sorted((metas or {}).items()):
        if (p, v) in logged or not meta.get("contributions"):
            continue
        unlogged += 1
        for c in meta["contributions"]:
            for seq in c.get("seqs") or []:
                file((str(c["learner"]), int(c["inc"]), int(seq), p),
                     f"merge v{v} (stored meta, no event)")
    evidence: dict[str, Any] = {
        "deltas": n_deltas, "duplicate_drops": duplicates, "unchecked": unchecked,
        "unlogged_merges": unlogged,
    }
    merged_twice.put(evidence, "merged_twice")
    merged_and_dropped.put(evidence, "merged_and_dropped")
    dropped_twice.put(evidence, "dropped_twice")
    ok = not (merged_twice.n or merged_and_dropped.n or dropped_twice.n)
    return Invariant("exactly_once", ok, evidence)


def stored_metas(store: ParameterStore, heads: Mapping[int, int | None], keep: int,
                 ) -> dict[tuple[int, int], dict[str, Any]]:
    """The metas of every fragment's kept versions (at most ``keep`` below and at each head),
    for :func:`check_exactly_once`; one small read per version, no blobs."""
    out: dict[tuple[int, int], dict[str, Any]] = {}
    for p, head in heads.items():
        if head is None:
            continue
        for v in range(max(1, head - keep + 1), head + 1):
            meta = store.version_meta(p, v)
            if meta is not None:
                out[(p, v)] = meta
    return out


def check_token_fate(fate: TokenFate) -> Invariant:
    """Every processed fragment-token has exactly one fate (DESIGN §5): balance 0, no anomaly.

    Evidence in fragment-tokens: processed, merged, balance, excess, the first anomalies.
    """
    anomalies = _Offenders()
    for a in fate.anomalies:
        anomalies.add(a)
    evidence: dict[str, Any] = {
        "processed": fate.processed,
        "merged": fate.merged,
        "balance": fate.balance,
        "excess": dict(fate.excess),
    }
    anomalies.put(evidence, "anomalies")
    return Invariant("token_fate", fate.balance == 0 and not fate.anomalies, evidence)


def check_adoptions(
    events: Iterable[EventLike], stored_digests: Mapping[tuple[int, int], str | None]
) -> Invariant:
    """Every ``adopted`` event took the store's exact bytes, and nothing stale.

    For each fragment ``p`` of an ``adopted`` event with version ``v = versions[p]``:

    * its digest equals ``stored_digests[(p, v)]``, the digest
      (:func:`ddiloco.workers.run.blobs.digest`) of the store's version ``v``; a digest that is
      None or
      absent (version no longer kept) makes the pair ``unverifiable``: counted, not a failure;
    * ``v`` is at least the highest version of ``p`` merged before that incarnation's ``join``
      event (it adopted the store's latest, not something older: the Clone pattern). When the
      log has no ``join`` of the incarnation this half is skipped (``no_join``).

    Args:
        events: the run's event stream.
        stored_digests: ``(fragment, version) -> digest`` of stored versions, e.g. from
            :func:`adoption_digests`.
    """
    newest: dict[int, int] = {}
    at_join: dict[tuple[str, int], dict[int, int]] = {}
    mismatches, stale = _Offenders(), _Offenders()
    adoptions = checked = unverifiable = no_join = 0
    for e in payloads(events):
        kind = e.get("kind")
        if kind == "merge":
            p, v = int(e["fragment"]), int(e["version"])
            newest[p] = max(newest.get(p, v), v)
        elif kind == "join":
            at_join[(str(e["learner"]), int(e["incarnation"]))] = dict(newest)
        elif kind == "adopted":
            adoptions += 1
            who = (str(e["learner"]), int(e["incarnation"]))
            floor = at_join.get(who)
            if floor is None:
                no_join += 1
            digests = e.get("digests") or {}
            for p, v in _per_fragment(e.get("versions")):
                item = {"learner": who[0], "inc": who[1], "fragment": p, "version": v}
                if floor is not None and v < floor.get(p, -1):
                    stale.add({**item, "merged_before_join": floor[p]})
                mine = digests.get(str(p))
                want = stored_digests.get((p, v))
                if mine is None or want is None:
                    unverifiable += 1
                elif mine != want:
                    mismatches.add({**item, "adopted": mine, "stored": want})
                else:
                    checked += 1
    evidence: dict[str, Any] = {
        "adoptions": adoptions,
        "checked": checked,
        "unverifiable": unverifiable,
        "no_join": no_join,
    }
    mismatches.put(evidence, "digest_mismatch")
    stale.put(evidence, "stale_adoption")
    return Invariant("adoptions", not (mismatches.n or stale.n), evidence)


# ------------------------------------------------------------------------------------------
# Store invariants
# ------------------------------------------------------------------------------------------


def adoption_digests(
    events: Iterable[EventLike], store: ParameterStore
) -> dict[tuple[int, int], str | None]:
    """Digests of the stored versions named by ``adopted`` events, for :func:`check_adoptions`.

    Reads each ``(fragment, version)`` once with ``store.get_version``; a version no longer
    kept (or never written) maps to None, one that does not decode maps to
    ``"undecodable: <error>"`` (which matches no adopted digest). Versions leave the store after
    ``sync.history`` newer ones, so call this while the run is live to verify more adoptions.

    Raises:
        StoreError: the store has no manifest.
        StoreUnavailable: the store cannot be reached.
    """
    manifest = store.get_manifest()
    if manifest is None:
        raise StoreError(f"run {store.run_id!r} has no manifest")
    layout = manifest_layout(manifest)
    out: dict[tuple[int, int], str | None] = {}
    for e in payloads(events):
        if e.get("kind") != "adopted":
            continue
        for p, v in _per_fragment(e.get("versions")):
            if (p, v) in out or v < 0 or p >= layout.n_fragments:
                continue
            try:
                blob = store.get_version(p, v)
                out[(p, v)] = (None if blob is None
                               else digest(decode_blob(blob.value, layout.shapes(p))))
            except StoreUnavailable:
                raise
            except DDilocoError as exc:
                out[(p, v)] = f"undecodable: {exc}"
    return out


def _scan_versions(store: ParameterStore, p: int) -> list[int] | None:
    """Every version of ``p`` whose value is stored
    (:meth:`~ddiloco.store.base.VersionStore.stored_versions`); None for a store that cannot
    list them (a test double)."""
    lister = getattr(store, "stored_versions", None)
    return None if lister is None else list(lister(p))


def _stored_versions(store: ParameterStore, p: int, head: int) -> tuple[list[int], str]:
    """Versions of ``p`` stored above ``head``, and how they were found.

    A store that lists its versions is asked for them all, which finds every stored version;
    any other store is probed with ``get_version`` at
    ``head + 1 .. head + DANGLING_PROBE``, which finds only dangling versions close to the head
    (a half-written version, which ``get_version`` rejects with ``StoreError``, counts too).
    """
    scanned = _scan_versions(store, p)
    if scanned is not None:
        return [v for v in scanned if v > head], "scan"
    probed: list[int] = []
    for v in range(head + 1, head + 1 + DANGLING_PROBE):
        try:
            if store.get_version(p, v) is not None:
                probed.append(v)
        except StoreUnavailable:
            raise
        except StoreError:  # half a version (value without momentum): dangling all the same
            probed.append(v)
    return probed, f"probe +{DANGLING_PROBE}"


@dataclass
class _FinalRead:
    """The heads of every fragment, decoded; problems collected, not raised."""

    values: dict[int, list[np.ndarray]]
    nonfinite: _Offenders
    problems: _Offenders  # everything else: no manifest, no head, undecodable, wrong shapes
    heads: list[int | None] | None
    read_races: list[dict[str, Any]]


def _read_final(store: ParameterStore, n_fragments: int) -> _FinalRead:
    out = _FinalRead({}, _Offenders(), _Offenders(), None, [])
    manifest = store.get_manifest()
    if manifest is None:
        out.problems.add({"error": "no manifest"})
        return out
    layout = manifest_layout(manifest)
    if layout.n_fragments != n_fragments:
        out.problems.add({"error": f"manifest has {layout.n_fragments} fragments, "
                                   f"expected {n_fragments}"})
    n = min(n_fragments, layout.n_fragments)
    heads = store.heads(n)
    out.heads = [h.version if h is not None else None for h in heads]
    try:
        blobs = store.get_latest_many(list(range(n)))
    except StoreUnavailable:
        raise
    except StoreError as exc:
        out.problems.add({"error": f"unreadable head: {exc}"})
        return out
    for p, (head, blob) in enumerate(zip(heads, blobs, strict=True)):
        if head is None or blob is None:
            out.problems.add({"fragment": p, "error": "no head"})
            continue
        if blob.version != head.version:  # a writer is still running: not a failure
            out.read_races.append({"fragment": p, "head": head.version, "read": blob.version})
        shapes = layout.shapes(p)
        item = {"fragment": p, "version": blob.version}
        try:
            tensors = decode_blob(blob.value, shapes)
        except NonFinite as exc:
            out.nonfinite.add({**item, "error": str(exc)})
            continue
        except DDilocoError as exc:
            out.problems.add({**item, "error": f"undecodable: {exc}"})
            continue
        got = [tuple(t.shape) for t in tensors]
        if got != [tuple(s) for s in shapes]:
            out.problems.add({**item, "error": f"shapes {got} != manifest {shapes}"})
            continue
        if not all(bool(np.isfinite(t).all()) for t in tensors):
            out.nonfinite.add({**item, "error": "non-finite values"})
            continue
        out.values[p] = tensors
    return out


def check_final_store(store: ParameterStore, n_fragments: int) -> Invariant:
    """The store a run leaves behind is whole.

    Every fragment ``0 .. n_fragments-1`` has a head whose value blob is readable, decodes
    (:func:`ddiloco.workers.run.blobs.decode_blob`) to the manifest's shapes and is finite; and no
    value
    blob of a version newer than the head is stored (``dangling``: a half-done publish). A store
    that lists its versions (:meth:`~ddiloco.store.base.VersionStore.stored_versions`) shows
    every dangling version; other stores are probed at ``head + 1 .. head + DANGLING_PROBE`` with
    ``get_version``.

    Raises:
        StoreUnavailable: the store cannot be reached (the audit cannot be done).
    """
    final = _read_final(store, n_fragments)
    dangling = _Offenders()
    method = None
    for p, head in enumerate(final.heads or []):
        above, method = _stored_versions(store, p, -1 if head is None else head)
        for v in above:
            dangling.add({"fragment": p, "head": head, "stored": v})
    evidence: dict[str, Any] = {
        "fragments": n_fragments,
        "readable": len(final.values),
        "heads": final.heads,
        "dangling_check": method,
        "read_races": final.read_races[:EXAMPLES],
    }
    final.problems.put(evidence, "problems")
    final.nonfinite.put(evidence, "nonfinite")
    dangling.put(evidence, "dangling")
    ok = not (final.problems.n or final.nonfinite.n or dangling.n)
    return Invariant("final_store", ok, evidence)


def check_objects(store: ParameterStore, n_fragments: int) -> Invariant:
    """No head points at a missing object: every blob the store still names reads back whole.

    For each fragment ``0 .. n_fragments-1``: its head through ``store.get_latest``, every
    other kept version at or below the head through ``store.get_version`` (the versions the
    store lists, ``stored_versions``; other stores: the head only),
    and its initial blob through ``store.get_initial``. A read that raises
    :class:`~ddiloco.store.objects.MissingObject` counts as ``missing``,
    :class:`~ddiloco.store.objects.CorruptObject` (length or CRC-32 differs from the pointer)
    as ``corrupt``, any other store error as ``unreadable``; each fails the invariant. A
    fragment without a head is :func:`check_final_store`'s finding, not this one's. On
    ``redis`` blob locations there are no objects and the reads only confirm the blobs are
    there; ``objects`` counts what the run holds in its object store (None on ``redis``).

    Raises:
        StoreUnavailable: Redis or the object store cannot be reached (the audit cannot be
            done).
    """
    missing, corrupt, unreadable = _Offenders(), _Offenders(), _Offenders()
    # blobs read back whole, by kind of read
    counts = {"heads": 0, "versions": 0, "initial": 0}

    def read(what: str, p: int, version: int | None, fn: Any) -> None:
        item = {"fragment": p, "version": version, "read": what}
        try:
            found = fn()
        except StoreUnavailable:
            raise
        except MissingObject as exc:
            missing.add({**item, "error": str(exc)})
        except CorruptObject as exc:
            corrupt.add({**item, "error": str(exc)})
        except StoreError as exc:
            unreadable.add({**item, "error": str(exc)})
        else:
            counts[what] += found is not None

    location = store.blob_location
    for p, head in enumerate(store.heads(n_fragments)):
        read("initial", p, None, lambda p=p: store.get_initial(p))
        if head is None:
            continue
        read("heads", p, head.version, lambda p=p: store.get_latest(p))
        for v in _scan_versions(store, p) or []:
            if v < head.version:
                read("versions", p, v, lambda p=p, v=v: store.get_version(p, v))
    evidence: dict[str, Any] = {
        "location": location,
        "objects": None if location == REDIS else len(store.object_paths()),
        "read": counts,
    }
    missing.put(evidence, "missing")
    corrupt.put(evidence, "corrupt")
    unreadable.put(evidence, "unreadable")
    return Invariant("objects", not (missing.n or corrupt.n or unreadable.n), evidence)


def _loss_values(event: Mapping[str, Any]) -> Iterable[tuple[str, Any]]:
    for key, value in event.items():
        if "loss" not in key:
            continue
        if isinstance(value, list | tuple):
            for x in value:
                yield key, x
        else:
            yield key, value


def check_no_nan(
    events: Iterable[EventLike], store: ParameterStore | None, n_fragments: int
) -> Invariant:
    """Training never produced NaN/Inf: in the log's losses nor in the final parameters.

    Every numeric value of an event field whose name contains ``loss`` (``eval`` events' ``loss``
    and any other) must be finite, and so must every value of each fragment's head in
    ``store`` (skipped when ``store`` is None). A head that cannot be decoded for another
    reason counts as ``unreadable`` (:func:`check_final_store` reports why).
    """
    bad = _Offenders()
    n_losses = 0
    for e in payloads(events):
        for key, value in _loss_values(e):
            if isinstance(value, bool) or not isinstance(value, int | float):
                continue
            n_losses += 1
            if not math.isfinite(value):
                bad.add({"kind": e.get("kind"), "field": key, "value": repr(value),
                         "t": e.get("t")})
    evidence: dict[str, Any] = {"losses": n_losses}
    bad.put(evidence, "nonfinite_losses")
    ok = not bad.n
    if store is not None:
        final = _read_final(store, n_fragments)
        evidence["fragments_finite"] = len(final.values)
        evidence["unreadable"] = final.problems.n
        final.nonfinite.put(evidence, "nonfinite_fragments")
        ok = ok and not final.nonfinite.n
    return Invariant("no_nan", ok, evidence)


# ------------------------------------------------------------------------------------------
# Report
# ------------------------------------------------------------------------------------------


def audit(invariants: Iterable[Invariant]) -> dict[str, Any]:
    """The audit block of a run report: ``{"ok", "invariants": [{name, ok, evidence}]}``."""
    items = [i.to_json() for i in invariants]
    return {"ok": all(i["ok"] for i in items), "invariants": items}


def raise_if_failed(report: Mapping[str, Any]) -> None:
    """Raise :class:`InvariantViolation` if the :func:`audit` report is not ok."""
    if not report.get("ok", False):
        raise InvariantViolation(dict(report))
