"""Muon as the inner optimizer (``train.optimizer = "muon"``): which tensors it takes, that the
others keep AdamW's exact update, and that the setting reaches both modes' optimizer."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest

from ddiloco.pipeline.errors import ConfigError
from ddiloco.workers.run.config import load_config
from ddiloco.workers.task.model import (
    _muon_labels,
    init_params,
    make_optimizer,
    optimizer_from_config,
)

SMALL = {"model.d_model": 16, "model.n_layers": 1, "model.n_heads": 2, "model.d_ff": 32,
         "model.seq_len": 16}


def _params() -> dict[str, jax.Array]:
    cfg = load_config(None, SMALL)
    return {k: jax.numpy.asarray(v) for k, v in init_params(cfg.model_config_obj(), 0).items()}


def _updates(tx: optax.GradientTransformation, params: dict[str, jax.Array],
             steps: int = 3) -> dict[str, np.ndarray]:
    rng = np.random.default_rng(0)
    state = tx.init(params)
    for _ in range(steps):
        grads = {k: jax.numpy.asarray(rng.normal(size=v.shape).astype(np.float32))
                 for k, v in params.items()}
        updates, state = tx.update(grads, state, params)
    return {k: np.asarray(v) for k, v in updates.items()}


def test_muon_takes_the_blocks_matrices_only() -> None:
    labels = _muon_labels(_params())
    assert labels["embed"] == "adamw" and labels["pos_embed"] == "adamw"  # tied output head
    assert labels["blocks.0.ln1.scale"] == "adamw" and labels["ln_f.scale"] == "adamw"
    assert labels["blocks.0.attn.wqkv"] == "muon" and labels["blocks.0.mlp.w_out"] == "muon"


def test_other_tensors_keep_adamws_update_and_matrices_are_orthogonalized() -> None:
    params = _params()
    kw = {"lr": 1e-2, "warmup_steps": 0, "weight_decay": 0.1, "total_steps": 100, "clip": None}
    adamw = _updates(make_optimizer(**kw), params)
    muon = _updates(make_optimizer(**kw, optimizer="muon"), params)
    for name in ("embed", "pos_embed", "blocks.0.ln1.scale"):
        np.testing.assert_allclose(muon[name], adamw[name], rtol=1e-6, atol=1e-9)
    # Muon's update of a matrix is (near) orthogonal: its singular values are close to each
    # other, where AdamW's sign-like update of random gradients spreads them out
    w = params["blocks.0.attn.wo"]
    sv_muon = np.linalg.svd(muon["blocks.0.attn.wo"] + 0.1 * 1e-2 * np.asarray(w),
                            compute_uv=False)
    sv_adamw = np.linalg.svd(adamw["blocks.0.attn.wo"], compute_uv=False)
    assert sv_muon.max() / sv_muon.min() < 2.0 < sv_adamw.max() / sv_adamw.min()


def test_the_setting_reaches_both_modes_and_is_validated() -> None:
    cfg = load_config(None, {**SMALL, "train.optimizer": "muon"})
    params = _params()
    for dp in (False, True):
        state = optimizer_from_config(cfg.train, dp=dp).init(params)
        assert "muon" in repr(state).lower()
    with pytest.raises(ConfigError, match=r"train\.optimizer: 'sgd' is not a valid choice"):
        load_config(None, {"train.optimizer": "sgd"})
    with pytest.raises(ConfigError, match=r"train\.optimizer: unknown 'sgd'"):
        make_optimizer(1e-3, 0, 0.0, optimizer="sgd")
