"""bench/sync_sweep.py: its batched round is the shard's merge and outer step; its cells."""

from __future__ import annotations

import numpy as np
import pytest

from ddiloco.workers.syncer.merge import OuterConfig, OuterOptimizer, merge_fragment
from tests._bench import load_bench

sweep = load_bench("sync_sweep")


def reference_round(value: list[np.ndarray], locals_: list[list[np.ndarray]], mask: list[bool],
                    merge: str, lr: float, mu: float, momentum: list[np.ndarray]
                    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
    """The shard's path for one run: merge_fragment, then OuterOptimizer (or plain SGD)."""
    deltas = [[v - t for v, t in zip(value, loc, strict=True)] for loc in locals_]
    g = merge_fragment(deltas, [1.0] * len(deltas), mask, merge)
    if mu == 0:
        return [v - np.float32(lr) * x for v, x in zip(value, g, strict=True)], momentum
    return OuterOptimizer(OuterConfig(lr, mu)).step(value, g, momentum)


def test_batched_round_matches_the_shards_merge_and_outer_step() -> None:
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    names, shapes = ["embed", "w", "b"], [(5, 3), (4, 6), (7,)]
    mask = [True, False, False]
    M = 3
    cells = [("rda", 1.0, 0.0), ("average", 0.6, 0.9), ("rda", 0.4, 0.9)]
    R = len(cells)
    value = {n: rng.standard_normal((R, *sh)).astype(np.float32)
             for n, sh in zip(names, shapes, strict=True)}
    locs = {n: (value[n][:, None] + 0.1 * rng.standard_normal((R, M, *sh))).astype(np.float32)
            for n, sh in zip(names, shapes, strict=True)}
    # one learner that did not move on run 0's w: a zero-norm contribution has no direction
    locs["w"][0, 1] = value["w"][0]
    mom = {n: (0.05 * rng.standard_normal(value[n].shape)).astype(np.float32) for n in names}
    for n in names:
        mom[n][0] = 0.0  # SGD keeps no momentum
    new_v, new_m = sweep.outer_steps(
        {n: jnp.asarray(v) for n, v in value.items()}, {n: jnp.asarray(v) for n, v in locs.items()},
        {n: jnp.asarray(v) for n, v in mom.items()},
        jnp.asarray([c[1] for c in cells], jnp.float32),
        jnp.asarray([c[2] for c in cells], jnp.float32),
        jnp.asarray([c[0] == "rda" for c in cells]), frozenset({"embed"}))
    for r, (merge, lr, mu) in enumerate(cells):
        want_v, want_m = reference_round(
            [value[n][r] for n in names], [[locs[n][r, m] for n in names] for m in range(M)],
            mask, merge, lr, mu, [mom[n][r] for n in names])
        for i, n in enumerate(names):
            np.testing.assert_allclose(np.asarray(new_v[n][r]), want_v[i], rtol=1e-5, atol=1e-6)
            if mu:
                np.testing.assert_allclose(np.asarray(new_m[n][r]), want_m[i], rtol=1e-5,
                                           atol=1e-6)


def test_cells_parse_and_refuse() -> None:
    cells = sweep.parse_cells("rda:sgd:1.0,average:nesterov:0.6", 0.9)
    assert [c.name for c in cells] == ["rda:sgd:1", "average:nesterov:0.6"]
    assert cells[0].momentum == 0.0 and cells[1].momentum == 0.9
    for bad in ("rda:adam:1", "mean:sgd:1", "rda:sgd", "rda:sgd:0"):
        with pytest.raises(SystemExit, match="--cells"):
            sweep.parse_cells(bad, 0.9)


def test_summary_ratios_are_per_seed_and_best_first() -> None:
    R = sweep.RunResult
    results = [R("dp", "dp", 0, 1.0, 0, 2.0), R("dp", "dp", 0, 1.0, 1, 1.0),
               R("diloco", "a", 12, 1.0, 0, 2.2), R("diloco", "a", 12, 1.0, 1, 1.2),
               R("diloco", "b", 12, 1.0, 0, 2.1), R("diloco", "b", 12, 1.0, 1, 1.04)]
    rows = sweep.summarize(results)
    assert [r["cell"] for r in rows] == ["b", "a"]
    assert rows[0]["ratios"] == pytest.approx([1.05, 1.04])
    assert rows[1]["ratio_median"] == pytest.approx(1.15)
    assert rows[1]["ratio_min"] == pytest.approx(1.1) and rows[1]["ratio_max"] == pytest.approx(1.2)
