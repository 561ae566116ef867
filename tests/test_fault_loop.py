"""The one fault loop of the local and the compose runner, on a fake clock and a fakeredis
store: faults inject and heal at their times, detections and reports happen on their cadence,
and a store that is away costs no event."""

from __future__ import annotations

import itertools
from typing import Any

import fakeredis
import pytest

from ddiloco.chaos.fault_loop import (
    DETECT_EVERY_S,
    TICK_S,
    FaultWindow,
    Health,
    LiveStats,
    play_window,
    schedule,
)
from ddiloco.chaos.script import FaultAction, FaultKind
from ddiloco.pipeline.errors import StoreUnavailable
from ddiloco.store.redis_store import RedisStore

LEARNERS = ["learner-0", "learner-1"]
SHARDS = ["shard-0"]


class FakeClock:
    def __init__(self) -> None:
        self.now = 50.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


class RecordingInjector:
    """Records what the loop asks, with the fake clock's time into the window."""

    def __init__(self, clock: FakeClock) -> None:
        self.clock = clock
        self.calls: list[tuple[str, str, float]] = []

    def inject(self, a: FaultAction) -> None:
        self.calls.append(("inject", a.id, round(self.clock.now - 50.0, 6)))

    def heal(self, a: FaultAction) -> None:
        self.calls.append(("heal", a.id, round(self.clock.now - 50.0, 6)))

    def restart(self, name: str) -> None:
        self.calls.append(("restart", name, round(self.clock.now - 50.0, 6)))


def _window(actions: list[FaultAction], duration_s: float) -> FaultWindow:
    return FaultWindow("diloco", schedule(actions, duration_s), LEARNERS, SHARDS, Health(),
                       LiveStats(0.0))


def _store() -> RedisStore:
    return RedisStore(fakeredis.FakeRedis(server=fakeredis.FakeServer()), "loop-run")


ACTIONS = [
    FaultAction(id="f0-kill-learner-1", at_s=1.0, kind=FaultKind.KILL, target="learner-1",
                duration_s=2.0),
    FaultAction(id="f1-pause-shard-0", at_s=1.5, kind=FaultKind.PAUSE, target="shard-0",
                duration_s=0.5),
    # heals after the window: only its injection is played
    FaultAction(id="f2-slow-learner-0", at_s=3.5, kind=FaultKind.SLOW, target="learner-0",
                duration_s=10.0, factor=2.0),
    # starts after the window: never played
    FaultAction(id="f3-kill-learner-0", at_s=9.0, kind=FaultKind.KILL, target="learner-0",
                duration_s=1.0),
]


def test_faults_play_at_their_times_and_the_window_ends_on_time() -> None:
    clock = FakeClock()
    injector = RecordingInjector(clock)
    store = _store()
    window = _window(ACTIONS, 4.0)
    play_window(window, store, injector, None, 4.0, clock=clock, sleep=clock.sleep)
    # Each fault plays on the first tick at or after its time (ticks of TICK_S seconds).
    assert [(kind, fid) for kind, fid, _ in injector.calls] == [
        ("inject", "f0-kill-learner-1"), ("inject", "f1-pause-shard-0"),
        ("heal", "f1-pause-shard-0"), ("heal", "f0-kill-learner-1"),
        ("inject", "f2-slow-learner-0")]
    expected = [1.0, 1.5, 2.0, 3.0, 3.5]
    for (_, _, t), want in zip(injector.calls, expected, strict=True):
        assert want <= t < want + TICK_S + 1e-9
    assert clock.now - 50.0 == pytest.approx(4.0, abs=TICK_S + 1e-9)
    assert window.plan == [] and window.down == set()  # the killed learner was restarted
    kinds = [(e["phase"], e["id"]) for _, e in store.events(kinds={"fault"})]
    assert kinds == [("inject", "f0-kill-learner-1"), ("inject", "f1-pause-shard-0"),
                     ("heal", "f1-pause-shard-0"), ("restart", "f0-kill-learner-1"),
                     ("inject", "f2-slow-learner-0")]


def test_a_killed_learner_is_detected_once_its_heartbeat_is_gone() -> None:
    clock = FakeClock()
    store = _store()
    window = _window(ACTIONS[:1], 1.6)
    play_window(window, store, RecordingInjector(clock), None, 1.6, clock=clock,
                sleep=clock.sleep)
    # No learner ever registered a heartbeat: the kill's target is not live, so the first
    # detection pass after the injection records it, and it is watched no more.
    detected = [e for _, e in store.events(kinds={"detected"})]
    assert [(e["id"], e["target"]) for e in detected] == [("f0-kill-learner-1", "learner-1")]
    assert window.watch == {}
    assert window.down == {"learner-1"}


def test_supervise_runs_every_tick_and_reports_on_their_cadence() -> None:
    clock = FakeClock()
    ticks: list[float] = []
    reports: list[float] = []
    play_window(_window([], 1.0), _store(), RecordingInjector(clock), None, 1.0,
                supervise=lambda w: ticks.append(clock.now),
                report=lambda now, w: reports.append(round(now, 6)), report_every_s=0.3,
                clock=clock, sleep=clock.sleep)
    assert len(ticks) == pytest.approx(1.0 / TICK_S, abs=1)
    # The first report at once, then one on the first tick at least 0.3 s after the last.
    assert reports[0] == 0.0 and len(reports) >= 3
    for a, b in itertools.pairwise(reports):
        assert 0.3 - 1e-9 <= b - a < 0.3 + TICK_S + 1e-9
    assert DETECT_EVERY_S < 1.0


class AwayStore:
    """A store that is away for the first ``away_calls`` writes (Redis paused by a fault)."""

    def __init__(self, inner: RedisStore, away_calls: int) -> None:
        self.inner = inner
        self.away = away_calls

    def add_event(self, *args: Any, **kwargs: Any) -> Any:
        if self.away > 0:
            self.away -= 1
            raise StoreUnavailable("paused")
        return self.inner.add_event(*args, **kwargs)

    def __getattr__(self, name: str) -> Any:
        if self.away > 0 and name in ("live_learners", "shards", "events"):
            def refuse(*args: Any, **kwargs: Any) -> Any:
                raise StoreUnavailable("paused")
            return refuse
        return getattr(self.inner, name)


def test_events_wait_while_the_store_is_away_and_none_is_lost() -> None:
    clock = FakeClock()
    inner = _store()
    store = AwayStore(inner, away_calls=10)
    reports: list[float] = []

    def report(now: float, w: FaultWindow) -> None:
        store.events()  # the live view reads the store: away, the report is skipped
        reports.append(now)

    play_window(_window(ACTIONS[:2], 2.5), store, RecordingInjector(clock),  # type: ignore
                None, 2.5, report=report, report_every_s=0.5, clock=clock, sleep=clock.sleep)
    assert store.away == 0
    phases = [(e["phase"], e["id"]) for _, e in inner.events(kinds={"fault"})]
    assert phases == [("inject", "f0-kill-learner-1"), ("inject", "f1-pause-shard-0"),
                      ("heal", "f1-pause-shard-0")]
    assert reports  # reports resumed once the store answered
