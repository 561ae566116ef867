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

:class:`StepGate` is ``run.deterministic``'s: a round gate that also decides *when* a version
is adopted, by step count alone. Under :class:`RoundGate` a version that arrives before the
learner needs it is adopted at once, at whichever step that happens to be, and so is a version
of another fragment; under :class:`StepGate` the version that merged the round sent at step s
is adopted after inner step ``s + tau`` exactly (:func:`adoption_step`), never earlier, and a
missing one holds the next step until it comes. Two runs of the same seed then adopt the same
versions at the same steps.

The learner picks its policy once (:func:`gate_for`) and calls the same methods either way:
:meth:`~RoundGate.sent` after a send, :meth:`~RoundGate.may_adopt` and
:meth:`~RoundGate.adopted` around an adoption, :meth:`~RoundGate.held` before an inner step.
The policies are pure bookkeeping with an injectable clock; the waiting itself is the
learner's (it has the comms thread and its stop flag).
"""

from __future__ import annotations

import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Protocol

from ddiloco.pipeline.errors import DeterminismBroken

__all__ = ["END", "Awaited", "Gate", "NoWait", "Release", "RoundGate", "StepGate",
           "adoption_step", "gate_for"]

#: The step count that stands for the end of training: every round awaited holds it, and every
#: awaited version may be adopted there (a learner's last rounds and its drain's).
END = sys.maxsize


def adoption_step(send_step: int, tau: int) -> int:
    """The inner step after which the version merging a round sent after step ``send_step``
    is adopted under ``run.deterministic``: ``send_step + tau`` (the overlap, DESIGN §1; the
    paper's earliest adoption, here the only one)."""
    return send_step + tau


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

    def may_adopt(self, fragment: int, version: int, step: int) -> bool:
        """Whether ``version`` of ``fragment`` may be adopted after inner step ``step``
        (:data:`END`: after the last); False keeps it for later."""

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

    def may_adopt(self, fragment: int, version: int, step: int) -> bool:
        """Always: a version is adopted as soon as it is decoded."""
        return True

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

    def may_adopt(self, fragment: int, version: int, step: int) -> bool:
        """Always: a version is adopted as soon as it is decoded (its round is released
        then, whatever the step)."""
        return True

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


class StepGate(RoundGate):
    """``run.deterministic``: :class:`RoundGate`, with adoption decided by step count alone.

    A version of fragment f newer than the base of the round awaited for f is adopted after
    inner step :func:`adoption_step` of that round's send, not before; a version of a
    fragment with no round awaited is not adopted (in a deterministic run every version
    merges a round every learner sent). A wait past ``timeout_s`` is not trained through but
    raises: the run could no longer be the one its seed gives.

    Args:
        learner: this learner's id.
        tau: inner steps from a send to the adoption of its round's version; < H.
        timeout_s: longest wait from a send, seconds (``sync.blocking_timeout_s``).
        clock: monotonic seconds (injectable for tests).

    Raises:
        ValueError: ``tau`` < 0 or ``timeout_s`` <= 0 (the config refuses both first).
    """

    def may_adopt(self, fragment: int, version: int, step: int) -> bool:
        """True when ``version`` releases the round awaited for ``fragment`` and ``step`` has
        reached that round's adoption step."""
        a = self.awaited.get(fragment)
        return (a is not None and version > a.base
                and step >= adoption_step(a.step, self.tau))

    def expire(self, next_step: int) -> list[Release]:
        """Nothing expires quietly here.

        Raises:
            DeterminismBroken: a round holding ``next_step`` is past its deadline, named
                with its fragment, base and send step.
        """
        now = self.clock()
        for p in self.held(next_step):
            a = self.awaited[p]
            if now >= a.deadline:
                raise DeterminismBroken(
                    f"run.deterministic: {self.learner} has no version of fragment {p} newer "
                    f"than {a.base} {now - a.sent_at:.1f} s after its send at step {a.step} "
                    "(sync.blocking_timeout_s); without it the run is no longer the one its "
                    "seed gives, so it stops (a learner failed or stalled: see the logs)")
        return []


def gate_for(blocking: bool, learner: str, tau: int, timeout_s: float,
             clock: Callable[[], float] = time.monotonic, deterministic: bool = False) -> Gate:
    """The policy of a run: :class:`StepGate` with ``run.deterministic``, :class:`RoundGate`
    with ``sync.blocking``, else :class:`NoWait`."""
    if deterministic:
        return StepGate(learner, tau, timeout_s, clock)
    if blocking:
        return RoundGate(learner, tau, timeout_s, clock)
    return NoWait()
