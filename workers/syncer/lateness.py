"""Rounds that hold every live learner unless one is really late (``sync.round_wait = "live"``).

The paper's round merges once K contributions are in and the grace window has passed, so
which learners a version holds depends on wall-clock timing: a learner a few steps behind
the others misses the round, and its delta forms a smaller one later. Rounds of fewer
learners cost loss and make same-seed runs differ (docs/QUALITY.md, "Rounds that wait for
every live learner"). Here a shard predicts, from the step counts and step times the
learners' own deltas carry, when each live learner's next outer gradient for the fragment
will arrive, and waits for those due within ``late_fraction * H`` of their step time after
the quorum. A learner predicted later than that (a straggler, or one out of phase) is not
waited for at all, so it costs the others no staleness; a learner that is not live (dead,
or left) never holds a round. All functions are pure: the shard passes its clock's reading.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass

from ddiloco.workers.syncer.merge import Round


@dataclass(frozen=True)
class Pace:
    """What a shard last heard from one learner: any of its deltas, to any owned fragment.

    Attributes:
        at: the delta's arrival time on the shard's clock, seconds.
        step: the learner's inner step count when it sent the delta.
        step_time: the learner's EMA inner step time then, seconds (0.0: not measured yet).
        inc: the learner's incarnation (a restart resets its send schedule).
    """

    at: float
    step: int
    step_time: float
    inc: int = 0


def expected_arrival(pace: Pace | None, last_sent: int | None, H: int,
                     step_time: float | None, last_step: int | None = None) -> float | None:
    """When a learner's next outer gradient for a fragment should reach the shard, seconds
    (shard clock); None when it cannot be told.

    A learner sends a fragment H inner steps after its previous send of it
    (:func:`ddiloco.pipeline.fragments.due_fragments`), so its next send is at step
    ``last_sent + H``, or at its last step (``train.steps``), where it drains every fragment;
    at its step time that is ``(next - pace.step) * step_time`` seconds after its newest
    delta arrived. A learner past that step is due now (``pace.at``). Transfer time is left
    out: it is the same for every learner of a region.

    Args:
        pace: the learner's newest delta at this shard (None: none yet).
        last_sent: the step of its last delta for this fragment (None: none yet).
        H: inner steps between two sends of one fragment, >= 1.
        step_time: the shard's step time to use when the learner reported none, seconds
            (None: unknown).
        last_step: the learners' step budget, after which they drain (None: open-ended).

    Returns:
        The predicted arrival time; ``math.inf`` once the learner sent this fragment at its
        last step (it has nothing more to send); None without a pace, a last send or a step
        time.
    """
    if pace is None or last_sent is None:
        return None
    st = pace.step_time if pace.step_time > 0 else step_time
    if st is None or st <= 0:
        return None
    if last_step is not None and last_sent >= last_step:
        return math.inf  # it drained this fragment: nothing more is coming from it
    due = last_sent + H if last_step is None else min(last_sent + H, last_step)
    return pace.at + max(0, due - pace.step) * st


def live_wait_s(H: int, step_time: float | None, late_fraction: float,
                unknown_s: float) -> float:
    """How long after its quorum a round may wait for live learners, seconds:
    ``late_fraction * H * step_time``, or ``unknown_s`` while the step time is unknown (the
    first rounds of a run, before any learner has measured its step).

    Raises:
        ValueError: ``H < 1``, ``late_fraction`` outside (0, 1] or ``unknown_s < 0``.
    """
    if H < 1 or not 0 < late_fraction <= 1 or unknown_s < 0:
        raise ValueError(f"live_wait_s needs H >= 1, late_fraction in (0, 1], unknown_s >= 0; "
                         f"got {H}, {late_fraction}, {unknown_s}")
    if step_time is None or step_time <= 0:
        return unknown_s
    return late_fraction * H * step_time


def waited_for(rnd: Round, live: set[str], expected: Mapping[str, float | None],
               wait_s: float) -> set[str]:
    """The live learners a round still waits for: not in it yet, and either announced
    (``rnd.joining``), of unknown arrival, or expected before ``quorum_at + wait_s``.
    Empty before the quorum is reached (the quorum rule decides then).
    """
    if rnd.quorum_at is None:
        return set()
    deadline = rnd.quorum_at + wait_s
    out = set()
    for learner in live - rnd.contributors.keys():
        eta = expected.get(learner)
        if learner in rnd.joining or eta is None or eta <= deadline:
            out.add(learner)
    return out


def live_round_ready(rnd: Round, now: float, live: set[str],
                     expected: Mapping[str, float | None], wait_s: float, min_quorum: int,
                     not_before: float | None = None) -> bool:
    """Whether a round merges now under ``sync.round_wait = "live"`` (ours; DESIGN §2, syncer
    round step 2).

    It merges once it holds at least K contributions and either no live learner is still
    waited for (:func:`waited_for`: every live learner is in, or the missing ones are
    expected later than ``wait_s`` after the quorum) or ``wait_s`` has passed since the
    quorum. Never before ``not_before`` (paced merges, :func:`merge_interval`). With no live
    set known (the registry is empty), only the deadline applies.

    Args:
        rnd: the fragment's open round (contributors with arrival times, announced joiners).
        now: the shard's clock, seconds.
        live: learner ids in the store's TTL registry.
        expected: predicted arrival per learner (:func:`expected_arrival`).
        wait_s: the longest wait after the quorum (:func:`live_wait_s`), seconds.
        min_quorum: K >= 1.
        not_before: earliest merge time, seconds (None: no pacing).
    """
    if len(rnd.contributors) < min_quorum or rnd.quorum_at is None:
        return False
    if not_before is not None and now < not_before:
        return False
    if now - rnd.quorum_at >= wait_s:
        return True
    if not live:
        return False
    return not waited_for(rnd, live, expected, wait_s)
