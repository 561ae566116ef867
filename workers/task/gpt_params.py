"""The built-in GPT's shape and initial parameters, in numpy only: names, shapes, values.

One idea: everything a process needs to know about the byte-level GPT's parameters without
running it: :class:`ModelConfig` (the shape), :data:`PRESETS`, :func:`param_shapes` (the flat
names, e.g. ``"blocks.0.attn.wqkv"``, and shapes in canonical order), :func:`embedding_names`
and :func:`init_params` (float32, bit-identical on any machine). The JAX model
(:mod:`ddiloco.workers.task.model`, which re-exports all of these) and its PyTorch twin
(:mod:`ddiloco.workers.task.torch_gpt`) build on it, so a PyTorch learner never imports JAX
and both frameworks start from the same values.

Shapes are in names (nanodo style): ``L`` sequence length, ``D`` model width, ``F`` MLP width,
``V`` vocabulary.
"""

from __future__ import annotations

import math
import zlib
from dataclasses import dataclass
from typing import Any

import numpy as np

from ddiloco.pipeline.errors import ConfigError

# Initialisation scale of GPT-2 (Radford et al., 2019): N(0, 0.02) for every matrix, and the
# residual output projections further scaled by 1/sqrt(2 * n_layers) so the residual stream's
# variance does not grow with depth.
_INIT_STD = 0.02
_NORM_EPS = 1e-6


@dataclass(frozen=True)
class ModelConfig:
    """Shape of the transformer.

    Attributes:
        vocab: vocabulary size; 256 for raw bytes.
        d_model: residual stream width D.
        n_layers: number of transformer blocks.
        n_heads: attention heads H; ``d_model`` must be divisible by it.
        d_ff: hidden width F of the MLP.
        seq_len: maximum context L (number of learned positions).

    Raises:
        ConfigError: if a field is not a positive integer or ``d_model % n_heads != 0``; the
            message names the field.
    """

    vocab: int = 256
    d_model: int = 128
    n_layers: int = 4
    n_heads: int = 4
    d_ff: int = 512
    seq_len: int = 128

    def __post_init__(self) -> None:
        for name in ("vocab", "d_model", "n_layers", "n_heads", "d_ff", "seq_len"):
            value = getattr(self, name)
            # bool is an int subclass; True as a layer count is a bug, not a config.
            if not isinstance(value, int) or isinstance(value, bool) or value <= 0:
                raise ConfigError(f"ModelConfig.{name} must be a positive int, got {value!r}")
        if self.d_model % self.n_heads != 0:
            raise ConfigError(
                f"ModelConfig.d_model ({self.d_model}) must be divisible by "
                f"ModelConfig.n_heads ({self.n_heads})"
            )

    @property
    def head_dim(self) -> int:
        """Width K of one attention head."""
        return self.d_model // self.n_heads


PRESETS: dict[str, ModelConfig] = {
    # 0.83M parameters, the default. Context 64 bytes: at an equal token budget (1M tokens of
    # one non-IID Shakespeare shard) it reached a lower held-out loss than 128 (1.997 vs 2.077
    # nats/byte at 512 tokens/step), with half the attention cost and activation memory.
    "tiny": ModelConfig(seq_len=64),
    # 10.8M parameters.
    "small": ModelConfig(d_model=384, n_layers=6, n_heads=6, d_ff=1536, seq_len=256),
}


def param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Name -> shape of every parameter tensor, in a fixed canonical order.

    Args:
        cfg: model shape.

    Returns:
        Insertion order is embeddings, blocks in order, final norm.
    """
    d, f = cfg.d_model, cfg.d_ff
    shapes: dict[str, tuple[int, ...]] = {
        "embed": (cfg.vocab, d),
        "pos_embed": (cfg.seq_len, d),
    }
    for i in range(cfg.n_layers):
        p = f"blocks.{i}."
        shapes[p + "ln1.scale"] = (d,)
        shapes[p + "attn.wqkv"] = (d, 3 * d)
        shapes[p + "attn.wo"] = (d, d)
        shapes[p + "ln2.scale"] = (d,)
        shapes[p + "mlp.w_in"] = (d, f)
        shapes[p + "mlp.w_out"] = (f, d)
    shapes["ln_f.scale"] = (d,)
    return shapes


def param_count(cfg: ModelConfig) -> int:
    """Total number of scalar parameters (the tied head is counted once)."""
    return sum(math.prod(s) for s in param_shapes(cfg).values())


def embedding_names(cfg: ModelConfig) -> frozenset[str]:
    """Names of the embedding tensors, merged by token-weighted average instead of RDA.

    The token embedding doubles as the output head (tied), so it is in this set; the learned
    positional embedding is too (DESIGN §2, syncer round step 4).
    """
    del cfg  # same names for every shape; the argument keeps the call site explicit
    return frozenset({"embed", "pos_embed"})


def init_params(cfg: ModelConfig, seed: int) -> dict[str, np.ndarray]:
    """Deterministic float32 initial parameters, bit-identical on any machine.

    Each tensor draws from its own ``np.random.default_rng([seed, crc32(name)])`` so a tensor's
    initial value depends only on (seed, name, shape), not on the order of the others.

    Args:
        cfg: model shape.
        seed: non-negative seed.

    Returns:
        Flat name -> float32 array, shapes as :func:`param_shapes`. Norm scales are ones, matrices
        N(0, 0.02), residual output projections N(0, 0.02 / sqrt(2 * n_layers)).
    """
    if seed < 0:
        raise ConfigError(f"seed must be non-negative, got {seed}")
    residual_std = _INIT_STD / math.sqrt(2 * cfg.n_layers)
    params: dict[str, np.ndarray] = {}
    for name, shape in param_shapes(cfg).items():
        if name.endswith(".scale"):
            params[name] = np.ones(shape, dtype=np.float32)
            continue
        std = residual_std if name.endswith(("attn.wo", "mlp.w_out")) else _INIT_STD
        rng = np.random.default_rng([seed, zlib.crc32(name.encode())])
        # Draw in float64 then cast: numpy documents the float64 stream as its stable one.
        params[name] = (rng.standard_normal(shape) * std).astype(np.float32)
    return params


def model_config_of(section: Any) -> ModelConfig:
    """The :class:`ModelConfig` of a run's ``model`` section
    (:class:`ddiloco.workers.run.config.ModelSection`): its preset with the fields it sets.

    Args:
        section: has ``preset`` (a key of :data:`PRESETS`) and the optional overrides
            ``vocab``... ``seq_len`` (None: the preset's); read by ``model_dump()``.

    Raises:
        ConfigError: an invalid combination (e.g. ``d_model`` not divisible by ``n_heads``).
    """
    base = PRESETS[section.preset]
    overrides = {k: v for k, v in section.model_dump().items()
                 if k != "preset" and k in base.__dataclass_fields__ and v is not None}
    return ModelConfig(**{**base.__dict__, **overrides})
