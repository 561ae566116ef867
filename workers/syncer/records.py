"""What a syncer shard writes about its work (events, counters, received totals), kept through
store outages: a write the store does not take is queued and written, in order, when it is
back (docs/RELIABILITY.md, "receive, then record").

The shard's state changes first (a delta is filed, a version is committed); the record of it
comes after and never undoes or reopens anything. A write whose outcome is unknown (its reply
was lost) is written again: an event keeps its ``eid``, so readers see it once
(:meth:`ddiloco.store.telemetry.RedisTelemetry.events`); received totals are absolute
values, so writing one twice is harmless. Counters are increments: one retried after a lost
reply counts twice (they are for dashboards; the audit reads events).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from ddiloco.pipeline.errors import StoreUnavailable
from ddiloco.store.base import TelemetryStore

__all__ = ["QUEUE_LIMIT", "ShardRecords"]

log = logging.getLogger("ddiloco.syncer")

#: Records held while the store is down; beyond this the oldest are dropped and counted
#: (about 1 KB each: 100 MB at the limit, hours of a large run's outage).
QUEUE_LIMIT = 100_000

Incarnation = tuple[str, int]


@dataclass
class _Received:
    """One learner incarnation's fragment-tokens received by this shard process, and the
    total an earlier process of the shard stored (None until read)."""

    count: int = 0
    base: int | None = None
    fate: list[int] | None = None
    queued: bool = False


@dataclass
class ShardRecords:
    """The queue of a shard's records, and its received totals (DESIGN §5 token fate).

    Args:
        store: the run's store.
        shard: the shard's name, ``shard-<s>``.
        clock: wall-clock seconds for the events' ``t`` (taken when the record is made, not
            when it is written).
    """

    store: TelemetryStore
    shard: str
    clock: Callable[[], float] = time.time
    queue: deque[tuple[Any, ...]] = field(default_factory=deque)
    received: dict[Incarnation, _Received] = field(default_factory=dict)
    #: records dropped because the queue was full
    lost: int = 0

    def __len__(self) -> int:
        return len(self.queue)

    # ------------------------------------------------------------------ records
    def event(self, kind: str, fields: dict[str, Any]) -> None:
        """Append the event ``kind`` now, or queue it (its time is now, either way)."""
        self._put(("event", kind, fields, self.clock(), uuid.uuid4().hex[:16]))

    def counter(self, name: str, field_: str, amount: int = 1) -> None:
        """Add ``amount`` to counter ``field_`` of group ``name``, now or queued."""
        self._put(("counter", name, field_, amount))

    def add_received(self, learner: str, inc: int, tokens: int,
                     fate: list[int] | None) -> None:
        """Count ``tokens`` fragment-tokens received from the incarnation and store the new
        absolute total (``fate``: the learner's snapshot from the header), now or queued.
        A shard process that does not know the total an earlier one stored reads it first."""
        rec = self.received.setdefault((learner, inc), _Received())
        rec.count += tokens
        if fate is not None:
            rec.fate = fate
        if not rec.queued:
            rec.queued = True
            self._put(("received", learner, inc))

    def total_received(self, learner: str, inc: int) -> int | None:
        """The incarnation's received total as this shard knows it; None while the stored
        base is unknown."""
        rec = self.received.get((learner, inc))
        if rec is None or rec.base is None:
            return None
        return rec.base + rec.count

    def forget(self, learner: str, inc: int) -> None:
        """Stop tracking an evicted incarnation (its queued total is still written)."""
        rec = self.received.get((learner, inc))
        if rec is not None and not rec.queued:
            del self.received[(learner, inc)]

    # ------------------------------------------------------------------ writing
    def _put(self, item: tuple[Any, ...]) -> None:
        if len(self.queue) >= QUEUE_LIMIT:
            self.queue.popleft()
            self.lost += 1
            if self.lost == 1 or self.lost % 1000 == 0:
                log.error("%s: %d records dropped: the store has been down too long",
                          self.shard, self.lost)
        self.queue.append(item)
        if len(self.queue) == 1:
            self.flush()

    def flush(self) -> int:
        """Write the queued records in order until the store fails; returns how many are
        still queued. Never raises ``StoreUnavailable``."""
        while self.queue:
            try:
                self._write(self.queue[0])
            except StoreUnavailable as exc:
                log.debug("%s: %d records queued: %s", self.shard, len(self.queue), exc)
                return len(self.queue)
            self.queue.popleft()
        return 0

    def _write(self, item: tuple[Any, ...]) -> None:
        what = item[0]
        if what == "event":
            _, kind, fields, t, eid = item
            self.store.add_event(kind, fields, t=t, eid=eid)
        elif what == "counter":
            _, name, field_, amount = item
            self.store.incr_counter(name, field_, amount)
        else:
            _, learner, inc = item
            rec = self.received[(learner, inc)]
            if rec.base is None:  # a restarted shard goes on from its stored total
                rec.base = self.store.received_total(learner, inc, self.shard)
            self.store.note_received(learner, inc, rec.base + rec.count, self.shard, rec.fate)
            rec.queued = False
