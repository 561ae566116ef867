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
from ddiloco.workers.fused import MergeEngine
from ddiloco.workers.merge import OuterOptimizer, guard_norm, guard_update

__all__ = ["outer_fused", "outer_reference"]


def outer_fused(s: SyncSection, engine: MergeEngine, st: FragmentState, acc: np.ndarray,
                shapes: list[tuple[int, ...]], recent: float | None,
                lr_mass: float, *, plain: bool = False) -> tuple[float, Packed, bytes]:
    """Outer step, guard and int downlink in two passes over the fragment
    (:func:`ddiloco.workers.fused.outer_int`): one that writes nothing, then, when the
    guard passes, one that updates value, momentum and residual in place.

    ``plain``: ``acc`` is already the step (the new value is ``Theta - acc``, e.g. from
    :func:`ddiloco.workers.merge.delayed_nesterov`): lr 1, no momentum.

    Returns:
        (the guard's normalized norm, the applied difference, the broadcast payload).

    Raises:
        MergeRefused: as :func:`ddiloco.workers.merge.guard_update`, or a non-finite
            new value; nothing was changed.
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
        sq, finite = engine.outer_int(*args, False, raw_down, raw_bcast)
        norm = guard_norm(sq, recent, s.update_guard, lr_mass)
        if not finite:
            raise MergeRefused("the new version is not finite in float32")
        engine.outer_int(*args, True, raw_down, raw_bcast)
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
