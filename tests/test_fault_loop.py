"""The one fault loop of the local and the compose runner, on a fake clock and a fakeredis
store: faults inject and heal at their times, detections and reports happen on their cadence,
and a store that is away costs no event."""

from __future__ import annotations

import itertools
import subprocess
import threading
import time
from pathlib import Path
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
from ddiloco.chaos.faults import ChaosError, Injector
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


# ---------------------------------------------------------------------------------------------
# The object-store server as a fault target (``blobs``)
# ---------------------------------------------------------------------------------------------

BLOBS_KILL = FaultAction(id="f0-kill-blobs", at_s=0.5, kind=FaultKind.KILL, target="blobs",
                         duration_s=1.0)
BLOBS_PAUSE = FaultAction(id="f1-pause-blobs", at_s=2.0, kind=FaultKind.PAUSE, target="blobs",
                          duration_s=0.5)


class _NoCluster:
    """What the Injector reads of a cluster when no fault acts on a worker."""

    run_id = "t"

    def __init__(self) -> None:
        self.workers: dict[str, Any] = {}


class FakeS3:
    """The interface of :class:`ddiloco.store.embedded_s3.EmbeddedS3` the Injector drives,
    around a real process (so SIGSTOP and SIGCONT are real).

    A restart called from another thread than the test's (the Injector's background restart)
    holds at :attr:`release` until the test sets it, as a SeaweedFS restart takes seconds: a
    heal that waited for it would hang there instead of returning.
    """

    def __init__(self) -> None:
        self.calls: list[str] = []
        self.proc: subprocess.Popen[bytes] | None = None
        self.test_thread = threading.get_ident()
        #: set by a restart as it begins, from whichever thread
        self.restarting = threading.Event()
        #: set by the test to let a background restart finish
        self.release = threading.Event()
        self._spawn()

    def _spawn(self) -> None:
        self.proc = subprocess.Popen(["sleep", "60"], start_new_session=True)

    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    def crash(self) -> None:
        self.calls.append("crash")
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait()
        self.proc = None

    def restart(self) -> None:
        self.calls.append("restart")
        self.restarting.set()
        if threading.get_ident() != self.test_thread:
            # Bounded: a test that fails before it releases the restart must not hang.
            self.release.wait(timeout=30)
        self._spawn()

    def state(self) -> str:
        assert self.pid is not None
        return Path(f"/proc/{self.pid}/stat").read_text().rsplit(")", 1)[1].split()[0]

    def settles(self, stopped: bool) -> bool:
        """Whether the process becomes stopped (or running) within 2 s: a signal sent just
        now takes a moment to land."""
        deadline = time.monotonic() + 2.0
        while (self.state() == "T") != stopped and time.monotonic() < deadline:
            time.sleep(0.01)
        return (self.state() == "T") == stopped

    def close(self) -> None:
        self.release.set()  # a restart still held would block the Injector's close
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()


def test_blobs_faults_need_the_embedded_object_store() -> None:
    for a in (BLOBS_KILL, BLOBS_PAUSE):
        with pytest.raises(ChaosError, match=r"store\.blobs = 'embedded-s3' \(--set "
                                             r"store\.blobs=embedded-s3\)") as info:
            Injector(_NoCluster(), None, None, [a], None)  # type: ignore[arg-type]
        assert str(info.value).startswith(a.id)
    Injector(_NoCluster(), None, None, [ACTIONS[0]], None)  # type: ignore[arg-type]


def test_the_injector_kills_restarts_and_pauses_the_object_store() -> None:
    s3 = FakeS3()
    try:
        inj = Injector(_NoCluster(), None, None, [BLOBS_KILL, BLOBS_PAUSE],  # type: ignore
                       None, blobs=s3)
        inj.inject(BLOBS_KILL)
        assert s3.calls == ["crash"] and s3.pid is None
        inj.heal(BLOBS_KILL)
        # The heal returned while the restart it began is held in another thread: the loop
        # does not wait for a server's restart.
        assert s3.restarting.wait(timeout=30) and s3.pid is None
        s3.release.set()
        inj.inject(BLOBS_PAUSE)  # waits for the restart first
        assert s3.calls == ["crash", "restart"] and s3.settles(stopped=True)
        inj.heal(BLOBS_PAUSE)
        assert s3.settles(stopped=False)
        inj.inject(BLOBS_PAUSE)
        assert s3.settles(stopped=True)
        inj.resume_all()  # the end of a window resumes a stopped server...
        assert s3.settles(stopped=False)
        inj.inject(BLOBS_KILL)
        inj.resume_all()  # ...and starts a killed one that the script left down
        assert s3.calls[-2:] == ["crash", "restart"] and s3.pid is not None
        inj.close()
    finally:
        s3.close()


def test_a_blobs_outage_is_detected_by_the_shards_report() -> None:
    clock = FakeClock()
    store = _store()
    window = _window([BLOBS_KILL], 3.0)

    reported: list[float] = []

    def shard(w: FaultWindow) -> None:  # a shard's publish fails a moment after the kill
        if w.watch and not reported:
            time.sleep(0.002)
            store.add_event("blobs_unavailable", {"shard": "shard-0", "error": "refused"})
            reported.append(clock.now)

    play_window(window, store, RecordingInjector(clock), None, 3.0, supervise=shard,
                clock=clock, sleep=clock.sleep)
    detected = [e for _, e in store.events(kinds={"detected"})]
    assert [(e["id"], e["target"]) for e in detected] == [("f0-kill-blobs", "blobs")]
    assert window.watch == {} and window.down == set()  # a server, not a worker


def test_an_outage_reported_before_the_fault_is_no_detection() -> None:
    clock = FakeClock()
    store = _store()
    store.add_event("blobs_unavailable", {"shard": "shard-0", "error": "earlier"})
    window = _window([BLOBS_KILL], 3.0)
    play_window(window, store, RecordingInjector(clock), None, 3.0, clock=clock,
                sleep=clock.sleep)
    assert store.events(kinds={"detected"}) == []
    assert [w[:2] for w in window.watch.values()] == [("blobs", "blobs")]


def test_blobs_faults_fail_no_dp_gang_and_pause_the_running_totals() -> None:
    clock = FakeClock()
    store = _store()
    window = FaultWindow("dp", schedule([BLOBS_KILL], 3.0), LEARNERS, SHARDS, Health(),
                         LiveStats(0.0))
    reads: list[float] = []

    def update(st: Any, pending: Any) -> None:
        reads.append(round(clock.now - 50.0, 6))

    window.stats.update = update  # type: ignore[method-assign]
    injector = RecordingInjector(clock)
    play_window(window, store, injector, None, 3.0, clock=clock, sleep=clock.sleep)
    assert [c[:2] for c in injector.calls] == [("inject", "f0-kill-blobs"),
                                               ("heal", "f0-kill-blobs")]
    assert store.events(kinds={"gang_failure"}) == []
    assert reads and not any(0.5 <= t < 1.5 for t in reads)
    assert any(t >= 1.5 for t in reads)


class _Container:
    def __init__(self, name: str) -> None:
        self.name = name
        self.status = "running"
        self.calls: list[str] = []

    def reload(self) -> None:
        pass

    def kill(self, signal: str) -> None:
        self.calls.append(f"kill {signal}")
        self.status = "exited"

    def start(self) -> None:
        self.calls.append("start")
        self.status = "running"

    def pause(self) -> None:
        self.calls.append("pause")
        self.status = "paused"

    def unpause(self) -> None:
        self.calls.append("unpause")
        self.status = "running"


class _Deployment:
    def __init__(self, services: list[str]) -> None:
        self.services = {s: _Container(s) for s in services}

    def containers(self) -> dict[str, Any]:
        return dict(self.services)

    def container(self, service: str) -> Any:
        if service not in self.services:
            raise ChaosError(f"no service {service!r}")
        return self.services[service]


def test_compose_faults_on_blobs_act_on_the_blobs_service() -> None:
    from ddiloco.chaos.compose import ComposeInjector, service_of

    assert [service_of(t) for t in ("blobs", "redis", "learner-2", "shard-0")] == [
        "blobs", "redis", "learner-2", "shard-0"]
    dep = _Deployment(["redis", "blobs", "shard-0"])
    inj = ComposeInjector(dep, ["shard-0"], [BLOBS_KILL, BLOBS_PAUSE])  # type: ignore[arg-type]
    inj.inject(BLOBS_KILL)
    inj.heal(BLOBS_KILL)
    inj.inject(BLOBS_PAUSE)
    inj.resume_all()
    assert dep.services["blobs"].calls == ["kill SIGKILL", "start", "pause", "unpause"]
    assert dep.services["redis"].calls == []
