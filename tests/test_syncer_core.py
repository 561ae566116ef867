"""The syncer shard's core on a fakeredis store with an injected clock: rounds, merges, drops."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import fakeredis
import numpy as np
import pytest

from ddiloco.pipeline import wire
from ddiloco.pipeline.errors import ConfigError, FencedOut
from ddiloco.pipeline.wire import Header, Kind
from ddiloco.store import RedisStore
from ddiloco.workers.run.blobs import decode_blob
from ddiloco.workers.run.config import load_config
from ddiloco.workers.run.manifest import build_manifest
from ddiloco.workers.syncer.core import ShardCore
from ddiloco.workers.syncer.lateness import Pace
from ddiloco.workers.syncer.merge import OuterConfig, OuterOptimizer, merge_fragment, token_weight
from ddiloco.workers.task.model import init_params

RUN = "core-run"
TINY = {"model.d_model": 16, "model.n_layers": 1, "model.n_heads": 2, "model.d_ff": 32,
        "model.seq_len": 16, "sync.fragments": 2, "run.shards": 1, "sync.grace_cap_s": 1.0,
        # the grace window's rules; sync.round_wait = "live" has tests of its own
        "sync.round_wait": "grace",
        "sync.codec_down": "fp32", "sync.codec_up": "fp32", "sync.gamma": 0.5,
        # unpaced, so a full round merges at the tick that completes it; pacing has its own test
        "sync.merge_every": 0.0}


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


#: a shard core, its store and its clock
Setup = tuple[ShardCore, RedisStore, Clock]


@contextmanager
def shard_core(overrides: dict[str, object]) -> Iterator[Setup]:
    """Shard 0 of run :data:`RUN` on a fakeredis store of its own, configured by ``overrides``
    and loaded (version 0 from the initial parameters), with learner-0 and learner-1 registered
    and live; its clock is at 100.0 and moves only when a test moves it.

    Use it in a ``with`` block (or through the fixtures below): the store is closed on the way
    out, whether the test passes or fails.
    """
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    try:
        store = RedisStore(client, RUN)
        cfg = load_config(None, overrides)
        manifest = store.put_manifest(build_manifest(cfg, RUN))
        clock = Clock()
        epoch = store.acquire_lease(0, "owner", 5000)
        assert epoch is not None
        core = ShardCore(manifest, 0, store, epoch, clock=clock)
        core.load(lambda: init_params(cfg.model_config_obj(), cfg.train.seed))
        for lid in ("learner-0", "learner-1"):
            store.register_learner(lid)
        core.set_live({"learner-0", "learner-1"})
        yield core, store, clock
    finally:
        client.close()


@pytest.fixture
def setup() -> Iterator[Setup]:
    with shard_core(TINY) as got:
        yield got


@pytest.fixture
def paced() -> Iterator[Setup]:
    with shard_core({**TINY, "sync.merge_every": 1.0}) as got:
        yield got


def delta_frames(core: ShardCore, sender: str, seq: int, frag: int, base: int,
                 tensors: list[np.ndarray], c_tokens: int = 1000, c_steps: int = 10,
                 run: str = RUN) -> list[bytes]:
    return wire.encode(Header(kind=Kind.DELTA, run=run, sender=sender, inc=1, seq=seq, frag=frag,
                              base=base, c_steps=c_steps, c_tokens=c_tokens, new_tokens=c_tokens,
                              step=100 + c_steps, step_time=0.5, codec="fp32"), tensors)


def rand_like(core: ShardCore, frag: int, seed: int) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.normal(scale=1e-2, size=s).astype(np.float32) for s in core.layout.shapes(frag)]


def test_version_zero_written_from_init(setup: tuple[ShardCore, RedisStore, Clock]) -> None:
    core, store, _ = setup
    for p in core.owned:
        head = store.head(p)
        assert head is not None and head.version == 0
        assert core.frags[p].version == 0


@pytest.mark.parametrize("mu", [0.0, 0.9])
def test_merge_waits_for_grace_then_applies_exact_math(mu: float) -> None:
    with shard_core({**TINY, "sync.outer_momentum": mu}) as (core, store, clock):
        p = 0
        before = [v.copy() for v in core.frags[p].value]
        d0, d1 = rand_like(core, p, 1), rand_like(core, p, 2)
        core.handle(delta_frames(core, "learner-0", 1, p, 0, d0, c_tokens=2000, c_steps=10))
        # K=1 is met, but learner-1 is live and missing: wait for the grace window
        # (step_time 0.5 s, tau 2 -> slack 1 s - sync 0 -> gamma 0.5 -> 0.5 s).
        assert core.tick() == []
        clock.now += 0.2
        assert core.tick() == []
        core.handle(delta_frames(core, "learner-1", 1, p, 0, d1, c_tokens=1000, c_steps=10))
        out = core.tick()  # every live learner is in: merge at once
        assert len(out) == 1
        msg = wire.decode(out[0], run_id=RUN, expected_shapes=lambda h: core.layout.shapes(h.frag))
        assert msg.header.kind == Kind.VERSION and msg.header.ver == 1 and msg.header.base == 0
        # the broadcast names whose deltas (by their inner step) it merged
        assert msg.header.extra["merged"] == {"learner-0": 110, "learner-1": 110}  # their steps
        # expected: RDA/average of the two by weights 2000^2/10 and 1000^2/10, then Nesterov
        w = [token_weight(2000, 10), token_weight(1000, 10)]
        mask = core.embedding_mask[p]
        g = merge_fragment([d0, d1], w, mask, "rda")
        opt = OuterOptimizer(OuterConfig(core.cfg.sync.outer_lr, core.cfg.sync.outer_momentum))
        want, mom = opt.step(before, g, opt.init_momentum(before))
        stored = store.get_latest(p)
        assert stored is not None and stored.version == 1
        got = decode_blob(stored.value, core.layout.shapes(p))
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        # the broadcast difference reconstructs the stored value exactly
        assert msg.tensors is not None
        for b0, d, s in zip(before, msg.tensors, got, strict=True):
            np.testing.assert_array_equal(b0 + d, s)
        if mu == 0:
            # no momentum kept or published: it would only hold the last outer gradient
            assert stored.momentum == b"" and core.frags[p].flat_momentum.size == 0
            return
        got_m = decode_blob(stored.momentum, core.layout.shapes(p))
        for a, b in zip(got_m, mom, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)
        # a second merge steps with the kept momentum
        d2 = rand_like(core, p, 3)
        core.handle(delta_frames(core, "learner-0", 2, p, 1, d2, c_tokens=1000, c_steps=10))
        core.handle(delta_frames(core, "learner-1", 2, p, 1, d2, c_tokens=1000, c_steps=10))
        assert len(core.tick()) == 1
        want2, mom2 = opt.step(got, merge_fragment([d2, d2], [1.0, 1.0], mask, "rda"), mom)
        stored = store.get_latest(p)
        assert stored is not None and stored.version == 2
        for a, b in zip(decode_blob(stored.value, core.layout.shapes(p)), want2, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)
        for a, b in zip(decode_blob(stored.momentum, core.layout.shapes(p)), mom2, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-7)


def test_grace_expiry_merges_single_contribution(
        setup: tuple[ShardCore, RedisStore, Clock]) -> None:
    core, _, clock = setup
    core.handle(delta_frames(core, "learner-0", 1, 0, 0, rand_like(core, 0, 1)))
    assert core.tick() == []
    clock.now += 0.51
    assert len(core.tick()) == 1
    assert core.frags[0].version == 1


def test_grace_steps_wait_for_every_live_learner() -> None:
    """sync.grace_steps = 1.5 at step time 0.5 s: the round waits 0.75 s (not the adaptive
    0.5 s) for the second live learner, and merges as soon as it is in."""
    for late in (0.6, None):
        with shard_core({**TINY, "sync.grace_steps": 1.5}) as (core, _, clock):
            core.handle(delta_frames(core, "learner-0", 1, 0, 0, rand_like(core, 0, 1)))
            clock.now += 0.51
            assert core.tick() == []
            if late is not None:
                clock.now += late - 0.51
                core.handle(delta_frames(core, "learner-1", 1, 0, 0, rand_like(core, 0, 2)))
                assert len(core.tick()) == 1
                assert set(core.frags[0].contributions) == set()
            else:
                clock.now += 0.23
                assert core.tick() == []
                clock.now += 0.02  # 0.76 s after the quorum: past the floor, merge without it
                assert len(core.tick()) == 1
            assert core.frags[0].version == 1


def test_grace_floor_is_at_most_H_steps() -> None:
    """sync.grace_steps = 3 at H = 2 and step time 0.5 s: the floor is 2 steps (1.0 s), not
    3 (1.5 s): by then the first learner's next outer gradient would replace its first."""
    with shard_core({**TINY, "sync.grace_steps": 3, "sync.H": 2,
                     "sync.grace_cap_s": 5.0}) as (core, _, clock):
        core.handle(delta_frames(core, "learner-0", 1, 0, 0, rand_like(core, 0, 1)))
        clock.now += 0.99
        assert core.tick() == []
        clock.now += 0.02
        assert len(core.tick()) == 1
        assert core.frags[0].version == 1


@pytest.mark.parametrize("last_sent, waits", [(98, True), (120, False)])
def test_round_wait_live_waits_only_for_a_learner_due_soon(last_sent: int, waits: bool) -> None:
    """sync.round_wait = live, H 24, step time 0.5 s, late_fraction 0.5 (a 6 s wait):
    learner-1 last sent fragment 0 at step ``last_sent`` and is at step 120, so its next
    delta is due at step last_sent + 24: 1 s away (waited for), or 12 s (really late: the
    round merges at once with learner-0 alone)."""
    with shard_core({**TINY, "sync.round_wait": "live"}) as (core, _, clock):
        core.set_live({"learner-0", "learner-1"})
        core.paces["learner-1"] = Pace(at=clock.now, step=120, step_time=0.5, inc=1)
        core.last_sent[(0, "learner-1")] = last_sent
        core.handle(delta_frames(core, "learner-0", 1, 0, 0, rand_like(core, 0, 1)))
        assert core.paces["learner-0"].step == 110 and core.last_sent[(0, "learner-0")] == 110
        if not waits:
            assert len(core.tick()) == 1 and core.frags[0].version == 1
            return
        clock.now += 0.9
        assert core.tick() == []
        clock.now += 0.2
        core.handle(delta_frames(core, "learner-1", 1, 0, 0, rand_like(core, 0, 2)))
        assert len(core.tick()) == 1
        assert core.frags[0].version == 1 and core.merged_contributions == 2


def test_round_wait_live_forgets_a_restarted_learners_send_steps() -> None:
    with shard_core({**TINY, "sync.round_wait": "live"}) as (core, _, _clock):
        core.paces["learner-0"] = Pace(at=1.0, step=500, step_time=0.5, inc=0)
        core.last_sent[(1, "learner-0")] = 490
        core.handle(delta_frames(core, "learner-0", 1, 0, 0, rand_like(core, 0, 1)))
        assert (1, "learner-0") not in core.last_sent
        assert core.paces["learner-0"].inc == 1


def test_round_wait_live_refuses_a_grace_floor() -> None:
    with pytest.raises(Exception, match="grace_steps"):
        load_config(None, {"sync.round_wait": "live", "sync.grace_steps": 6})


def test_old_base_is_anchored_exactly(setup: tuple[ShardCore, RedisStore, Clock]) -> None:
    core, _, _clock = setup
    core.set_live({"learner-0"})
    v0 = [x.copy() for x in core.frags[0].value]
    core.handle(delta_frames(core, "learner-0", 1, 0, 0, rand_like(core, 0, 1)))
    assert len(core.tick()) == 1
    # the shard keeps version 0 as the difference Theta_1 - Theta_0, not as a value
    assert core.frags[0].history[0] is None and core.frags[0].history[1] is not None
    v1 = [x.copy() for x in core.frags[0].value]
    d = rand_like(core, 0, 5)
    # learner-1 trained against version 0: Delta = (Theta_1 - Theta_0) + d
    core.set_live({"learner-1"})
    core.handle(delta_frames(core, "learner-1", 1, 0, 0, d))
    st = core.frags[0]
    contrib = st.contributions["learner-1"]
    assert contrib.base == 0
    anchored = [(c - b) + x for c, b, x in zip(v1, v0, d, strict=True)]
    opt = OuterOptimizer(OuterConfig(core.cfg.sync.outer_lr, core.cfg.sync.outer_momentum))
    want, _ = opt.step(v1, anchored, st.momentum or opt.init_momentum(v1))
    assert len(core.tick()) == 1
    assert st.version == 2
    for a, b in zip(st.value, want, strict=True):
        np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6)


def test_bad_messages_dropped_and_counted(setup: tuple[ShardCore, RedisStore, Clock]) -> None:
    core, store, _ = setup
    d = rand_like(core, 0, 1)
    assert core.handle([b"garbage"]) == []
    assert core.handle(delta_frames(core, "learner-0", 1, 0, 0, d, run="other")) == []
    assert core.handle(delta_frames(core, "stranger", 1, 0, 0, d)) == []
    core.handle(delta_frames(core, "learner-0", 5, 0, 0, d))
    assert core.handle(delta_frames(core, "learner-0", 5, 0, 0, d)) == []  # duplicate
    out = core.handle(delta_frames(core, "learner-1", 1, 0, 7, d))  # base from the future
    assert len(out) == 1 and wire.decode(out[0], run_id=RUN).header.kind == Kind.CONTROL
    bad = [x.copy() for x in d]
    bad[0].flat[0] = np.inf
    assert core.handle(delta_frames(core, "learner-1", 2, 0, 0, bad)) == []
    counts = store.counters("drops")
    assert counts == {"corrupt": 1, "wrong_run": 1, "unknown_sender": 1, "duplicate": 1,
                      "stale": 1, "nonfinite": 1}
    drops = store.events(kinds={"drop"})
    assert len(drops) == 6


def test_paced_full_round_waits_for_the_interval(
        paced: tuple[ShardCore, RedisStore, Clock]) -> None:
    core, _, clock = paced
    core.set_live({"learner-0"})
    core.handle(delta_frames(core, "learner-0", 1, 0, 0, rand_like(core, 0, 1)))
    assert len(core.tick()) == 1  # no merge before: nothing to pace against
    # the header's step_time (0.5 s) sets the interval: H steps of it after the last merge
    interval = core.cfg.sync.H * 0.5
    core.handle(delta_frames(core, "learner-0", 2, 0, 1, rand_like(core, 0, 2)))
    assert core.tick() == []
    clock.now += interval - 0.01
    assert core.tick() == []
    clock.now += 0.02
    assert len(core.tick()) == 1
    assert core.frags[0].version == 2


def test_stale_beyond_history(setup: tuple[ShardCore, RedisStore, Clock]) -> None:
    core, store, _clock = setup
    core.set_live({"learner-0"})
    keep = core.cfg.sync.history
    for i in range(keep + 1):
        core.handle(delta_frames(core, "learner-0", i + 1, 0, core.frags[0].version,
                                 rand_like(core, 0, i)))
        assert len(core.tick()) == 1
    assert 0 not in core.frags[0].history
    assert store.get_version(0, 0) is None
    out = core.handle(delta_frames(core, "learner-1", 1, 0, 0, rand_like(core, 0, 9)))
    assert store.counters("drops") == {"stale": 1}
    h = wire.decode(out[0], run_id=RUN).header
    assert h.extra == {"to": "learner-1", "action": "resync"}


def test_restarted_shard_resumes_versions_and_momentum(
        setup: tuple[ShardCore, RedisStore, Clock]) -> None:
    core, store, _ = setup
    core.set_live({"learner-0"})
    for i in range(3):
        core.handle(delta_frames(core, "learner-0", i + 1, 0, core.frags[0].version,
                                 rand_like(core, 0, i)))
        core.tick()
    mom = [m.copy() for m in core.frags[0].momentum]
    assert store.acquire_lease(0, "intruder", 5000) is None  # the old lease is still held
    store.release_lease(0, "owner")
    epoch2 = store.acquire_lease(0, "owner2", 5000)
    assert epoch2 is not None and epoch2 > core.epoch
    core2 = ShardCore(core.manifest, 0, store, epoch2)
    core2.load(lambda: pytest.fail("must resume, not re-initialise"))  # type: ignore[arg-type,return-value]
    assert core2.frags[0].version == 3
    for a, b in zip(core2.frags[0].momentum, mom, strict=True):
        np.testing.assert_array_equal(a, b)
    # the old owner is fenced out now
    core.handle(delta_frames(core, "learner-0", 10, 0, 3, rand_like(core, 0, 7)))
    with pytest.raises(FencedOut):
        core.tick()


def test_int4_downlink_is_exact_for_receivers(setup: tuple[ShardCore, RedisStore, Clock]) -> None:
    core, store, _clock = setup
    core.cfg = core.cfg.model_copy(update={"sync": core.cfg.sync.model_copy(
        update={"codec_down": "int4"})})
    core.set_live({"learner-0"})
    before = [v.copy() for v in core.frags[0].value]
    core.handle(delta_frames(core, "learner-0", 1, 0, 0, rand_like(core, 0, 3)))
    out = core.tick()
    msg = wire.decode(out[0], run_id=RUN, expected_shapes=lambda h: core.layout.shapes(h.frag))
    assert msg.header.codec == "int4" and msg.tensors is not None
    stored = store.get_latest(0)
    assert stored is not None
    got = decode_blob(stored.value, core.layout.shapes(0))
    for b0, d, s in zip(before, msg.tensors, got, strict=True):
        np.testing.assert_array_equal(b0 + d, s)
    with pytest.raises(ConfigError, match="codec_down"):
        load_config(None, {"sync.codec_down": "int3"})


def test_first_delta_of_a_round_announces_it(setup: tuple[ShardCore, RedisStore, Clock]) -> None:
    core, _, _ = setup
    out = core.handle(delta_frames(core, "learner-0", 1, 0, 0, rand_like(core, 0, 1)))
    assert len(out) == 1
    h = wire.decode(out[0], run_id=RUN).header
    assert h.kind == Kind.CONTROL and h.frag == 0
    assert h.extra == {"to": "*", "action": "round_open"}
    # the second contribution joins the open round: no new notice
    assert core.handle(delta_frames(core, "learner-1", 1, 0, 0, rand_like(core, 0, 2))) == []


def test_join_announcement_holds_the_round(setup: tuple[ShardCore, RedisStore, Clock]) -> None:
    core, _, clock = setup
    core.set_live({"learner-0", "learner-1", "learner-2"})
    core.store.register_learner("learner-2")
    core.handle(delta_frames(core, "learner-0", 1, 0, 0, rand_like(core, 0, 1)))
    join = wire.encode(Header(kind=Kind.CONTROL, run=RUN, sender="learner-1", inc=1, seq=2,
                              frag=0, extra={"action": "join"}))
    assert core.handle(join) == []
    assert core.frags[0].round.joining == {"learner-1"}
    clock.now += 0.6  # past the grace window (0.5 s) but learner-1 announced itself
    assert core.tick() == []
    core.handle(delta_frames(core, "learner-1", 3, 0, 0, rand_like(core, 0, 2)))
    out = core.tick()
    assert len(out) == 1
    merged = wire.decode(out[0], run_id=RUN,
                         expected_shapes=lambda h: core.layout.shapes(h.frag)).header.extra
    assert merged["merged"] == {"learner-0": 110, "learner-1": 110}


def test_pending_delta_is_added_to_a_newer_based_one_of_the_same_learner(
        setup: tuple[ShardCore, RedisStore, Clock]) -> None:
    """A learner's delta (base 0) is still in a round when its next one arrives with base 1
    (it adopted version 1 in between): the round holds their sum, anchored at base 1, with
    both counters and both token counts, so no work is lost or counted twice."""
    core, _store, clock = setup
    core.set_live({"learner-0", "learner-1"})
    p = 0
    # version 1 from learner-1 alone
    core.handle(delta_frames(core, "learner-1", 1, p, 0, rand_like(core, p, 3)))
    clock.now += 5.0
    assert core.tick()
    assert core.frags[p].version == 1
    d_old, d_new = rand_like(core, p, 4), rand_like(core, p, 5)
    core.handle(delta_frames(core, "learner-0", 1, p, 0, d_old, c_tokens=600, c_steps=6))
    core.handle(delta_frames(core, "learner-0", 2, p, 1, d_new, c_tokens=400, c_steps=4))
    c = core.frags[p].contributions["learner-0"]
    assert c.base == 1 and (c.c_steps, c.c_tokens, c.new_tokens) == (10, 1000, 1000)
    for got, a, b in zip(c.delta, d_old, d_new, strict=True):
        np.testing.assert_allclose(got, a + b, rtol=1e-6)
    assert c.seqs == [1, 2]
    # the same base again: cumulative since adoption, so it replaces (tokens still add up)
    d_cum = rand_like(core, p, 6)
    core.handle(delta_frames(core, "learner-0", 3, p, 1, d_cum, c_tokens=800, c_steps=8))
    c = core.frags[p].contributions["learner-0"]
    assert (c.c_steps, c.new_tokens) == (8, 1800)
    np.testing.assert_array_equal(c.delta[0], d_cum[0])


def test_flush_merges_what_pacing_holds(paced: tuple[ShardCore, RedisStore, Clock]) -> None:
    core, store, _ = paced
    core.set_live({"learner-0", "learner-1"})
    core.handle(delta_frames(core, "learner-0", 1, 0, 0, rand_like(core, 0, 1)))
    core.handle(delta_frames(core, "learner-1", 1, 0, 0, rand_like(core, 0, 2)))
    assert len(core.tick()) == 1
    # a drained learner's last delta: the round waits H step times (pacing) ...
    core.handle(delta_frames(core, "learner-0", 2, 0, 1, rand_like(core, 0, 3)))
    assert core.tick() == []
    # ... a clean stop merges it instead of dropping it
    out = core.flush()
    assert len(out) == 1 and core.frags[0].version == 2
    assert core.drop_pending("shard_stop") == 0
    assert store.counters("drops") == {}


def test_a_restarted_shard_holds_its_history_in_the_downlink_codec() -> None:
    """At start-up the kept versions' differences are read back and held in the int downlink's
    codec, as the running shard held them (0.14 F a version for int4), and they still add up
    to the differences between the stored versions."""
    with shard_core({**TINY, "sync.codec_down": "int4", "sync.history": 4}) as (core, store, _):
        core.set_live({"learner-0"})
        for i in range(3):
            core.handle(delta_frames(core, "learner-0", i + 1, 0, core.frags[0].version,
                                     rand_like(core, 0, i)))
            assert len(core.tick()) == 1
        store.release_lease(0, "owner")
        epoch2 = store.acquire_lease(0, "owner2", 5000)
        assert epoch2 is not None
        core2 = ShardCore(core.manifest, 0, store, epoch2)
        core2.load(lambda: pytest.fail("must resume"))  # type: ignore[arg-type,return-value]
        hist = core2.frags[0].history
        assert sorted(hist) == [0, 1, 2, 3] and hist[0] is None
        shapes = core.layout.shapes(0)
        n = sum(int(np.prod(s)) for s in shapes)
        for v in (1, 2, 3):
            d = hist[v]
            assert d is not None and d.codec == "int4" and d.nbytes < n  # under a byte a value
        v0 = store.get_version(0, 0)
        v3 = store.get_version(0, 3)
        assert v0 is not None and v3 is not None
        want = [b - a for a, b in zip(decode_blob(v0.value, shapes), decode_blob(v3.value, shapes),
                                      strict=True)]
        got = [sum(t) for t in zip(*(hist[v].tensors() for v in (1, 2, 3)), strict=True)]  # type: ignore[union-attr]
        for a, b in zip(got, want, strict=True):
            np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
