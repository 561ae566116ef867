"""The shared poll-until-deadline helper, on a fake clock (no real sleeps)."""

from __future__ import annotations

import pytest

from ddiloco.pipeline.waiting import WaitTimeout, poll_until, wait_until


class FakeClock:
    def __init__(self) -> None:
        self.now = 100.0
        self.sleeps: list[float] = []

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.sleeps.append(seconds)
        self.now += seconds


def test_returns_the_first_truthy_value() -> None:
    clock = FakeClock()
    values = iter([0, None, "", 7, 8])
    assert poll_until(lambda: next(values), timeout_s=10, interval_s=0.5, clock=clock,
                      sleep=clock.sleep) == 7
    assert clock.sleeps == [0.5, 0.5, 0.5]


def test_poll_returns_the_last_falsy_value_at_the_deadline() -> None:
    clock = FakeClock()
    calls: list[float] = []

    def never() -> int:
        calls.append(clock.now)
        return 0

    assert poll_until(never, timeout_s=1.0, interval_s=0.4, clock=clock, sleep=clock.sleep) == 0
    # Calls at 0, 0.4, 0.8 and once more at the deadline (1.0), never past it.
    assert [round(t - 100.0, 6) for t in calls] == [0.0, 0.4, 0.8, 1.0]


def test_wait_until_names_what_it_waited_for() -> None:
    clock = FakeClock()
    with pytest.raises(WaitTimeout, match=r"timed out after 2 s waiting for the shard"):
        wait_until(lambda: False, timeout_s=2, what="the shard", clock=clock, sleep=clock.sleep)
    assert isinstance(WaitTimeout("x"), TimeoutError)


def test_exceptions_propagate_unless_retried() -> None:
    clock = FakeClock()

    def boom() -> bool:
        raise KeyError("gone")

    with pytest.raises(KeyError):
        poll_until(boom, timeout_s=5, clock=clock, sleep=clock.sleep)
    assert clock.sleeps == []

    attempts = iter([ConnectionError("refused"), ConnectionError("refused"), "up"])

    def starting() -> str:
        item = next(attempts)
        if isinstance(item, Exception):
            raise item
        return item

    assert wait_until(starting, timeout_s=5, what="server", retry_on=(ConnectionError,),
                      clock=clock, sleep=clock.sleep) == "up"


def test_a_retried_exception_at_the_deadline_is_reported() -> None:
    clock = FakeClock()

    def refused() -> bool:
        raise ConnectionError("refused")

    with pytest.raises(WaitTimeout, match="ConnectionError: refused"):
        wait_until(refused, timeout_s=1, what="server", retry_on=(ConnectionError,),
                   clock=clock, sleep=clock.sleep)


def test_no_timeout_waits_as_long_as_it_takes() -> None:
    clock = FakeClock()
    values = iter([False] * 50 + [True])
    assert wait_until(lambda: next(values), timeout_s=None, what="x", interval_s=60,
                      clock=clock, sleep=clock.sleep) is True
    assert len(clock.sleeps) == 50
