"""Byte-level decoder-only transformer in plain JAX, and its inner optimizer.

The model is a GPT-2-style pre-norm transformer (Radford et al., 2019) over raw bytes
(vocabulary 256): learned positional embeddings, causal multi-head attention, a GELU MLP,
RMSNorm (Zhang & Sennrich, 2019, arXiv 1910.07467) instead of LayerNorm (one tensor per norm,
fewer CPU ops) and a token embedding tied with the output head (Press & Wolf, 2017). No biases.
Everything is float32.

Parameters are a FLAT ``dict[str, array]`` (names such as ``"blocks.0.attn.wqkv"``) rather
than a nested tree: fragments, the wire format and the store all address whole tensors by name,
so a flat mapping is the one shape every part of ddiloco shares. Initialisation uses numpy's
``default_rng`` seeded per tensor name, so learners and syncers (which never run jit) agree bit
for bit on any machine.

Shapes are in names (nanodo style): ``B`` batch, ``L`` sequence length, ``D`` model width,
``H`` heads, ``K`` head width, ``F`` MLP width, ``V`` vocabulary.

The training step is a pure jitted function ``(params, opt_state, batch) -> (params, opt_state,
loss)`` with the first two arguments donated, so XLA updates the weights in place; the loss stays
a device array so the caller decides when to synchronise with the host.

CPU speed (``bench/step.py``, 2-core AMD EPYC VM, tiny preset, 4 learner processes with one
XLA thread each): about 40k trained tokens/s for the machine when the processes have it to
themselves, at any B x L from 512 to 2048 tokens per step, PROVIDED each process calls
:func:`ddiloco.workers.run.runtime.configure_cpu_runtime` first. Without its malloc tuning, steps
whose
temporaries exceed 32 MiB (B x L >= 512 at L = 128, >= 1024 at L = 64) page-fault their whole
working set every step, and B=16, L=128 falls to about 24k. Three layout choices also
measured faster on XLA:CPU: activations as 2-D [B*L, D] matrices (about 30% faster than
[B, L, D]), a fused QKV projection, and one-hot matmuls instead of gathers/scatters for the
embedding and the target logits.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable, Mapping
from typing import Any, TypeAlias

import jax
import jax.numpy as jnp
import numpy as np
import optax

from ddiloco.pipeline.errors import ConfigError

# The parameters' shape, names and initial values are numpy-only (a PyTorch learner reads them
# without JAX); re-exported here, where the rest of ddiloco has always imported them.
from ddiloco.workers.task.gpt_params import _NORM_EPS
from ddiloco.workers.task.gpt_params import PRESETS as PRESETS
from ddiloco.workers.task.gpt_params import ModelConfig as ModelConfig
from ddiloco.workers.task.gpt_params import embedding_names as embedding_names
from ddiloco.workers.task.gpt_params import init_params as init_params
from ddiloco.workers.task.gpt_params import param_count as param_count
from ddiloco.workers.task.gpt_params import param_shapes as param_shapes

Params: TypeAlias = dict[str, Any]
"""Flat mapping tensor name -> float32 array (``jax.Array`` or ``np.ndarray``)."""

TrainStep: TypeAlias = Callable[[Params, Any, Any], tuple[Params, Any, jax.Array]]
GradStep: TypeAlias = Callable[[Params, Any], tuple[Params, jax.Array]]
ApplyStep: TypeAlias = Callable[[Params, Any, Params], tuple[Params, Any]]
EvalFn: TypeAlias = Callable[[Params, Any], jax.Array]

# ----------------------------------------------------------------------------------------------
# Forward pass
# ----------------------------------------------------------------------------------------------


def _rms_norm(x_NxD: jax.Array, scale_D: jax.Array) -> jax.Array:
    """RMSNorm: x / sqrt(mean(x^2) + eps) * scale (arXiv 1910.07467)."""
    ms_Nx1 = jnp.mean(jnp.square(x_NxD), axis=-1, keepdims=True)
    return x_NxD * jax.lax.rsqrt(ms_Nx1 + _NORM_EPS) * scale_D


def _causal_softmax(s_BxHxLxL: jax.Array) -> jax.Array:
    """Row softmax over keys with a causal mask.

    Written out instead of ``jax.nn.softmax(where(mask, s, -inf))``: multiplying by the
    reciprocal of the row sum lets XLA:CPU fuse the normalisation instead of materialising a
    broadcast [B, H, L, L] denominator, and the masked entries are exactly 0 without any
    infinities (NaN-free gradients).
    """
    seq = s_BxHxLxL.shape[-1]
    causal_LxL = jnp.tril(jnp.ones((seq, seq), dtype=bool))
    s_BxHxLxL = jnp.where(causal_LxL, s_BxHxLxL, jnp.float32(-1e30))
    # The row max only shifts the exponent for stability; it does not change the result, so
    # no gradient flows through it.
    m_BxHxLx1 = jax.lax.stop_gradient(jnp.max(s_BxHxLxL, axis=-1, keepdims=True))
    e_BxHxLxL = jnp.exp(s_BxHxLxL - m_BxHxLx1)
    return e_BxHxLxL * (1.0 / jnp.sum(e_BxHxLxL, axis=-1, keepdims=True))


def _attention(
    params: Params, prefix: str, x_NxD: jax.Array, batch: int, cfg: ModelConfig
) -> jax.Array:
    """Causal multi-head self-attention with a fused QKV projection; N = B * L rows."""
    n, d = x_NxD.shape
    seq = n // batch
    h, k = cfg.n_heads, cfg.head_dim
    # One [D, 3D] matmul instead of three [D, D] ones: larger GEMMs run closer to peak on CPU.
    qkv_NxE = x_NxD @ params[prefix + "wqkv"]
    # One transpose to head-major [3, B, H, L, K] so both attention matmuls are plain batched
    # GEMMs over (B, H) with contiguous operands.
    qkv_3xBxHxLxK = qkv_NxE.reshape(batch, seq, 3, h, k).transpose(2, 0, 3, 1, 4)
    # Fold 1/sqrt(K) into q (L*K multiplies) rather than into the scores (L*L).
    q_BxHxLxK = qkv_3xBxHxLxK[0] * (1.0 / math.sqrt(k))
    k_BxHxLxK = qkv_3xBxHxLxK[1]
    v_BxHxLxK = qkv_3xBxHxLxK[2]
    s_BxHxLxL = jnp.einsum("bhqk,bhsk->bhqs", q_BxHxLxK, k_BxHxLxK)
    p_BxHxLxL = _causal_softmax(s_BxHxLxL)
    o_BxHxLxK = jnp.einsum("bhqs,bhsk->bhqk", p_BxHxLxL, v_BxHxLxK)
    o_NxD = o_BxHxLxK.transpose(0, 2, 1, 3).reshape(n, d)
    return o_NxD @ params[prefix + "wo"]


def _mlp(params: Params, prefix: str, x_NxD: jax.Array) -> jax.Array:
    """GELU MLP (tanh approximation: cheaper than erf on CPU, same quality at this scale)."""
    h_NxF = jax.nn.gelu(x_NxD @ params[prefix + "w_in"], approximate=True)
    return h_NxF @ params[prefix + "w_out"]


def forward(params: Params, tokens_BxL: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Next-byte logits.

    Activations are kept as 2-D [N, D] matrices (N = B * L) between the attention cores: every
    projection is then a plain GEMM, and its gradients are plain GEMMs too. With 3-D
    [B, L, D] operands XLA:CPU contracts the weight gradients over two dimensions, which
    measured about 30% slower for the whole step.

    Args:
        params: flat float32 parameters from :func:`init_params` (numpy or jax arrays).
        tokens_BxL: int32 byte values in [0, vocab), shape [B, L] with L <= ``cfg.seq_len``.
        cfg: model shape (static).

    Returns:
        float32 logits, shape [B, L, V]; position i predicts byte i + 1.
    """
    return _logits_NxV(params, tokens_BxL, cfg).reshape(*tokens_BxL.shape, cfg.vocab)


def _logits_NxV(params: Params, tokens_BxL: jax.Array, cfg: ModelConfig) -> jax.Array:
    """:func:`forward` with the logits left as [B * L, V]."""
    batch, seq = tokens_BxL.shape
    if seq > cfg.seq_len:
        raise ConfigError(f"sequence length {seq} exceeds ModelConfig.seq_len={cfg.seq_len}")
    d = cfg.d_model
    embed_VxD = params["embed"]
    # Embedding lookup as a one-hot matmul: with V = 256 it costs about as much as one small
    # GEMM, and its gradient is a GEMM too instead of a scatter-add.
    onehot_NxV = jax.nn.one_hot(tokens_BxL.reshape(-1), cfg.vocab, dtype=jnp.float32)
    x_BxLxD = (onehot_NxV @ embed_VxD).reshape(batch, seq, d) + params["pos_embed"][:seq]
    x_NxD = x_BxLxD.reshape(batch * seq, d)
    for i in range(cfg.n_layers):
        p = f"blocks.{i}."
        a_NxD = _attention(
            params, p + "attn.", _rms_norm(x_NxD, params[p + "ln1.scale"]), batch, cfg
        )
        x_NxD = x_NxD + a_NxD
        x_NxD = x_NxD + _mlp(params, p + "mlp.", _rms_norm(x_NxD, params[p + "ln2.scale"]))
    x_NxD = _rms_norm(x_NxD, params["ln_f.scale"])
    return x_NxD @ embed_VxD.T  # tied output head


def loss_fn(params: Params, batch_BxL1: jax.Array, cfg: ModelConfig) -> jax.Array:
    """Mean next-byte cross-entropy.

    Args:
        params: flat float32 parameters.
        batch_BxL1: int32 windows of L + 1 bytes, shape [B, L + 1]: inputs are bytes [0, L), targets
            bytes [1, L + 1).
        cfg: model shape (static).

    Returns:
        float32 scalar, nats per byte (divide by ln 2 for bits per byte). A uniform model scores
        ln(256) = 5.545.
    """
    logits_NxV = _logits_NxV(params, batch_BxL1[:, :-1], cfg)
    targets_N = batch_BxL1[:, 1:].reshape(-1)
    logz_N = jax.nn.logsumexp(logits_NxV, axis=-1)
    # One-hot dot rather than take_along_axis: its gradient is dense and fuses (no scatter).
    target_logit_N = jnp.sum(
        logits_NxV * jax.nn.one_hot(targets_N, cfg.vocab, dtype=jnp.float32), axis=-1
    )
    return jnp.mean(logz_N - target_logit_N)


# ----------------------------------------------------------------------------------------------
# Optimizer and jitted steps
# ----------------------------------------------------------------------------------------------


def clip_by_tensor_norm(max_norm: float) -> optax.GradientTransformation:
    """Scale each tensor's update so that its own L2 norm is at most ``max_norm``.

    Unlike global-norm clipping this decomposes over tensors, hence over fragments: a learner
    and a data-parallel syncer that sees only some fragments compute the same clipped values.

    Args:
        max_norm: positive norm bound per tensor.
    """
    if not max_norm > 0:
        raise ConfigError(f"clip must be positive or None, got {max_norm}")

    def clip(g: jax.Array) -> jax.Array:
        norm = jnp.sqrt(jnp.sum(jnp.square(g)))
        # max(norm, max_norm) keeps the factor at exactly 1 below the bound and avoids 0/0.
        return g * (max_norm / jnp.maximum(norm, max_norm))

    def update_fn(updates: Any, state: Any, params: Any = None) -> tuple[Any, Any]:
        del params
        return jax.tree_util.tree_map(clip, updates), state

    return optax.GradientTransformation(lambda params: optax.EmptyState(), update_fn)


def lr_schedule(
    lr: float,
    warmup_steps: int,
    total_steps: int | None = None,
    final_fraction: float = 0.1,
    kind: str = "cosine",
) -> optax.Schedule:
    """Linear warm-up from 0 to ``lr``, then constant, cosine or linear decay.

    Args:
        lr: peak learning rate.
        warmup_steps: warm-up length, inner steps.
        total_steps: the step at which the decay reaches ``final_fraction * lr`` (the run's
            ``train.steps``, known to every learner from the manifest, also after a rejoin);
            None: constant after warm-up.
        final_fraction: the floor, as a share of ``lr`` (held after ``total_steps``).
        kind: "cosine" (Loshchilov & Hutter, 2017), "linear" or "constant".

    Raises:
        ConfigError: non-positive lr, negative warm-up, unknown kind, or a decaying schedule
            whose ``total_steps`` does not exceed ``warmup_steps``.
    """
    if lr <= 0:
        raise ConfigError(f"lr must be positive, got {lr}")
    if warmup_steps < 0:
        raise ConfigError(f"warmup_steps must be non-negative, got {warmup_steps}")
    if kind not in ("cosine", "linear", "constant"):
        raise ConfigError(f"schedule: unknown {kind!r} (cosine, linear or constant)")
    if total_steps is None or kind == "constant":
        if warmup_steps == 0:
            return optax.constant_schedule(lr)
        return optax.join_schedules(
            [optax.linear_schedule(0.0, lr, warmup_steps), optax.constant_schedule(lr)],
            [warmup_steps],
        )
    if total_steps <= warmup_steps:
        raise ConfigError(f"total_steps ({total_steps}) must exceed warmup_steps ({warmup_steps})")
    if kind == "cosine":
        return optax.warmup_cosine_decay_schedule(
            0.0, lr, warmup_steps, total_steps, end_value=final_fraction * lr
        )
    return optax.join_schedules(
        [optax.linear_schedule(0.0, lr, warmup_steps),
         optax.linear_schedule(lr, final_fraction * lr, total_steps - warmup_steps)],
        [warmup_steps],
    )


def _decay_mask(params: Params) -> dict[str, bool]:
    """Weight-decay matrices and embeddings only; norm scales (1-D) are not decayed."""
    return {name: np.ndim(value) >= 2 for name, value in params.items()}


def make_optimizer(
    lr: float,
    warmup_steps: int,
    weight_decay: float,
    b1: float = 0.9,
    b2: float = 0.95,
    clip: float | None = 1.0,
    total_steps: int | None = None,
    eps: float = 1e-8,
    schedule: str = "cosine",
    final_fraction: float = 0.1,
    optimizer: str = "adamw",
    clock: str = "own",
) -> optax.GradientTransformation:
    """The inner optimizer: optional per-tensor clipping, then AdamW (or Muon and AdamW).

    Args:
        lr: peak learning rate.
        warmup_steps: linear warm-up length in inner steps.
        weight_decay: decoupled weight decay (Loshchilov & Hutter, 2019), applied to tensors with
            ndim >= 2.
        b1, b2, eps: Adam moments' decay rates and denominator epsilon.
        clip: per-tensor L2 norm bound on the gradient (:func:`clip_by_tensor_norm`); None disables
            clipping, e.g. when a data-parallel syncer clips per fragment itself.
        total_steps: None for constant after warm-up; else ``schedule`` decays to
            ``final_fraction * lr`` at this step (:func:`lr_schedule`).
        schedule: "cosine", "linear" or "constant".
        final_fraction: the decay's floor as a share of ``lr``.
        optimizer: "adamw", or "muon": Muon (``optax.contrib.muon``; MuLoCo, arXiv 2505.23725, uses
            it as DiLoCo's inner optimizer) on the blocks' weight matrices, AdamW on the embeddings
            and the norm scales. Muon's update is scaled to AdamW's RMS (``consistent_rms`` 0.2,
            Moonlight, arXiv 2502.16982), so both share ``lr``, its schedule and weight decay.
        clock: "own": the schedule follows the optimizer's step count. "global" (``train.lr_clock``,
            :mod:`ddiloco.workers.learner.lr_clock`): the optimizer runs at ``lr`` and a last stage,
            ``optax.inject_hyperparams(optax.scale)`` (initially 0), multiplies the update by the
            schedule's share of ``lr`` that the caller sets (:func:`lr_clock.set_lr_scale`).

    Returns:
        The transformation; its state is a pytree of float32 arrays and int32 counters.

    Raises:
        ConfigError: a negative weight decay or an unknown optimizer.
    """
    if weight_decay < 0:
        raise ConfigError(f"weight_decay must be non-negative, got {weight_decay}")
    if optimizer not in INNER_OPTIMIZERS:
        raise ConfigError(f"train.optimizer: unknown {optimizer!r}; expected one of "
                          f"{', '.join(INNER_OPTIMIZERS)}")
    sched = lr_schedule(lr, warmup_steps, total_steps, final_fraction, schedule)
    if clock == "global":
        sched = optax.constant_schedule(lr)
    elif clock != "own":
        raise ConfigError(f"train.lr_clock: unknown {clock!r}; expected own or global")
    tx = optax.adamw(sched, b1=b1, b2=b2, eps=eps, weight_decay=weight_decay,
                     mask=_decay_mask)
    if optimizer == "muon":
        muon = optax.contrib.muon(sched, beta=MUON_MOMENTUM, weight_decay=weight_decay,
                                  consistent_rms=MUON_RMS)
        tx = optax.partition({"muon": muon, "adamw": tx}, _muon_labels)
    if clock == "global":
        tx = optax.chain(tx, optax.inject_hyperparams(optax.scale)(step_size=0.0))
    if clip is None:
        return tx
    return optax.chain(clip_by_tensor_norm(clip), tx)


#: inner optimizers of ``train.optimizer``
INNER_OPTIMIZERS = ("adamw", "muon")
#: Muon's momentum (its reference value; MuLoCo keeps it)
MUON_MOMENTUM = 0.95
#: RMS of Muon's update per unit learning rate, AdamW's typical value (Moonlight)
MUON_RMS = 0.2


def _muon_labels(params: Params) -> dict[str, str]:
    """Muon for the transformer blocks' 2-D weight matrices; AdamW for the rest (embeddings,
    tied to the output head, and 1-D norm scales), as Muon's authors prescribe."""
    return {name: "muon" if name.startswith("blocks.") and np.ndim(value) == 2 else "adamw"
            for name, value in params.items()}


def optimizer_from_config(train: Any, dp: bool = False) -> optax.GradientTransformation:
    """The inner optimizer of a run's ``train`` section
    (:class:`ddiloco.workers.run.config.TrainSection`).

    Both modes build it here, so DiLoCo's learners and the data-parallel baseline share the
    schedule, betas, clipping and weight decay: the comparison changes only the algorithm and,
    with ``dp`` and ``train.dp_lr`` set, the baseline's peak learning rate (tuned for its
    global batch of M learners' batches).
    """
    lr = train.dp_lr if dp and train.dp_lr is not None else train.lr
    return make_optimizer(lr, train.warmup, train.weight_decay, b1=train.b1,
                          b2=train.b2, clip=train.clip, total_steps=train.steps,
                          schedule=train.schedule, final_fraction=train.lr_floor,
                          optimizer=train.optimizer, clock="own" if dp else train.lr_clock)


def make_train_step(
    cfg: ModelConfig, optimizer: optax.GradientTransformation, donate: bool = True
) -> TrainStep:
    """Jitted ``(params, opt_state, batch_BxL1) -> (params, opt_state, loss)``.

    With ``donate`` (default) ``params`` and ``opt_state`` are donated, so the update is in
    place: pass device arrays (``jax.device_put``) and do not reuse the arguments after the
    call. ``loss`` is a float32 device scalar (no host sync). ``bench/step.py --no-donate``
    measures the alternative: on XLA:CPU donation is not always faster (it constrains buffer
    assignment), see the bench's notes.
    """

    def train_step(
        params: Params, opt_state: Any, batch_BxL1: jax.Array
    ) -> tuple[Params, Any, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch_BxL1, cfg)
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state, loss

    return jax.jit(train_step, donate_argnums=(0, 1) if donate else ())


def make_grad_step(cfg: ModelConfig) -> GradStep:
    """Jitted ``(params, batch_BxL1) -> (grads, loss)`` for the data-parallel baseline."""

    def grad_step(params: Params, batch_BxL1: jax.Array) -> tuple[Params, jax.Array]:
        loss, grads = jax.value_and_grad(loss_fn)(params, batch_BxL1, cfg)
        return grads, loss

    return jax.jit(grad_step)


def make_apply_step(optimizer: optax.GradientTransformation) -> ApplyStep:
    """Jitted ``(params, opt_state, grads) -> (params, opt_state)``; params/opt_state donated."""

    def apply_step(params: Params, opt_state: Any, grads: Params) -> tuple[Params, Any]:
        updates, opt_state = optimizer.update(grads, opt_state, params)
        return optax.apply_updates(params, updates), opt_state

    return jax.jit(apply_step, donate_argnums=(0, 1))


def make_eval_fn(cfg: ModelConfig) -> EvalFn:
    """Jitted ``(params, batch_BxL1) -> loss`` (nats per byte, float32 device scalar)."""

    def eval_fn(params: Params, batch_BxL1: jax.Array) -> jax.Array:
        return loss_fn(params, batch_BxL1, cfg)

    return jax.jit(eval_fn)


# ----------------------------------------------------------------------------------------------
# Sampling
# ----------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=8)
def _next_logits_fn(cfg: ModelConfig) -> Callable[[Params, Any, Any], jax.Array]:
    """Jitted ``(params, tokens_1xL, last) -> logits_V`` at position ``last``; cached per config
    so repeated :func:`generate` calls compile once."""

    def next_logits(params: Params, tokens_1xL: jax.Array, last: jax.Array) -> jax.Array:
        return _logits_NxV(params, tokens_1xL, cfg)[last]

    return jax.jit(next_logits)


def generate(
    params: Mapping[str, Any],
    cfg: ModelConfig,
    prompt: bytes,
    n_new: int,
    temperature: float,
    seed: int,
) -> bytes:
    """Sample ``n_new`` bytes after ``prompt``.

    The forward pass is jitted once on a fixed [1, seq_len] window (no KV cache: simple, and
    fast enough for previews). The context is the last ``seq_len`` bytes, placed at positions
    0..n-1; the zero padding after it cannot influence them because attention is causal.

    Args:
        params: flat float32 parameters.
        cfg: model shape.
        prompt: context; may be empty (a newline is used then).
        n_new: number of bytes to sample.
        temperature: softmax temperature; 0 means greedy (argmax).
        seed: seed of the sampler (numpy ``default_rng``).

    Returns:
        Exactly ``n_new`` sampled bytes (the prompt is not included).
    """
    if n_new < 0:
        raise ConfigError(f"n_new must be non-negative, got {n_new}")
    if temperature < 0:
        raise ConfigError(f"temperature must be non-negative, got {temperature}")
    window = cfg.seq_len
    device_params = {name: jnp.asarray(value) for name, value in params.items()}
    next_logits = _next_logits_fn(cfg)
    rng = np.random.default_rng(seed)
    context = list(prompt or b"\n")
    out = bytearray()
    for _ in range(n_new):
        ctx = context[-window:]
        tokens_1xL = np.zeros((1, window), dtype=np.int32)
        tokens_1xL[0, : len(ctx)] = ctx
        logits_V = np.asarray(next_logits(device_params, tokens_1xL, len(ctx) - 1), np.float64)
        if temperature == 0:
            nxt = int(np.argmax(logits_V))
        else:
            z_V = logits_V / temperature
            p_V = np.exp(z_V - z_V.max())
            nxt = int(rng.choice(cfg.vocab, p=p_V / p_V.sum()))
        # Vocabularies larger than 256 are not bytes; clamp so the output stays bytes.
        out.append(min(nxt, 255))
        context.append(nxt)
    return bytes(out)
