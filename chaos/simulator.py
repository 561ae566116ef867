"""Goodput of DP, elastic DP and Decoupled DiLoCo on a large failing cluster (DESIGN §5).

An event-driven simulator in numpy: it draws the slice failures and repairs of a cluster over a
simulated wall time, then integrates, for each training mode, how much of the allocated
chip-time did work that ends in the model. Seeded and deterministic: the same seed gives the same
failure trace, and all modes of one ``(chips, seed)`` see the *same* trace (common random
numbers), so differences between modes are never sampling noise.

Cluster model
-------------
``chips`` chips are grouped in ``chips / chips_per_slice`` slices. Every chip is interrupted as
a Poisson process of rate ``1 / chip_mtbi_s``; an interruption of any chip of a live slice takes
the whole slice down, so a live slice fails at rate ``chips_per_slice / chip_mtbi_s`` and the
whole cluster at rate ``chips / chip_mtbi_s`` (the superposition of the chips' processes). A
failed slice is back ``slice_repair_s`` later (replaced from a spare pool); interruptions of its
chips meanwhile are absorbed. Each slice is an alternating renewal process (exponential up time,
fixed down time), drawn for all slices at once.

Modes
-----
``dp``
    Data-parallel without elasticity. Any slice failure stops the whole job; it runs again only
    once every slice is back *and* a restart of ``restart_s`` has completed with no new failure
    (a failure during the restart aborts it). On restart it resumes from the last checkpoint: a
    checkpoint is written every ``checkpoint_interval_s`` of running time (overhead neglected),
    so the running time since the last checkpoint is lost at each failure. The run starts warm at
    t = 0 and the final segment at the horizon counts as kept.
``elastic_dp``
    Elastic data-parallel. Each membership change pauses the whole job: ``downscale_s`` after a
    slice fails, ``upscale_s`` after one returns; a change during a pause extends the pause to
    the later end. Outside pauses it trains on the live slices, throughput proportional to their
    number. A failure while training aborts the synchronous step in flight on every live slice
    (the partial step is lost).
``diloco``
    Decoupled DiLoCo with ``learners`` learners. The slices are split into ``learners`` groups of
    equal size (sizes differ by at most one slice when they do not divide); each learner is an
    elastic DP job on its own slices, paused only by its own failures and returns. The syncer
    never stops, so the global model progresses while at least one learner trains.

Outputs
-------
``goodput``: useful chip-time / allocated chip-time (``chips * horizon_s``). ``uptime``: the
fraction of wall time in which the global model makes progress: for ``dp`` the running time whose
work is kept; for ``elastic_dp`` the time with at least one live slice and no pause; for
``diloco`` the time at least one learner trains.

Defaults (:class:`SimParams`)
-----------------------------
Only the per-chip interruption rate comes from the paper (Decoupled DiLoCo, arXiv 2604.21428;
DESIGN §5: MTBI of 1 year per chip). The paper's reference goodputs at 1.2M chips are 27% (DP),
58% (elastic DP) and 88% (M = 8); the other defaults are *assumptions*, chosen as round
values that land the simulator near the first two at 1.2M chips:

================================  ===========  ================================================
field                             default      source
================================  ===========  ================================================
``chip_mtbi_s``                   31 536 000   paper: 1 year per chip (DESIGN §5)
``chips_per_slice``               1 000        assumption (divides every table size)
``slice_repair_s``                10 s         assumption: swap in a hot spare slice
``downscale_s``                   5 s          assumption: reshard onto the remaining slices
``upscale_s``                     9 s          assumption: reshard + copy state to the new slice
``restart_s``                     10 s         assumption: in-memory restart of the whole job
``checkpoint_interval_s``         25 s         assumption: frequent in-memory checkpoints
``step_s``                        1 s          assumption: one synchronous step
``horizon_s``                     604 800 s    assumption: one simulated week
================================  ===========  ================================================

At 1.2M chips the cluster loses a slice every ~26 s, so every recovery cost has to be seconds
for DP to keep any goodput at all. With these defaults the simulator gives about 27% (DP), 58%
(elastic DP) and 93% (M = 8) at 1.2M chips. A learner here is exactly elastic DP on N / M chips
(M = 8 at 1.2M chips matches elastic DP at 150K); the only loss that does not grow with the
cluster is the share of slices under repair (``chips_per_slice * slice_repair_s / chip_mtbi_s``,
0.03%), so the cost that puts elastic DP at 58% cannot also put M = 8 at 88%. The model has no
per-learner loss beyond reconfiguration and the step in flight (no outer gradients lost with a
learner or discarded as stale, DESIGN §5), which is one place the remaining gap could come from.
"""

from __future__ import annotations

import json
import math
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import Any, Literal, get_args

import numpy as np
import numpy.typing as npt
from rich.console import Console
from rich.table import Table

from pipeline.errors import ConfigError

__all__ = [
    "MODES",
    "Mode",
    "SimParams",
    "SimResult",
    "calibrate",
    "main",
    "render_table",
    "simulate",
    "simulate_events",
    "table",
]

Mode = Literal["dp", "elastic_dp", "diloco"]
MODES: tuple[Mode, ...] = get_args(Mode)

YEAR_S = 365 * 24 * 3600
"""One year in seconds: the paper's per-chip mean time between interruptions."""

MAX_EXPECTED_FAILURES = 5_000_000
"""Refuse parameter sets expected to draw more slice failures than this (memory bound)."""

_BLOCK_ELEMENTS = 1_000_000
"""Most random draws per block of :func:`_draw_trace` (memory bound)."""

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]


# --------------------------------------------------------------------------------------------
# Parameters and results
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimParams:
    """One simulated cluster. Times in seconds; defaults and sources in the module docstring.

    Attributes:
        chips: N, allocated chips (count). Must be a multiple of ``chips_per_slice``.
        learners: M, Decoupled DiLoCo learners (count; used by mode ``diloco`` only).
            Assumption-free; at most the number of slices.
        chips_per_slice: chips that fail, are repaired and join or leave together (count).
            Assumption: 1 000.
        chip_mtbi_s: mean time between interruptions of one chip (s). Paper: 1 year.
        slice_repair_s: time from a slice failure until the slice is back (s). Assumption: 10.
        downscale_s: pause of an elastic job to continue without a failed slice (s).
            Assumption: 5.
        upscale_s: pause of an elastic job to take a returning slice back (s). Assumption: 9.
        restart_s: time for non-elastic DP to restart the whole job from its checkpoint once
            every slice is back (s). Assumption: 10.
        checkpoint_interval_s: running time between two DP checkpoints (s). Assumption: 25.
        step_s: duration of one synchronous training step (s); the step in flight is lost when
            a slice of a training elastic job fails. Assumption: 1.
        horizon_s: simulated wall time (s). Assumption: one week.

    Raises:
        ConfigError: a value is non-positive (negative for the pause and restart times), not a
            whole multiple, exceeds the number of slices, or would draw an unreasonable number
            of failures.
    """

    chips: int
    learners: int = 1
    chips_per_slice: int = 1_000
    chip_mtbi_s: float = float(YEAR_S)
    slice_repair_s: float = 10.0
    downscale_s: float = 5.0
    upscale_s: float = 9.0
    restart_s: float = 10.0
    checkpoint_interval_s: float = 25.0
    step_s: float = 1.0
    horizon_s: float = 7 * 24 * 3600.0

    def __post_init__(self) -> None:
        for name in ("chips", "learners", "chips_per_slice"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise ConfigError(f"SimParams.{name} must be an integer, got {value!r}")
            if value <= 0:
                raise ConfigError(f"SimParams.{name} must be positive, got {value}")
        for name in ("chip_mtbi_s", "slice_repair_s", "checkpoint_interval_s", "step_s",
                     "horizon_s"):
            value = getattr(self, name)
            if not _is_real(value) or not value > 0 or not math.isfinite(value):
                raise ConfigError(f"SimParams.{name} must be a positive finite number of "
                                  f"seconds, got {value!r}")
        for name in ("downscale_s", "upscale_s", "restart_s"):
            value = getattr(self, name)
            if not _is_real(value) or not value >= 0 or not math.isfinite(value):
                raise ConfigError(f"SimParams.{name} must be a non-negative finite number of "
                                  f"seconds, got {value!r}")
        if self.chips % self.chips_per_slice:
            raise ConfigError(f"SimParams.chips ({self.chips}) must be a multiple of "
                              f"chips_per_slice ({self.chips_per_slice})")
        if self.learners > self.slices:
            raise ConfigError(f"SimParams.learners ({self.learners}) exceeds the number of "
                              f"slices ({self.slices} = {self.chips} / {self.chips_per_slice})")
        if self.step_s > self.checkpoint_interval_s:
            raise ConfigError(f"SimParams.checkpoint_interval_s ({self.checkpoint_interval_s}) "
                              f"must be at least step_s ({self.step_s})")
        expected = self.chips * self.horizon_s / self.chip_mtbi_s
        if expected > MAX_EXPECTED_FAILURES:
            raise ConfigError(f"SimParams: chips * horizon_s / chip_mtbi_s = {expected:.3g} "
                              f"expected failures, more than {MAX_EXPECTED_FAILURES}; "
                              "shorten horizon_s")

    @property
    def slices(self) -> int:
        """Number of slices, ``chips / chips_per_slice``."""
        return self.chips // self.chips_per_slice


@dataclass(frozen=True)
class SimResult:
    """Outcome of one simulated run.

    Attributes:
        chips: N, allocated chips.
        mode: ``dp``, ``elastic_dp`` or ``diloco``.
        learners: M for ``diloco``; 1 for the DP modes.
        goodput: useful chip-time / allocated chip-time, in [0, 1].
        uptime: fraction of wall time in which the global model makes progress, in [0, 1].
        failures: slice failures in the simulated horizon.
    """

    chips: int
    mode: str
    learners: int
    goodput: float
    uptime: float
    failures: int


def _is_real(value: object) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(
        value, bool)


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")


# --------------------------------------------------------------------------------------------
# Failure traces
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Trace:
    """Slice failures in ``[0, horizon)``, sorted by time: when, which slice, when it is back."""

    fail_t: FloatArray
    back_t: FloatArray
    slice_idx: IntArray

    def subset(self, mask: npt.NDArray[np.bool_]) -> _Trace:
        return _Trace(self.fail_t[mask], self.back_t[mask], self.slice_idx[mask])


def _draw_trace(n_slices: int, slice_rate: float, repair_s: float, horizon_s: float,
                rng: np.random.Generator, exponential_repair: bool = False) -> _Trace:
    """Alternating renewal per slice: up ~ Exp(slice_rate), down ``repair_s`` (or Exp with that
    mean). All slices advance together, a block of cycles at a time (cumulative sums), so the
    Python loop runs a handful of times whatever the number of failures.
    """
    mean_up = 1.0 / slice_rate
    cycles = horizon_s / (mean_up + repair_s)
    block = int(min(max(1.0, 1.2 * cycles + 4.0), max(1.0, _BLOCK_ELEMENTS / n_slices)))
    t = rng.exponential(mean_up, n_slices)
    idx = np.arange(n_slices, dtype=np.int64)
    fails: list[FloatArray] = []
    backs: list[FloatArray] = []
    owners: list[IntArray] = []
    while True:
        alive = t < horizon_s
        t, idx = t[alive], idx[alive]
        if t.size == 0:
            break
        shape = (t.size, block)
        down = rng.exponential(repair_s, shape) if exponential_repair else np.full(
            shape, repair_s)
        reach = np.cumsum(down + rng.exponential(mean_up, shape), axis=1)
        fail = t[:, None] + np.concatenate([np.zeros((t.size, 1)), reach[:, :-1]], axis=1)
        keep = fail < horizon_s
        fails.append(fail[keep])
        backs.append((fail + down)[keep])
        owners.append(np.broadcast_to(idx[:, None], shape)[keep])
        t = t + reach[:, -1]
    if not fails:
        return _Trace(np.empty(0), np.empty(0), np.empty(0, dtype=np.int64))
    fail_t = np.concatenate(fails)
    order = np.argsort(fail_t, kind="stable")
    return _Trace(fail_t[order], np.concatenate(backs)[order], np.concatenate(owners)[order])


def _explicit_trace(params: SimParams, failures: Sequence[tuple[float, int]]) -> _Trace:
    """A trace from ``(time_s, slice)`` pairs; a failure of a slice already down is absorbed."""
    back_of: dict[int, float] = {}
    rows: list[tuple[float, float, int]] = []
    for t, s in sorted((float(t), int(s)) for t, s in failures):
        if not 0 <= s < params.slices:
            raise ConfigError(f"failure slice {s} out of range [0, {params.slices})")
        if not 0 <= t < params.horizon_s:
            raise ConfigError(f"failure time {t} outside [0, horizon_s={params.horizon_s})")
        if t < back_of.get(s, -math.inf):
            continue
        back_of[s] = t + params.slice_repair_s
        rows.append((t, back_of[s], s))
    if not rows:
        return _Trace(np.empty(0), np.empty(0), np.empty(0, dtype=np.int64))
    arr = np.array([(t, b) for t, b, _ in rows], dtype=np.float64)
    return _Trace(arr[:, 0], arr[:, 1], np.array([s for _, _, s in rows], dtype=np.int64))


# --------------------------------------------------------------------------------------------
# Interval arithmetic
# --------------------------------------------------------------------------------------------


def _merge(starts: FloatArray, ends: FloatArray, horizon_s: float) -> tuple[FloatArray, FloatArray]:
    """Union of intervals ``[starts, ends)`` clipped to ``[0, horizon_s]``: disjoint, sorted.

    Intervals that touch are merged, so consecutive results are separated by a positive gap.
    """
    if starts.size == 0:
        return np.empty(0), np.empty(0)
    order = np.argsort(starts, kind="stable")
    s, e = starts[order], np.minimum(ends[order], horizon_s)
    reach = np.maximum.accumulate(e)
    first = np.ones(s.size, dtype=bool)
    first[1:] = s[1:] > reach[:-1]
    heads = np.flatnonzero(first)
    tails = np.append(heads[1:] - 1, s.size - 1)
    return s[heads], reach[tails]


def _all_covered(groups: Sequence[tuple[FloatArray, FloatArray]]) -> float:
    """Measure of the time covered by every one of ``groups`` (each a disjoint union)."""
    starts = np.concatenate([g[0] for g in groups])
    ends = np.concatenate([g[1] for g in groups])
    if starts.size == 0:
        return 0.0
    times = np.concatenate([starts, ends])
    deltas = np.concatenate([np.ones(starts.size), -np.ones(ends.size)])
    order = np.lexsort((deltas, times))
    times, count = times[order], np.cumsum(deltas[order])
    spans = np.diff(times)
    return float(spans[count[:-1] >= len(groups)].sum())


@dataclass(frozen=True)
class _DownProfile:
    """Number of down slices of a group of slices, piecewise constant between ``knots``.

    ``knots = [0, event times..., horizon]``; ``down[k]`` holds on ``[knots[k], knots[k+1])``;
    ``live_integral[k]`` is the live slice-seconds in ``[0, knots[k]]``.
    """

    knots: FloatArray
    down: FloatArray
    live_integral: FloatArray

    def live_seconds(self, start: FloatArray, end: FloatArray) -> float:
        """Live slice-seconds summed over the intervals ``[start, end)``."""
        return float(np.sum(np.interp(end, self.knots, self.live_integral)
                            - np.interp(start, self.knots, self.live_integral)))

    def down_before(self, t: FloatArray) -> FloatArray:
        """Down slices just before each time in ``t``."""
        k = np.searchsorted(self.knots, t, side="left") - 1
        return self.down[np.maximum(k, 0)]

    def level(self, value: float, horizon_s: float) -> tuple[FloatArray, FloatArray]:
        """Disjoint intervals in which exactly ``value`` slices are down."""
        mask = self.down == value
        return _merge(self.knots[:-1][mask], self.knots[1:][mask], horizon_s)


def _down_profile(trace: _Trace, n_slices: int, horizon_s: float) -> _DownProfile:
    returns = trace.back_t[trace.back_t < horizon_s]
    times = np.concatenate([trace.fail_t, returns])
    deltas = np.concatenate([np.ones(trace.fail_t.size), -np.ones(returns.size)])
    order = np.lexsort((deltas, times))  # a return before a failure at the same instant
    knots = np.concatenate([[0.0], times[order], [horizon_s]])
    down = np.concatenate([[0.0], np.cumsum(deltas[order])])
    live = (n_slices - down) * np.diff(knots)
    return _DownProfile(knots, down, np.concatenate([[0.0], np.cumsum(live)]))


# --------------------------------------------------------------------------------------------
# Modes
# --------------------------------------------------------------------------------------------


def _dp(trace: _Trace, p: SimParams) -> float:
    """Kept running time of non-elastic DP / horizon (goodput and uptime alike)."""
    h = p.horizon_s
    up_s, up_e = _down_profile(trace, p.slices, h).level(0.0, h)
    run_s = up_s + np.where(up_s > 0.0, p.restart_s, 0.0)
    ok = run_s < up_e
    run_s, run_e = run_s[ok], up_e[ok]
    length = run_e - run_s
    kept = np.where(run_e < h, np.floor(length / p.checkpoint_interval_s)
                    * p.checkpoint_interval_s, length)
    return float(kept.sum() / h)


def _elastic(trace: _Trace, n_slices: int, p: SimParams) -> tuple[float, FloatArray, FloatArray]:
    """One elastic job on ``n_slices`` slices.

    Returns:
        (useful slice-seconds, idle starts, idle ends): idle = paused or every slice down.
    """
    h = p.horizon_s
    prof = _down_profile(trace, n_slices, h)
    returns = trace.back_t[trace.back_t < h]
    pause_s, pause_e = _merge(np.concatenate([trace.fail_t, returns]),
                              np.concatenate([trace.fail_t + p.downscale_s,
                                              returns + p.upscale_s]), h)
    useful = float(prof.live_integral[-1]) - prof.live_seconds(pause_s, pause_e)
    # Step in flight: a failure that starts a pause (nothing paused the job before it) aborts
    # the step on every live slice; steps restart in phase with the end of the last pause.
    if trace.fail_t.size:
        j = np.searchsorted(pause_s, trace.fail_t, side="right") - 1
        training = pause_s[j] == trace.fail_t
        f, j = trace.fail_t[training], j[training]
        resume = np.where(j > 0, pause_e[np.maximum(j - 1, 0)], 0.0)
        partial = np.mod(f - resume, p.step_s)
        useful -= float(np.sum((n_slices - prof.down_before(f)) * partial))
    dead_s, dead_e = prof.level(float(n_slices), h)
    idle_s, idle_e = _merge(np.concatenate([pause_s, dead_s]), np.concatenate([pause_e, dead_e]),
                            h)
    return useful, idle_s, idle_e


def _elastic_dp(trace: _Trace, p: SimParams) -> tuple[float, float]:
    useful, idle_s, idle_e = _elastic(trace, p.slices, p)
    h = p.horizon_s
    return useful / (p.slices * h), 1.0 - float(np.sum(idle_e - idle_s)) / h


def _learner_of(n_slices: int, learners: int) -> IntArray:
    """Learner of each slice: contiguous groups whose sizes differ by at most one."""
    return (np.arange(n_slices, dtype=np.int64) * learners) // n_slices


def _diloco(trace: _Trace, p: SimParams) -> tuple[float, float]:
    h = p.horizon_s
    owner = _learner_of(p.slices, p.learners)
    sizes = np.bincount(owner, minlength=p.learners)
    trace_owner = owner[trace.slice_idx]
    useful = 0.0
    idle: list[tuple[FloatArray, FloatArray]] = []
    for m in range(p.learners):
        u, idle_s, idle_e = _elastic(trace.subset(trace_owner == m), int(sizes[m]), p)
        useful += u
        idle.append((idle_s, idle_e))
    return useful / (p.slices * h), 1.0 - _all_covered(idle) / h


def _run(trace: _Trace, p: SimParams, mode: Mode) -> SimResult:
    if mode == "dp":
        goodput = uptime = _dp(trace, p)
    elif mode == "elastic_dp":
        goodput, uptime = _elastic_dp(trace, p)
    else:
        goodput, uptime = _diloco(trace, p)
    return SimResult(chips=p.chips, mode=mode, learners=p.learners if mode == "diloco" else 1,
                     goodput=min(max(goodput, 0.0), 1.0), uptime=min(max(uptime, 0.0), 1.0),
                     failures=int(trace.fail_t.size))


# --------------------------------------------------------------------------------------------
# Public API
# --------------------------------------------------------------------------------------------


def simulate(params: SimParams, mode: Mode, seed: int = 0) -> SimResult:
    """Simulate ``mode`` on a failure trace drawn from ``seed``.

    The trace depends on ``(chips, chips_per_slice, chip_mtbi_s, slice_repair_s, horizon_s,
    seed)`` only, so every mode and every ``learners`` sees the same failures.

    Raises:
        ConfigError: unknown ``mode``.
    """
    _check_mode(mode)
    rng = np.random.default_rng(seed)
    trace = _draw_trace(params.slices, params.chips_per_slice / params.chip_mtbi_s,
                        params.slice_repair_s, params.horizon_s, rng)
    return _run(trace, params, mode)


def simulate_events(params: SimParams, mode: Mode,
                    failures: Sequence[tuple[float, int]]) -> SimResult:
    """Simulate ``mode`` on explicit slice failures ``(time_s, slice_index)``; no randomness.

    Each failed slice is back ``params.slice_repair_s`` later; a failure of a slice that is
    already down is absorbed (not counted in ``failures``).

    Raises:
        ConfigError: unknown ``mode``, or a failure outside ``[0, horizon_s)`` or the slices.
    """
    _check_mode(mode)
    return _run(_explicit_trace(params, failures), params, mode)


def table(chips: Sequence[int] = (150_000, 300_000, 600_000, 1_200_000, 2_400_000),
          learners: Sequence[int] = (2, 4, 8, 16), seed: int = 0,
          **overrides: Any) -> list[SimResult]:
    """``dp`` and ``elastic_dp`` once per chip count, ``diloco`` once per (chips, M).

    Args:
        chips: cluster sizes N.
        learners: learner counts M for ``diloco``.
        seed: seed of every run (same trace for all modes of one N).
        **overrides: other :class:`SimParams` fields (``learners`` excluded).

    Raises:
        ConfigError: an override is not a :class:`SimParams` field, or a value is invalid.
    """
    names = set(SimParams.__dataclass_fields__) - {"chips", "learners"}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ConfigError(f"unknown simulator parameter(s): {', '.join(unknown)}")
    results: list[SimResult] = []
    for n in chips:
        base = SimParams(chips=n, **overrides)
        rng = np.random.default_rng(seed)
        trace = _draw_trace(base.slices, base.chips_per_slice / base.chip_mtbi_s,
                            base.slice_repair_s, base.horizon_s, rng)
        results.append(_run(trace, base, "dp"))
        results.append(_run(trace, base, "elastic_dp"))
        for m in learners:
            results.append(_run(trace, SimParams(chips=n, learners=m, **overrides), "diloco"))
    return results


def calibrate(step_s: float, mtbf_s: float, repair_s: float, learners: int, wall_s: float,
              restart_s: float, checkpoint_interval_s: float, seed: int = 0,
              runs: int = 200) -> dict[str, float]:
    """Expected goodput of a small measured chaos run, for comparison with its report.

    Each of ``learners`` learners is one slice of one chip, failing after Exp(``mtbf_s``) of
    uptime and down for Exp(``repair_s``) (mean), over ``wall_s``. Decoupled DiLoCo: a learner
    trains while it is up, except for ``restart_s`` after each return (its process restarts and
    rejoins) and the step in flight when it fails. DP: non-elastic, all learners stop while any
    is down, ``restart_s`` to restart, work since the last checkpoint (every
    ``checkpoint_interval_s`` of running time) lost.

    Args:
        step_s: one learner step (s).
        mtbf_s: mean time between failures of one learner (s).
        repair_s: mean down time of a failed learner (s).
        learners: M, number of learners.
        wall_s: wall time of the run (s).
        restart_s: time to restart after a failure (s).
        checkpoint_interval_s: DP checkpoint interval (s).
        seed: seed of the first run; run ``i`` uses the ``i``-th child of ``SeedSequence(seed)``.
        runs: number of seeded runs averaged.

    Returns:
        ``{"diloco": goodput, "dp": goodput}``, each the mean over ``runs``, in [0, 1].

    Raises:
        ConfigError: a value is invalid.
    """
    if isinstance(runs, bool) or not isinstance(runs, int) or runs <= 0:
        raise ConfigError(f"runs must be a positive integer, got {runs!r}")
    p = SimParams(chips=learners, learners=learners, chips_per_slice=1, chip_mtbi_s=mtbf_s,
                  slice_repair_s=repair_s, downscale_s=0.0, upscale_s=restart_s,
                  restart_s=restart_s, checkpoint_interval_s=checkpoint_interval_s,
                  step_s=step_s, horizon_s=wall_s)
    dp = diloco = 0.0
    for child in np.random.SeedSequence(seed).spawn(runs):
        trace = _draw_trace(p.slices, 1.0 / mtbf_s, repair_s, wall_s,
                            np.random.default_rng(child), exponential_repair=True)
        dp += _run(trace, p, "dp").goodput
        diloco += _run(trace, p, "diloco").goodput
    return {"diloco": diloco / runs, "dp": dp / runs}


def render_table(results: list[SimResult]) -> Table:
    """A rich table: one row per chip count, one column per mode (goodput % / uptime %)."""
    columns: list[tuple[str, int]] = []
    cells: dict[tuple[int, str, int], SimResult] = {}
    for r in results:
        key = (r.mode, r.learners if r.mode == "diloco" else 1)
        if key not in columns:
            columns.append(key)
        cells[(r.chips, *key)] = r
    order: dict[str, int] = {mode: i for i, mode in enumerate(MODES)}
    columns.sort(key=lambda c: (order.get(c[0], len(order)), c[1]))
    out = Table(title="Simulated goodput % / uptime %",
                caption="per-chip MTBI and recovery times: docs/SIMULATOR.md")
    out.add_column("chips", justify="right")
    for mode, m in columns:
        out.add_column(f"diloco M={m}" if mode == "diloco" else mode, justify="right")
    for n in dict.fromkeys(r.chips for r in results):
        row = [f"{n:,}"]
        for mode, m in columns:
            cell = cells.get((n, mode, m))
            row.append("-" if cell is None
                       else f"{100 * cell.goodput:.1f} / {100 * cell.uptime:.1f}")
        out.add_row(*row)
    return out


def main(json_out: bool, seed: int, chips: list[int] | None, learners: list[int] | None,
         **overrides: Any) -> None:
    """Print the paper-scale table (rich), or with ``json_out`` a JSON list on stdout only.

    Each JSON item is ``{"chips", "mode", "learners", "goodput", "uptime"}``; ``overrides`` are
    :class:`SimParams` fields (``None`` values are ignored so CLI options can default to None).
    """
    kwargs: dict[str, Any] = {"seed": seed}
    if chips:
        kwargs["chips"] = tuple(chips)
    if learners:
        kwargs["learners"] = tuple(learners)
    results = table(**kwargs, **{k: v for k, v in overrides.items() if v is not None})
    if json_out:
        keys = ("chips", "mode", "learners", "goodput", "uptime")
        rows = [{k: v for k, v in asdict(r).items() if k in keys} for r in results]
        sys.stdout.write(json.dumps(rows) + "\n")
    else:
        Console().print(render_table(results))
