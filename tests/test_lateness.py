"""sync.round_wait = "live": predicted arrivals and the round's merge decision, by hand."""

from __future__ import annotations

import math

import pytest

from ddiloco.workers.syncer.lateness import (
    Pace,
    expected_arrival,
    live_round_ready,
    live_wait_s,
    waited_for,
)
from ddiloco.workers.syncer.merge import Round


def _round(arrivals: dict[str, float], k: int = 1) -> Round:
    rnd = Round()
    for name, t in arrivals.items():
        rnd.add(name, t, k)
    return rnd


def test_expected_arrival_counts_the_steps_to_the_next_send() -> None:
    # sent fragment at step 40, H 24 -> next send at step 64; newest delta at step 58, t=100 s
    pace = Pace(at=100.0, step=58, step_time=0.5)
    assert expected_arrival(pace, 40, 24, None) == pytest.approx(100.0 + 6 * 0.5)
    # past its send step: due at once (its newest delta's arrival)
    assert expected_arrival(Pace(100.0, 70, 0.5), 40, 24, None) == 100.0
    # a budget of 60 steps: it drains every fragment at step 60, 2 steps away, not 6
    assert expected_arrival(pace, 40, 24, None, last_step=60) == pytest.approx(101.0)
    # its drain at step 60 was its last delta for the fragment: none is coming
    assert expected_arrival(Pace(100.0, 60, 0.5), 60, 24, None, last_step=60) == math.inf


def test_expected_arrival_falls_back_to_the_shards_step_time_and_else_is_unknown() -> None:
    warming = Pace(at=10.0, step=2, step_time=0.0)
    assert expected_arrival(warming, 0, 24, 0.25) == pytest.approx(10.0 + 22 * 0.25)
    assert expected_arrival(warming, 0, 24, None) is None
    assert expected_arrival(None, 0, 24, 0.25) is None
    assert expected_arrival(Pace(1.0, 2, 0.5), None, 24, 0.25) is None


def test_live_wait_is_a_share_of_H_step_times_or_the_fallback() -> None:
    assert live_wait_s(24, 0.5, 0.5, 2.0) == pytest.approx(6.0)
    assert live_wait_s(12, 0.5, 0.25, 2.0) == pytest.approx(1.5)
    assert live_wait_s(24, None, 0.5, 2.0) == 2.0
    for bad in ((0, 0.5, 0.5, 2.0), (24, 0.5, 0.0, 2.0), (24, 0.5, 1.5, 2.0),
                (24, 0.5, 0.5, -1.0)):
        with pytest.raises(ValueError):
            live_wait_s(*bad)


def test_a_round_waits_for_learners_due_within_the_window_only() -> None:
    rnd = _round({"a": 10.0, "b": 10.5})      # quorum (K = 1) at 10.0
    live = {"a", "b", "c", "d"}
    # c due at 13 (inside 10 + 6), d at 20 (really late), wait 6 s
    expected = {"c": 13.0, "d": 20.0}
    assert waited_for(rnd, live, expected, 6.0) == {"c"}
    assert not live_round_ready(rnd, 12.9, live, expected, 6.0, 1)
    rnd.add("c", 13.1, 1)
    assert live_round_ready(rnd, 13.1, live, expected, 6.0, 1)  # d is not waited for


def test_unknown_and_announced_learners_are_waited_for_until_the_deadline() -> None:
    rnd = _round({"a": 10.0})
    rnd.joining.add("c")
    live = {"a", "b", "c"}
    expected: dict[str, float | None] = {"b": None, "c": 99.0}
    assert waited_for(rnd, live, expected, 6.0) == {"b", "c"}
    assert not live_round_ready(rnd, 15.9, live, expected, 6.0, 1)
    assert live_round_ready(rnd, 16.0, live, expected, 6.0, 1)


def test_dead_learners_hold_no_round_and_the_quorum_and_pacing_still_rule() -> None:
    rnd = _round({"a": 10.0})
    # b left the live set: a is alone and merges at once
    assert live_round_ready(rnd, 10.0, {"a"}, {}, 6.0, 1)
    # K = 2 is not reached by one contribution, whatever the wait
    rnd2 = _round({"a": 10.0}, k=2)
    assert not live_round_ready(rnd2, 99.0, {"a"}, {}, 6.0, 2)
    # paced: not before 12.0 even when every live learner is in
    assert not live_round_ready(rnd, 11.0, {"a"}, {}, 6.0, 1, not_before=12.0)
    assert live_round_ready(rnd, 12.0, {"a"}, {}, 6.0, 1, not_before=12.0)


def test_without_a_live_set_only_the_deadline_applies() -> None:
    rnd = _round({"a": 10.0})
    assert not live_round_ready(rnd, 15.0, set(), {}, 6.0, 1)
    assert live_round_ready(rnd, 16.0, set(), {}, 6.0, 1)
