"""The pure pieces of Decoupled DiLoCo, for people who keep their own training loop.

optax-style: plain functions and small objects over lists of float32 numpy arrays (one array
per tensor of a fragment), no processes, sockets or store. With them a user with an existing
JAX loop runs the learner's side with their own step function (docs/API.md, "Your own loop"):

* **the outer gradient and its codec**: ``delta = anchor - theta`` per tensor, sent as
  :func:`encode` (one zstd frame of the quantized values, DESIGN §4) and read back with
  :func:`decode`; :class:`ErrorFeedback` carries what a lossy codec dropped to the next send;
* **the merge rules** of a syncer shard: :func:`token_weight` (the paper's ``c_tokens^2 /
  c_steps``), :func:`weighted_average`, :func:`rda` (radial-directional averaging),
  :func:`merge_fragment` (RDA for most tensors, the weighted average for embeddings),
  :func:`anchor_delta` (re-anchoring a delta made against an older version);
* **the outer optimizer**: :class:`OuterOptimizer` (``optax.sgd`` with Nesterov momentum, one
  fragment at a time; DESIGN §2 step 5) configured by :class:`OuterConfig`;
* **the adoption rule**: :func:`adopt_fragment` (``carry``, ours: the new global value plus the
  local work not sent yet; ``overwrite``, the paper's; ``mix``, Streaming DiLoCo's) and
  :func:`fold_pending` (two pending deltas of one fragment into one).

Errors: the codecs raise :class:`~ddiloco.pipeline.errors.WireError` subclasses on bad
payloads; the merge rules raise ``ValueError`` on empty input or a zero total weight.
"""

from __future__ import annotations

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
from ddiloco.pipeline.errors import CodecError, WireError
from ddiloco.workers.checkpoint import CheckpointMismatch
from ddiloco.workers.merge import (
    ADOPT_POLICIES,
    OuterConfig,
    OuterOptimizer,
    adopt_fragment,
    anchor_delta,
    fold_pending,
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
    "ErrorFeedback",
    "OuterConfig",
    "OuterOptimizer",
    "WireError",
    "adopt_fragment",
    "anchor_delta",
    "decode",
    "encode",
    "encode_and_reconstruct",
    "fold_pending",
    "is_codec",
    "merge_fragment",
    "raw_size",
    "rda",
    "token_weight",
    "weighted_average",
]
