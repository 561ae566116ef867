"""The outer step of one merged fragment and its downlink (DESIGN §2, Algorithm 1 lines 10-12):
a closed round's contributions in, the fragment's next state out, the committed state untouched.

:func:`merge_and_step` merges a round (:class:`RoundTerms`), runs the outer step on the merged
outer gradient (SGD, with Nesterov momentum when it is on), the update guard and the downlink's
error feedback, and returns a :class:`MergeResult`: the next state, the quantized update that
becomes the new version and the broadcast payload. :func:`outer_fused` runs the int4/int8
downlinks in place over a state's flat buffers (:mod:`ddiloco.workers.syncer.fused`);
:func:`outer_reference` is the same step with the reference functions (float32 temporaries of
the fragment's size) for every other downlink codec.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ddiloco.pipeline import codec
from ddiloco.pipeline.accumulate import Packed, pack_raw
from ddiloco.pipeline.codec_spec import raw_size
from ddiloco.pipeline.errors import MergeRefused
from ddiloco.workers.run.config import SyncSection
from ddiloco.workers.syncer.fragment_state import FragmentState, one_buffer, views
from ddiloco.workers.syncer.fused import FUSED_DOWN, MergeEngine
from ddiloco.workers.syncer.heloco import HeLoCoConfig, correct_contribution, reference
from ddiloco.workers.syncer.merge import (
    GUARD_WARMUP_MERGES,
    OuterOptimizer,
    delayed_nesterov,
    guard_norm,
    guard_update,
)
from ddiloco.workers.syncer.norm_clip import contribution_norm, median_clip_factors

__all__ = ["FragmentSpec", "MergeResult", "RoundTerms", "heloco_terms", "merge_and_step",
           "outer_fused", "outer_reference"]


@dataclass(frozen=True)
class FragmentSpec:
    """What a merge needs of a fragment's layout.

    Attributes:
        shapes: its tensors' shapes, in the layout's order.
        embedding_mask: per tensor, whether it is an embedding (merged by the token-weighted
            average, not RDA; DESIGN §2.5 step 4).
    """

    shapes: list[tuple[int, ...]]
    embedding_mask: list[bool]


@dataclass(frozen=True)
class RoundTerms:
    """A closed round's contributions, as the merge takes them (DESIGN §2.5 steps 3-4).

    Attributes:
        terms: per contribution, its payloads as received (quantized, each of the fragment's
            size): the learner's own first, then the kept version differences that re-anchor
            it at the fragment's version; the contribution is their sum.
        weights: the contributions' token weights (``c_tokens^2 / c_steps``); their sum is > 0.
        lr_mass: the sum of the inner learning rates over the steps the contributions hold,
            weight-averaged (the update guard's unit,
            :func:`ddiloco.workers.syncer.merge.guard_update`);
            > 0.
        own: per contribution, how many of its payloads are the learner's own (the HeLoCo
            correction's input, ``sync.correction``); None: all of them.
        share: factor on the merged outer gradient (``sync.partial_merge = "share"``,
            :func:`ddiloco.workers.syncer.merge.partial_share`); 1.0: none.
    """

    terms: list[list[Packed]]
    weights: list[float]
    lr_mass: float
    own: list[int] | None = None
    share: float = 1.0


@dataclass(frozen=True)
class MergeResult:
    """A round's merge and outer step, computed but not committed.

    Attributes:
        state: the fragment's next state, a :meth:`FragmentState.scratch` of the committed one
            with value, momentum, residual and the HeLoCo counts stepped; its version, history,
            guard and clip statistics are still the committed state's (the commit advances
            them, :meth:`ddiloco.workers.syncer.core.ShardCore.merge`).
        norm: the guard's norm of the update per unit of inner learning rate.
        diff: the applied difference ``Theta_(c+1) - Theta_c``, quantized as the history holds
            it (the int downlink's codec, else float32).
        payload: the VERSION broadcast's payload, ``sync.codec_down`` encoded.
        norms: the contributions' L2 norms (the median clip's history; empty without
            ``sync.norm_clip``).
        delayed: delayed Nesterov's new ``(momentum, buffer)``, flat float32 of the fragment's
            size (``sync.outer_delay`` > 1), else None; stored in place of the momentum.
    """

    state: FragmentState
    norm: float
    diff: Packed
    payload: bytes
    norms: list[float]
    delayed: tuple[np.ndarray, np.ndarray] | None


def heloco_terms(s: SyncSection, st: FragmentState, terms: list[list[Packed]], own: list[int],
                 shapes: list[tuple[int, ...]]) -> list[list[Packed]]:
    """``terms`` with each learner's own payloads (the first ``own[i]``) replaced by their
    HeLoCo correction against the fragment's reference (the outer momentum where the shard
    keeps one, else its recent outer steps; :func:`ddiloco.workers.syncer.heloco.reference`). Adds
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
    (:func:`ddiloco.workers.syncer.fused.outer_int`) that updates ``st``'s value, momentum and
    residual in place; the guard judges the result.

    Args:
        s: the run's ``sync`` section (``codec_down`` int4 or int8, ``outer_lr``,
            ``outer_momentum``, ``update_guard``, ``error_feedback``).
        engine: the shard's merge engine.
        st: the state to step, written in place (:func:`merge_and_step` passes its own
            scratch copy).
        acc: the merged outer gradient, flat float32 of the fragment's size.
        shapes: the fragment's tensor shapes.
        recent: the fragment's recent update norm per unit of inner lr (None: the guard's
            norm bound does not apply yet).
        lr_mass: the inner learning rates the update holds (the guard's unit); > 0.
        plain: ``acc`` is already the step (the new value is ``Theta - acc``, e.g. from
            :func:`ddiloco.workers.syncer.merge.delayed_nesterov`): lr 1, no momentum.

    Returns:
        (the guard's normalized norm, the applied difference quantized in ``codec_down``,
        the broadcast payload).

    Raises:
        MergeRefused: as :func:`ddiloco.workers.syncer.merge.guard_update`, or a non-finite
            new value. ``st`` was stepped all the same: the caller drops it.
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
    (float32 temporaries of the fragment's size); same arguments, result and exceptions, the
    applied difference as float32. ``outer`` is the reference optimizer (optax); it may be None
    with ``plain``. A refused step leaves ``st`` unchanged."""
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


def merge_and_step(s: SyncSection, engine: MergeEngine, outer: OuterOptimizer | None,
                   committed: FragmentState, rnd: RoundTerms, spec: FragmentSpec) -> MergeResult:
    """A round's merge and outer step, as the shard applies them (DESIGN §2.5 steps 4-5),
    computed in a copy of the committed state (:meth:`FragmentState.scratch`).

    With ``sync.correction = "heloco"`` each contribution's own payloads (the learner's outer
    gradient; the rest re-anchor it) are first corrected against the fragment's reference
    (:func:`heloco_terms`; the new state's ``corrected`` counts the tensors). The contributions
    are then scaled by the median norm clip (``sync.norm_clip``,
    :mod:`ddiloco.workers.syncer.norm_clip`), merged with their token weights
    (:meth:`MergeEngine.merge`), scaled by ``rnd.share``, then stepped: delayed Nesterov
    (``sync.outer_delay`` > 1, :func:`ddiloco.workers.syncer.merge.delayed_nesterov`) or Nesterov /
    SGD, fused with the int downlinks (:func:`outer_fused`) or through ``outer``. The update
    guard's bound applies once the fragment has
    :data:`ddiloco.workers.syncer.merge.GUARD_WARMUP_MERGES`
    merges behind it.

    Memory: the copy, ``F`` each for the value and, where kept, the outer momentum and the
    downlink residual (``F``: the fragment's float32 bytes); the merge runs in the engine's
    accumulator.

    Args:
        s: the run's ``sync`` section.
        engine: the shard's merge engine (its accumulator and threads).
        outer: the reference outer optimizer; needed only for a downlink codec without a
            fused step (not int4/int8) without delayed Nesterov, else None.
        committed: the fragment's committed state; read, never changed.
        rnd: the round's contributions (non-empty, weights summing to > 0).
        spec: the fragment's shapes and embedding mask.

    Returns:
        The next state and what its commit needs. The delayed-Nesterov state is returned
        beside it, not in it: it is the caller's to keep once the version is published.

    Raises:
        MergeRefused: the update is not finite or its norm is far outside the fragment's
            recent range (:func:`ddiloco.workers.syncer.merge.guard_update`); ``committed`` is
            unchanged and the copy is dropped.
    """
    st = committed.scratch()
    shapes = spec.shapes
    terms, weights = rnd.terms, rnd.weights
    merge_weights, rescale, norms = weights, rnd.share, []
    if s.correction == "heloco":
        terms = heloco_terms(s, st, terms, rnd.own or [len(t) for t in terms], shapes)
    if s.norm_clip == "median":
        norms = [contribution_norm(t) for t in terms]
        factors = median_clip_factors(norms, st.recent_norms)
        merge_weights = [w * f for w, f in zip(weights, factors, strict=True)]
        rescale *= sum(merge_weights) / sum(weights)
    with np.errstate(over="ignore", invalid="ignore"):
        acc = engine.merge(terms, merge_weights, shapes, spec.embedding_mask, s.merge)
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
    # The norm bound waits until the fragment's update-norm EMA has settled.
    recent = st.update_norm if st.norm_count >= GUARD_WARMUP_MERGES else None
    if s.codec_down in FUSED_DOWN:
        norm, diff, payload = outer_fused(s, engine, st, acc, shapes, recent, rnd.lr_mass,
                                          plain=plain)
    else:
        norm, diff, payload = outer_reference(s, outer, st, acc, shapes, recent, rnd.lr_mass,
                                              plain=plain)
    return MergeResult(state=st, norm=norm, diff=diff, payload=payload, norms=norms,
                       delayed=delayed)
