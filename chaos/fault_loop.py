"""The fault window, one loop for the local and the compose runner (DESIGN §5).

:func:`play_window` plays a fault schedule against a run: at each due time it injects or heals
a fault through an injector (:class:`ddiloco.chaos.faults.Injector` for local processes,
:class:`ddiloco.chaos.compose.ComposeInjector` for containers), watches the store for the
detection of each fault and for healthy learners that look dead, and writes every event,
buffering them while the store is away (:class:`Pending`). What differs between the runners
(supervising local processes, the live view or progress lines) comes in as callables. The
clock and the pause are injectable, so the loop is tested on a fake clock.
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ddiloco.chaos.faults import Injector
from ddiloco.chaos.script import SERVICES, FaultAction, FaultKind
from ddiloco.pipeline.errors import StoreUnavailable
from ddiloco.pipeline.waiting import poll_until
from ddiloco.store.base import ParameterStore
from ddiloco.workers.run.launch import LocalCluster

log = logging.getLogger(__name__)


@dataclass
class Pending:
    """Events observed while the store may be down, written when it answers again."""

    events: list[tuple[str, dict[str, Any], float]] = field(default_factory=list)

    def add(self, kind: str, fields: dict[str, Any]) -> None:
        # A write whose reply was lost (Redis paused mid-command) is retried and may land
        # twice: readers keep the first event of each uid (:func:`dedupe`).
        self.events.append((kind, {**fields, "uid": uuid.uuid4().hex[:16]}, time.time()))

    def flush(self, store: ParameterStore) -> None:
        while self.events:
            kind, fields, t = self.events[0]
            try:
                store.add_event(kind, fields, t=t)
            except StoreUnavailable:
                return
            self.events.pop(0)


@dataclass
class LiveStats:
    """Running totals for the live view, read incrementally from the event stream."""

    t0: float
    cursor: str = "-"
    merged_ft: int = 0
    faults: int = 0

    def update(self, store: ParameterStore, pending: Pending) -> None:
        """Read new events; record the stored digests of every version a (re)joining learner
        adopted while the store still keeps them (the audit compares them afterwards)."""
        from ddiloco.chaos.invariants import adoption_digests

        adopted = []
        for eid, e in store.events(self.cursor):
            self.cursor = f"({eid}"
            if e["kind"] == "merge" and e["t"] >= self.t0:
                self.merged_ft += sum(int(c["tokens"]) for c in e.get("contributions", []))
            elif e["kind"] == "fault" and e.get("phase") == "inject":
                self.faults += 1
            elif e["kind"] == "adopted":
                adopted.append(e)
        if adopted:
            digests = adoption_digests(adopted, store)
            pending.add("stored_digests", {"pairs": [[p, v, d] for (p, v), d in
                                                     sorted(digests.items())]})


def schedule(actions: list[FaultAction],
              duration_s: float) -> list[tuple[float, str, FaultAction]]:
    """(time, "inject"|"heal", action), time-sorted; heals after the end are left out."""
    out: list[tuple[float, str, FaultAction]] = []
    for a in actions:
        if a.at_s >= duration_s:
            continue
        out.append((a.at_s, "inject", a))
        end = a.end_s
        if end is not None and end < duration_s:
            out.append((end, "heal", a))
    return sorted(out, key=lambda x: (x[0], x[1] != "heal"))


def apply_fault(mode: str, phase: str, a: FaultAction, injector: Injector, cluster: LocalCluster,
           learners: list[str], shards: list[str], down: set[str], pending: Pending,
           watch: dict[str, tuple[str, str, str | None]], owners: dict[str, str]) -> None:
    fields: dict[str, Any] = {"id": a.id, "fault": a.kind.value, "target": a.target,
                              "phase": phase if not (phase == "heal" and a.kind in (FaultKind.KILL,
                                                                              FaultKind.WIPE))
                              else "restart",
                              "duration_s": a.duration_s, "mode": mode}
    if a.factor is not None:
        fields["factor"] = a.factor
    if a.peer is not None:
        fields["peer"] = a.peer
    gang = (mode == "dp" and a.kind is FaultKind.KILL and a.target not in SERVICES)
    if phase == "inject":
        log.info("inject %s", a.id)
        pending.add("fault", fields)
        if gang:
            # No elasticity: the failure of one member fails the synchronous job.
            for name in [*learners, *shards]:
                cluster.kill(name)
                down.add(name)
            pending.add("gang_failure", {"id": a.id, "killed": [*learners, *shards]})
        else:
            if a.kind is FaultKind.KILL and a.target not in SERVICES:
                down.add(a.target)
            injector.inject(a)
        if a.target == "blobs":
            # Noticed when a shard's publish fails: its blobs_unavailable event, written
            # after this moment (stream ids are milliseconds of the same clock; from the next
            # millisecond on, so an earlier outage's report never counts).
            watch[a.id] = (a.target, "blobs", f"{int(time.time() * 1000) + 1}-0")
        elif a.kind in (FaultKind.KILL, FaultKind.PAUSE) and a.target != "redis":
            watch[a.id] = (a.target, "shard" if a.target.startswith("shard") else "learner",
                           owners.get(a.target))
        elif a.target == "redis":
            pending.add("detected", {"id": a.id, "target": a.target, "how": "store requests "
                                     "fail at once"})
    else:
        log.info("heal %s", a.id)
        if gang:
            for name in [*shards, *learners]:
                down.discard(name)
                injector.restart(name)
            pending.add("gang_restart", {"id": a.id})
        else:
            down.discard(a.target)
            injector.heal(a)
        pending.add("fault", fields)
        if a.kind is not FaultKind.KILL:
            # A restarted worker is still noticed as gone when its old lease or TTL entry
            # expires (and a restarting object store by the next failed publish); a resumed
            # one that was never noticed is not.
            watch.pop(a.id, None)


def record_recoveries(store: ParameterStore, t0: float) -> None:
    """Write each observed recovery as a ``recovered`` event at the time it happened."""
    from ddiloco.chaos.chaos_report import dedupe
    from ddiloco.chaos.recoveries import recoveries

    events = dedupe(sorted((e for _, e in store.events()), key=lambda e: e["t"]))
    for r in recoveries(events):
        if r.recover_s is not None and r.injected_t >= t0:
            store.add_event("recovered", {"id": r.id, "target": r.target, "fault": r.kind,
                                          "recover_s": r.recover_s, "detect_s": r.detect_s},
                            t=r.injected_t + r.recover_s)


class Health:
    """Tells a healthy learner that looks dead from one a fault rightly took down."""

    _EXCUSED = (FaultKind.KILL, FaultKind.PAUSE, FaultKind.PARTITION)

    def __init__(self, region_of: dict[str, str] | None = None) -> None:
        #: with emulated regions, a partition cuts every worker of the target's region
        self.region_of = dict(region_of or {})
        self.faulted: dict[str, int] = {}
        self.seen: set[str] = set()  # alive since its last fault ended
        self.dead: set[str] = set()  # looking dead now (reported once)

    def on_fault(self, phase: str, a: FaultAction, learners: list[str]) -> None:
        if a.kind not in self._EXCUSED and a.target != "redis":
            return
        if a.target == "blobs":
            return  # heartbeats go to Redis: an object-store outage excuses no learner
        hit = learners if a.target == "redis" else [a.target]
        region = self.region_of.get(a.target)
        if a.kind is FaultKind.PARTITION and region is not None:
            hit = [n for n in learners if n == a.target or self.region_of.get(n) == region]
        for name in hit:
            if phase == "inject":
                self.faulted[name] = self.faulted.get(name, 0) + 1
            else:
                self.faulted[name] = max(0, self.faulted.get(name, 0) - 1)
                self.seen.discard(name)  # must come back before it can look dead again

    def check(self, live: set[str], learners: list[str], down: set[str],
              pending: Pending) -> None:
        for name in learners:
            if name in live:
                self.seen.add(name)
                self.dead.discard(name)
            elif (name in self.seen and name not in down and not self.faulted.get(name)
                  and name not in self.dead):
                self.dead.add(name)
                pending.add("looked_dead", {"learner": name})


def detect(store: ParameterStore, watch: dict[str, tuple[str, str, str | None]], pending: Pending,
            owners: dict[str, str]) -> set[str] | None:
    """Emit ``detected`` when the store notices a fault: the learner's TTL entry expired, the
    shard's lease expired (its announcement vanished or a new owner holds it), or a shard
    reported the object store unavailable (a ``blobs_unavailable`` event after the stream id
    the watch recorded at injection). Returns the live learners (None when the store cannot
    be read)."""
    try:
        live = set(store.live_learners())
        announced = {f"shard-{k}": str(v.get("owner")) for k, v in store.shards().items()}
        since = [ref for _, what, ref in watch.values() if what == "blobs" and ref]
        fresh = store.events(min(since, key=_stream_order)) if since else []
    except StoreUnavailable:
        return None
    noticed = any(e["kind"] == "blobs_unavailable" for _, e in fresh)
    if fresh and not noticed:
        # Read on from here next time: the stream is not read again from the injection.
        for fid, (target, what, _) in list(watch.items()):
            if what == "blobs":
                watch[fid] = (target, what, f"({fresh[-1][0]}")
    owners.clear()
    owners.update(announced)
    for fid, (target, what, owner) in list(watch.items()):
        if what == "learner":
            gone = target not in live
        elif what == "blobs":
            gone = noticed
        else:
            gone = target not in announced or announced[target] != owner
        if gone:
            pending.add("detected", {"id": fid, "target": target})
            del watch[fid]
    return live


def _stream_order(stream_id: str | None) -> tuple[int, int]:
    """Sort key of a stream id, ``"<ms>-<seq>"`` or exclusive ``"(<ms>-<seq>"``."""
    ms, _, seq = str(stream_id).lstrip("(").partition("-")
    return int(ms), int(seq or 0)


def wait_store(store: ParameterStore, pending: Pending, timeout_s: float = 30.0) -> bool:
    """Write the pending events, retrying while the store is away for up to ``timeout_s``
    seconds; True when none is left."""
    def flushed() -> bool:
        pending.flush(store)
        return not pending.events

    return bool(poll_until(flushed, timeout_s=timeout_s, interval_s=0.2))


def play_due(mode: str, now: float, plan: list[tuple[float, str, FaultAction]],
              injector: Any, cluster: Any, learners: list[str], shards: list[str],
              down: set[str], pending: Pending, watch: dict[str, tuple[str, str, str | None]],
              owners: dict[str, str], health: Health) -> None:
    """Inject or heal every planned fault whose time (seconds into the window) has come.
    ``injector``: a :class:`ddiloco.chaos.faults.Injector` or
    :class:`ddiloco.chaos.compose.ComposeInjector`."""
    while plan and plan[0][0] <= now:
        _, phase, a = plan.pop(0)
        apply_fault(mode, phase, a, injector, cluster, learners, shards, down, pending, watch,
        owners)
        health.on_fault(phase, a, learners)


def watch_health(mode: str, store: ParameterStore, watch: dict[str, tuple[str, str, str | None]],
                  pending: Pending, owners: dict[str, str], health: Health,
                  learners: list[str], down: set[str]) -> None:
    """Record detections of watched faults and, in DiLoCo mode, healthy learners that look
    dead."""
    live_now = detect(store, watch, pending, owners)
    if live_now is not None and mode == "diloco":
        health.check(live_now, learners, down, pending)


@dataclass
class FaultWindow:
    """The state of one fault window: what is still to play, who is down on purpose, which
    faults wait for their detection, and the running totals."""

    mode: str
    plan: list[tuple[float, str, FaultAction]]
    learners: list[str]
    shards: list[str]
    health: Health
    stats: LiveStats
    pending: Pending = field(default_factory=Pending)
    #: workers kept down on purpose (killed, waiting for their restart)
    down: set[str] = field(default_factory=set)
    #: fault id -> (target, "learner"|"shard"|"blobs", the shard's lease owner when it was hit;
    #: for blobs, the event stream id to look for the shards' ``blobs_unavailable`` from)
    watch: dict[str, tuple[str, str, str | None]] = field(default_factory=dict)
    #: shard -> current lease owner, as last read
    owners: dict[str, str] = field(default_factory=dict)

    @property
    def to_come(self) -> int:
        """Faults of the plan not injected yet."""
        return sum(1 for p in self.plan if p[1] == "inject")

    def blobs_away(self, now: float) -> bool:
        """Whether a fault on the object-store server is in force ``now`` seconds into the
        window (injected, its heal still to come)."""
        return any(phase == "heal" and a.target == "blobs" and a.at_s <= now
                   for _, phase, a in self.plan)


#: seconds between two reads of the detections, and of the running totals
DETECT_EVERY_S = 0.25
STATS_EVERY_S = 0.5
TICK_S = 0.05


def play_window(window: FaultWindow, store: ParameterStore, injector: Any,
                cluster: LocalCluster | None, duration_s: float, *,
                supervise: Callable[[FaultWindow], None] | None = None,
                report: Callable[[float, FaultWindow], None] | None = None,
                report_every_s: float = 1.0,
                clock: Callable[[], float] = time.monotonic,
                sleep: Callable[[float], None] = time.sleep) -> None:
    """Play ``window.plan`` for ``duration_s`` seconds (DESIGN §5): the one fault loop of the
    local and the compose runner.

    Each turn injects or heals the faults that are due (:func:`play_due`), lets the caller
    restart what died on its own (``supervise``, local runs), every ``DETECT_EVERY_S`` records
    detections and healthy learners that look dead (:func:`watch_health`), writes the pending
    events (kept while the store is away), every ``STATS_EVERY_S`` reads the running totals
    (not while a fault on the object-store server is in force), and every ``report_every_s``
    calls ``report(seconds_into_window, window)`` (the live view
    or a progress line).

    Args:
        window: the plan and state; updated in place.
        store: the run's store. A :class:`~ddiloco.pipeline.errors.StoreUnavailable` while
            Redis is away (a fault of the script) is absorbed: events wait in
            ``window.pending``, totals and reports skip a turn.
        injector: applies and heals faults (``inject``, ``heal``, ``restart``).
        cluster: the local cluster (data-parallel gang failures kill through it), or None.
        duration_s: length of the window, seconds.
        clock, sleep: monotonic seconds and the pause between turns (injectable for tests).
    """
    m0 = clock()
    last_detect = last_stats = last_report = -math.inf
    while (now := clock() - m0) < duration_s:
        play_due(window.mode, now, window.plan, injector, cluster, window.learners,
                 window.shards, window.down, window.pending, window.watch, window.owners,
                 window.health)
        if supervise is not None:
            supervise(window)
        if now - last_detect >= DETECT_EVERY_S:
            last_detect = now
            watch_health(window.mode, store, window.watch, window.pending, window.owners,
                         window.health, window.learners, window.down)
        window.pending.flush(store)
        # The totals read stored versions for new adoptions: with the object store down or
        # stopped each read would hang in the client's retries, stalling the fault loop.
        if now - last_stats >= STATS_EVERY_S and not window.blobs_away(now):
            last_stats = now
            try:
                window.stats.update(store, window.pending)
            except StoreUnavailable:
                pass
        if report is not None and now - last_report >= report_every_s:
            last_report = now
            try:
                report(now, window)
            except StoreUnavailable:
                pass
        sleep(TICK_S)
