"""The pure pieces of Decoupled DiLoCo, for people who keep their own training loop.

optax-style: plain functions and small objects over lists of float32 numpy arrays (one array
per tensor of a fragment), no processes, sockets or store. With them a user with an existing
JAX loop runs the learner's side with their own step function (docs/API.md, "Your own loop"):

* **fragments and their schedule**: :func:`balanced_fragments` (whole tensors in P groups of
  nearly equal size, paper §2; also ``ddiloco.ParamTree.layout``), :func:`fragment_offsets`,
  :func:`initial_last_sends` and :func:`due_fragments` (fragment p leaves every H inner steps,
  staggered so that traffic stays smooth; Streaming DiLoCo, arXiv 2501.18512);
* **the outer gradient and its codec**: ``delta = anchor - theta`` per tensor, sent as
  :func:`encode` (one zstd frame of the quantized values, DESIGN §4) and read back with
  :func:`decode`; :func:`encode_and_reconstruct` also returns what the receiver will decode;
  :class:`ErrorFeedback` carries what a lossy codec dropped to the next send;
* **the merge rules** of a syncer shard: :func:`token_weight` (the paper's ``c_tokens^2 /
  c_steps``), :func:`weighted_average`, :func:`rda` (radial-directional averaging),
  :func:`merge_fragment` (RDA for most tensors, the weighted average for embeddings),
  :func:`anchor_delta` (re-anchoring a delta made against an older version);
* **the outer optimizer**: :class:`OuterOptimizer` (``optax.sgd`` with Nesterov momentum, one
  fragment at a time; DESIGN §2 step 5) configured by :class:`OuterConfig`, or the optax
  transformation itself, :func:`outer_optimizer`, for a pytree;
* **the adoption rule**: :func:`adopt_fragment` (``carry``, ours: the new global value plus the
  local work not sent yet; ``overwrite``, the paper's; ``mix``, Streaming DiLoCo's) and
  :func:`fold_pending` (two pending deltas of one fragment into one).

Errors: the codecs raise :class:`~ddiloco.pipeline.errors.WireError` subclasses on bad
payloads; the merge rules raise ``ValueError`` on empty input or a zero total weight; the
schedule and :class:`OuterConfig` raise :class:`~ddiloco.pipeline.errors.ConfigError`.
"""

from __future__ import annotations

import optax

from ddiloco.pipeline.codec import (
    CODECS,
    DENSE_CODECS,
    ErrorFeedback,
    decode,
    encode,
    encode_and_reconstruct,
    is_codec,
    raw_size,
)
from ddiloco.pipeline.errors import CodecError, ConfigError, WireError
from ddiloco.pipeline.fragments import (
    FragmentLayout,
    balanced_fragments,
    due_fragments,
    fragment_offsets,
    initial_last_sends,
)
from ddiloco.workers.learner.adoption import ADOPT_POLICIES, adopt_fragment, fold_pending
from ddiloco.workers.learner.checkpoint import CheckpointMismatch
from ddiloco.workers.syncer.merge import (
    OuterConfig,
    OuterOptimizer,
    anchor_delta,
    merge_fragment,
    rda,
    token_weight,
    weighted_average,
)

__all__ = [
    "ADOPT_POLICIES",
    "CODECS",
    "DENSE_CODECS",
    "CheckpointMismatch",
    "CodecError",
    "ConfigError",
    "ErrorFeedback",
    "FragmentLayout",
    "OuterConfig",
    "OuterOptimizer",
    "WireError",
    "adopt_fragment",
    "anchor_delta",
    "balanced_fragments",
    "decode",
    "due_fragments",
    "encode",
    "encode_and_reconstruct",
    "fold_pending",
    "fragment_offsets",
    "initial_last_sends",
    "is_codec",
    "merge_fragment",
    "outer_optimizer",
    "raw_size",
    "rda",
    "token_weight",
    "weighted_average",
]


def outer_optimizer(cfg: OuterConfig | None = None) -> optax.GradientTransformation:
    """The outer optimizer as an optax transformation, for a fragment held as any pytree.

    ``optax.sgd(lr, momentum, nesterov=True)``: with outer gradient ``g`` (the merged
    ``anchor - theta``, same tree as the parameters) and momentum ``b`` (zeros at ``init``),
    ``b <- mu * b + g`` and ``Theta <- Theta - lr * (g + mu * b)``; the state is optax's
    ``(TraceState(trace=b), EmptyState())``. :class:`OuterOptimizer` applies the same step to
    lists of numpy arrays, as the syncer shards do.

    Args:
        cfg: learning rate and momentum; None: the lineage defaults (lr 0.7, momentum 0.9).

    Returns:
        An ``optax.GradientTransformation``: ``updates, state = tx.update(g, state)``, then
        ``optax.apply_updates(params, updates)``.

    References:
        DiLoCo (Douillard et al., arXiv 2311.08105), the outer Nesterov step; DESIGN §2 step 5.
    """
    cfg = OuterConfig() if cfg is None else cfg
    return optax.sgd(cfg.lr, momentum=cfg.momentum, nesterov=True)
