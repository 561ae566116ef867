"""Control plane on slow links, pure parts: the heartbeat TTL rule, the upload pacer and the
chaos runner's tell of a healthy learner that looks dead."""

from __future__ import annotations

import time

import pytest

from ddiloco.chaos.fault_loop import Health, Pending
from ddiloco.chaos.script import FaultAction, FaultKind
from ddiloco.pipeline.transport import Pacer
from ddiloco.workers.run.liveness import heartbeat_ttl_s


class Clock:
    def __init__(self) -> None:
        self.t = 10.0

    def __call__(self) -> float:
        return self.t


def test_heartbeat_ttl_covers_twice_the_worst_tick_plus_margin() -> None:
    # idle link: ticks of a few ms keep the configured TTL
    assert heartbeat_ttl_s(3.0, 0.5, [0.002, 0.004]) == 3.0
    assert heartbeat_ttl_s(3.0, 0.5, []) == 3.0
    # a tick of 1.2 s (a deep queue each way): writes may arrive 1.2 + 0.5 + 1.2 = 2.9 s apart,
    # which a 3 s TTL barely covers; the rule gives 0.5 + 3 * 1.2 = 4.1 s
    assert heartbeat_ttl_s(3.0, 0.5, [0.1, 1.2, 0.3]) == pytest.approx(4.1)
    assert heartbeat_ttl_s(3.0, 0.5, [0.1, 1.2, 0.3]) > 1.2 + 0.5 + 1.2


def test_pacer_spaces_messages_by_their_bytes_at_the_rate() -> None:
    clock = Clock()
    pacer = Pacer(8e6, clock)  # 1 MB/s
    assert pacer.ready() and pacer.wait_s() == 0.0
    pacer.sent(250_000)  # 0.25 s of link time
    assert not pacer.ready() and pacer.wait_s() == pytest.approx(0.25)
    clock.t += 0.2
    assert not pacer.ready()
    clock.t += 0.05
    assert pacer.ready()
    pacer.sent(100_000)
    clock.t += 5.0  # idle time gives no burst credit: the next gap is still n bytes' worth
    pacer.sent(500_000)
    assert pacer.wait_s() == pytest.approx(0.5)
    with pytest.raises(ValueError, match="rate_bps"):
        Pacer(0)


def _fault(kind: FaultKind, target: str) -> FaultAction:
    return FaultAction(id=f"f-{kind.value}-{target}", at_s=1.0, kind=kind, target=target,
                       duration_s=2.0, peer="syncers")


def test_health_reports_a_healthy_learner_that_looks_dead_once() -> None:
    learners = ["learner-0", "learner-1"]
    health, pending = Health(), Pending()
    health.check({"learner-0"}, learners, set(), pending)  # learner-1 not up yet: no report
    assert pending.events == []
    health.check({"learner-0", "learner-1"}, learners, set(), pending)
    health.check({"learner-0"}, learners, set(), pending)
    health.check({"learner-0"}, learners, set(), pending)  # still gone: reported once
    assert [(k, f["learner"]) for k, f, _ in pending.events] == [("looked_dead", "learner-1")]


def test_health_excuses_faulted_learners_until_they_are_back() -> None:
    learners = ["learner-0", "learner-1"]
    health, pending = Health(), Pending()
    health.check(set(learners), learners, set(), pending)
    pause = _fault(FaultKind.PAUSE, "learner-1")
    health.on_fault("inject", pause, learners)
    health.check({"learner-0"}, learners, set(), pending)
    health.on_fault("heal", pause, learners)
    health.check({"learner-0"}, learners, set(), pending)  # resumed, entry not back yet
    assert pending.events == []
    # a congested link is no excuse: the control plane must keep a healthy learner alive
    congest = _fault(FaultKind.CONGEST, "learner-0")
    health.on_fault("inject", congest, learners)
    health.check({"learner-1"}, learners, set(), pending)
    assert [f["learner"] for _, f, _ in pending.events] == ["learner-0"]
    # a Redis fault excuses every learner
    health2, pending2 = Health(), Pending()
    health2.check(set(learners), learners, set(), pending2)
    health2.on_fault("inject", _fault(FaultKind.KILL, "redis"), learners)
    health2.check(set(), learners, set(), pending2)
    assert pending2.events == []


def test_sockets_use_kernel_keepalives_not_zmtp_heartbeats() -> None:
    """A connection cut while the receiver's input is stopped by its high-water mark aborts
    libzmq (zeromq/libzmq#3937, #4364); a ZMTP heartbeat timeout is such a cut whenever a
    receiver is busy for longer than it. Every socket relies on the kernel instead."""
    import zmq

    from ddiloco.pipeline.transport import TCP_MAXRT_MS, configure

    ctx = zmq.Context()
    try:
        for kind in (zmq.PULL, zmq.SUB, zmq.PUSH, zmq.PUB):
            sock = configure(ctx.socket(kind), 1 << 20)
            assert sock.getsockopt(zmq.HEARTBEAT_IVL) == 0
            assert sock.getsockopt(zmq.HEARTBEAT_TIMEOUT) == -1  # unset: no timeout at all
            assert sock.getsockopt(zmq.TCP_KEEPALIVE) == 1
            assert sock.getsockopt(zmq.TCP_MAXRT) == TCP_MAXRT_MS
            assert sock.getsockopt(zmq.MAXMSGSIZE) == 1 << 20
            sock.close()
    finally:
        ctx.term()


def test_a_busy_subscriber_with_a_full_queue_survives() -> None:
    """A subscriber that stops reading with its queue full, for longer than a heartbeat
    timeout, keeps its connection and reads on (libzmq aborts if the connection is cut then:
    with the PUB's former 5 s ZMTP heartbeat timeout, this cut it)."""
    import zmq

    from ddiloco.pipeline.transport import configure

    ctx = zmq.Context()
    try:
        pub = configure(ctx.socket(zmq.PUB), 1 << 20)
        pub.setsockopt(zmq.SNDHWM, 2)
        port = pub.bind_to_random_port("tcp://127.0.0.1")
        sub = configure(ctx.socket(zmq.SUB), 1 << 20)
        sub.setsockopt(zmq.RCVHWM, 1)
        sub.setsockopt(zmq.RCVBUF, 4096)
        sub.setsockopt(zmq.SUBSCRIBE, b"")
        monitor = sub.get_monitor_socket(zmq.EVENT_DISCONNECTED)
        sub.connect(f"tcp://127.0.0.1:{port}")
        payload = b"x" * (256 << 10)
        got = 0
        deadline = time.monotonic() + 10
        while got == 0 and time.monotonic() < deadline:  # the subscription reached the PUB
            pub.send(payload)
            got += sub.poll(50) and len(sub.recv()) > 0
        for _ in range(200):  # far more than both queues hold: the subscriber's input stops
            pub.send(payload)
        time.sleep(6.0)  # longer than a 5 s heartbeat timeout would have allowed
        while sub.poll(500):  # what the queues held
            sub.recv()
        deadline = time.monotonic() + 10
        last = b""
        while last != b"last" and time.monotonic() < deadline:  # still connected: new ones come
            pub.send(b"last")
            last = sub.recv() if sub.poll(100) else b""
        assert last == b"last"
        # and the connection was never cut (a 5 s ZMTP heartbeat timeout on the PUB cuts it)
        assert not monitor.poll(200), "the subscriber's connection was cut"
        sub.disable_monitor()
        monitor.close()
        pub.close()
        sub.close()
    finally:
        ctx.term()


class _Cluster:
    run_id = "t"

    def __init__(self) -> None:
        self.workers: dict[str, object] = {}

    def names(self, role: str) -> list[str]:
        return {"shard": ["shard-0", "shard-1"], "learner": ["learner-0", "learner-1"]}[role]


def test_region_faults_act_on_region_pairs_and_refuse_what_cannot_be_cut() -> None:
    from ddiloco.chaos.faults import ChaosError, Injector

    where = {"learner-0": "us", "learner-1": "hub", "shard-0": "hub", "shard-1": "eu",
             "redis": "hub"}
    part = FaultAction(id="p", at_s=1.0, kind=FaultKind.PARTITION, target="learner-0",
                       duration_s=2.0, peer="syncers")
    inj = Injector(_Cluster(), None, None, [part], None, wan=object(),  # type: ignore[arg-type]
                   region_of=where)
    assert inj.firewall is None  # regions replace the loopback firewall
    assert inj.region_pairs(part) == [("us", "eu"), ("us", "hub")]
    to_redis = FaultAction(id="r", at_s=1.0, kind=FaultKind.CONGEST, target="learner-0",
                           duration_s=2.0, peer="redis")
    assert inj.region_pairs(to_redis) == [("us", "hub")]
    same = FaultAction(id="s", at_s=1.0, kind=FaultKind.PARTITION, target="learner-1",
                       duration_s=2.0, peer="syncers")
    with pytest.raises(ChaosError, match="shares region 'hub' with shard-0"):
        Injector(_Cluster(), None, None, [same], None, wan=object(),  # type: ignore[arg-type]
                 region_of=where)
    with pytest.raises(ChaosError, match="congest faults need emulated regions"):
        Injector(_Cluster(), None, None, [to_redis], None)  # type: ignore[arg-type]


def test_health_excuses_the_whole_region_a_partition_cuts() -> None:
    learners = ["learner-0", "learner-1", "learner-2"]
    where = {"learner-0": "far", "learner-1": "far", "learner-2": "hub"}
    health, pending = Health(where), Pending()
    health.check(set(learners), learners, set(), pending)
    health.on_fault("inject", _fault(FaultKind.PARTITION, "learner-0"), learners)
    health.check({"learner-2"}, learners, set(), pending)  # learner-1 shares the cut region
    assert pending.events == []


def test_store_outage_backs_off_and_reports_an_object_store_outage_once() -> None:
    from ddiloco.workers.run.liveness import StoreOutage

    o = StoreOutage(first_s=0.5, max_s=3.0)
    assert o.succeeded(1.0) is None  # no outage: nothing to report
    assert o.failed(10.0, blobs=False) == (0.5, False)  # Redis: back-off, no event
    assert o.failed(10.5, blobs=True) == (1.0, True)  # the object store: reported once
    assert o.failed(11.5, blobs=True) == (2.0, False)
    assert o.failed(13.5, blobs=True) == (3.0, False)  # capped at max_s
    assert o.succeeded(16.5) == {"outage_s": 6.5, "tries": 4}
    assert o.failed(20.0, blobs=False) == (0.5, False)  # a new outage starts over
    assert o.succeeded(20.5) is None  # Redis only: no blobs_restored
