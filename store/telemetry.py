"""Telemetry of a run in the Redis store (DESIGN §3, §5): events, counters, wire bytes, token fate.

:class:`RedisTelemetry` implements :class:`~ddiloco.store.base.TelemetryStore`:

* the event stream (XADD, trimmed to about :data:`EVENTS_MAXLEN` entries), read oldest first and
  without the copies a re-sent XADD leaves;
* counter groups (hashes of integers), among them ``wire_peers`` (application bytes per directed
  worker pair), ``received`` and ``wire_fate`` (what shards saw of each learner incarnation);
* token-fate records, one per learner incarnation (DESIGN §5).

Every cumulative value is written absolute (HSET, SET), not added, where a write may be retried
after a lost reply: a retry then cannot count twice. Event times are wall-clock seconds, from the
caller or from the store's injectable clock.
"""

from __future__ import annotations

import json
import uuid
from collections.abc import Collection
from typing import Any, cast, overload

from redis.client import Pipeline

from ddiloco.store.core import RedisCore, as_str, dumps, unavailable

__all__ = ["EVENTS_MAXLEN", "RedisTelemetry"]

#: Approximate cap on the event stream (XADD MAXLEN ~): enough for a long run's joins, merges and
#: drops while bounding memory to a few hundred MB at worst.
EVENTS_MAXLEN = 200_000
#: Entries read per XRANGE call when :meth:`RedisTelemetry.events` has to filter or page.
_EVENTS_PAGE = 1_000


class RedisTelemetry(RedisCore):
    """Events, counters, wire bytes per peer and token fate of one run (:class:`TelemetryStore`).

    Args and errors as :class:`~ddiloco.store.core.RedisCore`.
    """

    # -- events and counters ---------------------------------------------------------------------
    @overload
    def add_event(self, kind: str, fields: dict[str, Any], pipe: None = None,
                  t: float | None = None, eid: str | None = None) -> str: ...

    @overload
    def add_event(self, kind: str, fields: dict[str, Any], pipe: Pipeline,
                  t: float | None = None, eid: str | None = None) -> None: ...

    @unavailable
    def add_event(
        self, kind: str, fields: dict[str, Any], pipe: Pipeline | None = None,
        t: float | None = None, eid: str | None = None,
    ) -> str | None:
        """Append an event (XADD, stream trimmed to about ``EVENTS_MAXLEN`` entries).

        Stored as fields ``kind``, ``t`` (wall-clock seconds, ``self.clock()`` when None; ``t``
        backdates an event recorded late, e.g. a fault observed while Redis was down) and
        ``data`` (``fields`` as JSON), with ``eid`` (a fresh id when None): :meth:`events`
        returns one event per ``eid``, so a write repeated after a lost reply (by the client's
        retry, or by a caller passing the same ``eid``) is read once.

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
        entry: dict[Any, Any] = {"kind": kind, "t": repr(self.clock() if t is None else t),
                                 "data": dumps(fields), "eid": eid or uuid.uuid4().hex[:16]}
        target = pipe if pipe is not None else self._r
        event_id = target.xadd(self.keys.events, entry, maxlen=EVENTS_MAXLEN, approximate=True)
        return None if pipe is not None else as_str(event_id)

    @staticmethod
    def _event(raw: dict[Any, Any]) -> dict[str, Any]:
        fields = {as_str(k): v for k, v in raw.items()}
        event: dict[str, Any] = json.loads(fields["data"])
        event["kind"] = as_str(fields["kind"])
        event["t"] = float(fields["t"])
        return event

    @unavailable
    def events(
        self, start: str = "-", count: int | None = None, kinds: Collection[str] | None = None
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
                    out.append((as_str(raw_id), event))
                    if count is not None and len(out) >= count:
                        return out
            if len(batch) < page:
                return out
            cursor = f"({as_str(batch[-1][0])}"

    @unavailable
    def incr_counter(
        self, name: str, field: str, amount: int = 1, pipe: Pipeline | None = None
    ) -> None:
        """Add ``amount`` to ``field`` of counter group ``name`` (HINCRBY), e.g. drops by reason."""
        (pipe if pipe is not None else self._r).hincrby(self.keys.counters(name), field, amount)

    @unavailable
    def counters(self, name: str) -> dict[str, int]:
        """All fields of counter group ``name`` ({} if none)."""
        raw = self._r.hgetall(self.keys.counters(name))
        return {as_str(k): int(v) for k, v in raw.items()}

    @unavailable
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

    @unavailable
    def wire_peers(self) -> dict[str, int]:
        """Bytes per directed pair ``"src>dst"``, summed over learner incarnations."""
        out: dict[str, int] = {}
        for k, v in self._r.hgetall(self.keys.counters("wire_peers")).items():
            pair = as_str(k).split("|", 1)[-1]
            out[pair] = out.get(pair, 0) + int(v)
        return out

    # -- token fate (DESIGN §5) ---------------------------------------------------------------
    @unavailable
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
        target.set(self.keys.fate(learner_id, incarnation), dumps(record))
        if pipe is None:
            target.execute()

    @unavailable
    def received_total(self, learner_id: str, incarnation: int, shard: str) -> int:
        """What :meth:`note_received` last stored for this learner incarnation and shard."""
        raw = self._r.hget(self.keys.counters("received"),
                          f"{learner_id}:{incarnation}:{shard}")
        return int(raw) if raw is not None else 0

    @unavailable
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
            pipe.hset(self.keys.counters("wire_fate"), member, dumps(snapshot))
        pipe.execute()

    @unavailable
    def fate_records(self) -> list[dict[str, Any]]:
        """Every learner incarnation's fate record, each with ``learner``, ``incarnation``,
        ``wire`` (the send-time snapshots shards saw: list of ``[processed, sent, overwritten,
        drain]``) and ``received`` (fragment-tokens that reached a shard)."""
        members = sorted(as_str(m) for m in self._r.smembers(self.keys.fates))
        received: dict[str, int] = {}
        for a, b in self._r.hgetall(self.keys.counters("received")).items():
            learner_inc = as_str(a).rsplit(":", 1)[0]  # summed over shards
            received[learner_inc] = received.get(learner_inc, 0) + int(b)
        wire: dict[str, list[list[int]]] = {}
        for k, v in self._r.hgetall(self.keys.counters("wire_fate")).items():
            learner, inc, _shard = as_str(k).rsplit(":", 2)
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
