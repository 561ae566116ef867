"""The built-in byte-level GPT in PyTorch: a twin of :mod:`ddiloco.workers.task.model`.

One idea: the same function with the same parameters. :class:`TorchGPT` has the JAX model's
parameter names (``named_parameters()`` == :func:`ddiloco.workers.task.gpt_params.param_shapes`,
in order), shapes, initial values (:func:`ddiloco.workers.task.gpt_params.init_params`, bit for
bit) and math: pre-norm blocks of RMSNorm (eps 1e-6), causal multi-head attention (scale
1/sqrt(K)), a tanh-GELU MLP, learned positions and a token embedding tied with the output head;
no biases, float32. Its loss is the same mean next-byte cross-entropy (nats/byte) and
:func:`torch_optimizer` the same AdamW (betas, eps, weight decay on tensors of ndim >= 2,
warm-up and decay, per-tensor clipping) as
:func:`ddiloco.workers.task.model.optimizer_from_config`. So learners of both frameworks train
one run and exchange outer gradients through the same shards
(:mod:`ddiloco.workers.task.torch_api`); ``tests/test_torch_gpt.py`` measures the agreement
(loss, gradients and AdamW steps within float32 rounding).

Shapes are in names (nanodo style): ``B`` batch, ``L`` sequence length, ``D`` model width,
``H`` heads, ``K`` head width, ``F`` MLP width, ``V`` vocabulary.

Importing this module imports torch (a :class:`TaskError` naming the extra when it is missing),
never JAX.
"""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import Any

import numpy as np

from ddiloco.workers.task.api import TaskContext, TaskError
from ddiloco.workers.task.gpt import gpt_data
from ddiloco.workers.task.gpt_params import (
    _NORM_EPS,
    ModelConfig,
    embedding_names,
    init_params,
    model_config_of,
)
from ddiloco.workers.task.torch_api import TORCH_EXTRA, TorchTask, warmup_decay

try:
    import torch
    import torch.nn.functional as F
    from torch import nn
except ImportError as _exc:  # pragma: no cover - exercised only without the extra
    raise TaskError(f"the PyTorch GPT needs torch: {TORCH_EXTRA} ({_exc})") from None

__all__ = ["TorchGPT", "gpt_torch_task", "loss", "torch_optimizer"]

#: Adam's denominator epsilon: :func:`ddiloco.workers.task.model.make_optimizer`'s default, the
#: value the JAX learners run with (the ``train`` section has no field for it)
ADAM_EPS = 1e-8


class RMSNorm(nn.Module):
    """RMSNorm (arXiv 1910.07467): ``x * rsqrt(mean(x^2) + 1e-6) * scale``, one ``scale`` [D]."""

    def __init__(self, d_model: int) -> None:
        super().__init__()
        self.scale = nn.Parameter(torch.ones(d_model, dtype=torch.float32))

    def forward(self, x_BxLxD: torch.Tensor) -> torch.Tensor:
        """Normalised ``x_BxLxD`` (any leading shape, last dimension D)."""
        ms_BxLx1 = x_BxLxD.square().mean(dim=-1, keepdim=True)
        return x_BxLxD * torch.rsqrt(ms_BxLx1 + _NORM_EPS) * self.scale


class Attention(nn.Module):
    """Causal multi-head self-attention with a fused QKV projection: parameters ``wqkv``
    [D, 3D] and ``wo`` [D, D], applied as ``x @ W``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        d = cfg.d_model
        self.n_heads, self.head_dim = cfg.n_heads, cfg.head_dim
        self.wqkv = nn.Parameter(torch.zeros(d, 3 * d, dtype=torch.float32))
        self.wo = nn.Parameter(torch.zeros(d, d, dtype=torch.float32))

    def forward(self, x_BxLxD: torch.Tensor) -> torch.Tensor:
        """float32 [B, L, D] -> [B, L, D]; position i attends to positions 0..i."""
        b, seq, d = x_BxLxD.shape
        h, k = self.n_heads, self.head_dim
        qkv_3xBxHxLxK = (x_BxLxD @ self.wqkv).reshape(b, seq, 3, h, k).permute(2, 0, 3, 1, 4)
        # The fused kernel's scale defaults to 1/sqrt(K), as the JAX model's; it agrees with the
        # written-out softmax within float32 rounding (tests/test_torch_gpt.py).
        o_BxHxLxK = F.scaled_dot_product_attention(
            qkv_3xBxHxLxK[0], qkv_3xBxHxLxK[1], qkv_3xBxHxLxK[2], is_causal=True)
        return o_BxHxLxK.transpose(1, 2).reshape(b, seq, d) @ self.wo


class MLP(nn.Module):
    """GELU MLP (tanh approximation): parameters ``w_in`` [D, F] and ``w_out`` [F, D]."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        self.w_in = nn.Parameter(torch.zeros(cfg.d_model, cfg.d_ff, dtype=torch.float32))
        self.w_out = nn.Parameter(torch.zeros(cfg.d_ff, cfg.d_model, dtype=torch.float32))

    def forward(self, x_BxLxD: torch.Tensor) -> torch.Tensor:
        """float32 [B, L, D] -> [B, L, D]."""
        return F.gelu(x_BxLxD @ self.w_in, approximate="tanh") @ self.w_out


class Block(nn.Module):
    """One pre-norm transformer block: ``x + attn(ln1(x))``, then ``x + mlp(ln2(x))``."""

    def __init__(self, cfg: ModelConfig) -> None:
        super().__init__()
        # Registration order is the parameters' order: ln1, attn, ln2, mlp (param_shapes').
        self.ln1 = RMSNorm(cfg.d_model)
        self.attn = Attention(cfg)
        self.ln2 = RMSNorm(cfg.d_model)
        self.mlp = MLP(cfg)

    def forward(self, x_BxLxD: torch.Tensor) -> torch.Tensor:
        """float32 [B, L, D] -> [B, L, D]."""
        x_BxLxD = x_BxLxD + self.attn(self.ln1(x_BxLxD))
        return x_BxLxD + self.mlp(self.ln2(x_BxLxD))


class TorchGPT(nn.Module):
    """The byte-level GPT of :mod:`ddiloco.workers.task.model` as an ``nn.Module``.

    Parameters (``named_parameters()``, in this order, as ``param_shapes(cfg)``): ``embed``
    [V, D] (also the output head), ``pos_embed`` [L, D], per block ``blocks.<i>.ln1.scale``
    [D], ``blocks.<i>.attn.wqkv`` [D, 3D], ``blocks.<i>.attn.wo`` [D, D], ``blocks.<i>.ln2.scale``
    [D], ``blocks.<i>.mlp.w_in`` [D, F], ``blocks.<i>.mlp.w_out`` [F, D], then ``ln_f.scale``
    [D]. All float32, on the CPU until moved.

    Args:
        cfg: model shape.
        seed: the initial values are ``init_params(cfg, seed)``, bit-identical to the JAX
            model's.

    Raises:
        ddiloco.pipeline.errors.ConfigError: a negative seed.
    """

    def __init__(self, cfg: ModelConfig, seed: int = 0) -> None:
        super().__init__()
        self.cfg = cfg
        self.embed = nn.Parameter(torch.zeros(cfg.vocab, cfg.d_model, dtype=torch.float32))
        self.pos_embed = nn.Parameter(torch.zeros(cfg.seq_len, cfg.d_model, dtype=torch.float32))
        self.blocks = nn.ModuleList(Block(cfg) for _ in range(cfg.n_layers))
        self.ln_f = RMSNorm(cfg.d_model)
        self.load_values(init_params(cfg, seed))

    @torch.no_grad()
    def load_values(self, values: dict[str, np.ndarray]) -> None:
        """Copy float32 host arrays into the parameters of the same names.

        Raises:
            TaskError: a missing or unknown name, or a shape that differs.
        """
        params = dict(self.named_parameters())
        if set(values) != set(params):
            raise TaskError(f"TorchGPT.load_values: names differ: missing "
                            f"{sorted(set(params) - set(values))}, unknown "
                            f"{sorted(set(values) - set(params))}")
        for name, p in params.items():
            value = torch.from_numpy(np.ascontiguousarray(values[name], dtype=np.float32))
            if tuple(value.shape) != tuple(p.shape):
                raise TaskError(f"TorchGPT.load_values: {name!r} has shape "
                                f"{tuple(value.shape)}, the parameter {tuple(p.shape)}")
            p.copy_(value)

    def forward(self, tokens_BxL: torch.Tensor) -> torch.Tensor:
        """Next-byte logits.

        Args:
            tokens_BxL: integer byte values in [0, V), shape [B, L] with L <= ``cfg.seq_len``,
                on the module's device.

        Returns:
            float32 logits [B, L, V]; position i predicts byte i + 1.

        Raises:
            TaskError: L exceeds ``cfg.seq_len``.
        """
        seq = tokens_BxL.shape[1]
        if seq > self.cfg.seq_len:
            raise TaskError(f"sequence length {seq} exceeds ModelConfig.seq_len="
                            f"{self.cfg.seq_len}")
        x_BxLxD = F.embedding(tokens_BxL, self.embed) + self.pos_embed[:seq]
        for block in self.blocks:
            x_BxLxD = block(x_BxLxD)
        return self.ln_f(x_BxLxD) @ self.embed.T  # tied output head


def loss(module: nn.Module, batch: Any) -> torch.Tensor:
    """Mean next-byte cross-entropy of a :class:`TorchGPT` (``TorchTask.loss``).

    Args:
        module: the model (any module mapping int64 [B, L] to logits [B, L, V]).
        batch: integer windows of L + 1 bytes, [B, L + 1] (numpy array or tensor): inputs are
            bytes [0, L), targets bytes [1, L + 1). Moved to the module's device.

    Returns:
        float32 scalar tensor, nats per byte (a uniform model scores ln(256) = 5.545).
    """
    device = next(module.parameters()).device
    batch_BxL1 = torch.as_tensor(batch, device=device).long()
    logits_BxLxV = module(batch_BxL1[:, :-1])
    return F.cross_entropy(logits_BxLxV.float().flatten(0, 1), batch_BxL1[:, 1:].flatten())


def torch_optimizer(train: Any, dp: bool = False
                    ) -> tuple[Callable[[nn.Module], torch.optim.Optimizer],
                               Callable[[int], float], float | None]:
    """The inner optimizer of a run's ``train`` section for a PyTorch learner: the twin of
    :func:`ddiloco.workers.task.model.optimizer_from_config` with ``train.optimizer = adamw``.

    Args:
        train: :class:`ddiloco.workers.run.config.TrainSection`.
        dp: the data-parallel baseline (peak rate ``train.dp_lr`` when set; the schedule follows
            the optimizer's own steps, as the JAX baseline's).

    Returns:
        ``(optimizer, schedule, clip)`` for :class:`TorchTask`: ``optimizer(module)`` is
        ``torch.optim.AdamW`` at the peak rate with betas ``(b1, b2)`` and eps
        :data:`ADAM_EPS`, in two groups: tensors of ndim >= 2 with ``weight_decay``, the
        others (norm scales) without; ``schedule(step)`` the rate's factor at inner step
        ``step`` (:func:`warmup_decay`: warm-up, then ``train.schedule`` down to
        ``train.lr_floor`` at ``train.steps``); ``clip`` the per-tensor gradient norm bound
        ``train.clip`` (None: none).

    Raises:
        TaskError: ``train.optimizer`` is not adamw, or ``train.lr_clock`` is global (outside
            ``dp``): PyTorch learners support adamw with lr_clock=own.
    """
    if train.optimizer != "adamw":
        raise TaskError(f"train.optimizer: {train.optimizer!r} is not available to PyTorch "
                        "learners; they support train.optimizer=adamw with train.lr_clock=own")
    if not dp and train.lr_clock != "own":
        raise TaskError(f"train.lr_clock: {train.lr_clock!r} is not available to PyTorch "
                        "learners; they support train.optimizer=adamw with train.lr_clock=own")
    lr = float(train.dp_lr if dp and train.dp_lr is not None else train.lr)
    betas = (float(train.b1), float(train.b2))
    weight_decay = float(train.weight_decay)

    def optimizer(module: nn.Module) -> torch.optim.Optimizer:
        params = list(module.parameters())
        groups = [{"params": [p for p in params if p.ndim >= 2], "weight_decay": weight_decay},
                  {"params": [p for p in params if p.ndim < 2], "weight_decay": 0.0}]
        return torch.optim.AdamW([g for g in groups if g["params"]], lr=lr, betas=betas,
                                 eps=ADAM_EPS)

    schedule = warmup_decay(lr, train.warmup, train.steps, train.lr_floor,
                            train.schedule)
    return optimizer, schedule, train.clip


def gpt_torch_task(ctx: TaskContext) -> TorchTask:
    """The built-in GPT task of ``ctx.config`` for PyTorch learners: the model, data, loss and
    optimizer of :func:`ddiloco.workers.task.gpt.gpt_task`, so both tasks train one run.

    Raises:
        TaskError: an inner optimizer PyTorch learners lack (:func:`torch_optimizer`).
        ddiloco.pipeline.errors.ConfigError: an invalid model shape; (on first use of the data)
            a corpus too small for the windows.
        ddiloco.pipeline.errors.CorpusUnavailable: (on first use of the data) the corpus cannot
            be read or fetched.
    """
    cfg = ctx.config
    mcfg = model_config_of(cfg.model)
    t = cfg.train
    optimizer, schedule, clip = torch_optimizer(t, dp=cfg.run.mode == "dp")
    batches, eval_batches = gpt_data(cfg, mcfg.seq_len)
    return TorchTask(
        model=functools.partial(TorchGPT, mcfg, seed=ctx.seed),
        optimizer=optimizer,
        loss=loss,
        batches=batches,
        tokens_per_batch=t.batch_size * mcfg.seq_len,
        schedule=schedule,
        clip=clip,
        embeddings=sorted(embedding_names(mcfg)),
        eval_batches=eval_batches,
        name=f"gpt-{cfg.model.preset}",
        loss_unit="nats/byte",  # next-byte cross-entropy: a token is a byte
        device=None,
    )
