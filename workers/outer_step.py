"""The outer step of one merged fragment and its downlink (DESIGN §2, Algorithm 1 lines 10-12):
outer Nesterov step on the merged outer gradient, the update guard, error feedback, the
quantized update that becomes the new version, and the broadcast payload.

:func:`outer_fused` runs the int4/int8 downlinks in place over the fragment's flat buffers
(:mod:`ddiloco.workers.fused`); :func:`outer_reference` is the same step with the reference
functions (float32 temporaries of the fragment's size) for every other downlink codec.
"""

from __future__ import annotations

import numpy as np

from ddiloco.pipeline import codec
from ddiloco.pipeline.accumulate import Packed, pack_raw
from ddiloco.pipeline.codec_spec import raw_size
from ddiloco.pipeline.errors import MergeRefused
from ddiloco.workers.config import SyncSection
from ddiloco.workers.fragment_state import FragmentState, one_buffer, views
from ddiloco.workers.fused import FUSED_DOWN, MergeEngine
from ddiloco.workers.heloco import HeLoCoConfig, correct_contribution, reference
from ddiloco.workers.merge import OuterOptimizer, delayed_nesterov, guard_norm, guard_update
from ddiloco.workers.norm_clip import contribution_norm, median_clip_factors

__all__ = ["heloco_terms", "merge_and_step", "outer_fused", "outer_reference"]


def heloco_terms(s: SyncSection, st: FragmentState, terms: list[list[Packed]], own: list[int],
                 shapes: list[tuple[int, ...]]) -> list[list[Packed]]:
    """``terms`` with each learner's own payloads (the first ``own[i]``) replaced by their
    HeLoCo correction against the fragment's reference (the outer momentum where the shard
    keeps one, else its recent outer steps; :func:`ddiloco.workers.heloco.reference`). Adds
    the tensors kept, shrunk and turned to ``st.corrected``. With no reference yet (the
    fragment's first merge) the terms are returned as they are."""
    n = st.flat_value.size
    momentum = st.delayed_m if s.outer_delay > 1 else st.flat_momentum
    ref = reference(n, st.history, momentum)
    if ref is None:
        return terms
    cfg = HeLoCoConfig(s.heloco_keep, s.heloco_shrink, s.heloco_shrink_max, s.heloco_reorient,
                       s.heloco_kappa)
    out = []
    for parts, k in zip(terms, own, strict=True):
        fixed, counts = correct_contribution(parts[:k], ref, shapes, cfg)
        for what, c in counts.items():
            st.corrected[what] = st.corrected.get(what, 0) + c
        out.append([fixed, *parts[k:]])
    return out


def outer_fused(s: SyncSection, engine: MergeEngine, st: FragmentState, acc: np.ndarray,
                shapes: list[tuple[int, ...]], recent: float | None,
                lr_mass: float, *, plain: bool = False) -> tuple[float, Packed, bytes]:
    """Outer step, guard and int downlink in one pass over the fragment
    (:func:`ddiloco.workers.fused.outer_int`) that updates value, momentum and residual in
    place; the guard judges the result.

    ``plain``: ``acc`` is already the step (the new value is ``Theta - acc``, e.g. from
    :func:`ddiloco.workers.merge.delayed_nesterov`): lr 1, no momentum.

    Returns:
        (the guard's normalized norm, the applied difference, the broadcast payload).

    Raises:
        MergeRefused: as :func:`ddiloco.workers.merge.guard_update`, or a non-finite
            new value. The fragment's state was changed: the caller takes it back from the
            store (the head it was built on).
    """
    down = s.codec_down
    n = acc.size
    residual = None
    if s.error_feedback:
        if st.flat_residual is None:
            st.flat_residual = np.zeros(n, np.float32)
            st.residual = views(st.flat_residual, shapes)
        residual = st.flat_residual
    raw_down = np.empty(raw_size(n, down), np.uint8)
    raw_bcast = np.empty(raw_size(n, down), np.uint8)
    if plain:
        args = (acc, st.flat_value, np.zeros(0, np.float32), residual, 1.0, 0.0, down,
                codec.DEFAULT_BLOCK)
    else:
        args = (acc, st.flat_value, st.flat_momentum, residual, s.outer_lr, s.outer_momentum,
                down, codec.DEFAULT_BLOCK)
    with np.errstate(over="ignore", invalid="ignore"):
        sq, finite = engine.outer_int(*args, raw_down, raw_bcast)
    norm = guard_norm(sq, recent, s.update_guard, lr_mass)
    if not finite:
        raise MergeRefused("the new version is not finite in float32")
    payload = codec._compressor(1).compress(raw_bcast.data)
    return norm, pack_raw(raw_down, shapes, down), payload

def outer_reference(s: SyncSection, outer: OuterOptimizer | None, st: FragmentState,
                    acc: np.ndarray, shapes: list[tuple[int, ...]], recent: float | None,
                    lr_mass: float, *, plain: bool = False) -> tuple[float, Packed, bytes]:
    """:func:`outer_fused` for the other downlink codecs, with the reference functions
    (float32 temporaries of the fragment's size); ``outer`` may be None with ``plain``."""
    outer_grad = views(acc, shapes)
    momentum: list[np.ndarray] = []
    with np.errstate(over="ignore", invalid="ignore"):
        if plain:
            target = [v - g for v, g in zip(st.value, outer_grad, strict=True)]
        else:
            assert outer is not None
            # no momentum kept (outer_momentum 0): b starts at zero every step
            b = st.momentum or outer.init_momentum(st.value)
            target, momentum = outer.step(st.value, outer_grad, b)
        diff = [np.asarray(t - v, np.float32) for t, v in zip(target, st.value,
                                                                strict=True)]
    norm = guard_update(diff, recent, s.update_guard, lr_mass)
    if s.error_feedback and st.residual is not None:
        diff = [d + r for d, r in zip(diff, st.residual, strict=True)]
    diff_q = codec.quantize_roundtrip(diff, s.codec_down)
    with np.errstate(over="ignore", invalid="ignore"):
        new_value = [v + d for v, d in zip(st.value, diff_q, strict=True)]
    if not all(np.isfinite(v).all() for v in new_value):
        raise MergeRefused("the new version is not finite in float32")
    if s.error_feedback:
        residual = [d - q for d, q in zip(diff, diff_q, strict=True)]
        st.flat_residual, st.residual = one_buffer(residual)
    for dst, src in zip(st.value, new_value, strict=True):
        dst[...] = src
    # none kept, or a plain step: nothing to write
    for dst, src in zip(st.momentum, momentum, strict=False):
        dst[...] = src
    payload = codec.encode(diff_q, s.codec_down)
    flat_q, _ = one_buffer(diff_q)
    return norm, pack_raw(flat_q.view(np.uint8), shapes, "fp32"), payload


def merge_and_step(
    s: SyncSection, engine: MergeEngine, outer: OuterOptimizer | None, st: FragmentState,
    terms: list[list[Packed]], weights: list[float], shapes: list[tuple[int, ...]],
    embedding_mask: list[bool], recent: float | None, lr_mass: float, share: float = 1.0,
    own: list[int] | None = None,
) -> tuple[float, Packed, bytes, list[float], tuple[np.ndarray, np.ndarray] | None]:
    """A round's merge and outer step, as the shard applies them (DESIGN §2 steps 4-5).

    With ``sync.correction = "heloco"`` the first ``own[i]`` payloads of ``terms[i]`` (the
    learner's outer gradient; the rest re-anchor it) are first corrected against the
    fragment's reference (:mod:`ddiloco.workers.heloco`; ``st.corrected`` counts the tensors).
    The contributions ``terms`` (each the sum of its payloads) are then scaled by the median norm
    clip (``sync.norm_clip``, :mod:`ddiloco.workers.norm_clip`), merged with their token
    ``weights`` (:meth:`MergeEngine.merge`), scaled by ``share`` (``sync.partial_merge``,
    :func:`ddiloco.workers.merge.partial_share`), then stepped: delayed Nesterov
    (``sync.outer_delay`` > 1, :func:`ddiloco.workers.merge.delayed_nesterov`) or Nesterov /
    SGD, fused with the int downlinks (:func:`outer_fused`) or through ``outer`` (the
    reference optimizer, needed only for other downlinks without delayed Nesterov).

    Returns:
        ``(guard norm, applied difference, broadcast payload, the contributions' norms (for
        the clip's history; empty without it), the new delayed-Nesterov (momentum, buffer) or
        None)``. The value (and momentum, residual) changed in place; the delayed-Nesterov
        state is the caller's to keep once the version is published.

    Raises:
        MergeRefused: as :func:`outer_fused`: with an int downlink the fragment's state was
            changed in place (the caller reads it back from the store), otherwise not.
    """
    merge_weights, rescale, norms = weights, share, []
    if s.correction == "heloco":
        terms = heloco_terms(s, st, terms, own or [len(t) for t in terms], shapes)
    if s.norm_clip == "median":
        norms = [contribution_norm(t) for t in terms]
        factors = median_clip_factors(norms, st.recent_norms)
        merge_weights = [w * f for w, f in zip(weights, factors, strict=True)]
        rescale *= sum(merge_weights) / sum(weights)
    with np.errstate(over="ignore", invalid="ignore"):
        acc = engine.merge(terms, merge_weights, shapes, embedding_mask, s.merge)
        if rescale != 1.0:
            np.multiply(acc, np.float32(rescale), out=acc)
    delayed: tuple[np.ndarray, np.ndarray] | None = None
    if s.outer_delay > 1:
        assert st.delayed_m is not None and st.delayed_buf is not None
        step, m_new, buf_new = delayed_nesterov(acc, st.delayed_m, st.delayed_buf, st.version,
                                                s.outer_delay, s.outer_momentum, s.outer_c,
                                                s.outer_lr)
        acc[...] = step
        delayed = (m_new, buf_new)
    plain = delayed is not None
    if s.codec_down in FUSED_DOWN:
        norm, diff_raw, payload = outer_fused(s, engine, st, acc, shapes, recent, lr_mass,
                                              plain=plain)
    else:
        norm, diff_raw, payload = outer_reference(s, outer, st, acc, shapes, recent, lr_mass,
                                                  plain=plain)
    return norm, diff_raw, payload, norms, delayed
