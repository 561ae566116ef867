"""Liveness off the main loop: a periodic ticker thread, and the TTL of a learner's heartbeat
(DESIGN §3 "learner registry with TTL heartbeats", §4 liveness)."""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["StoreOutage", "Ticker", "heartbeat_ttl_s"]

log = logging.getLogger("ddiloco")


def heartbeat_ttl_s(base_ttl_s: float, period_s: float, recent_tick_s: Sequence[float]) -> float:
    """TTL for a learner's heartbeat entry that a slow control path cannot make lapse.

    A heartbeat tick is one round trip to the store (the entry is written on the way there);
    the next tick starts ``period_s`` after this one's reply. Two writes therefore arrive at
    most ``d_k + period_s + d_{k+1}`` apart, where ``d`` is a tick's duration. On a congested
    link ``d`` grows with the queue (seconds on a saturated 10 Mbit/s link with deep buffers),
    so the TTL is ``max(base_ttl_s, period_s + 3 * max(recent_tick_s))``: twice the worst
    recent tick, plus half again for a queue that is still growing. A dead learner writes no
    more, so its entry still lapses within one such TTL.

    Args:
        base_ttl_s: configured TTL (``run.learner_ttl_s``), seconds: the floor.
        period_s: heartbeat period (``run.heartbeat_s``), seconds.
        recent_tick_s: durations of the last ticks, seconds (any length, may be empty).

    Returns:
        The TTL, seconds.
    """
    worst = max(recent_tick_s, default=0.0)
    return max(base_ttl_s, period_s + 3.0 * worst)


@dataclass
class StoreOutage:
    """Back-off and reporting of one process's view of store outages (pure; the caller's
    clock).

    A shard that cannot publish keeps every accepted contribution and tries again
    (DESIGN §4): the wait between tries doubles from ``first_s`` up to ``max_s`` seconds, and
    an outage of the object store is reported once when it starts and once when it ends (the
    events ``blobs_unavailable`` and ``blobs_restored``), not at every try. Redis outages get
    the same back-off but no events: the events live in Redis.

    Attributes:
        first_s: wait after the first failed try, seconds.
        max_s: longest wait, seconds.
    """

    first_s: float = 0.5
    max_s: float = 5.0
    since: float | None = None
    tries: int = 0
    blobs_reported: bool = False

    def failed(self, now: float, blobs: bool) -> tuple[float, bool]:
        """Record a failed try at ``now`` (seconds); ``blobs``: the object store failed.

        Returns:
            ``(wait_s, report)``: seconds to wait before the next try, and whether this is
            the first failure of the object store in this outage (emit ``blobs_unavailable``).
        """
        if self.since is None:
            self.since = now
        self.tries += 1
        wait = min(self.max_s, self.first_s * 2.0 ** (self.tries - 1))
        report = blobs and not self.blobs_reported
        self.blobs_reported |= blobs
        return wait, report

    def succeeded(self, now: float) -> dict[str, Any] | None:
        """Record a try that went through at ``now``; ends an outage.

        Returns:
            The fields of ``blobs_restored`` (``outage_s``: seconds since the first failure,
            ``tries``: failed tries) when an object-store outage ends, else None.
        """
        if self.since is None:
            return None
        ended = ({"outage_s": round(now - self.since, 3), "tries": self.tries}
                 if self.blobs_reported else None)
        self.since, self.tries, self.blobs_reported = None, 0, False
        return ended


class Ticker:
    """Calls ``fn`` every ``period_s`` seconds on a daemon thread until :meth:`stop`.

    Liveness (learner TTL heartbeats, shard lease renewal) must not depend on the main loop:
    a JIT compilation or a slow step can block it for longer than a TTL.
    Exceptions of ``fn`` are logged and the ticker goes on (a transient Redis error must not
    end liveness for good).
    """

    def __init__(self, period_s: float, fn: Callable[[], object], name: str) -> None:
        self.period_s = period_s
        self.fn = fn
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Ticker:
        """Start ticking (the first call happens at once)."""
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.fn()
            except Exception as exc:  # logged; liveness must keep trying
                log.warning("%s: %s", self._thread.name, exc)
            self._stop.wait(self.period_s)

    def stop(self) -> None:
        """Stop and join the thread (at most 5 s)."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)
