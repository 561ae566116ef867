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
from ddiloco.workers.run.blobs import decode_blob
from ddiloco.workers.syncer.merge import Round
from ddiloco.workers.syncer.norm_clip import RECENT

__all__ = ["Contribution", "FragmentState", "PendingCommit", "one_buffer", "views"]


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
    #: EMA of the accepted update norms per unit lr
    #: (:func:`ddiloco.workers.syncer.merge.guard_update`)
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
    #: buffer, flat float32 (:func:`ddiloco.workers.syncer.merge.delayed_nesterov`)
    delayed_m: np.ndarray | None = None
    delayed_buf: np.ndarray | None = None
    #: ``sync.correction = "heloco"``: tensors of merged contributions kept, shrunk and
    #: turned (:mod:`ddiloco.workers.syncer.heloco`; in memory, per shard process)
    corrected: dict[str, int] = field(default_factory=dict)
    #: the committed state may differ from the store's head: read it back before a merge
    stale: bool = False
    #: a closed round whose publish has an unknown outcome (commit, then apply)
    pending: PendingCommit | None = None

    def __post_init__(self) -> None:
        self.flat_value, self.value = one_buffer(self.value)
        self.flat_momentum, self.momentum = one_buffer(self.momentum)

    def scratch(self) -> FragmentState:
        """A copy to compute the next version in: value, momentum, residual and the counts
        are its own (copied: ``F`` bytes each that exist), the history and the recent norms
        are shared (a merge reads them). The round and contributions are not carried."""
        shapes = [v.shape for v in self.value]
        new = FragmentState(version=self.version, value=[], momentum=[],
                            history=dict(self.history), last_merge_at=self.last_merge_at,
                            update_norm=self.update_norm, norm_count=self.norm_count,
                            recent_norms=deque(self.recent_norms, maxlen=RECENT),
                            corrected=dict(self.corrected), delayed_m=self.delayed_m,
                            delayed_buf=self.delayed_buf)
        new.flat_value = self.flat_value.copy()
        new.value = views(new.flat_value, shapes)
        new.flat_momentum = self.flat_momentum.copy()
        new.momentum = views(new.flat_momentum, shapes) if self.momentum else []
        if self.flat_residual is not None:
            new.flat_residual = self.flat_residual.copy()
            new.residual = views(new.flat_residual, shapes)
        return new

    def take(self, new: FragmentState) -> None:
        """Make ``new``'s buffers (a :meth:`scratch` a merge stepped) this state's own: the
        commit of a published version (no copy: the buffers change hands)."""
        self.value, self.flat_value = new.value, new.flat_value
        self.momentum, self.flat_momentum = new.momentum, new.flat_momentum
        self.residual, self.flat_residual = new.residual, new.flat_residual
        self.history, self.recent_norms = new.history, new.recent_norms
        self.corrected = new.corrected

    def restore_delayed(self, blob: bytes) -> None:
        """Delayed Nesterov's momentum and buffer from a stored momentum blob (the two as flat
        float32 tensors of the fragment's size; an empty blob: zeros)."""
        n = self.flat_value.size
        if blob:
            m, buf = decode_blob(blob, [(n,), (n,)])
            self.delayed_m, self.delayed_buf = m.reshape(-1), buf.reshape(-1)
        else:
            self.delayed_m, self.delayed_buf = np.zeros(n, np.float32), np.zeros(n, np.float32)




@dataclass
class PendingCommit:
    """A merged round on its way into the store (commit, then apply; docs/RELIABILITY.md).

    The round's next state is computed into ``state`` (a :meth:`FragmentState.scratch`) and
    published with ``token``; the fragment's committed state takes it only once the store's
    head is ``expected + 1`` with that token. Until then new deltas file into the next round.

    Attributes:
        token: the round's write token (the store keeps it in the head).
        expected: the version the round was built on.
        state: the fragment's state after the round (not yet committed).
        contribs: the round's contributions.
        weights: their token weights.
        meta: the version's meta (contributors, weights, bases, merged steps, contributions).
        diff: the applied difference, quantized as the history holds it.
        payload: the broadcast payload.
        norm: the guard's normalized norm of the update.
        norms: the contributions' norms (the median clip's history).
        delayed: delayed Nesterov's new (momentum, buffer), or None.
        started_at: when the round opened (shard clock), for ``round_s``.
        quorum_at: when it reached quorum (shard clock), or None.
        t0: when the merge began (shard clock).
        tries: publishes tried.
    """

    token: str
    expected: int
    state: FragmentState
    contribs: list[Contribution]
    weights: list[float]
    meta: dict[str, object]
    diff: Packed
    payload: bytes
    norm: float
    norms: list[float]
    delayed: tuple[np.ndarray, np.ndarray] | None
    started_at: float | None
    quorum_at: float | None
    t0: float
    tries: int = 0
