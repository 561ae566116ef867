"""The learner's side of a version: how its local tensors adopt a new global version, how it
moves eagerly at a send, and how two pending deltas of one fragment fold into one.

Pure functions over float32 tensors, tested with hand-computed numbers (``tests/test_merge.py``).
Sources (DESIGN §2, learner loop step 3): overwrite is the paper's rule (Decoupled DiLoCo, arXiv
2604.21428); mix is Streaming DiLoCo's (arXiv 2501.18512); carry and the eager move follow
"eager updates" (Kale, Douillard and Donchev, arXiv 2502.12996).
"""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

__all__ = ["ADOPT_POLICIES", "adopt_fragment", "eager_estimate", "eager_move", "fold_pending"]

ADOPT_POLICIES = ("carry", "overwrite", "mix")


def fold_pending(older_base: int, older: Sequence[np.ndarray], newer_base: int,
                 newer: Sequence[np.ndarray]) -> tuple[list[np.ndarray], bool]:
    """One learner's pending delta of a fragment followed by a newer one: what is sent or
    merged in their place (DESIGN §2 step 2; the learner's outbox and the shard's round).

    Same base: deltas are cumulative since adoption, so the newer one already holds the older
    one's work and replaces it. Newer base: the learner adopted a version between the two, so
    the newer delta holds only the work since that adoption and the older one's is added.

    Returns:
        (float32 tensors, True when the older delta was added: the caller then adds its
        step and token counters too, for the token weight).
    """
    if newer_base > older_base:
        return [np.asarray(n, np.float32) + np.asarray(o, np.float32)
                for n, o in zip(newer, older, strict=True)], True
    return list(newer), False


def eager_estimate(anchor: Sequence[np.ndarray], sent: Sequence[np.ndarray],
                   last_step: Sequence[np.ndarray], own_weight: float,
                   outer_lr: float) -> list[np.ndarray]:
    """A learner's estimate of a fragment's next version at the moment it sends its delta:
    eager updates (Kale, Douillard and Donchev, arXiv 2502.12996, §3), where the outer
    gradient not yet merged is stood in for by the learner's own, at its weight, and the
    others' by their last merged one.

    ``E = anchor - outer_lr * own_weight * sent - (1 - own_weight) * last_step``.

    Args:
        anchor: the fragment's version the learner last adopted (float32 tensors).
        sent: the delta the shard will decode, anchor - theta after the codec (same shapes).
        last_step: the fragment's last outer step as the learner saw it, previous version -
            anchor per version (the outer lr and momentum already applied).
        own_weight: this learner's share of a round's merge, 1 / M with equal tokens.
        outer_lr: ``sync.outer_lr``.

    Returns:
        float32 tensors, the shapes of ``anchor``.

    Raises:
        ValueError: ``own_weight`` outside (0, 1].
    """
    if not 0 < own_weight <= 1:
        raise ValueError(f"own_weight: {own_weight} is out of range; allowed: (0, 1]")
    a, b = np.float32(outer_lr * own_weight), np.float32(1.0 - own_weight)
    return [np.asarray(x - a * d - b * g, np.float32)
            for x, d, g in zip(anchor, sent, last_step, strict=True)]


def eager_move(anchor: Sequence[np.ndarray], own: Sequence[np.ndarray],
               sent: Sequence[np.ndarray], exact: Sequence[np.ndarray],
               last_step: Sequence[np.ndarray], own_weight: float, outer_lr: float,
               ) -> tuple[list[np.ndarray], list[np.ndarray], list[np.ndarray]]:
    """The learner's bookkeeping of an eager move at a send (``sync.eager``).

    Args:
        anchor: the adopted version.
        own: the fragment as this learner's own work left it (its tensors minus any earlier
            eager move since the adoption: that move is not its work).
        sent: the decoded delta it sends; ``exact``: anchor - own, before the codec.
        last_step, own_weight, outer_lr: as :func:`eager_estimate`.

    Returns:
        ``(estimate, ref, jump)``: the tensors to train on; where carry adoption measures
        unsent work from (estimate - ref = sent - exact, the codec's error, as without the
        move); the move itself, estimate - own, which the next send of the fragment against
        the same anchor takes off again (its delta is then its own work since the adoption).

    Raises:
        ValueError: as :func:`eager_estimate`.
    """
    est = eager_estimate(anchor, sent, last_step, own_weight, outer_lr)
    ref = [e - d + x for e, d, x in zip(est, sent, exact, strict=True)]
    jump = [e - o for e, o in zip(est, own, strict=True)]
    return est, ref, jump


def adopt_fragment(
    mode: str,
    theta: Sequence[np.ndarray],
    value: Sequence[np.ndarray],
    *,
    alpha: float = 0.5,
    ref: Sequence[np.ndarray] | None = None,
) -> list[np.ndarray]:
    """New local tensors of a fragment when a newer global version arrives (DESIGN §2 step 3).

    Args:
        mode: one of :data:`ADOPT_POLICIES`:

            * ``"overwrite"`` (paper): theta = Theta. Local steps not yet sent are lost.
            * ``"mix"`` (Streaming DiLoCo, arXiv 2501.18512): theta = alpha*theta +
              (1-alpha)*Theta.
            * ``"carry"`` (ours, after "eager updates", arXiv 2502.12996): theta = Theta +
              (theta - ref), where ``theta - ref`` is the local work that has not left the
              learner yet. The caller then anchors at Theta, so that work leaves in the next
              delta exactly once and no processed token is thrown away.
        theta: the learner's current tensors (float32, the fragment's shapes).
        value: Theta, the new global value (same shapes).
        alpha: mixing weight of the local tensors for "mix".
        ref: for "carry": the point unsent work is measured from: the fragment as the shard
            will see it after the learner's last send (anchor - decoded sent delta, so the
            codec's error is carried too: error feedback), or the anchor when nothing was
            sent since the last adoption.

    Returns:
        float32 tensors.

    Raises:
        ValueError: unknown mode, or "carry" without ``ref``.
    """
    if mode == "overwrite":
        return [np.array(v, dtype=np.float32, copy=True) for v in value]
    if mode == "mix":
        a = np.float32(alpha)
        return [a * t + (np.float32(1) - a) * v for t, v in zip(theta, value, strict=True)]
    if mode == "carry":
        if ref is None:
            raise ValueError("adopt mode 'carry' needs ref (the unsent work's origin)")
        return [np.asarray(v, np.float32) + (np.asarray(t, np.float32) - np.asarray(r, np.float32))
                for v, t, r in zip(value, theta, ref, strict=True)]
    raise ValueError(f"adopt mode: unknown {mode!r} (one of {', '.join(ADOPT_POLICIES)})")
