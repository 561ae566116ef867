"""What a syncer shard holds per fragment: the open round's contributions, as received
(quantized), and the fragment's state (value, outer momentum, downlink residual, history), each
tensor group one flat float32 buffer so the merge kernels run over it in ranges (DESIGN §2).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field

import numpy as np

from ddiloco.pipeline.accumulate import Packed
from ddiloco.workers.blobs import decode_blob
from ddiloco.workers.merge import Round
from ddiloco.workers.norm_clip import RECENT

__all__ = ["Contribution", "FragmentState", "one_buffer", "views"]


@dataclass
class Contribution:
    """One learner's latest delta for a fragment in the open round: the sum of ``parts``, as
    received (quantized), anchored at version ``base``."""

    learner: str
    base: int
    parts: list[Packed]
    c_steps: int
    c_tokens: int
    new_tokens: int
    nbytes: int
    step: int = 0
    inc: int = 0
    #: wire sequence numbers of the deltas folded into this contribution (exactly-once audit)
    seqs: list[int] = field(default_factory=list)

    @property
    def delta(self) -> list[np.ndarray]:
        """The decoded delta (float32 tensors; a fresh copy, for inspection)."""
        total: list[np.ndarray] | None = None
        for part in self.parts:
            ts = part.tensors()
            total = ts if total is None else [a + b for a, b in zip(total, ts, strict=True)]
        return total or []


def one_buffer(tensors: list[np.ndarray]) -> tuple[np.ndarray, list[np.ndarray]]:
    """float32 tensors copied into one flat buffer: ``(buffer, views of it)``."""
    flat = np.empty(sum(int(np.size(t)) for t in tensors), np.float32)
    out, offset = [], 0
    for t in tensors:
        size = int(np.size(t))
        view = flat[offset:offset + size].reshape(np.shape(t))
        view[...] = t
        out.append(view)
        offset += size
    return flat, out


def views(flat: np.ndarray, shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    """Tensors of ``shapes`` as views of consecutive ranges of ``flat``."""
    out, offset = [], 0
    for sh in shapes:
        size = math.prod(sh)
        out.append(flat[offset:offset + size].reshape(sh))
        offset += size
    return out


@dataclass
class FragmentState:
    """What a shard holds for one fragment: the stored value, its history and the round.

    ``value``, ``momentum`` and ``residual`` are views of one flat float32 buffer each, updated
    in place by merges. ``momentum`` is empty (no tensors, a buffer of size 0) when the outer
    optimizer has none (``sync.outer_momentum = 0``: ``b`` would only ever hold the last outer
    gradient), which saves ``F`` of memory and half of every publish. ``history`` maps each
    kept version v to the difference Theta_v - Theta_(v-1), quantized (None for the oldest
    kept version).
    """

    version: int
    value: list[np.ndarray]
    momentum: list[np.ndarray]
    history: dict[int, Packed | None] = field(default_factory=dict)
    round: Round = field(default_factory=Round)
    contributions: dict[str, Contribution] = field(default_factory=dict)
    residual: list[np.ndarray] | None = None
    #: when the last merge of this fragment was published (shard clock; paced merges)
    last_merge_at: float | None = None
    #: EMA of the accepted update norms per unit lr (:func:`ddiloco.workers.merge.guard_update`)
    update_norm: float | None = None
    #: merges accepted since this shard loaded the fragment (the guard's warm-up)
    norm_count: int = 0
    #: norms of the latest accepted contributions (``sync.norm_clip``; in memory only: a
    #: restarted shard starts from each round's own median)
    recent_norms: deque[float] = field(default_factory=lambda: deque(maxlen=RECENT))
    flat_value: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    flat_momentum: np.ndarray = field(default_factory=lambda: np.zeros(0, np.float32))
    flat_residual: np.ndarray | None = None
    #: delayed Nesterov (``sync.outer_delay`` > 1): the momentum and the outer-gradient
    #: buffer, flat float32 (:func:`ddiloco.workers.merge.delayed_nesterov`)
    delayed_m: np.ndarray | None = None
    delayed_buf: np.ndarray | None = None
    #: ``sync.correction = "heloco"``: tensors of merged contributions kept, shrunk and
    #: turned (:mod:`ddiloco.workers.heloco`; in memory, per shard process)
    corrected: dict[str, int] = field(default_factory=dict)
    #: a merge changed the value in place but did not publish it: read it back first
    stale: bool = False

    def __post_init__(self) -> None:
        self.flat_value, self.value = one_buffer(self.value)
        self.flat_momentum, self.momentum = one_buffer(self.momentum)

    def restore_delayed(self, blob: bytes) -> None:
        """Delayed Nesterov's momentum and buffer from a stored momentum blob (the two as flat
        float32 tensors of the fragment's size; an empty blob: zeros)."""
        n = self.flat_value.size
        if blob:
            m, buf = decode_blob(blob, [(n,), (n,)])
            self.delayed_m, self.delayed_buf = m.reshape(-1), buf.reshape(-1)
        else:
            self.delayed_m, self.delayed_buf = np.zeros(n, np.float32), np.zeros(n, np.float32)


