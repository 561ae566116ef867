"""Merge math, RDA, token weights, the outer Nesterov step and grace decisions, by hand."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ddiloco.pipeline.errors import ConfigError
from ddiloco.workers.syncer.merge import (
    GraceConfig,
    OuterConfig,
    OuterOptimizer,
    Round,
    Timing,
    anchor_delta,
    grace_window,
    merge_fragment,
    rda,
    should_merge,
    token_weight,
    weighted_average,
)


def f32(*xs: float) -> np.ndarray:
    return np.array(xs, dtype=np.float32)


def test_token_weight() -> None:
    assert token_weight(1000, 10) == 100_000.0
    assert token_weight(0, 10) == 0.0
    assert token_weight(10, 0) == 0.0


def test_weighted_average_by_hand() -> None:
    out = weighted_average([f32(1, 0), f32(0, 4)], [3.0, 1.0])
    np.testing.assert_allclose(out, [0.75, 1.0])
    with pytest.raises(ValueError):
        weighted_average([f32(1)], [0.0])


def test_rda_orthogonal_keeps_length() -> None:
    # v1=(3,0), v2=(0,4), equal weights: mean norm 3.5; mean direction (0.5,0.5)->unit (1,1)/sqrt2
    out = rda([f32(3, 0), f32(0, 4)], [1.0, 1.0])
    np.testing.assert_allclose(out, [3.5 / math.sqrt(2), 3.5 / math.sqrt(2)], rtol=1e-6)
    # plain average would be (1.5, 2) with norm 2.5 < 3.5
    assert np.linalg.norm(out) == pytest.approx(3.5, rel=1e-6)


def test_rda_weighted_by_hand() -> None:
    # v1=(2,0) w=3, v2=(0,1) w=1: radius=(3*2+1*1)/4=1.75; direction (0.75,0.25)
    out = rda([f32(2, 0), f32(0, 1)], [3.0, 1.0])
    d = np.array([0.75, 0.25]) / np.linalg.norm([0.75, 0.25])
    np.testing.assert_allclose(out, 1.75 * d, rtol=1e-6)


def test_rda_parallel_equals_average_and_cancel_falls_back() -> None:
    np.testing.assert_allclose(rda([f32(1, 1), f32(3, 3)], [1.0, 1.0]), [2, 2], rtol=1e-6)
    # opposite directions cancel: fall back to the weighted average (zero here)
    np.testing.assert_allclose(rda([f32(1, 0), f32(-1, 0)], [1.0, 1.0]), [0, 0], atol=1e-7)


def test_merge_fragment_embeddings_average_others_rda() -> None:
    d1 = [f32(3, 0), f32(3, 0)]
    d2 = [f32(0, 4), f32(0, 4)]
    out = merge_fragment([d1, d2], [1.0, 1.0], [True, False])
    np.testing.assert_allclose(out[0], [1.5, 2.0])
    assert np.linalg.norm(out[1]) == pytest.approx(3.5, rel=1e-6)
    # zero-weight contributions are ignored; a single one passes through unchanged
    out = merge_fragment([d1, d2], [1.0, 0.0], [True, False])
    np.testing.assert_array_equal(out[1], d1[1])
    with pytest.raises(ValueError):
        merge_fragment([d1], [0.0], [True, False])
    with pytest.raises(ValueError, match="method"):
        merge_fragment([d1], [1.0], [True, False], method="median")


def test_anchor_delta_exact() -> None:
    # Delta_m = (Theta_c - Theta_b) + delta_m: with Theta_b=1, Theta_c=0.5, theta_m=0.8:
    # delta_m = 1-0.8 = 0.2 -> Delta = -0.5 + 0.2 = -0.3 = Theta_c - theta_m
    out = anchor_delta([f32(0.2)], [f32(0.5)], [f32(1.0)])
    np.testing.assert_allclose(out[0], [-0.3], rtol=1e-6)


def test_outer_nesterov_by_hand() -> None:
    opt = OuterOptimizer(OuterConfig(lr=0.5, momentum=0.9))
    p = [f32(1.0, 2.0)]
    g = [f32(0.1, -0.2)]
    m = opt.init_momentum(p)
    p1, m1 = opt.step(p, g, m)
    # b = 0.9*0 + g = g; update = -lr*(g + 0.9*b) = -0.5*1.9*g
    np.testing.assert_allclose(m1[0], [0.1, -0.2], rtol=1e-6)
    np.testing.assert_allclose(p1[0], [1 - 0.095, 2 + 0.19], rtol=1e-6)
    p2, m2 = opt.step(p1, g, m1)
    # b = 0.9*0.1+0.1 = 0.19; update = -0.5*(0.1 + 0.9*0.19) = -0.1355
    np.testing.assert_allclose(m2[0], [0.19, -0.38], rtol=1e-6)
    np.testing.assert_allclose(p2[0], [0.905 - 0.1355, 2.19 + 0.271], rtol=1e-6)


def test_outer_config_validation() -> None:
    with pytest.raises(ConfigError, match=r"outer\.momentum"):
        OuterConfig(momentum=1.0)
    with pytest.raises(ConfigError, match=r"outer\.lr"):
        OuterConfig(lr=0)


def test_grace_window_formula() -> None:
    cfg = GraceConfig(tau=2, gamma=0.5, cap_s=10.0)
    t = Timing(step_time=1.0, quorum_time=0.2, sync_time=0.3)
    # 0.5 * max(0, 2*1.0 - 0.2 - 0.3) = 0.75
    assert grace_window(t, cfg) == pytest.approx(0.75)
    assert grace_window(t, GraceConfig(tau=2, gamma=0.5, cap_s=0.5)) == 0.5
    assert grace_window(Timing(step_time=0.1, quorum_time=1.0), cfg) == 0.0
    assert grace_window(Timing(), cfg) == 0.0
    assert grace_window(t, GraceConfig(enabled=False)) == 0.0
    # a floor of 3 step times (3.0 s) wins over the adaptive 0.75 s, under the cap
    assert grace_window(t, GraceConfig(tau=2, gamma=0.5, cap_s=10.0,
                                       floor_steps=3)) == pytest.approx(3.0)
    assert grace_window(t, GraceConfig(tau=2, gamma=0.5, cap_s=2.0, floor_steps=3)) == 2.0
    assert grace_window(t, GraceConfig(tau=2, gamma=0.5, cap_s=10.0,
                                       floor_steps=0.5)) == pytest.approx(0.75)
    assert grace_window(t, GraceConfig(enabled=False, floor_steps=3)) == 0.0
    assert grace_window(Timing(), GraceConfig(floor_steps=3)) == 0.0
    # the floor is at most H step times: 24 steps at H = 12 and 1.0 s per step wait 12 s
    assert grace_window(t, GraceConfig(tau=2, gamma=0.5, cap_s=30.0, floor_steps=24,
                                       period_steps=12)) == pytest.approx(12.0)
    assert grace_window(t, GraceConfig(tau=2, gamma=0.5, cap_s=30.0, floor_steps=24,
                                       period_steps=24)) == pytest.approx(24.0)


def test_timing_ema() -> None:
    t = Timing()
    t.observe("step_time", 1.0, 0.5)
    t.observe("step_time", 3.0, 0.5)
    assert t.step_time == pytest.approx(2.0)


def test_should_merge_with_injected_clock() -> None:
    rnd = Round()
    rnd.add("a", now=10.0, min_quorum=2)
    assert not should_merge(rnd, 100.0, {"a", "b", "c"}, grace_s=1.0, min_quorum=2)
    rnd.add("b", now=10.5, min_quorum=2)
    assert rnd.quorum_at == 10.5
    # quorum met at 10.5, grace 1 s: not before 11.5 unless every live learner is in
    assert not should_merge(rnd, 11.4, {"a", "b", "c"}, grace_s=1.0, min_quorum=2)
    assert should_merge(rnd, 11.5, {"a", "b", "c"}, grace_s=1.0, min_quorum=2)
    assert should_merge(rnd, 10.6, {"a", "b"}, grace_s=1.0, min_quorum=2)
    # a newer contribution of the same learner replaces the older one
    rnd.add("a", now=10.7, min_quorum=2)
    assert len(rnd.contributors) == 2


def test_grace_config_validation() -> None:
    with pytest.raises(ConfigError, match="grace_steps"):
        GraceConfig(floor_steps=-1)
    with pytest.raises(ConfigError, match=r"sync\.H"):
        GraceConfig(period_steps=0)
    with pytest.raises(ConfigError, match="min_quorum"):
        GraceConfig(min_quorum=0)
    with pytest.raises(ConfigError, match="gamma"):
        GraceConfig(gamma=0)


def test_adopt_overwrite_and_mix_by_hand() -> None:
    from ddiloco.workers.learner.adoption import adopt_fragment

    theta, value = [f32(0.5, 1.0)], [f32(2.0, 3.0)]
    np.testing.assert_array_equal(adopt_fragment("overwrite", theta, value)[0], [2, 3])
    np.testing.assert_allclose(adopt_fragment("mix", theta, value, alpha=0.25)[0],
                               [0.25 * 0.5 + 0.75 * 2, 0.25 + 0.75 * 3])
    with pytest.raises(ValueError, match="adopt mode"):
        adopt_fragment("average", theta, value)


def test_adopt_carry_keeps_exactly_the_unsent_work() -> None:
    from ddiloco.workers.learner.adoption import adopt_fragment

    # anchor 1.0; the learner sent delta 0.25 (theta was 0.75 then), then stepped on to 0.5.
    # The version holding that send is 0.9: theta = 0.9 + (0.5 - 0.75) = 0.65.
    theta, value, ref = [f32(0.5, 2.0)], [f32(0.9, 1.0)], [f32(0.75, 2.0)]
    np.testing.assert_allclose(adopt_fragment("carry", theta, value, ref=ref)[0], [0.65, 1.0])
    # the next delta against the new anchor is minus the carried work: it leaves exactly once
    new = adopt_fragment("carry", theta, value, ref=ref)
    np.testing.assert_allclose(value[0] - new[0], ref[0] - theta[0])
    with pytest.raises(ValueError, match="ref"):
        adopt_fragment("carry", theta, value)
    with pytest.raises(ValueError, match="carry, overwrite, mix"):
        adopt_fragment("eager", theta, value)


def test_eager_estimate_by_hand() -> None:
    from ddiloco.workers.learner.adoption import eager_estimate

    # M = 4, outer lr 1: anchor 1.0, own delta 0.4, last outer step 0.2 per version:
    # E = 1.0 - 0.25 * 0.4 - 0.75 * 0.2 = 0.75
    est = eager_estimate([f32(1.0, -2.0)], [f32(0.4, 0.0)], [f32(0.2, -0.8)], 0.25, 1.0)
    np.testing.assert_allclose(est[0], [0.75, -2.0 + 0.6], rtol=1e-6)
    assert est[0].dtype == np.float32
    # outer lr 0.5 halves only the learner's own part: 1.0 - 0.5 * 0.25 * 0.4 - 0.15 = 0.8
    np.testing.assert_allclose(
        eager_estimate([f32(1.0)], [f32(0.4)], [f32(0.2)], 0.25, 0.5)[0], [0.8], rtol=1e-6)
    # one learner: its own delta is the whole round
    np.testing.assert_allclose(
        eager_estimate([f32(1.0)], [f32(0.4)], [f32(0.2)], 1.0, 1.0)[0], [0.6], rtol=1e-6)
    for bad in (0.0, 1.5):
        with pytest.raises(ValueError, match="own_weight"):
            eager_estimate([f32(1.0)], [f32(0.4)], [f32(0.2)], bad, 1.0)


def test_eager_move_keeps_the_learners_own_work_across_two_sends() -> None:
    from ddiloco.workers.learner.adoption import adopt_fragment, eager_move

    # M = 4, lr 1, fp32. Anchor 1.0; the learner's work takes it to 0.8; last outer step 0.1.
    anchor, last = [f32(1.0)], [f32(0.1)]
    own = [f32(0.8)]
    exact = [anchor[0] - own[0]]                                   # 0.2
    est, ref, jump = eager_move(anchor, own, exact, exact, last, 0.25, 1.0)
    np.testing.assert_allclose(est[0], [1.0 - 0.05 - 0.075], rtol=1e-6)   # 0.875
    np.testing.assert_allclose(jump[0], [0.075], rtol=1e-5)
    # one more step of its own (-0.1) before any version arrives: tensors 0.775; the second
    # send's delta is its work since the adoption, 0.3, not 0.225
    theta = [est[0] - np.float32(0.1)]
    own2 = [theta[0] - jump[0]]
    np.testing.assert_allclose(anchor[0] - own2[0], [0.3], rtol=1e-5)
    # a version 0.9 arrives after another step (-0.05): carry keeps exactly that step
    theta = [theta[0] - np.float32(0.05)]
    new = adopt_fragment("carry", theta, [f32(0.9)], ref=ref)
    np.testing.assert_allclose(new[0], [0.9 - 0.1 - 0.05], rtol=1e-5)
    # the codec's error is carried as without the move: sent 0.18 of an exact 0.2
    est, ref, _ = eager_move(anchor, own, [f32(0.18)], exact, last, 0.25, 1.0)
    np.testing.assert_allclose(est[0] - ref[0], [0.18 - 0.2], rtol=1e-4)


def test_eager_needs_carry_adoption() -> None:
    from ddiloco.workers.run.config import load_config

    assert load_config(None, ["sync.eager=true"]).sync.eager
    with pytest.raises(ConfigError, match=r"sync\.eager: needs sync\.adopt = carry"):
        load_config(None, ["sync.eager=true", "sync.adopt=overwrite"])


def test_should_merge_waits_for_announced_joiners_up_to_the_cap() -> None:
    rnd = Round()
    rnd.add("a", now=10.0, min_quorum=1)
    rnd.joining.add("b")
    live = {"a", "b", "c"}
    # grace (0.5 s) has passed but b said it is joining: wait, though never past the cap (2 s)
    assert not should_merge(rnd, 10.6, live, grace_s=0.5, min_quorum=1, cap_s=2.0)
    assert should_merge(rnd, 12.0, live, grace_s=0.5, min_quorum=1, cap_s=2.0)
    rnd.add("b", now=10.9, min_quorum=1)
    assert should_merge(rnd, 10.9, live, grace_s=0.5, min_quorum=1, cap_s=2.0)
    # a joiner that is no longer live is not waited for
    rnd2 = Round()
    rnd2.add("a", now=0.0, min_quorum=1)
    rnd2.joining.add("gone")
    assert should_merge(rnd2, 0.6, {"a", "c"}, grace_s=0.5, min_quorum=1, cap_s=2.0)


def test_paced_merges_hold_a_partial_round_until_the_interval() -> None:
    from ddiloco.workers.syncer.merge import merge_interval

    # H = 24 steps of 0.5 s, share 0.9: at least 10.8 s between two merges of a fragment
    assert merge_interval(Timing(step_time=0.5), 24, 0.9) == pytest.approx(10.8)
    assert merge_interval(Timing(), 24, 0.9) == 0.0
    assert merge_interval(Timing(step_time=0.5), 24, 0.0) == 0.0
    rnd = Round()
    rnd.add("d", now=101.0, min_quorum=1)  # the late learner of the previous period
    live = {"a", "b", "c", "d"}
    # last merge at 100.0: grace (0.5 s) alone would merge at 101.5; pacing holds it to 110.8
    assert should_merge(rnd, 101.5, live, grace_s=0.5, min_quorum=1)
    assert not should_merge(rnd, 101.5, live, 0.5, 1, not_before=110.8)
    assert not should_merge(rnd, 110.7, live, 0.5, 1, not_before=110.8)
    assert should_merge(rnd, 110.8, live, 0.5, 1, not_before=110.8)
    # the next period's deltas arrive first: a full round also waits for the interval, so
    # learners out of phase cannot make two versions (two broadcasts) in one period
    for who, t in (("a", 109.0), ("b", 109.1), ("c", 109.2)):
        rnd.add(who, now=t, min_quorum=1)
    assert not should_merge(rnd, 109.2, live, 0.5, 1, not_before=110.8)
    assert should_merge(rnd, 110.8, live, 0.5, 1, not_before=110.8)
    assert should_merge(rnd, 109.2, live, 0.5, 1)  # unpaced (merge_every = 0): at once
