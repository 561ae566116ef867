"""Median norm scaling of contributions (``sync.norm_clip``): the factors by hand, the norm of
quantized contributions, and a shard's merge with one learner far longer than the other."""

from __future__ import annotations

import numpy as np
import pytest

from ddiloco.pipeline import codec
from ddiloco.pipeline.accumulate import unpack
from ddiloco.pipeline.errors import ConfigError
from ddiloco.workers.run.blobs import decode_blob
from ddiloco.workers.run.config import load_config
from ddiloco.workers.syncer.merge import NORM_FLOOR, token_weight
from ddiloco.workers.syncer.norm_clip import CHUNK, contribution_norm, median_clip_factors
from tests.test_syncer_core import TINY, delta_frames, rand_like, shard_core


def test_factors_bring_norms_above_the_median_down_to_it() -> None:
    # median of (1, 2, 3, 10) is 2.5
    assert median_clip_factors([1.0, 2.0, 3.0, 10.0]) == pytest.approx([1, 1, 2.5 / 3, 0.25])
    # recent norms join the pool: median of (1, 1, 1, 2, 3, 10) is 1.5
    assert median_clip_factors([1.0, 2.0, 3.0, 10.0], [1.0, 1.0]) == pytest.approx(
        [1, 0.75, 0.5, 0.15])


def test_a_lone_contribution_is_scaled_only_against_history() -> None:
    assert median_clip_factors([4.0]) == [1.0]
    assert median_clip_factors([4.0], [1.0, 2.0]) == pytest.approx([0.5])  # median of 1, 2, 4
    assert median_clip_factors([1.5], [1.0, 2.0]) == [1.0]


def test_zero_and_non_finite_norms_are_left_alone() -> None:
    out = median_clip_factors([0.0, float("nan"), float("inf"), 1.0, 3.0])
    assert out == pytest.approx([1.0, 1.0, 1.0, 1.0, 2.0 / 3.0])  # median of (1, 3) is 2
    assert median_clip_factors([]) == []


@pytest.mark.parametrize("name", ["fp32", "int4", "int8"])
def test_contribution_norm_is_the_norm_of_the_decoded_sum(name: str) -> None:
    rng = np.random.default_rng(0)
    shapes = [(CHUNK + 17,), (3, 5)]  # more than one pass of scratch
    parts = []
    for _ in range(3):
        x = [rng.normal(size=s).astype(np.float32) for s in shapes]
        parts.append(unpack(codec.encode(x, name), shapes, name))
    decoded = [np.concatenate([t.ravel() for t in p.tensors()]) for p in parts]
    assert contribution_norm(parts[:1]) == pytest.approx(
        float(np.linalg.norm(decoded[0].astype(np.float64))), rel=1e-6)
    total = (decoded[0] + decoded[1]) + decoded[2]  # float32 additions, as the shard's
    assert contribution_norm(parts) == pytest.approx(
        float(np.linalg.norm(total.astype(np.float64))), rel=1e-6)
    assert contribution_norm([]) == 0.0


def _rda(xs: list[np.ndarray], ws: list[float]) -> np.ndarray:
    """RDA with every quantity written out (independent of the shard's code path)."""
    total = sum(ws)
    norms = [float(np.linalg.norm(x)) for x in xs]
    radius = sum(w * n for w, n in zip(ws, norms, strict=True)) / total
    direction = sum(w / total * x / n for w, x, n in zip(ws, xs, norms, strict=True))
    assert float(np.linalg.norm(direction)) > NORM_FLOOR
    return direction * (radius / float(np.linalg.norm(direction)))


def test_a_shard_scales_the_long_contribution_down_to_the_median() -> None:
    with shard_core({**TINY, "sync.norm_clip": "median"}) as (core, store, _):
        p = 0
        before = [v.copy() for v in core.frags[p].value]
        d0 = rand_like(core, p, 1)
        d1 = [10.0 * x for x in rand_like(core, p, 2)]  # one learner ten times longer
        n0 = float(np.sqrt(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in d0)))
        n1 = float(np.sqrt(sum(float(np.sum(x.astype(np.float64) ** 2)) for x in d1)))
        f1 = (n0 + n1) / 2 / n1  # the median of two norms is their mean
        core.handle(delta_frames(core, "learner-0", 1, p, 0, d0, c_tokens=2000, c_steps=10))
        core.handle(delta_frames(core, "learner-1", 1, p, 0, d1, c_tokens=1000, c_steps=10))
        assert len(core.tick()) == 1
        w0, w1 = token_weight(2000, 10), token_weight(1000, 10)
        mask = core.embedding_mask[p]
        stored = store.get_latest(p)
        assert stored is not None and stored.version == 1
        got = decode_blob(stored.value, core.layout.shapes(p))
        lr = core.cfg.sync.outer_lr
        for i, (b0, a) in enumerate(zip(before, got, strict=True)):
            x0, x1 = d0[i].astype(np.float64), f1 * d1[i].astype(np.float64)
            if mask[i]:
                g = (w0 * x0 + w1 * x1) / (w0 + w1)
            else:
                # radius: the scaled norms under the original weights; direction: weights w * f
                norms = [float(np.linalg.norm(x0)), float(np.linalg.norm(x1))]
                radius = (w0 * norms[0] + w1 * norms[1]) / (w0 + w1)
                g = _rda([x0, x1], [w0, w1 * f1])
                g = g / float(np.linalg.norm(g)) * radius
            np.testing.assert_allclose(a, b0 - lr * g, rtol=1e-4, atol=1e-6)
        assert list(core.frags[p].recent_norms) == pytest.approx([n0, n1], rel=1e-5)


def test_norm_clip_is_validated() -> None:
    assert load_config(None, {"sync.norm_clip": "median"}).sync.norm_clip == "median"
    with pytest.raises(ConfigError, match=r"sync\.norm_clip: 'mean' is not a valid choice; "
                       r"expected 'none' or 'median'"):
        load_config(None, {"sync.norm_clip": "mean"})
