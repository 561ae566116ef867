"""``sync.blocking``: the round gate (hand-computed cases, injected clock) and its validation.

The gate (:mod:`ddiloco.workers.learner.blocking`) holds an inner step more than tau steps after a
send
of a fragment until a version newer than the delta's base is adopted, or until the deadline.
"""

from __future__ import annotations

import pytest

from ddiloco.pipeline.errors import ConfigError
from ddiloco.workers.learner.blocking import NoWait, RoundGate, gate_for
from ddiloco.workers.run.config import config_from_dict, load_config


class Clock:
    """A hand-driven monotonic clock, seconds."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_tau_zero_holds_the_next_step_until_the_round_is_adopted() -> None:
    clock = Clock()
    gate = RoundGate("learner-0", tau=0, timeout_s=10.0, clock=clock)
    assert gate.held(7) == []
    gate.sent(0, base=3, step=6)
    assert gate.held(6) == []  # the send's own step is done
    assert gate.held(7) == [0]
    gate.adopted(0, 3, {})  # not newer than the base: still held
    assert gate.held(7) == [0]
    clock.t = 101.5
    gate.adopted(0, 4, {"learner-0": 6, "learner-1": 6})
    assert gate.held(7) == []
    (r,) = gate.releases()
    assert (r.awaited.fragment, r.awaited.base, r.awaited.step) == (0, 3, 6)
    assert r.version == 4 and r.included and not r.timed_out
    assert r.waited_s == pytest.approx(1.5)
    assert gate.releases() == []


def test_tau_lets_that_many_steps_run_before_holding() -> None:
    gate = RoundGate("learner-0", tau=2, timeout_s=10.0, clock=Clock())
    gate.sent(3, base=0, step=10)
    assert [gate.held(s) for s in (11, 12, 13, 14)] == [[], [], [3], [3]]


def test_each_fragment_is_held_on_its_own() -> None:
    gate = RoundGate("learner-0", tau=0, timeout_s=10.0, clock=Clock())
    gate.sent(2, base=5, step=4)
    gate.sent(0, base=1, step=6)
    assert gate.held(7) == [0, 2]
    gate.adopted(2, 6, {"learner-0": 4})
    assert gate.held(7) == [0]
    gate.adopted(1, 9, {"learner-0": 6})  # another fragment's version releases nothing
    assert gate.held(7) == [0]


def test_a_round_merged_without_this_learner_releases_it_not_included() -> None:
    gate = RoundGate("learner-0", tau=0, timeout_s=10.0, clock=Clock())
    gate.sent(0, base=3, step=12)
    gate.adopted(0, 4, {"learner-1": 12})
    assert gate.held(13) == []
    (r,) = gate.releases()
    assert r.version == 4 and not r.included
    # merged at an earlier step of this learner (its previous round): not this round either
    gate.sent(0, base=4, step=18)
    gate.adopted(0, 5, {"learner-0": 12})
    assert not gate.releases()[0].included


def test_the_deadline_releases_a_round_that_never_merges() -> None:
    clock = Clock()
    gate = RoundGate("learner-0", tau=0, timeout_s=5.0, clock=clock)
    gate.sent(1, base=2, step=8)
    clock.t = 104.9
    assert gate.expire(9) == []
    assert gate.held(9) == [1]
    clock.t = 105.0
    (r,) = gate.expire(9)
    assert r.timed_out and r.version is None and not r.included
    assert r.waited_s == pytest.approx(5.0)
    assert gate.held(9) == []
    assert gate.releases() == [r]
    gate.adopted(1, 3, {"learner-0": 8})  # the late version then releases nothing twice
    assert gate.releases() == []


def test_expire_leaves_rounds_that_do_not_hold_the_step_yet() -> None:
    clock = Clock()
    gate = RoundGate("learner-0", tau=2, timeout_s=1.0, clock=clock)
    gate.sent(0, base=0, step=10)
    clock.t = 200.0
    assert gate.expire(12) == []  # within the overlap: not waited for, not expired
    assert [r.awaited.step for r in gate.expire(13)] == [10]


def test_a_second_send_before_the_release_keeps_the_older_base() -> None:
    clock = Clock()
    gate = RoundGate("learner-0", tau=8, timeout_s=10.0, clock=clock)
    gate.sent(0, base=3, step=6)
    clock.t = 101.0
    gate.sent(0, base=3, step=12)
    gate.adopted(0, 4, {"learner-0": 6})
    (r,) = gate.releases()
    assert (r.awaited.base, r.awaited.step, r.awaited.sent_at) == (3, 12, 101.0)
    assert not r.included  # version 4 merged the round of step 6, not of step 12


def test_no_wait_never_holds() -> None:
    gate = NoWait()
    gate.sent(0, base=0, step=1)
    assert gate.held(100) == [] and gate.expire(100) == [] and gate.releases() == []
    assert isinstance(gate_for(False, "learner-0", 0, 1.0), NoWait)
    assert isinstance(gate_for(True, "learner-0", 0, 1.0), RoundGate)


def test_gate_arguments_are_checked() -> None:
    with pytest.raises(ValueError, match="tau"):
        RoundGate("learner-0", tau=-1, timeout_s=1.0)
    with pytest.raises(ValueError, match="timeout_s"):
        RoundGate("learner-0", tau=0, timeout_s=0.0)


# -- validation -----------------------------------------------------------------------------


def test_blocking_needs_a_full_quorum() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["sync.blocking=true"])
    assert str(exc.value) == ("sync.blocking needs sync.min_quorum = run.learners (M = 4); "
                              "got 1")
    cfg = load_config(None, ["sync.blocking=true", "sync.min_quorum=4"])
    assert cfg.sync.blocking and cfg.sync.blocking_timeout_s == 60.0
    with pytest.raises(ConfigError, match=r"^sync.blocking needs .*\(M = 2\); got 3$"):
        load_config(None, ["sync.blocking=true", "run.learners=2", "sync.min_quorum=3"])


def test_blocking_is_refused_in_dp_mode_but_a_stored_dp_copy_ignores_it() -> None:
    with pytest.raises(ConfigError, match=r"^sync.blocking is a DiLoCo diagnostic; .*"
                                          r"set sync.blocking=false$"):
        load_config(None, ["sync.blocking=true", "sync.min_quorum=4", "run.mode=dp"])
    # `ddiloco run --baseline dp` stores the DiLoCo config with run.mode = dp: its workers
    # must read it back.
    tree = load_config(None, ["sync.blocking=true", "sync.min_quorum=4"]).model_dump(
        mode="json")
    tree["run"]["mode"] = "dp"
    assert config_from_dict(tree, stored=True).sync.blocking


@pytest.mark.parametrize("value", ["0", "-1", "3601"])
def test_blocking_timeout_is_bounded(value: str) -> None:
    with pytest.raises(ConfigError, match=r"^sync.blocking_timeout_s: .* out of range; "
                                          r"allowed: \(0, 3600\]$"):
        load_config(None, [f"sync.blocking_timeout_s={value}"])


def test_blocking_is_refused_in_chaos_runs_before_anything_starts() -> None:
    from ddiloco.chaos.faults import ChaosError
    from ddiloco.chaos.runner import check_diagnostics

    check_diagnostics(load_config(None, []))
    with pytest.raises(ChaosError) as exc:
        check_diagnostics(load_config(None, ["sync.blocking=true", "sync.min_quorum=4"]))
    assert str(exc.value) == ("sync.blocking is a diagnostic that waits for every learner's "
                              "round, which faults break: set sync.blocking=false for chaos "
                              "runs")


def test_only_non_blocking_learners_join_rounds_early() -> None:
    # An early join moves one learner's schedule of a fragment against the others': blocked
    # learners could then each wait for a round the other has not sent yet.
    assert NoWait().joins_rounds_early
    assert not RoundGate("learner-0", tau=0, timeout_s=1.0).joins_rounds_early
