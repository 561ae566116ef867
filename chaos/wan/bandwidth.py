"""Link bandwidth each mode needs to keep its learners busy: a pure model of measured traffic.

The paper's bandwidth figure (arXiv 2604.21428, the data-parallel vs Decoupled DiLoCo
comparison: about 198 vs 0.84 Gbit/s at its scale) asks how fast the link between regions must be
for learners to spend a target share of their time computing. The same question at this
project's scale, from what a run measured: the wire bytes per inner step of one learner and its
step time. Link rates here are one direction of a full-duplex link (bit/s); protocol overheads
are whatever the measured bytes include.

* **Data-parallel** blocks every step: it sends its gradient, waits for the average, and only
  then applies it. Communication is ``8 (up + down) / B`` seconds per step, so the busy share is
  ``t / (t + 8 (up + down) / B)``. (A latency term, one round trip per step, comes on top and is
  reported separately.)
* **Decoupled DiLoCo** never blocks. A learner exchanges each of its ``P`` fragments once per
  ``H`` inner steps (staggered: one every ``H / P`` steps), and the overlap window ``tau`` lets a
  fragment's round trip (delta up, merged version down) run behind ``tau`` inner steps of
  compute. Its work stays useful as long as (a) the link carries the average traffic, and
  (b) a fragment's exchange fits in ``tau`` steps; each step by which it does not is counted as
  a stall here, which is what a blocking implementation (Streaming DiLoCo) would pay. With ``P``
  exchanges per ``H t`` seconds, the busy share is ``H t / (H t + P max(0, x - tau t))`` where
  ``x = 8 f / B`` and ``f`` is one fragment's exchange, ``(up + down) H / P`` bytes.

All functions are pure; units are bytes, seconds and bit/s.
"""

from __future__ import annotations

import math

__all__ = [
    "busy_share_diloco",
    "busy_share_dp",
    "required_bps_diloco",
    "required_bps_dp",
]


def _check(bytes_per_step: float, step_s: float, busy: float) -> None:
    if not (bytes_per_step > 0 and math.isfinite(bytes_per_step)):
        raise ValueError(f"bytes_per_step must be > 0, got {bytes_per_step!r}")
    if not (step_s > 0 and math.isfinite(step_s)):
        raise ValueError(f"step_s must be > 0, got {step_s!r}")
    if not 0 < busy < 1:
        raise ValueError(f"busy must be in (0, 1), got {busy!r}")


def busy_share_dp(bytes_per_step: float, step_s: float, link_bps: float) -> float:
    """Share of time a data-parallel learner computes on a link of ``link_bps``.

    Args:
        bytes_per_step: one learner's wire bytes per inner step, up plus down.
        step_s: compute time of one inner step, seconds.
        link_bps: link rate, bit/s.
    """
    comm_s = 8.0 * bytes_per_step / link_bps
    return step_s / (step_s + comm_s)


def required_bps_dp(bytes_per_step: float, step_s: float, busy: float = 0.95) -> float:
    """Link rate (bit/s) at which a data-parallel learner is ``busy`` of the time computing.

    Inverse of :func:`busy_share_dp`: ``8 b / (t (1 / busy - 1))``.

    Raises:
        ValueError: a non-positive byte count or step time, or ``busy`` not in (0, 1).
    """
    _check(bytes_per_step, step_s, busy)
    return 8.0 * bytes_per_step / (step_s * (1.0 / busy - 1.0))


def busy_share_diloco(bytes_per_step: float, step_s: float, link_bps: float, H: int, P: int,
                      tau: int) -> float:
    """Share of time a Decoupled DiLoCo learner computes usefully on a link of ``link_bps``.

    Below the average traffic rate (``8 b / t``) the link falls behind without bound: 0.

    Args:
        bytes_per_step: one learner's wire bytes per inner step, up plus down (averaged).
        step_s: compute time of one inner step, seconds.
        link_bps: link rate, bit/s.
        H: sync period, inner steps. P: fragments. tau: overlap window, inner steps.
    """
    if 8.0 * bytes_per_step / link_bps > step_s:
        return 0.0
    fragment_bytes = bytes_per_step * H / P
    exchange_s = 8.0 * fragment_bytes / link_bps
    stall_s = P * max(0.0, exchange_s - tau * step_s)
    return H * step_s / (H * step_s + stall_s)


def required_bps_diloco(bytes_per_step: float, step_s: float, H: int, P: int, tau: int,
                        busy: float = 0.95) -> float:
    """Link rate (bit/s) at which a Decoupled DiLoCo learner is ``busy`` of the time computing.

    The larger of the average rate ``8 b / t`` and the rate that fits one fragment's exchange
    into ``tau t`` plus its share of the allowed stall, ``H t (1 / busy - 1) / P``.

    Raises:
        ValueError: a non-positive byte count or step time, ``busy`` not in (0, 1), or H, P
            not >= 1 or tau < 0.
    """
    _check(bytes_per_step, step_s, busy)
    if H < 1 or P < 1 or tau < 0:
        raise ValueError(f"need H >= 1, P >= 1, tau >= 0; got H={H}, P={P}, tau={tau}")
    average = 8.0 * bytes_per_step / step_s
    fragment_bytes = bytes_per_step * H / P
    window_s = step_s * (tau + H * (1.0 / busy - 1.0) / P)
    return max(average, 8.0 * fragment_bytes / window_s)
