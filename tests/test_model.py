"""Tests of workers.task.model: shapes, determinism, initial loss, learning, step equivalence."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest

from ddiloco.pipeline.errors import ConfigError
from ddiloco.workers.task import model as M

# Small enough that every jitted function compiles in about a second.
CFG = M.ModelConfig(d_model=32, n_layers=1, n_heads=2, d_ff=64, seq_len=16)
B = 4


def _batch(seed: int = 0, cfg: M.ModelConfig = CFG) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, 256, (B, cfg.seq_len + 1), dtype=np.int32)


def _repetitive_batch(cfg: M.ModelConfig = CFG) -> np.ndarray:
    text = np.frombuffer(b"abcdefgh" * 64, dtype=np.uint8).astype(np.int32)
    return np.stack([text[i : i + cfg.seq_len + 1] for i in range(B)])


def test_preset_param_counts() -> None:
    tiny, small = M.param_count(M.PRESETS["tiny"]), M.param_count(M.PRESETS["small"])
    print(f"tiny: {tiny:,} params, small: {small:,} params")
    assert 0.8e6 <= tiny <= 1.5e6
    assert 8e6 <= small <= 13e6


def test_param_count_matches_init() -> None:
    params = M.init_params(CFG, seed=0)
    assert sum(p.size for p in params.values()) == M.param_count(CFG)
    assert {n: p.shape for n, p in params.items()} == M.param_shapes(CFG)
    assert all(p.dtype == np.float32 for p in params.values())
    assert M.embedding_names(CFG) <= params.keys()
    assert {"embed", "pos_embed", "blocks.0.attn.wqkv", "blocks.0.mlp.w_out"} <= params.keys()
    assert "ln_f.scale" in params


def test_init_is_deterministic() -> None:
    a, b, c = M.init_params(CFG, 7), M.init_params(CFG, 7), M.init_params(CFG, 8)
    assert all(np.array_equal(a[n], b[n]) for n in a)
    assert not np.array_equal(a["embed"], c["embed"])
    # A tensor's value depends on its name, not on which other tensors exist.
    deeper = M.init_params(M.ModelConfig(d_model=32, n_layers=3, n_heads=2, d_ff=64, seq_len=16), 7)
    assert np.array_equal(a["blocks.0.attn.wqkv"], deeper["blocks.0.attn.wqkv"])


def test_forward_shape_and_causality() -> None:
    params = M.init_params(CFG, 0)
    tokens = _batch()[:, :-1]
    forward = jax.jit(M.forward, static_argnums=2)
    logits = np.asarray(forward(params, tokens, CFG))
    assert logits.shape == (B, CFG.seq_len, CFG.vocab) and logits.dtype == np.float32
    changed = tokens.copy()
    changed[:, -1] = (changed[:, -1] + 1) % 256  # only the last position differs
    logits2 = np.asarray(forward(params, changed, CFG))
    np.testing.assert_allclose(logits[:, :-1], logits2[:, :-1], rtol=1e-5, atol=1e-5)
    assert not np.allclose(logits[:, -1], logits2[:, -1])


def test_initial_loss_is_uniform() -> None:
    loss = float(M.make_eval_fn(CFG)(M.init_params(CFG, 0), _batch()))
    assert abs(loss - math.log(256)) < 0.3


def test_training_reduces_loss() -> None:
    opt = M.make_optimizer(lr=3e-3, warmup_steps=5, weight_decay=0.0)
    params = jax.device_put(M.init_params(CFG, 0))
    state = opt.init(params)
    step = M.make_train_step(CFG, opt)
    batch = _repetitive_batch()
    losses = []
    for _ in range(30):
        params, state, loss = step(params, state, batch)
        losses.append(float(loss))
    assert losses[-1] < losses[0] - 1.5, losses


def test_grad_and_apply_equal_train_step() -> None:
    opt = M.make_optimizer(lr=1e-3, warmup_steps=2, weight_decay=0.1, clip=0.5)
    init = M.init_params(CFG, 3)
    batch = _batch(1)

    p1 = jax.device_put(init)
    s1 = opt.init(p1)
    p2 = jax.device_put(init)
    s2 = opt.init(p2)
    train, grad, apply = M.make_train_step(CFG, opt), M.make_grad_step(CFG), M.make_apply_step(opt)
    for _ in range(3):
        p1, s1, loss1 = train(p1, s1, batch)
        grads, loss2 = grad(p2, batch)
        p2, s2 = apply(p2, s2, grads)
        np.testing.assert_allclose(float(loss1), float(loss2), rtol=1e-5)
    for name in init:
        np.testing.assert_allclose(np.asarray(p1[name]), np.asarray(p2[name]), atol=1e-6)


def test_clip_by_tensor_norm() -> None:
    clip = M.clip_by_tensor_norm(1.0)
    grads = {"a": np.full((4,), 1.0, np.float32), "b": np.full((4,), 0.1, np.float32)}
    out, _ = clip.update(grads, clip.init(grads))
    np.testing.assert_allclose(np.linalg.norm(out["a"]), 1.0, rtol=1e-6)  # norm 2 -> 1
    np.testing.assert_allclose(out["b"], grads["b"])  # norm 0.2 is under the bound


def test_schedule_warmup_then_constant() -> None:
    sched = M.lr_schedule(1e-3, warmup_steps=10)
    assert float(sched(0)) == 0.0
    np.testing.assert_allclose(float(sched(5)), 5e-4, rtol=1e-6)
    np.testing.assert_allclose(float(sched(10_000)), 1e-3, rtol=1e-6)
    cosine = M.lr_schedule(1e-3, warmup_steps=10, total_steps=110)
    np.testing.assert_allclose(float(cosine(110)), 1e-4, rtol=1e-5)


@pytest.mark.parametrize(
    ("kwargs", "field"),
    [
        ({"d_model": 30, "n_heads": 4}, "n_heads"),
        ({"n_layers": 0}, "n_layers"),
        ({"vocab": -1}, "vocab"),
        ({"seq_len": 1.5}, "seq_len"),
        ({"d_ff": True}, "d_ff"),
    ],
)
def test_config_validation_names_the_field(kwargs: dict, field: str) -> None:
    with pytest.raises(ConfigError, match=field):
        M.ModelConfig(**kwargs)


def test_optimizer_validation() -> None:
    with pytest.raises(ConfigError, match="lr"):
        M.make_optimizer(lr=0.0, warmup_steps=0, weight_decay=0.0)
    with pytest.raises(ConfigError, match="clip"):
        M.make_optimizer(lr=1e-3, warmup_steps=0, weight_decay=0.0, clip=0.0)


def test_sequence_longer_than_context_is_rejected() -> None:
    with pytest.raises(ConfigError, match="seq_len"):
        M.forward(M.init_params(CFG, 0), np.zeros((1, CFG.seq_len + 1), np.int32), CFG)


def test_generate_returns_n_new_bytes() -> None:
    params = M.init_params(CFG, 0)
    out = M.generate(params, CFG, b"To be, or not to be" * 2, n_new=8, temperature=1.0, seed=0)
    assert isinstance(out, bytes) and len(out) == 8
    again = M.generate(params, CFG, b"To be, or not to be" * 2, n_new=8, temperature=1.0, seed=0)
    assert out == again
    assert len(M.generate(params, CFG, b"", n_new=3, temperature=0.0, seed=0)) == 3


def test_lr_schedules_decay_to_the_floor() -> None:
    cos = M.lr_schedule(1.0, 10, 110, final_fraction=0.1, kind="cosine")
    lin = M.lr_schedule(1.0, 10, 110, final_fraction=0.1, kind="linear")
    const = M.lr_schedule(1.0, 10, 110, kind="constant")
    assert float(cos(5)) == pytest.approx(0.5) and float(lin(5)) == pytest.approx(0.5)
    assert float(cos(10)) == pytest.approx(1.0) and float(lin(10)) == pytest.approx(1.0)
    # half-way through the decay: cosine at (1 + 0.1) / 2, linear at the same mid-point
    assert float(cos(60)) == pytest.approx(0.55, abs=1e-6)
    assert float(lin(60)) == pytest.approx(0.55, abs=1e-6)
    assert float(cos(110)) == pytest.approx(0.1) and float(lin(200)) == pytest.approx(0.1)
    assert float(const(500)) == pytest.approx(1.0)
    with pytest.raises(ConfigError, match="schedule"):
        M.lr_schedule(1.0, 10, 110, kind="step")


def test_optimizer_from_config_uses_dp_lr_only_for_the_baseline() -> None:
    from ddiloco.workers.run.config import load_config

    cfg = load_config(None, {"train.lr": 1e-3, "train.dp_lr": 4e-3, "train.warmup_steps": 0,
                             "train.schedule": "constant", "train.clip": None,
                             "train.weight_decay": 0.0})
    params = {"w": jax.numpy.ones((2, 2))}
    grads = {"w": jax.numpy.ones((2, 2))}
    for dp, lr in ((False, 1e-3), (True, 4e-3)):
        tx = M.optimizer_from_config(cfg.train, dp=dp)
        upd, _ = tx.update(grads, tx.init(params), params)
        # Adam's first step moves every coordinate by lr (unit gradient, no decay)
        np.testing.assert_allclose(np.asarray(upd["w"]), -lr, rtol=1e-3)


def test_both_modes_warm_up_for_the_fraction_of_their_steps() -> None:
    from ddiloco.workers.run.config import load_config

    # 0.25 of 40 steps: 10 steps of linear warm-up, so the 5th update is half the peak rate
    cfg = load_config(None, {"train.lr": 1e-3, "train.dp_lr": 4e-3, "train.steps": 40,
                             "train.warmup_fraction": 0.25, "train.schedule": "constant",
                             "train.clip": None, "train.weight_decay": 0.0})
    params = {"w": jax.numpy.ones((2, 2))}
    grads = {"w": jax.numpy.ones((2, 2))}
    for dp, lr in ((False, 1e-3), (True, 4e-3)):
        tx = M.optimizer_from_config(cfg.train, dp=dp)
        state = tx.init(params)
        for _ in range(5):
            upd, state = tx.update(grads, state, params)
        # Adam's step with a constant unit gradient is the scheduled rate at step 4 of 10
        np.testing.assert_allclose(np.asarray(upd["w"]), -lr * 4 / 10, rtol=1e-3)
