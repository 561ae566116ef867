"""Norm scaling of each contribution against the median (``sync.norm_clip = "median"``).

A contribution whose outer gradient is longer than the median of its peers' is scaled down to
the median before the merge; shorter ones are left alone. One learner that drifted (a bad
shard, a loss spike, a burst of stale local steps) then moves the fragment no further than a
typical learner does. The rule follows Covenant-72B (arXiv 2603.08163), which normalizes each
peer's pseudo-gradient against the median norm of the round before aggregation.

Rounds of an asynchronous shard are small (K = 1: often one or two contributions), so the
median is taken over this round's contributions together with the fragment's last
:data:`RECENT` accepted contribution norms; with no history it is the round's own median, and
a round of one contribution with no history is left alone.

Merging with scaled contributions: with factors ``f_m``, the merge is run with token weights
``w_m f_m`` and the result multiplied by ``sum(w f) / sum(w)``. For a weighted average that is
exactly ``sum(w_m f_m x_m) / sum(w_m)``; for RDA the radius becomes
``sum(w_m f_m ||x_m||) / sum(w_m)`` (the scaled norms, weighted as before), and the direction
weighs each unit vector by ``w_m f_m``: a clipped contribution also counts less in the
direction.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence

import numpy as np

from ddiloco.pipeline.accumulate import Packed, add_range, sumsq_f32, sumsq_range

__all__ = ["CHUNK", "RECENT", "contribution_norm", "median_clip_factors"]

#: accepted contribution norms a fragment remembers for the median (per shard, in memory)
RECENT = 16
#: values per pass of :func:`contribution_norm` (256 KiB of float32 scratch)
CHUNK = 1 << 16


def median_clip_factors(norms: Sequence[float], recent: Iterable[float] = ()) -> list[float]:
    """Scale factors that bring every norm above the median down to it.

    Args:
        norms: this round's contribution norms (L2, float32 values, any unit), one each.
        recent: the fragment's recently accepted contribution norms (same unit).

    Returns:
        One factor in (0, 1] per entry of ``norms``: ``min(1, median / norm)``; 1 for a zero
        or non-finite norm (the update guard rejects non-finite merges), and all 1 when the
        pool holds fewer than two finite positive norms.
    """
    pool = [float(x) for x in (*recent, *norms) if math.isfinite(x) and x > 0.0]
    if len(pool) < 2:
        return [1.0] * len(norms)
    median = float(np.median(pool))
    return [median / n if math.isfinite(n) and n > median else 1.0 for n in norms]


def contribution_norm(parts: Sequence[Packed]) -> float:
    """L2 norm of one contribution, the sum of its payloads, over every value of the fragment.

    Args:
        parts: the contribution's quantized payloads, all of ``n`` values (one, or a delta
            and the version differences that re-anchor it).

    Returns:
        ``||sum(parts)||``, accumulated in float64. A single payload's norm comes from the
        sums of squares taken when it was unpacked (:attr:`Packed.sumsq`) where it has them;
        otherwise each payload is read once, and a contribution of several payloads uses
        :data:`CHUNK` float32 values of scratch.
    """
    if not parts:
        return 0.0
    n = parts[0].n
    if len(parts) == 1:
        if parts[0].sumsq is not None:  # taken when the payload was unpacked: no reading
            return math.sqrt(sum(parts[0].sumsq))
        return math.sqrt(sumsq_range(parts[0], 0, n))
    total = 0.0
    scratch = np.empty(min(n, CHUNK), np.float32)
    for a in range(0, n, CHUNK):
        b = min(n, a + CHUNK)
        out = scratch[: b - a]
        out[:] = 0
        for p in parts:
            add_range(p, a, b, 1.0, out)
        total += sumsq_f32(out)
    return math.sqrt(total)
