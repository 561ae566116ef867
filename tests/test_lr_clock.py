"""The inner schedule on the run's global clock (``train.lr_clock = global``): the global step
by hand, the injected scale against optax's own rate, and the refusals. A real run with it on
is ``tests/test_adoption_run.py``'s overwrite case."""

from __future__ import annotations

import jax.numpy as jnp
import numpy as np
import pytest

from ddiloco.pipeline.errors import ConfigError
from ddiloco.workers.learner.lr_clock import global_step, schedule_share, set_lr_scale
from ddiloco.workers.run.config import load_config
from ddiloco.workers.task.model import make_optimizer, optimizer_from_config


def test_the_global_step_is_the_mean_step_of_the_m_learners() -> None:
    # own 100; learner-1 at 300, learner-2 at 200, learner-3 not heard from (counts as 100);
    # this learner's own reported entry (50) is older than its step and ignored:
    # (100 + 300 + 200 + 100) // 4 = 175
    peers = {"learner-0": 50, "learner-1": 300, "learner-2": 200}
    assert global_step(100, peers, "learner-0", 4) == 175
    assert global_step(100, {}, "learner-0", 4) == 100
    # a replacement learner reported beside the M = 2 it replaced: every one counts
    assert global_step(10, {"a": 20, "b": 31}, "me", 2) == 20  # (10 + 20 + 31) // 3


def test_the_share_follows_the_schedule_at_the_step_given() -> None:
    train = load_config(None, {"train.steps": 100, "train.warmup_steps": 10,
                               "train.lr_floor": 0.1, "train.schedule": "linear"}).train
    assert schedule_share(train, 0) == pytest.approx(0.0)
    assert schedule_share(train, 5) == pytest.approx(0.5)
    assert schedule_share(train, 10) == pytest.approx(1.0)
    assert schedule_share(train, 55) == pytest.approx(0.55)  # halfway down from 1 to 0.1
    assert schedule_share(train, 500) == pytest.approx(0.1)


def test_the_injected_scale_is_optax_at_that_rate() -> None:
    params = {"w": jnp.asarray(np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4))}
    grads = {"w": jnp.asarray(np.cos(np.arange(12, dtype=np.float32)).reshape(3, 4))}
    # peak 1e-2 at a share of 0.3 against optax's AdamW at a constant 3e-3 (decay included)
    ref = make_optimizer(3e-3, 0, 0.1, clip=None)
    glob = make_optimizer(1e-2, 0, 0.1, clip=None, clock="global")
    state = glob.init(params)
    set_lr_scale(state, 0.3)
    for _ in range(3):
        want, _ = ref.update(grads, ref.init(params), params)
        got, state = glob.update(grads, state, params)
    np.testing.assert_allclose(got["w"], want["w"], rtol=1e-5)
    set_lr_scale(state, 0.0)
    got, _ = glob.update(grads, state, params)
    assert not np.any(np.asarray(got["w"]))


def test_a_state_without_the_scale_is_refused_and_dp_keeps_its_own_clock() -> None:
    own = make_optimizer(1e-3, 0, 0.1)
    with pytest.raises(ConfigError, match=r"train\.lr_clock=global: the inner optimizer has no "
                       r"injected update scale"):
        set_lr_scale(own.init({"w": jnp.zeros(3)}), 0.5)
    train = load_config(None, {"train.lr_clock": "global"}).train
    dp_state = optimizer_from_config(train, dp=True).init({"w": jnp.zeros(3)})
    with pytest.raises(ConfigError):
        set_lr_scale(dp_state, 0.5)
    set_lr_scale(optimizer_from_config(train).init({"w": jnp.zeros(3)}), 0.5)
    with pytest.raises(ConfigError, match=r"train\.lr_clock: 'mine' is not a valid choice"):
        load_config(None, {"train.lr_clock": "mine"})
    with pytest.raises(ConfigError, match=r"train\.lr_clock: unknown 'x'"):
        make_optimizer(1e-3, 0, 0.1, clock="x")
