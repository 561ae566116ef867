"""Losing the embedded Redis with its disk, and coming back from the object store: the chaos
``wipe`` fault (docs/CHAOS.md, docs/RELIABILITY.md "Losing Redis altogether").

:meth:`Wipe.lose` pauses every writer (``CLIENT PAUSE ... WRITE``: a write in flight is neither
taken nor answered), notes each fragment's head, carries the run's telemetry aside
(:func:`~ddiloco.store.rebuild.snapshot_telemetry`), then kills the server and deletes its data.
:meth:`Wipe.restore` brings it back on a private port, rebuilds the run from the object store
(:func:`~ddiloco.store.rebuild.rebuild`), writes the telemetry back so the run's audit spans
the loss, and serves again on the old port. Its :class:`WipeCheck` says whether every version
acknowledged before the loss is in the rebuilt store: the head the run had, or one of the
versions it descends from in the rebuilt chain.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import redis

from ddiloco.store.core import as_str
from ddiloco.store.embedded import EmbeddedRedis
from ddiloco.store.rebuild import rebuild, restore_telemetry, snapshot_telemetry

__all__ = ["PAUSE_MS", "Wipe", "WipeCheck"]

#: How long writers are paused before the kill, at most (milliseconds): the kill follows the
#: snapshot within milliseconds; the pause only has to outlast them.
PAUSE_MS = 30_000


@dataclass
class WipeCheck:
    """The outcome of one wipe.

    Attributes:
        before: fragment -> (version, token) of its head when Redis was lost.
        after: fragment -> rebuilt head version.
        lost: ``"f<p> v<version>"`` of each head acknowledged before the loss that the rebuilt
            store does not hold (empty: nothing acknowledged lost).
        telemetry_keys: keys carried over (the run's telemetry, other runs' keys).
        rebuild_s: seconds the rebuild took (not counting the server's restarts).
        down_s: seconds from the kill to serving again.
    """

    before: dict[int, tuple[int, str]] = field(default_factory=dict)
    after: dict[int, int] = field(default_factory=dict)
    lost: list[str] = field(default_factory=list)
    telemetry_keys: int = 0
    rebuild_s: float = 0.0
    down_s: float = 0.0

    def to_json(self) -> dict[str, Any]:
        """JSON-able form, for an event or a report."""
        return {"before": {str(p): v for p, (v, _) in sorted(self.before.items())},
                "after": {str(p): v for p, v in sorted(self.after.items())},
                "lost": self.lost, "telemetry_keys": self.telemetry_keys,
                "rebuild_s": round(self.rebuild_s, 3), "down_s": round(self.down_s, 3)}


class Wipe:
    """One loss of an embedded Redis and its rebuild (module docstring).

    Args:
        server: the run's embedded Redis (started; a single server, not a Sentinel group).
        run_id: the run.
        location: the run's blob location (an object store, not ``redis``).
        clock: seconds, for the check's durations.
    """

    def __init__(self, server: EmbeddedRedis, run_id: str, location: str,
                 *, clock: Callable[[], float] = time.monotonic) -> None:
        self.server, self.run_id, self.location = server, run_id, location
        self.clock = clock
        self.check = WipeCheck()
        self._snapshot: dict[bytes, bytes] = {}
        self._lost_at = 0.0
        self._chains: dict[int, list[tuple[int, str]]] = {}

    def lose(self) -> None:
        """Pause writers, note heads and telemetry, kill the server and delete its data.

        Raises:
            StoreUnavailable: the server did not answer before the loss.
        """
        client = redis.Redis.from_url(self.server.url)
        try:
            client.execute_command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")
            self.check.before = _heads(client, self.run_id)
            # other runs on the server (a chaos run's earlier mode) are carried whole: the
            # fault is the loss of this run's Redis state
            self._snapshot = snapshot_telemetry(client, self.run_id, other_runs=True)
        finally:
            client.close()
        self.server.lose_data()
        self._lost_at = self.clock()

    def restore(self) -> WipeCheck:
        """Rebuild on a private port, write the telemetry back, serve again; check.

        Raises:
            StoreError: the rebuild failed (e.g. no manifest in the object store).
            StoreUnavailable: the server did not come back.
        """
        with self.server.aside() as url:
            client = redis.Redis.from_url(url)
            try:
                report = rebuild(client, self.run_id, self.location, clock=self.clock)
                self.check.telemetry_keys = restore_telemetry(client, self._snapshot)
                self._chains = report.chains
            finally:
                client.close()
        self.check.rebuild_s = report.seconds
        self.check.after = dict(report.heads)
        self.check.down_s = self.clock() - self._lost_at
        # A head of before the loss is in the rebuilt chain (the chain's newest is at most one
        # version past it: a publish whose objects were written when Redis was lost).
        self.check.lost = [f"f{p} v{v}" for p, (v, token) in sorted(self.check.before.items())
                           if (v, token) not in self._chains.get(p, [])]
        return self.check


_HEAD_KEY = re.compile(r":(\d+)\}:head$")


def _heads(client: redis.Redis, run_id: str) -> dict[int, tuple[int, str]]:
    """Fragment -> (version, token) of every published head of the run."""
    out: dict[int, tuple[int, str]] = {}
    for key in client.scan_iter(match=f"ddl:{{{run_id}:*}}:head", count=1000):
        m = _HEAD_KEY.search(as_str(key))
        version, token = client.hmget(key, ["version", "token"])
        if m and version is not None:
            out[int(m.group(1))] = (int(version), "" if token is None else as_str(token))
    return out

