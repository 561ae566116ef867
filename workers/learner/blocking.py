"""When a learner may take its next inner step: never held (Decoupled DiLoCo), or held until the
merge of its own round is adopted (``sync.blocking``, a diagnostic).

Decoupled DiLoCo learners never wait (DESIGN §2, paper arXiv 2604.21428): :class:`NoWait`.
:class:`RoundGate` is the diagnostic that turns a run into synchronous DiLoCo (DiLoCo,
arXiv 2311.08105, Algorithm 1: every worker waits for the outer step before its next inner
phase) or, with fragments and an overlap, synchronous Streaming DiLoCo (arXiv 2501.18512,
§2.2: a fragment sent at step s is merged in by step s + tau). After a learner sends fragment
f's delta at step s against version b, it may take at most ``tau`` more inner steps; the next
one waits until it has adopted a version of f newer than b. That version is the merge of its
round, or (the shard merged a round without it: a dropped contribution, a missed round) at
least a version the learner can train on. A deadline bounds the wait, so neither a lost
contribution nor a shard that stops can hold the run forever.

The learner picks its policy once (:func:`gate_for`) and calls the same three methods either
way: :meth:`~RoundGate.sent` after a send, :meth:`~RoundGate.adopted` after an adoption,
:meth:`~RoundGate.held` before an inner step. The policies are pure bookkeeping with an
injectable clock; the waiting itself is the learner's (it has the comms thread and its stop
flag).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

__all__ = ["Awaited", "Gate", "NoWait", "Release", "RoundGate", "gate_for"]


@dataclass(frozen=True)
class Awaited:
    """A sent delta whose merge the learner waits for.

    Attributes:
        fragment: the fragment p.
        base: the version the delta was computed against.
        step: the learner's inner step at the send (its round).
        sent_at: clock time of the send, seconds.
        deadline: clock time after which the learner trains on without the merge, seconds.
    """

    fragment: int
    base: int
    step: int
    sent_at: float
    deadline: float


@dataclass(frozen=True)
class Release:
    """How the wait for one round ended.

    Attributes:
        awaited: the round waited for.
        version: the version adopted (None: the wait timed out).
        included: that version merged this learner's delta of the round (the broadcast's
            ``merged`` map names the learner at the send step or later); False for a round
            merged without it and for a timeout.
        waited_s: seconds from the send to the release.
    """

    awaited: Awaited
    version: int | None
    included: bool
    waited_s: float

    @property
    def timed_out(self) -> bool:
        """The deadline passed before a newer version was adopted."""
        return self.version is None


class Gate(Protocol):
    """What the learner asks of its waiting policy."""

    #: whether the learner may send a fragment early to join a round another learner opened
    #: (``sync.round_notice``)
    joins_rounds_early: bool

    def sent(self, fragment: int, base: int, step: int) -> None:
        """A delta of ``fragment`` against version ``base`` left at inner step ``step``."""

    def adopted(self, fragment: int, version: int, merged: Mapping[str, int]) -> None:
        """Version ``version`` of ``fragment`` was adopted; ``merged``: learner -> step of the
        deltas it merged (from the broadcast or the store)."""

    def held(self, next_step: int) -> list[int]:
        """Fragments that hold inner step ``next_step`` back, ascending (empty: go on)."""

    def expire(self, next_step: int) -> list[Release]:
        """Give up on the rounds holding ``next_step`` whose deadline has passed."""

    def releases(self) -> list[Release]:
        """The rounds released since the last call (adopted or timed out), in order."""


class NoWait:
    """Decoupled DiLoCo: nothing ever holds an inner step (DESIGN §2: learners never wait)."""

    joins_rounds_early = True

    def sent(self, fragment: int, base: int, step: int) -> None:
        """Nothing to remember."""

    def adopted(self, fragment: int, version: int, merged: Mapping[str, int]) -> None:
        """Nothing to release."""

    def held(self, next_step: int) -> list[int]:
        """Never held."""
        return []

    def expire(self, next_step: int) -> list[Release]:
        """Nothing to expire."""
        return []

    def releases(self) -> list[Release]:
        """Nothing released."""
        return []


class RoundGate:
    """``sync.blocking``: an inner step more than ``tau`` steps after a send of fragment f
    waits until a version of f newer than the delta's base is adopted, or until
    ``timeout_s`` after the send.

    Args:
        learner: this learner's id (to tell whether a merge included it).
        tau: inner steps a learner may take after a send before it needs the merge.
        timeout_s: longest wait from a send, seconds (``sync.blocking_timeout_s``).
        clock: monotonic seconds (injectable for tests).

    Raises:
        ValueError: ``tau`` < 0 or ``timeout_s`` <= 0 (the config refuses both first).
    """

    #: No early joins: blocked learners are in phase by construction, and an early send moves
    #: one learner's schedule of one fragment against the others'. Two learners could then
    #: each wait for a round the other has not sent yet, until the timeout.
    joins_rounds_early = False

    def __init__(self, learner: str, tau: int, timeout_s: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if tau < 0:
            raise ValueError(f"tau: {tau} must be >= 0")
        if timeout_s <= 0:
            raise ValueError(f"timeout_s: {timeout_s} must be > 0")
        self.learner = learner
        self.tau = tau
        self.timeout_s = timeout_s
        self.clock = clock
        #: the round awaited per fragment; a second send of f before the first's release
        #: (an overlap of at least H steps) replaces it, keeping the older base
        self.awaited: dict[int, Awaited] = {}
        self._released: list[Release] = []

    def sent(self, fragment: int, base: int, step: int) -> None:
        """Remember the round of this send; its deadline starts now."""
        now = self.clock()
        prev = self.awaited.get(fragment)
        # A second send before the first was released (the overlap exceeds the period) keeps
        # the older base: a version newer than it is what the learner has not seen yet.
        base = min(base, prev.base) if prev is not None else base
        self.awaited[fragment] = Awaited(fragment, base, step, now, now + self.timeout_s)

    def adopted(self, fragment: int, version: int, merged: Mapping[str, int]) -> None:
        """Release the fragment's round when ``version`` is newer than the delta's base."""
        a = self.awaited.get(fragment)
        if a is None or version <= a.base:
            return
        del self.awaited[fragment]
        included = merged.get(self.learner, -1) >= a.step
        self._released.append(Release(a, version, included, self.clock() - a.sent_at))

    def held(self, next_step: int) -> list[int]:
        """Fragments sent more than ``tau`` steps before ``next_step`` and not yet released."""
        return sorted(p for p, a in self.awaited.items() if next_step > a.step + self.tau)

    def expire(self, next_step: int) -> list[Release]:
        """Drop the holding rounds past their deadline; returns them (timed out) and records
        them for :meth:`releases` as well."""
        now = self.clock()
        out = []
        for p in self.held(next_step):
            a = self.awaited[p]
            if now >= a.deadline:
                del self.awaited[p]
                out.append(Release(a, None, False, now - a.sent_at))
        self._released += out
        return out

    def releases(self) -> list[Release]:
        """The rounds released since the last call, in order."""
        out, self._released = self._released, []
        return out


def gate_for(blocking: bool, learner: str, tau: int, timeout_s: float,
             clock: Callable[[], float] = time.monotonic) -> Gate:
    """The policy of a run: :class:`RoundGate` with ``sync.blocking``, else :class:`NoWait`."""
    if blocking:
        return RoundGate(learner, tau, timeout_s, clock)
    return NoWait()
