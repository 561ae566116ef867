"""Direction-aware correction of incoming outer gradients (``sync.correction = "heloco"``).

HeLoCo (Asif et al., arXiv 2606.00271) corrects each learner's outer gradient, tensor by
tensor, against a reference for the fragment's current trajectory before the merge. A stale
or drifted outer gradient (an old base, a learner on its own shard of non-IID data) can point
against where the global model is going:

* a tensor whose cosine with the reference is at least ``keep`` (c_ok) passes unchanged;
* an anti-aligned tensor (cosine c < 0) loses part of its component along the reference:
  ``x - beta c ||x|| v``, ``beta = min(shrink * (-c) * conf, shrink_max)``;
* a weakly aligned tensor (0 <= c < keep) is turned part of the way towards the reference at
  its own length: ``||x|| u~ / ||u~||``, ``u~ = (1 - lam) u + lam v``,
  ``lam = min(reorient * (keep - c) * conf, 1)``;

with ``u = x / ||x||``, ``v = r / ||r||`` and the confidence ``conf = ||x|| / (||x|| + kappa
||r|| + eps)``: a contribution that is short against the reference is corrected the least.
The shape of the rule is the paper's; the formula of ``lam`` and the constants' defaults are
ours (the paper's values were not at hand), and are settings.

The reference. The paper's is the outer Nesterov momentum. A shard keeps one only with
``sync.outer_momentum > 0`` (delayed Nesterov: its momentum); at the default, plain outer SGD,
it is ours: minus the sum of the fragment's kept version differences (``Theta_v -
Theta_(v-1)`` over the last ``sync.history - 1`` versions), the outer gradients the shard
applied lately, in the same unit as a contribution. Both are rebuilt from the store by a
restarted shard, so the correction has no state of its own. Only the learner's own payloads
are corrected; the re-anchoring differences a stale contribution is completed with are the
shard's own steps and are left as they are.

Memory at the shard during a merge of C contributions of a fragment of F values: (C + 1) F
float32 (each contribution decoded, the reference), against none without the correction.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

import numpy as np

from ddiloco.pipeline.accumulate import Packed, add_range, pack_raw
from ddiloco.pipeline.errors import ConfigError

__all__ = ["HeLoCoConfig", "correct_contribution", "correct_tensor", "reference"]

#: what :func:`correct_tensor` did to one tensor
KEPT, SHRUNK, TURNED = "kept", "shrunk", "turned"


@dataclass(frozen=True)
class HeLoCoConfig:
    """The correction's constants (``sync.heloco_*``; arXiv 2606.00271, HeLoCo).

    Attributes:
        keep: c_ok, the cosine from which a tensor passes unchanged, in [0, 1].
        shrink: k_s, strength of the shrinkage of anti-aligned tensors, >= 0.
        shrink_max: beta_max, the largest share of the anti-aligned component removed, [0, 1].
        reorient: k_d, strength of the turn of weakly aligned tensors, >= 0.
        kappa: weight of the reference's norm in the confidence, >= 0.
    """

    keep: float = 0.2
    shrink: float = 1.0
    shrink_max: float = 0.5
    reorient: float = 0.5
    kappa: float = 1.0

    def __post_init__(self) -> None:
        for name, lo, hi in (("keep", 0.0, 1.0), ("shrink", 0.0, math.inf),
                             ("shrink_max", 0.0, 1.0), ("reorient", 0.0, math.inf),
                             ("kappa", 0.0, math.inf)):
            value = getattr(self, name)
            if not lo <= value <= hi:
                raise ConfigError(f"sync.heloco_{name}: must be in [{lo:g}, {hi:g}], got {value}")


#: below this norm a tensor or a reference is treated as zero (left alone)
EPS = 1e-12


def correct_tensor(x: np.ndarray, r: np.ndarray, cfg: HeLoCoConfig) -> tuple[np.ndarray, str]:
    """One tensor of one outer gradient corrected against the reference (module docstring).

    Args:
        x: the learner's outer gradient of the tensor, float32, any shape.
        r: the reference of the same tensor, same shape.
        cfg: the constants.

    Returns:
        (the corrected tensor, float32, x's shape; :data:`KEPT` (``x`` itself), :data:`SHRUNK`
        or :data:`TURNED`). A zero or non-finite ``x`` or ``r`` is kept: the update guard
        judges non-finite merges.
    """
    x64 = x.astype(np.float64).ravel()
    r64 = r.astype(np.float64).ravel()
    # elementwise sums, not BLAS: a shard's BLAS threads contend with the learners' cores
    nx, nr = math.sqrt(float(np.sum(x64 * x64))), math.sqrt(float(np.sum(r64 * r64)))
    if not (math.isfinite(nx) and math.isfinite(nr)) or nx < EPS or nr < EPS:
        return x, KEPT
    u, v = x64 / nx, r64 / nr
    c = float(np.sum(u * v))
    if c >= cfg.keep:
        return x, KEPT
    conf = nx / (nx + cfg.kappa * nr + EPS)
    if c < 0:
        beta = min(cfg.shrink * -c * conf, cfg.shrink_max)
        out = x64 - beta * c * nx * v
        return out.astype(np.float32).reshape(x.shape), SHRUNK
    lam = min(cfg.reorient * (cfg.keep - c) * conf, 1.0)
    turned = (1.0 - lam) * u + lam * v
    out = nx * turned / max(math.sqrt(float(np.sum(turned * turned))), EPS)
    return out.astype(np.float32).reshape(x.shape), TURNED


def reference(n: int, history: Mapping[int, Packed | None],
              momentum: np.ndarray | None = None) -> np.ndarray | None:
    """A fragment's reference direction, flat float32 of ``n`` values, in outer-gradient units.

    Args:
        n: the fragment's number of values.
        history: version -> the kept difference ``Theta_v - Theta_(v-1)`` (None: not kept).
        momentum: the outer momentum when the shard keeps one (the paper's reference).

    Returns:
        ``momentum`` where it is given and not all zero; else minus the sum of the kept
        differences; None when there is neither (the first merge: nothing to correct against).
    """
    if momentum is not None and momentum.size == n and np.any(momentum):
        return momentum
    diffs = [d for _, d in sorted(history.items()) if d is not None]
    if not diffs:
        return None
    out = np.zeros(n, np.float32)
    for d in diffs:
        add_range(d, 0, n, -1.0, out)
    return out


def correct_contribution(own: Sequence[Packed], ref: np.ndarray,
                         shapes: Sequence[tuple[int, ...]],
                         cfg: HeLoCoConfig) -> tuple[Packed, dict[str, int]]:
    """A learner's own payloads of a contribution, decoded, summed and corrected per tensor.

    Args:
        own: the payloads the learner sent (its outer gradient is their sum), ``n`` values.
        ref: the fragment's reference (:func:`reference`), flat float32 of ``n`` values.
        shapes: the fragment's tensor shapes, in payload order.
        cfg: the constants.

    Returns:
        (one fp32 payload of the corrected outer gradient, the number of tensors kept,
        shrunk and turned).
    """
    n = own[0].n
    flat = np.zeros(n, np.float32)
    for p in own:
        add_range(p, 0, n, 1.0, flat)
    counts = {KEPT: 0, SHRUNK: 0, TURNED: 0}
    offset = 0
    for sh in shapes:
        size = math.prod(sh)
        seg = slice(offset, offset + size)
        out, what = correct_tensor(flat[seg], ref[seg], cfg)
        if what != KEPT:
            flat[seg] = out.ravel()
        counts[what] += 1
        offset += size
    return pack_raw(flat.view(np.uint8), shapes, "fp32"), counts
