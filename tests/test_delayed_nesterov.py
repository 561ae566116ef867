"""Delayed Nesterov outer momentum (``sync.outer_delay``): the rule by hand, its reduction to
Nesterov, and a shard that keeps momentum and buffer in the store across a restart."""

from __future__ import annotations

import numpy as np
import pytest

from ddiloco.pipeline.errors import ConfigError
from ddiloco.workers.run.blobs import decode_blob
from ddiloco.workers.run.config import load_config
from ddiloco.workers.syncer.core import ShardCore
from ddiloco.workers.syncer.merge import OuterConfig, OuterOptimizer, delayed_nesterov
from tests.test_syncer_core import TINY, delta_frames, rand_like, shard_core


def _run(gs: list[float], n: int, beta: float, c: float, lr: float = 1.0) -> list[float]:
    m, buf = np.zeros(1, np.float32), np.zeros(1, np.float32)
    out = []
    for t, g in enumerate(gs):
        d, m, buf = delayed_nesterov(np.array([g], np.float32), m, buf, t, n, beta, c, lr)
        out.append(float(d[0]))
    return out


def test_the_rule_by_hand() -> None:
    # n = 2, beta = 0.5, c = 0, gradients 1, 3, 5:
    # t=0: buf 1, no momentum step: d = 1/2; t=1: buf 4, m = 4/2 = 2, d = 0.5 * 2 + 3/2 = 2.5,
    # buf 0; t=2: buf 5, d = 5/2
    assert _run([1, 3, 5], 2, 0.5, 0.0) == pytest.approx([0.5, 2.5, 2.5])
    # c = 0.25: between momentum steps d gains c * beta * m; at them the momentum's
    # coefficient is (1 - c n + c) beta = 0.375
    assert _run([1, 3, 5], 2, 0.5, 0.25) == pytest.approx([0.5, 0.375 * 2 + 1.5, 0.25 + 2.5])
    assert _run([1, 3], 2, 0.5, 0.0, lr=0.7) == pytest.approx([0.35, 0.7 * 2.5])


def test_with_no_delay_it_is_optax_nesterov() -> None:
    rng = np.random.default_rng(0)
    opt = OuterOptimizer(OuterConfig(lr=0.7, momentum=0.9))
    theta = [rng.normal(size=(3, 4)).astype(np.float32)]
    mom = opt.init_momentum(theta)
    mine = theta[0].copy()
    m, buf = np.zeros_like(mine), np.zeros_like(mine)
    for t in range(4):
        g = rng.normal(size=(3, 4)).astype(np.float32)
        theta, mom = opt.step(theta, [g], mom)
        d, m, buf = delayed_nesterov(g, m, buf, t, 1, 0.9, 0.0, 0.7)
        mine = mine - d
        np.testing.assert_allclose(mine, theta[0], rtol=1e-5, atol=1e-6)


def test_settings_are_validated() -> None:
    with pytest.raises(ConfigError, match=r"sync\.outer_c: 0\.5 is out of range; allowed: "
                       r"\[0, 1 / sync\.outer_delay\] = \[0, 0\.25\]"):
        load_config(None, {"sync.outer_delay": 4, "sync.outer_c": 0.5,
                           "sync.outer_momentum": 0.9})
    with pytest.raises(ConfigError, match=r"sync\.outer_delay: delayed Nesterov needs "
                       r"sync\.outer_momentum > 0"):
        load_config(None, {"sync.outer_delay": 4})
    with pytest.raises(ConfigError, match=r"sync\.outer_delay"):
        load_config(None, {"sync.outer_delay": 0, "sync.outer_momentum": 0.9})


@pytest.mark.parametrize("down", ["fp32", "int4"])
def test_a_shard_steps_keeps_and_restores_momentum_and_buffer(down: str) -> None:
    n, beta, lr = 2, 0.5, 0.8
    with shard_core({**TINY, "sync.codec_down": down, "sync.outer_delay": n,
                     "sync.outer_momentum": beta, "sync.outer_lr": lr}) as (core, store, _):
        core.set_live({"learner-0"})
        p = 0
        shapes = core.layout.shapes(p)
        flat = core.frags[p].flat_value.copy()
        m, buf = np.zeros_like(flat), np.zeros_like(flat)
        for t in range(3):
            if t == 2:
                # a new owner takes the fragment over: momentum and buffer come from the store
                store.release_lease(0, "owner")
                epoch = store.acquire_lease(0, "owner2", 5000)
                assert epoch is not None
                core = ShardCore(core.manifest, 0, store, epoch, clock=core.clock)
                core.load(lambda: pytest.fail("must resume"))  # type: ignore[arg-type,return-value]
                core.set_live({"learner-0"})
                np.testing.assert_array_equal(core.frags[p].delayed_m, m)
                np.testing.assert_array_equal(core.frags[p].delayed_buf, buf)
            g = rand_like(core, p, t)
            core.handle(delta_frames(core, "learner-0", t + 1, p, t, g))
            assert len(core.tick()) == 1
            g_flat = np.concatenate([x.ravel() for x in g])  # a lone contribution is its own merge
            d, m, buf = delayed_nesterov(g_flat, m, buf, t, n, beta, 0.0, lr)
            flat = flat - d
            stored = store.get_latest(p)
            assert stored is not None and stored.version == t + 1
            got = np.concatenate([x.ravel() for x in decode_blob(stored.value, shapes)])
            if down == "fp32":
                np.testing.assert_allclose(got, flat, rtol=1e-5, atol=1e-6)
            else:  # int4 downlink with error feedback: within one step's quantization
                assert float(np.abs(got - flat).max()) < 0.1 * float(np.abs(d).max()) + 1e-6
                flat = got.copy()
            sm, sb = decode_blob(stored.momentum, [(flat.size,), (flat.size,)])
            np.testing.assert_allclose(sm, m, rtol=1e-6)
            np.testing.assert_allclose(sb, buf, rtol=1e-6)
            assert not buf.any() if t % 2 == 1 else buf.any()  # emptied at each momentum step
