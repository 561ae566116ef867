"""Hostile and malformed input: every check runs before a shard or learner changes state.

The four frames that used to stop a shard, claims that would set their own token weight,
a merge that overflows, and property tests (hypothesis) over arbitrary and mutated frames
into the shard's handler and the learner's broadcast handler: each is applied correctly or
is a named drop; nothing else escapes.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from typing import Any

import fakeredis
import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ddiloco.pipeline import wire
from ddiloco.pipeline.errors import DropError, ImplausibleClaim, InvalidField, MergeRefused
from ddiloco.pipeline.wire import Header, Kind
from ddiloco.store import RedisStore
from ddiloco.workers.dp import DPShardCore
from ddiloco.workers.roles import make_shard_core
from ddiloco.workers.run.config import load_config
from ddiloco.workers.run.manifest import build_manifest
from ddiloco.workers.syncer.core import ShardCore
from ddiloco.workers.syncer.merge import guard_update
from ddiloco.workers.syncer.validate import (
    ClaimLimits,
    check_broadcast,
    check_claim,
    check_counters,
    check_fate,
)
from ddiloco.workers.task.model import init_params

RUN = "hostile-run"
TINY = {"model.d_model": 16, "model.n_layers": 1, "model.n_heads": 2, "model.d_ff": 32,
        "model.seq_len": 16, "sync.fragments": 2, "run.shards": 1, "sync.grace_cap_s": 1.0,
        # the grace window's rules; sync.round_wait = "live" has tests of its own
        "sync.round_wait": "grace",
        "sync.codec_down": "fp32", "sync.codec_up": "int4", "sync.merge_every": 0.0,
        "train.batch_size": 4, "security.curve": False}  # no sockets here
TPB = 4 * 16  # tokens per batch of TINY


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def make_core(overrides: dict[str, Any] | None = None) -> tuple[ShardCore, RedisStore, Clock]:
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    store = RedisStore(client, RUN)
    cfg = load_config(None, {**TINY, **(overrides or {})})
    manifest = store.put_manifest(build_manifest(cfg, RUN))
    clock = Clock()
    epoch = store.acquire_lease(0, "owner", 5000)
    assert epoch is not None
    core = make_shard_core(manifest, 0, store, epoch, clock=clock)
    core.load(lambda: init_params(cfg.model_config_obj(), cfg.train.seed))
    for lid in ("learner-0", "learner-1"):
        store.register_learner(lid)
    core.set_live({"learner-0", "learner-1"})
    return core, store, clock


@pytest.fixture
def shard() -> Iterator[tuple[ShardCore, RedisStore, Clock]]:
    core, store, clock = make_core()
    yield core, store, clock


def header(**kw: Any) -> Header:
    base: dict[str, Any] = dict(kind=Kind.DELTA, run=RUN, sender="learner-0", inc=1, seq=1,
                                frag=0, base=0, c_steps=24, c_tokens=24 * TPB,
                                new_tokens=24 * TPB, step=24, step_time=0.5, codec="int4")
    base.update(kw)
    return Header(**base)


def small(core: ShardCore, frag: int = 0, scale: float = 1e-2, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(scale=scale, size=s).astype(np.float32)
            for s in core.layout.shapes(frag)]


def version_unchanged(core: ShardCore, store: RedisStore) -> bool:
    return all(st.version == 0 for st in core.frags.values()) and all(
        (b is not None and b.version == 0)
        for b in store.get_latest_many(list(core.frags)))


# ---------------------------------------------------------------------------- pure checks


def test_claims_bounded_by_what_a_learner_can_produce() -> None:
    lim = ClaimLimits(tokens_per_batch=100, max_c_steps=96)
    assert check_claim(header(c_steps=24, c_tokens=2400, new_tokens=2400, step=30), lim) == \
        (24, 2400, False)
    with pytest.raises(ImplausibleClaim, match="tokens per batch"):
        check_claim(header(c_steps=24, c_tokens=2401, new_tokens=0, step=30), lim)
    with pytest.raises(ImplausibleClaim, match="exceeds c_tokens"):
        check_claim(header(c_steps=24, c_tokens=2000, new_tokens=2001, step=30), lim)
    with pytest.raises(ImplausibleClaim, match="learner's step"):
        check_claim(header(c_steps=24, c_tokens=2400, new_tokens=0, step=23), lim)
    with pytest.raises(ImplausibleClaim, match="at least one"):
        check_claim(header(c_steps=0, c_tokens=0, new_tokens=0, step=23), lim)
    # 1000 steps since adoption: clamped to 96, tokens scaled with it -> weight bounded
    assert check_claim(header(c_steps=1000, c_tokens=100_000, new_tokens=10, step=1000), lim) \
        == (96, 9600, True)


def test_counters_and_fate_ranges() -> None:
    check_counters(header())
    for bad in (dict(seq=-1), dict(c_tokens=-5), dict(frag=-2), dict(step_time=float("inf")),
                dict(step_time=-1.0), dict(step_time=1e9), dict(t=float("nan")),
                dict(inc=2**63)):
        with pytest.raises(InvalidField):
            check_counters(header(**bad))
    assert check_fate({}) is None
    assert check_fate({"fate": [4, 3, 1, 0]}) == [4, 3, 1, 0]
    for bad_fate in ([1, 2, 3], ["a", 1, 2, 3], [1, 2, 3, -4], [True, 1, 1, 1], "x", {"a": 1}):
        with pytest.raises(InvalidField, match="token-fate"):
            check_fate({"fate": bad_fate})


def test_update_guard_by_hand() -> None:
    d = [np.full((2, 2), 1.0, np.float32), np.zeros(3, np.float32)]  # norm 2
    assert guard_update(d, None, 20.0) == pytest.approx(2.0)
    assert guard_update(d, 0.1, 20.0) == pytest.approx(2.0)  # bound 2.0: equal passes
    with pytest.raises(MergeRefused, match="exceeds 20 x"):  # per unit lr (lr_mass 1)
        guard_update(d, 0.099, 20.0)
    assert guard_update(d, 0.01, 0.0) == pytest.approx(2.0)  # norm bound off
    with pytest.raises(MergeRefused, match="not finite"):
        guard_update([np.array([np.inf], np.float32)], None, 0.0)
    with pytest.raises(MergeRefused, match="not finite"):  # finite values, overflowing norm
        guard_update([np.full(4, 3e38, np.float32)], None, 0.0)


def test_learner_checks_broadcasts() -> None:
    hb = Header(kind=Kind.HEARTBEAT, run=RUN, sender="shard-0", extra={"versions": {"1": 7}})
    assert check_broadcast(hb, None, 2) == {1: 7}
    for versions in ({"x": 1}, {"5": 1}, {"1": "7"}, {"1": -1}, [1, 2]):
        with pytest.raises(InvalidField):
            check_broadcast(Header(kind=Kind.HEARTBEAT, run=RUN, sender="shard-0",
                                   extra={"versions": versions}), None, 2)
    v = Header(kind=Kind.VERSION, run=RUN, sender="shard-0", frag=1, base=3, ver=4, enc="diff")
    t = [np.zeros(1, np.float32)]
    assert check_broadcast(v, t, 2) is None
    for bad in (dict(frag=2), dict(ver=3), dict(enc="zip"), dict(base=-1),
                dict(extra={"merged": {"a": "b"}})):
        with pytest.raises(DropError):
            check_broadcast(Header(**{**v.__dict__, **bad}), t, 2)
    with pytest.raises(DropError, match="without tensors"):
        check_broadcast(v, None, 2)
    with pytest.raises(InvalidField, match="does not take DELTA"):
        check_broadcast(Header(kind=Kind.DELTA, run=RUN, sender="x", frag=0), t, 2)


# ---------------------------------------------------------------------------- the shard


def test_the_four_frames_that_stopped_a_shard(
        shard: tuple[ShardCore, RedisStore, Clock]) -> None:
    core, store, clock = shard
    t = small(core)
    # 1. unregistered sender with a malformed fate record: nothing is recorded for it
    out = core.handle(wire.encode(header(sender="mallory", extra={"fate": ["x"]}), t))
    assert out == []
    assert ("mallory", 1) not in core.records.received and ("mallory", 1) not in core.last_seq
    assert store.received_total("mallory", 1, core.name) == 0
    # 2. a DELTA without tensors for a fragment the shard does not own
    assert core.handle(wire.encode(header(frag=7, codec=""))) == []
    # 3. a DELTA without tensors for an owned fragment
    assert core.handle(wire.encode(header(seq=2, codec=""))) == []
    assert core.frags[0].contributions == {}
    # 4. a correctly encoded int4 delta near float32 max: the merge is refused, not raised
    huge = [np.full(s, 3.0e38, np.float32) for s in core.layout.shapes(0)]
    core.handle(wire.encode(header(seq=3), huge))  # valid on the wire: filed
    assert "learner-0" in core.frags[0].contributions
    clock.now += 5.0
    assert core.tick() == []
    assert version_unchanged(core, store)
    drops = store.counters("drops")
    assert drops["invalid_field"] == 1 or drops.get("unknown_sender") == 1
    assert drops["not_owned"] + drops.get("schema", 0) >= 1
    assert drops["no_payload"] == 1
    assert drops["merge_refused"] == 1
    # the shard goes on: a valid delta afterwards merges
    core.handle(wire.encode(header(seq=4, base=0), small(core, seed=3)))
    clock.now += 5.0
    assert len(core.tick()) == 1
    assert core.frags[0].version == 1


def test_update_far_outside_the_recent_range_is_refused(
        shard: tuple[ShardCore, RedisStore, Clock]) -> None:
    core, store, clock = shard
    for i in range(3):  # establish the fragment's update norm
        core.handle(wire.encode(header(seq=i + 1, base=i, step=24 * (i + 1)),
                                small(core, seed=i)))
        clock.now += 5.0
        assert len(core.tick()) == 1
    assert core.frags[0].update_norm is not None
    # a keyed learner's finite but enormous delta (x1e4): refused, the version unchanged
    core.handle(wire.encode(header(seq=9, base=3, step=96), small(core, scale=100.0)))
    clock.now += 5.0
    assert core.tick() == []
    assert core.frags[0].version == 3
    assert store.counters("drops") == {"merge_refused": 1}
    drop = store.events(kinds={"drop"})[-1][1]
    assert drop["reason"] == "merge_refused" and drop["learner"] == "learner-0"


@pytest.mark.parametrize("error_feedback", [True, False])
def test_a_refused_int4_step_leaves_the_committed_state_alone(error_feedback: bool) -> None:
    # the int downlinks step in place before the guard's verdict: in a scratch copy, so the
    # committed value, momentum and residual are those of the last published version
    core, store, clock = make_core({"sync.codec_down": "int4", "sync.outer_momentum": 0.9,
                                    "sync.error_feedback": error_feedback})
    for i in range(3):
        core.handle(wire.encode(header(seq=i + 1, base=i, step=24 * (i + 1)),
                                small(core, seed=i)))
        clock.now += 5.0
        assert len(core.tick()) == 1
    st = core.frags[0]
    before = (st.flat_value.copy(), st.flat_momentum.copy())
    core.handle(wire.encode(header(seq=9, base=3, step=96), small(core, scale=100.0)))
    clock.now += 5.0
    assert core.tick() == []
    assert store.counters("drops") == {"merge_refused": 1}
    assert not core.frags[0].stale and core.frags[0].version == 3
    np.testing.assert_array_equal(core.frags[0].flat_value, before[0])
    np.testing.assert_array_equal(core.frags[0].flat_momentum, before[1])
    # the next merge is that of a shard that never saw the refused round, residual included
    twin, twin_store, twin_clock = make_core({"sync.codec_down": "int4",
                                              "sync.outer_momentum": 0.9,
                                              "sync.error_feedback": error_feedback})
    for i in range(3):
        twin.handle(wire.encode(header(seq=i + 1, base=i, step=24 * (i + 1)),
                                small(twin, seed=i)))
        twin_clock.now += 5.0
        twin.tick()
    for c, cl in ((core, clock), (twin, twin_clock)):
        c.handle(wire.encode(header(seq=10, base=3, step=120), small(c, seed=7)))
        cl.now += 5.0
        assert len(c.tick()) == 1
    assert core.frags[0].version == twin.frags[0].version == 4 and not core.frags[0].stale
    np.testing.assert_array_equal(core.frags[0].flat_value, twin.frags[0].flat_value)
    assert store.get_latest(0).value == twin_store.get_latest(0).value


def test_codec_other_than_the_manifests_is_dropped(
        shard: tuple[ShardCore, RedisStore, Clock]) -> None:
    core, store, _ = shard
    assert core.handle(wire.encode(header(codec="fp32"), small(core))) == []
    assert store.counters("drops") == {"schema": 1}
    assert core.frags[0].contributions == {}


def test_claim_cannot_set_its_own_weight(
        shard: tuple[ShardCore, RedisStore, Clock]) -> None:
    core, store, _clock = shard
    # the spoof of the issue: c_tokens 1e9 from a registered id
    assert core.handle(wire.encode(header(c_tokens=10**9), small(core))) == []
    assert store.counters("drops") == {"implausible_claim": 1}
    # a consistent but enormous claim (steps since adoption) is clamped to 4 H
    H = core.cfg.sync.H
    core.handle(wire.encode(header(seq=2, c_steps=10_000, c_tokens=10_000 * TPB,
                                   new_tokens=TPB, step=10_000), small(core)))
    c = core.frags[0].contributions["learner-0"]
    assert (c.c_steps, c.c_tokens) == (4 * H, 4 * H * TPB)
    assert store.counters("claims") == {"clamped": 1}


def test_step_time_cannot_pin_the_grace_window(
        shard: tuple[ShardCore, RedisStore, Clock]) -> None:
    core, store, _ = shard
    core.handle(wire.encode(header(step_time=float("inf")), small(core)))
    core.handle(wire.encode(header(seq=2, step_time=1e7), small(core)))
    assert core.timing.step_time is None
    assert store.counters("drops") == {"invalid_field": 2}


def test_per_sender_state_keeps_two_incarnations(
        shard: tuple[ShardCore, RedisStore, Clock]) -> None:
    core, _, _ = shard
    for inc in range(1, 8):
        core.handle(wire.encode(header(inc=inc, seq=1), small(core)))
    assert sorted(k for k in core.last_seq if k[0] == "learner-0") == \
        [("learner-0", 6), ("learner-0", 7)]
    assert sorted(k for k in core.records.received if k[0] == "learner-0") == \
        [("learner-0", 6), ("learner-0", 7)]


def test_spoofed_sender_on_an_authenticated_connection(
        shard: tuple[ShardCore, RedisStore, Clock]) -> None:
    core, store, _ = shard
    frames = wire.encode(header(sender="learner-1"), small(core))
    assert core.handle(frames, peer="learner-0") == []
    assert store.counters("drops") == {"spoofed_sender": 1}
    assert core.frags[0].contributions == {}
    core.handle(frames, peer="learner-1")
    assert set(core.frags[0].contributions) == {"learner-1"}


def test_dp_shard_bounds_open_steps() -> None:
    core, store, _ = make_core({"run.mode": "dp"})
    g = [np.zeros(s, np.float32) for s in core.layout.shapes(0)]
    for step in range(6):
        core.handle(wire.encode(Header(kind=Kind.GRAD, run=RUN, sender="learner-0", inc=1,
                                       seq=step + 1, frag=0, ver=step, codec="bf16"), g))
    assert isinstance(core, DPShardCore)
    assert len(core.frags[0].grads) == 4  # type: ignore[attr-defined]
    assert store.counters("drops") == {"invalid_field": 2}
    nothing = Header(kind=Kind.GRAD, run=RUN, sender="learner-0", inc=1, seq=99, frag=0, ver=1)
    assert core.handle(wire.encode(nothing)) == []
    assert store.counters("drops")["no_payload"] == 1


# ---------------------------------------------------------------------------- properties


def _valid_frames(core: ShardCore) -> list[bytes]:
    return wire.encode(header(), small(core))


_FUZZ = settings(max_examples=150, deadline=None,
                 suppress_health_check=[HealthCheck.function_scoped_fixture,
                                        HealthCheck.too_slow])


@pytest.fixture(scope="module")
def fuzz_core() -> tuple[ShardCore, RedisStore, Clock]:
    return make_core()


@_FUZZ
@given(frames=st.lists(st.binary(max_size=2048), min_size=0, max_size=3))
def test_any_bytes_are_applied_or_a_named_drop(
        fuzz_core: tuple[ShardCore, RedisStore, Clock], frames: list[bytes],
        caplog: pytest.LogCaptureFixture) -> None:
    core, _, clock = fuzz_core
    with caplog.at_level(logging.ERROR):
        core.handle(frames)
        clock.now += 1.0
        core.tick()
    assert "internal" not in core.drops, caplog.text


@_FUZZ
@given(data=st.data())
def test_mutated_valid_frames_are_applied_or_a_named_drop(
        fuzz_core: tuple[ShardCore, RedisStore, Clock], data: st.DataObject,
        caplog: pytest.LogCaptureFixture) -> None:
    core, _, clock = fuzz_core
    frames = [bytearray(f) for f in _valid_frames(core)]
    which = data.draw(st.integers(0, len(frames) - 1))
    for _ in range(data.draw(st.integers(1, 6))):
        if not frames[which]:
            break
        i = data.draw(st.integers(0, len(frames[which]) - 1))
        op = data.draw(st.sampled_from(["flip", "cut", "byte"]))
        if op == "flip":
            frames[which][i] ^= 1 << data.draw(st.integers(0, 7))
        elif op == "cut":
            del frames[which][i:]
        else:
            frames[which][i] = data.draw(st.integers(0, 255))
    with caplog.at_level(logging.ERROR):
        core.handle([bytes(f) for f in frames])
        clock.now += 1.0
        core.tick()
    assert "internal" not in core.drops, caplog.text
    for st_ in core.frags.values():
        assert all(np.isfinite(v).all() for v in st_.value)


@_FUZZ
@given(fields=st.fixed_dictionaries({}, optional={
    "inc": st.integers(-2**64, 2**64), "seq": st.integers(-5, 2**64),
    "frag": st.integers(-3, 5), "base": st.integers(-3, 5),
    "c_steps": st.integers(-3, 10**6), "c_tokens": st.integers(-3, 10**12),
    "new_tokens": st.integers(-3, 10**12), "step": st.integers(-3, 10**6),
    "step_time": st.floats(allow_nan=True, allow_infinity=True),
    "t": st.floats(allow_nan=True, allow_infinity=True),
    "sender": st.sampled_from(["learner-0", "learner-1", "mallory", ""]),
    "extra": st.dictionaries(st.sampled_from(["fate", "action", "x"]),
                             st.one_of(st.integers(), st.text(max_size=5),
                                       st.lists(st.integers(-2, 10), max_size=5)),
                             max_size=3),
}), scale=st.sampled_from([1e-3, 1.0, 1e30, 1e37]))
def test_any_header_values_are_applied_or_a_named_drop(
        fuzz_core: tuple[ShardCore, RedisStore, Clock], fields: dict[str, Any], scale: float,
        caplog: pytest.LogCaptureFixture) -> None:
    core, _store, clock = fuzz_core
    h = header(**fields)
    try:
        frames = wire.encode(h, small(core, frag=max(0, min(1, h.frag)), scale=scale))
    except (ValueError, OverflowError):
        return  # not encodable by our own encoder (e.g. an int beyond 64 bits)
    with caplog.at_level(logging.ERROR):
        core.handle(frames)
        clock.now += 1.0
        core.tick()
    assert "internal" not in core.drops, caplog.text
    for st_ in core.frags.values():
        assert all(np.isfinite(v).all() for v in st_.value)


# ---------------------------------------------------------------------------- the learner


@pytest.fixture(scope="module")
def comms() -> Iterator[Any]:
    from ddiloco.workers.learner.comms import Comms

    core, store, _ = make_core()
    c = Comms(store, core.manifest, "learner-0", 1, logging.getLogger("test"))
    for p in range(core.layout.n_fragments):
        c.seed(p, 0, [np.zeros(s, np.float32) for s in core.layout.shapes(p)])
    yield c
    c.push.close() if hasattr(c.push, "close") else None
    c.ctx.destroy(linger=0)


def _version_frames(comms: Any, fill: float | None = None) -> list[bytes]:
    shapes = comms.layout.shapes(1)
    rng = np.random.default_rng(0)
    tensors = [np.full(s, fill, np.float32) if fill is not None
               else (rng.normal(size=s) * 1e-2).astype(np.float32) for s in shapes]
    return wire.encode(
        Header(kind=Kind.VERSION, run=RUN, sender="shard-0", inc=1, seq=1, frag=1, base=0,
               ver=1, codec="fp32", enc="diff", extra={"merged": {"learner-0": 3}}), tensors)


def test_learner_applies_a_valid_version_and_drops_an_overflowing_one(comms: Any) -> None:
    zeros = [np.zeros(s, np.float32) for s in comms.layout.shapes(1)]
    comms.view[1] = (0, [z + 3e38 for z in zeros])
    comms._on_message(_version_frames(comms, fill=3e38))  # finite diff, infinite result
    assert comms.view[1][0] == 0 and comms.drops.get("nonfinite") == 1 and 1 in comms.resync
    comms.resync.clear()
    comms.view[1] = (0, zeros)
    comms._on_message(_version_frames(comms))
    assert comms.view[1][0] == 1 and comms.inbox[1][0] == 1
    comms.view[1] = (0, zeros)


@_FUZZ
@given(data=st.data())
def test_learner_broadcast_handler_never_raises(comms: Any, data: st.DataObject,
                                                caplog: pytest.LogCaptureFixture) -> None:
    base = data.draw(st.sampled_from(["version", "heartbeat", "control", "bytes"]))
    if base == "bytes":
        frames = [bytearray(b) for b in data.draw(st.lists(st.binary(max_size=512),
                                                           max_size=3))]
    else:
        if base == "version":
            raw = _version_frames(comms)
        elif base == "heartbeat":
            raw = wire.encode(Header(kind=Kind.HEARTBEAT, run=RUN, sender="shard-0",
                                     extra={"versions": {"0": 0, "1": 0}}))
        else:
            raw = wire.encode(Header(kind=Kind.CONTROL, run=RUN, sender="shard-0", frag=0,
                                     extra={"to": "learner-0", "action": "resync"}))
        frames = [bytearray(f) for f in raw]
        which = data.draw(st.integers(0, len(frames) - 1))
        for _ in range(data.draw(st.integers(0, 6))):
            if not frames[which]:
                break
            i = data.draw(st.integers(0, len(frames[which]) - 1))
            frames[which][i] = data.draw(st.integers(0, 255))
    with caplog.at_level(logging.ERROR):
        comms._on_message([bytes(f) for f in frames])
    assert "internal" not in comms.drops, caplog.text
    for _ver, value in comms.view.values():
        assert all(np.isfinite(v).all() for v in value)


def test_guard_measures_updates_per_unit_of_learning_rate(
        shard: tuple[ShardCore, RedisStore, Clock]) -> None:
    from ddiloco.workers.syncer.core import Contribution

    core, _, _ = shard
    t = core.cfg.train
    assert (t.lr, t.warmup) == (8.5e-3, 150)
    # warm-up: lr(s) = 8.5e-3 * s / 150, so steps 0..23 hold 8.5e-3 / 150 * (0 + ... + 23)
    c = Contribution("learner-0", 0, [], c_steps=24, c_tokens=0, new_tokens=0, nbytes=0,
                     step=24)
    assert core._lr_mass(c) == pytest.approx(8.5e-3 / 150 * 276, rel=1e-5)
    # an early update 50x smaller in norm but also 50x smaller in lr mass is the same size
    d = [np.ones(4, np.float32)]  # norm 2
    ref = guard_update(d, None, 20.0, lr_mass=1.0)
    assert guard_update([x / 50 for x in d], ref, 20.0, lr_mass=1 / 50) == pytest.approx(ref)
    with pytest.raises(MergeRefused, match="per unit lr"):
        guard_update([x * 21 for x in d], ref, 20.0, lr_mass=1.0)
