"""The end of a compose run (ddiloco/finish.py), stop requests in the store, and the compose
chaos target's pure parts; hand-computed cases."""

from __future__ import annotations

from pathlib import Path

import fakeredis
import pytest

from ddiloco.chaos.compose import cpu_quota_us, partition_rules
from ddiloco.chaos.faults import ChaosError
from ddiloco.finish import FinishTimeout, _stored, pending_learners, shutdown_server
from ddiloco.pipeline.errors import StoreUnavailable
from ddiloco.report import learner_rates
from ddiloco.store.redis_store import RedisStore


def ev(kind: str, t: float, **fields: object) -> dict[str, object]:
    return {"kind": kind, "t": t, **fields}


def test_a_learner_is_finished_when_it_left_after_its_last_step() -> None:
    expected = ["learner-0", "learner-1", "learner-2"]
    events = [
        ev("join", 1.0, learner="learner-0"), ev("join", 1.0, learner="learner-1"),
        ev("leave", 50.0, learner="learner-0", step=100),
        # learner-1 stopped early (a fault), rejoined, then finished
        ev("leave", 20.0, learner="learner-1", step=40),
        ev("join", 25.0, learner="learner-1"),
        ev("leave", 60.0, learner="learner-1", step=100),
        # an unexpected learner that joined is waited for too
        ev("join", 30.0, learner="learner-9"),
        ev("merge", 31.0, shard="shard-0"),
    ]
    assert pending_learners(events, expected, 100, live=[]) == ["learner-2", "learner-9"]
    # learner-1 left early and has not come back: pending
    assert pending_learners(events[:5], expected, 100, live=[]) == ["learner-1", "learner-2"]
    # a finished learner whose heartbeat entry is still alive is still pending
    done = [*events[:6], ev("join", 1.0, learner="learner-2"),
            ev("leave", 70.0, learner="learner-2", step=120)]
    assert pending_learners(done, expected, 100, live=["learner-0"]) == ["learner-0"]
    assert pending_learners(done, expected, 100, live=[]) == []


def test_learner_rates_over_the_last_incarnation() -> None:
    events = [
        ev("join", 10.0, learner="learner-0"),
        ev("leave", 30.0, learner="learner-0", tokens=4000, step_time_mean_s=0.5),
        ev("join", 40.0, learner="learner-1"),
        ev("leave", 50.0, learner="learner-1", tokens=500),
        ev("join", 60.0, learner="learner-1"),
        ev("leave", 100.0, learner="learner-1", tokens=2000),
        ev("join", 60.0, learner="learner-2"),  # still running: no entry
    ]
    assert learner_rates(events) == {
        "learner-0": {"tokens": 4000, "wall_s": 20.0, "tokens_per_s": 200.0,
                      "step_time_mean_s": 0.5},
        "learner-1": {"tokens": 2000, "wall_s": 40.0, "tokens_per_s": 50.0,
                      "step_time_mean_s": None},
    }


def test_stop_requests_are_newer_than_the_worker_or_ignored() -> None:
    store = RedisStore(fakeredis.FakeRedis(server=fakeredis.FakeServer()), "run-a")
    assert not store.stop_requested("shards", since=0.0)
    store.request_stop("shards", "run finished", t=1000.0)
    assert store.stop_requested("shards", since=999.0)
    # a worker started after the request (a later `up` of the same run) is not stopped
    assert not store.stop_requested("shards", since=1001.0)
    assert not store.stop_requested("evaluator", since=0.0)
    with pytest.raises(ValueError, match="stop role 'learners'"):
        store.request_stop("learners", "no")
    # another run's request stops nothing here
    other = RedisStore(store.client, "run-b")
    assert not other.stop_requested("shards", since=0.0)


def test_partition_rules_cut_both_ways_and_are_tagged() -> None:
    rules = partition_rules("f3", ["172.28.0.10", "172.28.0.11"])
    assert rules[0] == ["OUTPUT", "-d", "172.28.0.10", "-m", "comment", "--comment",
                        "ddiloco-f3", "-j", "DROP"]
    assert rules[1] == ["INPUT", "-s", "172.28.0.10", "-m", "comment", "--comment",
                        "ddiloco-f3", "-j", "DROP"]
    assert len(rules) == 4


def test_cpu_quota_of_a_slow_fault() -> None:
    assert cpu_quota_us(4.0) == 25_000  # a quarter of one core per 100 ms period
    assert cpu_quota_us(1000.0) == 1_000  # the engine's minimum
    with pytest.raises(ChaosError, match="factor must be > 1"):
        cpu_quota_us(1.0)


def test_shutdown_server_stops_a_real_redis_and_keeps_its_data(tmp_path: Path) -> None:
    """compose's `finish --shutdown-store`: a real redis-server exits (SHUTDOWN SAVE, through a
    store client with retries), and its data is back after a restart from the same folder."""
    from ddiloco.store.connect import connect
    from ddiloco.store.embedded import EmbeddedRedis

    server = EmbeddedRedis(tmp_path / "redis").start()
    try:
        client = connect(server.url)
        client.set("kept", b"1")
        proc = server._proc
        assert proc is not None
        shutdown_server(client)
        assert proc.wait(timeout=20) == 0
        server.restart()
        assert connect(server.url).get("kept") == b"1"
    finally:
        server.stop()


def test_finish_waits_out_a_store_outage_and_says_so_once() -> None:
    calls: list[int] = []
    said: list[str] = []

    def flaky() -> int:
        calls.append(1)
        if len(calls) <= 3:
            raise StoreUnavailable("Redis unavailable during events: connection refused")
        return 42

    assert _stored("the run's events", flaky, timeout_s=30.0, say=said.append) == 42
    assert len(calls) == 4
    assert said == [
        "waiting for the run's events: the store is unavailable (Redis unavailable during "
        "events: connection refused); trying again",
        "waiting for the run's events: the store answers again",
    ]


def test_an_outage_longer_than_the_timeout_is_a_finish_timeout() -> None:
    def down() -> int:
        raise StoreUnavailable("Redis unavailable")

    with pytest.raises(FinishTimeout, match="the report: not done after 1 s"):
        _stored("the report", down, timeout_s=1.0, say=lambda _: None)
