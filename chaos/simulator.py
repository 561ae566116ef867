"""Goodput of DP, elastic DP and Decoupled DiLoCo on a large failing cluster (DESIGN §5).

One failure and recovery model, evaluated two ways:

* :func:`expected` gives its long-run expectation in closed form (renewal-reward arguments,
  derived in docs/SIMULATOR.md). It is exact, instant and noise-free, so the paper-scale table,
  the comparison with the paper and the sensitivity analysis use it.
* :func:`simulate` and :func:`simulate_events` run the *same rules* event by event on a drawn
  failure trace or on an explicit list of failures (a chaos run's script). They check the closed
  form (tests: agreement within a fraction of a point at paper scale) and predict runs too
  small or too irregular for an expectation (:func:`calibrate_report`).

Cluster
-------
``chips`` chips in slices of ``chips_per_slice``. Every chip is interrupted as a Poisson process
of rate ``1 / chip_mtbi_s``; an interruption takes its slice out of service for
``slice_repair_s`` (swapped from a spare pool and health-checked); interruptions of a slice
already out are absorbed. A job of ``n`` chips therefore fails at rate ``n / chip_mtbi_s``.

Modes and their rules
---------------------
``dp``, no elasticity (with ``hot_spares``, the paper's setting). A failure stops the job; it
runs again ``detect_s + restart_s`` later, from its last checkpoint. Failures before it runs
again are handled by the same restart (their slices are swapped from the spare pool while it
restarts). A checkpoint is written every ``checkpoint_interval_s`` of training and blocks it for
``checkpoint_cost_s``; a failure loses the unfinished interval. Without ``hot_spares`` (a chaos
run, where the killed worker itself must come back) the restart takes ``restart_s`` after the
failure is detected *and* every failed slice is back, and a failure before the job runs again
makes it wait for that slice and restart again.

``elastic_dp``, one elastic job on every slice (and each Decoupled DiLoCo learner on its own).
It trains on the slices in its mesh, throughput proportional to their number. A failure of a
slice in the mesh loses the step in flight (``step_s``) on the whole mesh and stalls the job for
``detect_s + downscale_s`` while it rebuilds without that slice; failures during a stall are left
out by the same rebuild. A slice back from repair is taken in at the end of the next stall; if
no stall starts within ``upscale_wait_s`` of its return, an upscale stall of ``upscale_s`` is
started for it (and takes in every slice returned by its end). A job that lost every slice is
down until one returns, then rejoins in ``rejoin_s``.

``diloco``, ``learners`` learners, each an elastic job on its own group of slices (sizes differ by
at most one slice). Learners never wait for each other. A learner sends each fragment once per
``sync_period_s``; one that crashes with every slice loses the work it had not sent, and work not
sent by the end of the window is not counted (chaos runs; never at paper scale). The syncer is
available a fraction ``syncer_availability`` of the time; work whose outer gradients reach it
while it is not is counted as lost (a pessimistic bound: our learners fold unsent deltas into
the next).

Outputs
-------
``goodput`` = useful chip-time / allocated chip-time (``chips * horizon``). ``uptime`` = share of
wall time in which the global model progresses: ``dp``, running time whose work is kept;
``elastic_dp``, time the job trains; ``diloco``, time at least one learner trains (times the
syncer's availability).

Parameters (:class:`SimParams`, docs/SIMULATOR.md has the table with sources)
------------------------------------------------------------------------------
The per-chip failure rate, H and the syncer's availability are the paper's (Decoupled DiLoCo,
arXiv 2604.21428; DESIGN §2, §5), the detection time ours. The other times are assumptions,
chosen once: the elastic ones (``downscale_s``, ``upscale_s``, ``upscale_wait_s``) against the
paper's fifteen elastic cells (elastic DP and Decoupled DiLoCo, M = 2..16), the DP ones
(``restart_s``, ``checkpoint_cost_s``) against its three DP cells; every published cell is then
within 2.1 points. :data:`PUBLISHED_GOODPUT` holds the paper's cells for comparison only; nothing
here reads it to compute a prediction.
"""

from __future__ import annotations

import json
import math
import statistics
import sys
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any, Literal, get_args

import numpy as np
import numpy.typing as npt
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ddiloco.pipeline.errors import ConfigError

__all__ = [
    "MODES",
    "PUBLISHED_GOODPUT",
    "SENSITIVITY_PARAMS",
    "Calibration",
    "Failure",
    "Mode",
    "PublishedCell",
    "SensitivityRow",
    "SimParams",
    "SimResult",
    "calibrate",
    "calibrate_report",
    "compare_published",
    "expected",
    "main",
    "parse_params",
    "render_calibration",
    "render_sensitivity",
    "render_table",
    "sensitivity",
    "simulate",
    "simulate_events",
    "table",
]

Mode = Literal["dp", "elastic_dp", "diloco"]
MODES: tuple[Mode, ...] = get_args(Mode)

YEAR_S = 365 * 24 * 3600
"""One year in seconds: the paper's per-chip mean time between interruptions."""

TABLE_CHIPS: tuple[int, ...] = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
"""Cluster sizes of the table (the paper's range, DESIGN §5)."""

TABLE_LEARNERS: tuple[int, ...] = (2, 4, 8, 16)
"""Learner counts M of the table (the paper's Table 1)."""

PUBLISHED_GOODPUT: Mapping[int, Mapping[tuple[str, int], float]] = {
    150_000: {("dp", 1): 72, ("elastic_dp", 1): 88, ("diloco", 2): 94, ("diloco", 4): 96,
              ("diloco", 8): 98, ("diloco", 16): 99},
    1_200_000: {("dp", 1): 27, ("elastic_dp", 1): 58, ("diloco", 2): 70, ("diloco", 4): 82,
                ("diloco", 8): 88, ("diloco", 16): 93},
    2_400_000: {("dp", 1): 18, ("elastic_dp", 1): 40, ("diloco", 2): 54, ("diloco", 4): 73,
                ("diloco", 8): 80, ("diloco", 16): 86},
}
"""The paper's Table 1, goodput in % by chips and (mode, M): the reference the model is compared
against (:func:`compare_published`). Never an input of a prediction."""

MAX_EXPECTED_FAILURES = 5_000_000
"""Refuse parameter sets expected to draw more slice failures than this (memory bound)."""

_BLOCK_ELEMENTS = 1_000_000
"""Most random draws per block of :func:`_draw_trace` (memory bound)."""

FloatArray = npt.NDArray[np.float64]
IntArray = npt.NDArray[np.int64]
BoolArray = npt.NDArray[np.bool_]


# --------------------------------------------------------------------------------------------
# Parameters and results
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class SimParams:
    """One cluster and its recovery times. Times in seconds; sources in docs/SIMULATOR.md.

    Attributes:
        chips: N, allocated chips. A multiple of ``chips_per_slice``.
        learners: M, Decoupled DiLoCo learners (mode ``diloco`` only), at most the slices.
        chips_per_slice: chips that fail, are replaced and join or leave together.
            Assumption: 100.
        chip_mtbi_s: mean time between interruptions of one chip. Paper: 1 year.
        slice_repair_s: time a failed slice is out of service (drained, a host replaced,
            health-checked). Assumption: 1 200 (20 min).
        detect_s: time from a failure until the job notices it (heartbeat timeout). Ours:
            ``run.learner_ttl_s`` = 3, measured 2.7-3.1 in chaos runs.
        downscale_s: rebuild of an elastic job's mesh without a failed slice, after detection.
            Assumption: 16.5 (fitted with ``upscale_s`` and ``upscale_wait_s`` to the paper's
            elastic cells).
        upscale_s: rebuild that takes returned slices in (state copied to them).
            Assumption: 25 (fitted).
        upscale_wait_s: longest a returned slice waits to be taken in by another stall before
            one is started for it. Assumption: 150 (fitted).
        restart_s: restart of the whole non-elastic job from its checkpoint, after detection.
            Assumption: 53 (fitted with ``checkpoint_cost_s`` to the paper's DP cells).
        checkpoint_interval_s: training time between two DP checkpoints (lost work on a
            failure: the unfinished interval). Assumption: 1 (every step, in memory).
        checkpoint_cost_s: training time one DP checkpoint blocks. Assumption: 0.1 (fitted).
        step_s: one synchronous training step; the step in flight is lost on a failure.
            Assumption: 1.
        rejoin_s: restart of an elastic job (a learner) that lost every slice, reading the
            latest global model from the store. Assumption: 60 (no paper-scale learner loses
            every slice; measured in chaos runs).
        sync_period_s: time in which a Decoupled DiLoCo learner sends every fragment once (H
            inner steps). A learner that crashes with every slice loses the work it has not
            sent; work not sent by the end of the simulated window is not counted. Paper:
            H = 24 steps, here 24 s.
        syncer_availability: share of time the syncer accepts outer gradients. Paper: 1
            (zero global downtime).
        hot_spares: DP restarts on spare slices (True, the paper's setting) or must wait for
            its failed slices to come back (False, a chaos run).
        horizon_s: simulated wall time of :func:`simulate` (not used by :func:`expected`).
            Assumption: one week.

    Raises:
        ConfigError: a value is out of range, not a whole multiple, or would draw an
            unreasonable number of failures.
    """

    chips: int
    learners: int = 1
    chips_per_slice: int = 100
    chip_mtbi_s: float = float(YEAR_S)
    slice_repair_s: float = 1200.0
    detect_s: float = 3.0
    downscale_s: float = 16.5
    upscale_s: float = 25.0
    upscale_wait_s: float = 150.0
    restart_s: float = 53.0
    checkpoint_interval_s: float = 1.0
    checkpoint_cost_s: float = 0.1
    step_s: float = 1.0
    rejoin_s: float = 60.0
    sync_period_s: float = 24.0
    syncer_availability: float = 1.0
    hot_spares: bool = True
    horizon_s: float = 7 * 24 * 3600.0

    def __post_init__(self) -> None:
        for name in ("chips", "learners", "chips_per_slice"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int | np.integer):
                raise ConfigError(f"SimParams.{name} must be an integer, got {value!r}")
            if value <= 0:
                raise ConfigError(f"SimParams.{name} must be positive, got {value}")
        for name in ("chip_mtbi_s", "checkpoint_interval_s", "step_s", "sync_period_s",
                     "horizon_s"):
            value = getattr(self, name)
            if not _is_real(value) or not value > 0 or not math.isfinite(value):
                raise ConfigError(f"SimParams.{name} must be a positive finite number of "
                                  f"seconds, got {value!r}")
        for name in ("slice_repair_s", "detect_s", "downscale_s", "upscale_s", "upscale_wait_s",
                     "restart_s", "checkpoint_cost_s", "rejoin_s"):
            value = getattr(self, name)
            if not _is_real(value) or not value >= 0 or not math.isfinite(value):
                raise ConfigError(f"SimParams.{name} must be a non-negative finite number of "
                                  f"seconds, got {value!r}")
        a = self.syncer_availability
        if not _is_real(a) or not 0 < a <= 1:
            raise ConfigError(f"SimParams.syncer_availability must be in (0, 1], got {a!r}")
        if not isinstance(self.hot_spares, bool):
            raise ConfigError(f"SimParams.hot_spares must be a bool, got {self.hot_spares!r}")
        if self.chips % self.chips_per_slice:
            raise ConfigError(f"SimParams.chips ({self.chips}) must be a multiple of "
                              f"chips_per_slice ({self.chips_per_slice})")
        if self.learners > self.slices:
            raise ConfigError(f"SimParams.learners ({self.learners}) exceeds the number of "
                              f"slices ({self.slices} = {self.chips} / {self.chips_per_slice})")
        expected_failures = self.chips * self.horizon_s / self.chip_mtbi_s
        if expected_failures > MAX_EXPECTED_FAILURES:
            raise ConfigError(f"SimParams: chips * horizon_s / chip_mtbi_s = "
                              f"{expected_failures:.3g} expected failures, more than "
                              f"{MAX_EXPECTED_FAILURES}; shorten horizon_s")

    @property
    def slices(self) -> int:
        """Number of slices, ``chips / chips_per_slice``."""
        return self.chips // self.chips_per_slice


@dataclass(frozen=True)
class SimResult:
    """Goodput and uptime of one mode on one cluster.

    Attributes:
        chips: N, allocated chips.
        mode: ``dp``, ``elastic_dp`` or ``diloco``.
        learners: M for ``diloco``; 1 for the DP modes.
        goodput: useful chip-time / allocated chip-time, in [0, 1].
        uptime: share of wall time in which the global model progresses, in [0, 1].
        failures: slice failures over ``horizon_s``: drawn (:func:`simulate`), given
            (:func:`simulate_events`) or expected, rounded (:func:`expected`).
    """

    chips: int
    mode: str
    learners: int
    goodput: float
    uptime: float
    failures: int


@dataclass(frozen=True)
class Failure:
    """One explicit failure for :func:`simulate_events`.

    Attributes:
        t_s: when, seconds from the start of the run.
        slice: which slice, ``0 <= slice < params.slices``.
        down_s: how long the slice is out; None: ``params.slice_repair_s``.
        restart: True for a crash (its process restarts: DP restarts from a checkpoint, a
            learner that lost every slice rejoins); False for a pause (the process resumes
            with its state: nothing is lost, nothing restarts).
    """

    t_s: float
    slice: int
    down_s: float | None = None
    restart: bool = True


def _is_real(value: object) -> bool:
    return isinstance(value, int | float | np.integer | np.floating) and not isinstance(
        value, bool)


def _check_mode(mode: str) -> None:
    if mode not in MODES:
        raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {mode!r}")


def _clip(x: float) -> float:
    return min(max(x, 0.0), 1.0)


# --------------------------------------------------------------------------------------------
# Closed form (long-run expectation of the rules above)
# --------------------------------------------------------------------------------------------


def _elastic_expected(n: float, p: SimParams, learner: bool = False) -> tuple[float, float]:
    """``(goodput, share of time training)`` of one elastic job on ``n`` chips.

    Failures at rate ``L = n / chip_mtbi_s``; ``u = L * upscale_wait_s``. A training stretch
    ends at the first failure or ``upscale_wait_s`` after the first return (returns are also a
    Poisson stream of rate ``L``), whichever is first: it ends on a failure with probability
    ``p_f = 1 - e^-u / 2`` and lasts ``p_f / L`` on average, so the share of time training is
    ``1 / (1 + L a + L b e^-u / (2 - e^-u))`` with ``a = detect_s + downscale_s`` and
    ``b = upscale_s``. Of that time the job loses, per chip: the slices under repair
    (``L S R / n``), the step in flight (``L step_s / 2``) and the returned slices waiting to be
    taken in (``(S / n) (1 - e^-u (1 + u / 2)) / p_f``). A job of one slice is down while it is
    repaired and rejoins after each return: ``e^(-L rejoin) / (1 + L R)`` of the time; a
    learner (``learner``) also loses its unsent work at each crash, on average
    ``(1 / L) (1 - (1 - e^-v) / v)`` with ``v = L sync_period_s`` (:func:`_unsent_share` over
    an Exp(L) training stretch). A larger learner loses every slice too rarely to count.
    """
    lam = 1.0 / p.chip_mtbi_s
    size = float(p.chips_per_slice)
    rate = n * lam
    if n <= size:
        train = math.exp(-rate * p.rejoin_s) / (1.0 + rate * p.slice_repair_s)
        v = rate * p.sync_period_s
        unsent = 1.0 - (1.0 - math.exp(-v)) / v if learner else 0.0
        return train * (1.0 - rate * p.step_s / 2.0 - unsent), train
    u = rate * p.upscale_wait_s
    e = math.exp(-u)
    p_fail = 1.0 - e / 2.0
    train = 1.0 / (1.0 + rate * (p.detect_s + p.downscale_s) + rate * p.upscale_s * e / (2.0 - e))
    repair = lam * size * p.slice_repair_s
    in_flight = rate * p.step_s / 2.0
    waiting = size / n * (1.0 - e * (1.0 + u / 2.0)) / p_fail
    return train * (1.0 - repair - in_flight - waiting), train


def _dp_expected(p: SimParams) -> float:
    """Kept training share of non-elastic DP with hot spares.

    Up stretches ~ Exp(L), ``L = chips / chip_mtbi_s``; each keeps ``T`` per completed
    checkpoint period ``P = T + C``: ``E[T floor(X / P)] = T / (e^(L P) - 1)``. Every cycle adds
    ``detect_s + restart_s`` stopped (failures during it absorbed).
    """
    rate = p.chips / p.chip_mtbi_s
    period = p.checkpoint_interval_s + p.checkpoint_cost_s
    kept = p.checkpoint_interval_s / math.expm1(rate * period)
    return kept / (1.0 / rate + p.detect_s + p.restart_s)


def expected(params: SimParams, mode: Mode) -> SimResult:
    """Long-run expected goodput and uptime of ``mode`` (closed form, no randomness).

    Raises:
        ConfigError: unknown ``mode``, or ``dp`` without ``hot_spares`` (no closed form: use
            :func:`simulate`).
    """
    _check_mode(mode)
    p = params
    failures = round(p.chips * p.horizon_s / p.chip_mtbi_s)
    if mode == "dp":
        if not p.hot_spares:
            raise ConfigError("expected(): DP without hot spares has no closed form; "
                              "use simulate()")
        g = _dp_expected(p)
        return SimResult(p.chips, mode, 1, _clip(g), _clip(g), failures)
    if mode == "elastic_dp":
        g, train = _elastic_expected(float(p.chips), p)
        return SimResult(p.chips, mode, 1, _clip(g), _clip(train), failures)
    g, train = _elastic_expected(p.chips / p.learners, p, learner=True)
    a = p.syncer_availability
    return SimResult(p.chips, mode, p.learners, _clip(a * g),
                     _clip(a * (1.0 - (1.0 - train) ** p.learners)), failures)


# --------------------------------------------------------------------------------------------
# Failure traces
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class _Trace:
    """Slice failures in ``[0, horizon)``, sorted by time: when, which slice, when it is back,
    and whether it was a crash (True) or a pause (False)."""

    fail_t: FloatArray
    back_t: FloatArray
    slice_idx: IntArray
    restart: BoolArray

    def subset(self, mask: BoolArray) -> _Trace:
        return _Trace(self.fail_t[mask], self.back_t[mask], self.slice_idx[mask],
                      self.restart[mask])


def _empty_trace() -> _Trace:
    return _Trace(np.empty(0), np.empty(0), np.empty(0, dtype=np.int64),
                  np.empty(0, dtype=bool))


def _draw_trace(n_slices: int, slice_rate: float, repair_s: float, horizon_s: float,
                rng: np.random.Generator) -> _Trace:
    """Alternating renewal per slice: up ~ Exp(slice_rate), down ``repair_s``. All slices
    advance together, a block of cycles at a time (cumulative sums), so the Python loop runs a
    handful of times whatever the number of failures.
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
        down = np.full(shape, repair_s)
        reach = np.cumsum(down + rng.exponential(mean_up, shape), axis=1)
        fail = t[:, None] + np.concatenate([np.zeros((t.size, 1)), reach[:, :-1]], axis=1)
        keep = fail < horizon_s
        fails.append(fail[keep])
        backs.append((fail + down)[keep])
        owners.append(np.broadcast_to(idx[:, None], shape)[keep])
        t = t + reach[:, -1]
    if not fails:
        return _empty_trace()
    fail_t = np.concatenate(fails)
    order = np.argsort(fail_t, kind="stable")
    return _Trace(fail_t[order], np.concatenate(backs)[order], np.concatenate(owners)[order],
                  np.ones(fail_t.size, dtype=bool))


def _explicit_trace(params: SimParams, failures: Iterable[Failure | tuple[float, int]]) -> _Trace:
    """A trace from explicit failures; a failure of a slice that is out (or returns at that
    instant) is absorbed."""
    items = [f if isinstance(f, Failure) else Failure(float(f[0]), int(f[1])) for f in failures]
    back_of: dict[int, float] = {}
    rows: list[tuple[float, float, int, bool]] = []
    for f in sorted(items, key=lambda x: (float(x.t_s), int(x.slice))):
        t, s = float(f.t_s), int(f.slice)
        if not 0 <= s < params.slices:
            raise ConfigError(f"failure slice {s} out of range [0, {params.slices})")
        if not 0 <= t < params.horizon_s:
            raise ConfigError(f"failure time {t} outside [0, horizon_s={params.horizon_s})")
        down = params.slice_repair_s if f.down_s is None else float(f.down_s)
        if not down >= 0:
            raise ConfigError(f"failure down_s must be >= 0, got {f.down_s!r}")
        if t <= back_of.get(s, -math.inf):
            continue
        back_of[s] = t + down
        rows.append((t, back_of[s], s, bool(f.restart)))
    if not rows:
        return _empty_trace()
    return _Trace(np.array([r[0] for r in rows]), np.array([r[1] for r in rows]),
                  np.array([r[2] for r in rows], dtype=np.int64),
                  np.array([r[3] for r in rows], dtype=bool))


# --------------------------------------------------------------------------------------------
# Event-by-event evaluation of the rules
# --------------------------------------------------------------------------------------------

_IN, _OUT, _WAITING = 0, 1, 2
"""Slice states of an elastic job: in the mesh, out of service, back but not yet taken in."""


def _unsent_share(x: float, period: float) -> float:
    """Share of the work of a learner's last ``x`` seconds of training that it has not sent.

    Its P fragments are sent in turn, each once per ``period`` (staggered evenly), so a
    fragment's unsent work is the time since its last send: ``x - x^2 / (2 period)`` on average
    over the fragments while ``x < period``, ``period / 2`` after.
    """
    if x <= 0.0:
        return 0.0
    return 1.0 - x / (2.0 * period) if x < period else period / (2.0 * x)


def _elastic_run(trace: _Trace, first_slice: int, n_slices: int, p: SimParams,
                 learner: bool = False) -> tuple[float, list[float], list[float]]:
    """One elastic job on slices ``[first_slice, first_slice + n_slices)``.

    With ``learner`` (a Decoupled DiLoCo learner) a crash that leaves it no slice loses its
    unsent work (:func:`_unsent_share` of its work since it last joined), and so does the end
    of the window.

    Returns:
        (useful slice-seconds, training starts, training ends) over ``[0, horizon_s)``.
    """
    h, inf = p.horizon_s, math.inf
    fail_t = trace.fail_t.tolist()
    fail_s = (trace.slice_idx - first_slice).tolist()
    fail_restart = trace.restart.tolist()
    order = np.argsort(trace.back_t, kind="stable")
    back_t = trace.back_t[order].tolist()
    back_s = (trace.slice_idx[order] - first_slice).tolist()
    back_restart = trace.restart[order].tolist()
    stall_down = p.detect_s + p.downscale_s
    state = [_IN] * n_slices
    mesh = n_slices
    waiting: dict[int, float] = {}  # slot -> return time, oldest first
    stall_end = inf  # inf: not stalled
    t = resume = useful = 0.0
    joined_t = joined_u = 0.0  # training time and useful slice-seconds since it last joined
    starts, ends = [0.0], []
    i = j = 0
    while True:
        tf = fail_t[i] if i < len(fail_t) else inf
        tr = back_t[j] if j < len(back_t) else inf
        training = stall_end == inf and mesh > 0
        if stall_end != inf:
            td = stall_end
        elif training and waiting:
            td = next(iter(waiting.values())) + p.upscale_wait_s
        else:
            td = inf
        tn = min(tf, tr, td)
        if tn >= h:
            if training:
                useful += mesh * (h - t)
                joined_t += h - t
                joined_u += mesh * (h - t)
                ends.append(h)
            if learner:  # not sent by the end of the window
                useful -= joined_u * _unsent_share(joined_t, p.sync_period_s)
            break
        if training:
            useful += mesh * (tn - t)
            joined_t += tn - t
            joined_u += mesh * (tn - t)
        t = tn
        if td <= tr and td <= tf:
            if stall_end != inf:  # the rebuild ends: every returned slice is taken in
                for s in waiting:
                    state[s] = _IN
                mesh += len(waiting)
                waiting.clear()
                stall_end = inf
                if mesh > 0:
                    resume = t
                    starts.append(t)
            else:  # no stall took the oldest returned slice in: upscale for it
                stall_end = t + p.upscale_s
                ends.append(t)
        elif tr < tf:
            s = back_s[j]
            restart = back_restart[j]
            j += 1
            if state[s] != _OUT:  # cannot happen with a trace from _draw/_explicit_trace
                continue
            state[s] = _WAITING
            waiting[s] = t
            if mesh == 0 and stall_end == inf:  # an empty job restarts around it
                stall_end = t + (p.rejoin_s if restart else 0.0)
        else:
            s = fail_s[i]
            crash = fail_restart[i]
            i += 1
            if state[s] == _IN:
                if training:
                    lost = mesh * math.fmod(t - resume, p.step_s)
                    useful -= lost
                    joined_u -= lost
                    ends.append(t)
                mesh -= 1
                state[s] = _OUT
                if learner and crash and mesh == 0:  # its unsent outer gradients die with it
                    useful -= joined_u * _unsent_share(joined_t, p.sync_period_s)
                    joined_t = joined_u = 0.0
                if training:  # a failure during a stall is left out by that rebuild
                    if mesh > 0:
                        stall_end = t + stall_down
                    elif waiting:
                        stall_end = t + p.rejoin_s
            elif state[s] == _WAITING:
                del waiting[s]
                state[s] = _OUT
    return useful, starts, ends


def _dp_run(trace: _Trace, p: SimParams) -> float:
    """Kept (checkpointed) training time of non-elastic DP over ``[0, horizon_s)``, seconds."""
    h = p.horizon_s
    interval, period = p.checkpoint_interval_s, p.checkpoint_interval_s + p.checkpoint_cost_s
    fail_t, back_t = trace.fail_t.tolist(), trace.back_t.tolist()
    crash = trace.restart.tolist()
    kept = resume = carry = 0.0  # carry: training since the last checkpoint, before a pause
    i, n = 0, len(fail_t)

    def ready_after(k: int) -> float:
        """When the job runs again after crash ``k`` alone."""
        if p.hot_spares:
            return fail_t[k] + p.detect_s + p.restart_s
        return max(fail_t[k] + p.detect_s, back_t[k]) + p.restart_s

    while i < n and fail_t[i] < h:
        run = carry + fail_t[i] - resume
        kept += interval * math.floor(run / period)
        if crash[i]:  # the unfinished checkpoint interval is lost
            carry = 0.0
            restarting, resume = True, ready_after(i)
        else:  # a pause: everyone waits for the slice, then goes on where it was
            carry = math.fmod(run, period)
            restarting, resume = False, back_t[i]
        i += 1
        while i < n and fail_t[i] < resume:
            if not crash[i]:
                resume = max(resume, back_t[i])
            elif not restarting or not p.hot_spares:
                resume = max(resume, ready_after(i))
                restarting = True
            i += 1
    if resume < h:  # the interval unfinished at the end of the window is not committed
        kept += interval * math.floor((carry + h - resume) / period)
    return kept


def _learner_of(n_slices: int, learners: int) -> IntArray:
    """Learner of each slice: contiguous groups whose sizes differ by at most one."""
    return (np.arange(n_slices, dtype=np.int64) * learners) // n_slices


def _union_length(starts: list[float], ends: list[float]) -> float:
    """Measure of the union of the intervals ``[starts[k], ends[k])``."""
    if not starts:
        return 0.0
    s, e = np.asarray(starts), np.asarray(ends)
    order = np.argsort(s, kind="stable")
    s, e = s[order], e[order]
    reach = np.maximum.accumulate(e)
    first = np.ones(s.size, dtype=bool)
    first[1:] = s[1:] > reach[:-1]
    heads = np.flatnonzero(first)
    tails = np.append(heads[1:] - 1, s.size - 1)
    return float(np.sum(reach[tails] - s[heads]))


def _run(trace: _Trace, p: SimParams, mode: Mode) -> SimResult:
    h = p.horizon_s
    if mode == "dp":
        goodput = uptime = _dp_run(trace, p) / h
    elif mode == "elastic_dp":
        useful, starts, ends = _elastic_run(trace, 0, p.slices, p)
        goodput, uptime = useful / (p.slices * h), _union_length(starts, ends) / h
    else:
        owner = _learner_of(p.slices, p.learners)
        firsts = np.searchsorted(owner, np.arange(p.learners + 1))
        trace_owner = owner[trace.slice_idx]
        useful, all_starts, all_ends = 0.0, [], []
        for m in range(p.learners):
            u, starts, ends = _elastic_run(trace.subset(trace_owner == m), int(firsts[m]),
                                           int(firsts[m + 1] - firsts[m]), p, learner=True)
            useful += u
            all_starts += starts
            all_ends += ends
        a = p.syncer_availability
        goodput = a * useful / (p.slices * h)
        uptime = a * _union_length(all_starts, all_ends) / h
    return SimResult(chips=p.chips, mode=mode, learners=p.learners if mode == "diloco" else 1,
                     goodput=_clip(goodput), uptime=_clip(uptime),
                     failures=int(trace.fail_t.size))


# --------------------------------------------------------------------------------------------
# Public API: simulation, table, comparison with the paper, sensitivity
# --------------------------------------------------------------------------------------------


def simulate(params: SimParams, mode: Mode, seed: int = 0) -> SimResult:
    """Simulate ``mode`` event by event on a failure trace drawn from ``seed``.

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
                    failures: Sequence[Failure | tuple[float, int]]) -> SimResult:
    """Simulate ``mode`` on explicit failures (:class:`Failure` or ``(time_s, slice)``, which
    is out for ``params.slice_repair_s``); no randomness. A failure of a slice that is already
    out is absorbed (not counted in ``failures``).

    Raises:
        ConfigError: unknown ``mode``, or a failure outside ``[0, horizon_s)`` or the slices.
    """
    _check_mode(mode)
    return _run(_explicit_trace(params, failures), params, mode)


def table(chips: Sequence[int] = TABLE_CHIPS, learners: Sequence[int] = TABLE_LEARNERS,
          monte_carlo: bool = False, seed: int = 0, **overrides: Any) -> list[SimResult]:
    """``dp`` and ``elastic_dp`` once per chip count, ``diloco`` once per (chips, M).

    Args:
        chips: cluster sizes N.
        learners: learner counts M for ``diloco``.
        monte_carlo: simulate one trace per N (:func:`simulate`, the same trace for every mode
            of one N) instead of the closed form (:func:`expected`).
        seed: seed of every trace (``monte_carlo`` only).
        **overrides: other :class:`SimParams` fields (``chips`` and ``learners`` excluded).

    Raises:
        ConfigError: an override is not a :class:`SimParams` field, or a value is invalid.
    """
    names = {f.name for f in fields(SimParams)} - {"chips", "learners"}
    unknown = sorted(set(overrides) - names)
    if unknown:
        raise ConfigError(f"unknown simulator parameter(s): {', '.join(unknown)}")
    results: list[SimResult] = []
    for n in chips:
        base = SimParams(chips=n, **overrides)
        by_m = [SimParams(chips=n, learners=m, **overrides) for m in learners]
        if not monte_carlo:
            results += [expected(base, "dp"), expected(base, "elastic_dp")]
            results += [expected(q, "diloco") for q in by_m]
            continue
        trace = _draw_trace(base.slices, base.chips_per_slice / base.chip_mtbi_s,
                            base.slice_repair_s, base.horizon_s, np.random.default_rng(seed))
        results += [_run(trace, base, "dp"), _run(trace, base, "elastic_dp")]
        results += [_run(trace, q, "diloco") for q in by_m]
    return results


@dataclass(frozen=True)
class PublishedCell:
    """One cell of the paper's Table 1 next to the model's prediction (goodput in %)."""

    chips: int
    mode: str
    learners: int
    predicted: float
    published: float

    @property
    def error(self) -> float:
        """Predicted minus published, in goodput points."""
        return self.predicted - self.published


def compare_published(results: Sequence[SimResult]) -> list[PublishedCell]:
    """The cells of ``results`` that the paper published (:data:`PUBLISHED_GOODPUT`)."""
    out: list[PublishedCell] = []
    for r in results:
        pub = PUBLISHED_GOODPUT.get(r.chips, {}).get((r.mode, r.learners))
        if pub is not None:
            out.append(PublishedCell(r.chips, r.mode, r.learners, 100.0 * r.goodput, pub))
    return out


SENSITIVITY_PARAMS: tuple[str, ...] = (
    "chip_mtbi_s", "chips_per_slice", "slice_repair_s", "detect_s", "downscale_s", "upscale_s",
    "upscale_wait_s", "step_s", "rejoin_s", "syncer_availability", "restart_s",
    "checkpoint_interval_s", "checkpoint_cost_s")
"""Parameters :func:`sensitivity` varies (``syncer_availability`` through 1 - availability)."""


@dataclass(frozen=True)
class SensitivityRow:
    """Goodput (%) of one cell with one parameter halved, as given and doubled.

    ``half`` or ``double`` is None when that value is not a valid parameter set.
    """

    name: str
    value: float
    half: float | None
    base: float
    double: float | None


def _scaled(params: SimParams, name: str, factor: float) -> SimParams | None:
    value = getattr(params, name)
    if name == "syncer_availability":
        new: float | int = 1.0 - (1.0 - value) * factor
    elif name == "chips_per_slice":
        new = round(value * factor)
    else:
        new = value * factor
    changes: dict[str, Any] = {name: new}
    try:
        return replace(params, **changes)
    except ConfigError:
        return None


def sensitivity(params: SimParams, mode: Mode,
                names: Sequence[str] = SENSITIVITY_PARAMS) -> list[SensitivityRow]:
    """Goodput of ``mode`` with each parameter of ``names`` halved and doubled (closed form).

    Raises:
        ConfigError: unknown ``mode`` or parameter name.
    """
    known = {f.name for f in fields(SimParams)}
    unknown = sorted(set(names) - known)
    if unknown:
        raise ConfigError(f"unknown simulator parameter(s): {', '.join(unknown)}")
    base = 100.0 * expected(params, mode).goodput
    rows = []
    for name in names:
        half, double = (_scaled(params, name, f) for f in (0.5, 2.0))
        rows.append(SensitivityRow(
            name, float(getattr(params, name)),
            None if half is None else 100.0 * expected(half, mode).goodput, base,
            None if double is None else 100.0 * expected(double, mode).goodput))
    return rows


# --------------------------------------------------------------------------------------------
# Calibration against a measured chaos run
# --------------------------------------------------------------------------------------------


def calibrate(params: SimParams, runs: int = 200, seed: int = 0,
              modes: Sequence[Mode] = ("diloco", "dp")) -> dict[str, float]:
    """Mean goodput of ``modes`` over ``runs`` drawn traces (Poisson failures) of ``params``:
    what a run of this size, length and failure rate gets on average.

    Run ``i`` draws its trace from the ``i``-th child of ``SeedSequence(seed)``; every mode sees
    the same traces.

    Raises:
        ConfigError: ``runs`` is not a positive integer, or an unknown mode.
    """
    if isinstance(runs, bool) or not isinstance(runs, int) or runs <= 0:
        raise ConfigError(f"runs must be a positive integer, got {runs!r}")
    for mode in modes:
        _check_mode(mode)
    total = dict.fromkeys(modes, 0.0)
    for child in np.random.SeedSequence(seed).spawn(runs):
        trace = _draw_trace(params.slices, params.chips_per_slice / params.chip_mtbi_s,
                            params.slice_repair_s, params.horizon_s,
                            np.random.default_rng(child))
        for mode in modes:
            total[mode] += _run(trace, params, mode).goodput
    return {mode: v / runs for mode, v in total.items()}


@dataclass
class Calibration:
    """The model fitted to one chaos run (:func:`calibrate_report`).

    Attributes:
        inputs: what was read from the run (learners, window, fault counts, MTBF, detection,
            rejoin, DP restart, step times, checkpoint interval, syncer availability).
        params: the model's parameters per mode (one slice of one chip per learner).
        failures: the run's learner faults, as the model sees them.
        measured: per mode, the run's ``goodput`` and ``availability``.
        predicted: per mode, the model's goodput on this run's fault times.
        poisson: per mode, the model's mean goodput over Poisson failures at the measured MTBF.
        unmodelled: faults of the run the model leaves out (slow, congest, learner partition).
    """

    inputs: dict[str, Any]
    params: dict[str, SimParams]
    failures: list[Failure]
    measured: dict[str, dict[str, float | None]]
    predicted: dict[str, float]
    poisson: dict[str, float]
    unmodelled: list[str] = field(default_factory=list)

    def errors(self) -> dict[str, float | None]:
        """Predicted minus measured goodput, in points, per mode (None: nothing measured)."""
        out: dict[str, float | None] = {}
        for mode, pred in self.predicted.items():
            got = self.measured.get(mode, {}).get("goodput")
            out[mode] = None if got is None else 100.0 * (pred - got)
        return out

    def to_json(self) -> dict[str, Any]:
        """JSON-able summary (the ``simulator`` block of chaos.json)."""
        return {
            "inputs": self.inputs,
            "params": {m: asdict(p) for m, p in self.params.items()},
            "failures": [asdict(f) for f in self.failures],
            "predicted": {m: round(v, 4) for m, v in self.predicted.items()},
            "predicted_poisson": {m: round(v, 4) for m, v in self.poisson.items()},
            "measured": {m: v.get("goodput") for m, v in self.measured.items()},
            "measured_availability": {m: v.get("availability") for m, v in self.measured.items()},
            "error_points": {m: None if v is None else round(v, 2)
                             for m, v in self.errors().items()},
            "unmodelled": self.unmodelled,
        }


def _p50(block: Mapping[str, Any], key: str) -> float | None:
    summary = block.get(key) or {}
    value = summary.get("p50") if isinstance(summary, Mapping) else None
    return None if value is None else float(value)


def _dp_restart(block: Mapping[str, Any], kills: Sequence[tuple[float, float]]) -> float | None:
    """Median DP restart time of a run: for each recovered learner kill, the time the job ran
    again less the latest return of a killed learner before it (``kills``: ``(at_s, back_s)``
    relative to the run's start)."""
    faults = [f for f in block.get("faults") or [] if f.get("kind") == "kill"
              and str(f.get("target", "")).startswith("learner")]
    recs = [r for r in block.get("recoveries") or [] if r.get("kind") == "kill"
            and str(r.get("target", "")).startswith("learner")]
    estimates = []
    for f, r in zip(faults, recs, strict=False):
        if r.get("recover_s") is None:
            continue
        resumed = float(f["at_s"]) + float(r["recover_s"])
        backs = [b for a, b in kills if a <= resumed and b <= resumed]
        if backs:
            estimates.append(resumed - max(backs))
    return statistics.median(estimates) if estimates else None


def _mode(name: str) -> Mode:
    for mode in MODES:
        if mode == name:
            return mode
    raise ConfigError(f"mode must be one of {', '.join(MODES)}, got {name!r}")


def calibrate_report(report: Mapping[str, Any], runs: int = 200, seed: int = 0) -> Calibration:
    """Fit the model to a chaos run (a parsed chaos.json) and predict its goodput per mode.

    Each learner is one slice of one chip; its faults are the run's learner kills (crashes: out
    for their scripted down time, then a restart) and pauses. Measured, per mode: the
    detection time (``detect_s`` p50); the step time during the run (``own_step_s``, else
    ``ref_step_s``), which also gives the sync period (``sync.H`` steps) and DP's checkpoint
    interval (``run.dp_publish_every`` steps); Decoupled DiLoCo's rejoin time (``rejoin_s``
    p50: recovery less the down time); DP's restart time (:func:`_dp_restart`). Shard and Redis
    faults lower the syncer's availability by their share of the window.

    The model gives the share of learner wall-time whose work is merged within the window. Two
    measured factors turn it into goodput as chaos.json counts it: ``speed`` = fault-free step
    time / step time during the run (goodput converts merged steps at the fault-free step
    time), and ``efficiency`` = the fault-free reference run's goodput / the model's goodput for
    it (what the run loses without faults: start-up, merge latency; 1 without ``--reference``).

    Returns:
        the fitted :class:`Calibration`: per mode, goodput predicted on the run's own fault
        times, the mean over Poisson failures at the run's MTBF (``runs`` traces from ``seed``),
        and the measured goodput and availability.

    Raises:
        ConfigError: the report has no diloco or dp block, or no learner count or window.
    """
    blocks = {m: b for m, b in (report.get("modes") or {}).items() if m in ("diloco", "dp")}
    if not blocks:
        raise ConfigError("chaos report: no diloco or dp mode block")
    config = report.get("config") or {}
    run_cfg = config.get("run") or {}
    sync_steps = int((config.get("sync") or {}).get("H") or 24)
    publish = int(run_cfg.get("dp_publish_every") or 1)
    learners = int(next(iter(blocks.values())).get("learners") or run_cfg.get("learners") or 0)
    if learners < 1:
        raise ConfigError("chaos report: no learner count")
    shards = max(1, int(run_cfg.get("shards") or 1))
    script_wall = float((report.get("script") or {}).get("duration_s") or 0.0)
    wall = {m: float(b.get("wall_s") or script_wall) for m, b in blocks.items()}
    window = max(wall.values())
    if not window > 0:
        raise ConfigError("chaos report: no run window (wall_s)")
    failures: list[Failure] = []
    kills: list[tuple[float, float]] = []
    syncer_down_s = 0.0
    unmodelled: list[str] = []
    for a in report.get("actions") or []:
        kind, target = str(a.get("kind")), str(a.get("target"))
        at = float(a.get("at_s") or 0.0)
        down = a.get("duration_s")
        suffix = target.rsplit("-", 1)[-1]
        if target.startswith("learner-") and kind in ("kill", "pause") and suffix.isdigit():
            slot = int(suffix)
            if not 0 <= slot < learners:
                unmodelled.append(f"{kind}:{target}@{at:g}s")
                continue
            down_s = 2.0 * window if down is None else float(down)
            failures.append(Failure(at, slot, down_s, restart=kind == "kill"))
            if kind == "kill":
                kills.append((at, at + down_s))
        elif (target.startswith("shard-") or target == "redis") and kind in (
                "kill", "pause", "partition"):
            share = 1.0 if target == "redis" else 1.0 / shards
            syncer_down_s += share * (float(down) if down is not None else window - at)
        else:
            unmodelled.append(f"{kind}:{target}@{at:g}s")
    mtbf = learners * window / len(failures) if failures else math.inf
    repair = statistics.mean(f.down_s or 0.0 for f in failures) if failures else 0.0
    d_block = blocks.get("diloco", {})
    rejoin = _p50(d_block, "rejoin_s")
    restart = _dp_restart(blocks.get("dp", {}), kills)
    availability = max(1e-9, 1.0 - syncer_down_s / window)
    fault_free = report.get("fault_free") or {}
    ref_steps = {m: b.get("ref_step_s") for m, b in blocks.items()}
    fallback_step = next((float(x) for x in ref_steps.values() if x), 1.0)
    inputs: dict[str, Any] = {
        "learners": learners, "window_s": round(window, 3),
        "learner_faults": len(failures), "learner_kills": len(kills),
        "mtbf_s": None if not math.isfinite(mtbf) else round(mtbf, 3),
        "mean_down_s": round(repair, 3),
        "detect_s": {m: _p50(b, "detect_s") for m, b in blocks.items()},
        "diloco_rejoin_s": rejoin, "dp_restart_s": restart,
        "sync_steps": sync_steps, "dp_publish_every": publish,
        "syncer_availability": round(availability, 4),
        "ref_step_s": {}, "step_s": {}, "speed": {}, "efficiency": {},
    }
    params: dict[str, SimParams] = {}
    predicted: dict[str, float] = {}
    poisson: dict[str, float] = {}
    for name, block in blocks.items():
        mode = _mode(name)
        ref_step = float(block.get("ref_step_s") or fallback_step)
        own = block.get("own_step_s")
        step = float(own) if own else ref_step
        speed = ref_step / step
        p = SimParams(
            chips=learners, learners=learners, chips_per_slice=1,
            chip_mtbi_s=mtbf if math.isfinite(mtbf) else 1e30, slice_repair_s=repair,
            detect_s=_p50(block, "detect_s") or 0.0, downscale_s=0.0, upscale_s=0.0,
            upscale_wait_s=0.0,
            restart_s=restart if restart is not None else (rejoin or 0.0),
            checkpoint_interval_s=publish * step, checkpoint_cost_s=0.0, step_s=step,
            rejoin_s=rejoin if rejoin is not None else (restart or 0.0),
            sync_period_s=sync_steps * step, syncer_availability=availability,
            hot_spares=False, horizon_s=wall[name])
        efficiency = 1.0
        ref_run = fault_free.get(name) or {}
        if ref_run.get("goodput") is not None and ref_run.get("wall_s"):
            clean = replace(p, step_s=ref_step, checkpoint_interval_s=publish * ref_step,
                            sync_period_s=sync_steps * ref_step, syncer_availability=1.0,
                            horizon_s=float(ref_run["wall_s"]))
            model_clean = simulate_events(clean, mode, []).goodput
            if model_clean > 0:
                efficiency = float(ref_run["goodput"]) / model_clean
        params[name] = p
        scale = speed * efficiency
        inside = [f for f in failures if f.t_s < wall[name]]
        predicted[name] = scale * simulate_events(p, mode, inside).goodput
        poisson[name] = (scale * calibrate(p, runs=runs, seed=seed, modes=(mode,))[mode]
                         if failures else predicted[name])
        inputs["ref_step_s"][name] = ref_step
        inputs["step_s"][name] = step
        inputs["speed"][name] = round(speed, 4)
        inputs["efficiency"][name] = round(efficiency, 4)
    measured = {m: {"goodput": b.get("goodput"), "availability": b.get("availability")}
                for m, b in blocks.items()}
    return Calibration(inputs, params, failures, measured, predicted, poisson, unmodelled)


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def _columns(results: Sequence[SimResult]) -> list[tuple[str, int]]:
    columns: list[tuple[str, int]] = []
    for r in results:
        key = (r.mode, r.learners if r.mode == "diloco" else 1)
        if key not in columns:
            columns.append(key)
    order: dict[str, int] = {mode: i for i, mode in enumerate(MODES)}
    columns.sort(key=lambda c: (order.get(c[0], len(order)), c[1]))
    return columns


def render_table(results: Sequence[SimResult], value: Literal["goodput", "uptime"] = "goodput"
                 ) -> Table:
    """A rich table: one row per chip count, one column per mode, each cell ``value`` in %.
    Goodput cells the paper published show its value in brackets, and the caption names the
    largest gap."""
    columns = _columns(results)
    cells = {(r.chips, r.mode, r.learners if r.mode == "diloco" else 1): r for r in results}
    if value == "goodput":
        title = "Predicted goodput % [paper's Table 1]; M = Decoupled DiLoCo learners"
        cmp = compare_published(results)
        caption = "parameters and sources: docs/SIMULATOR.md"
        if cmp:
            worst = max(cmp, key=lambda c: abs(c.error))
            caption = (f"largest gap to the paper {abs(worst.error):.1f} points "
                       f"({worst.chips:,} chips, {_label(worst.mode, worst.learners)}); "
                       + caption)
    else:
        title = "Predicted uptime % (share of time the global model progresses)"
        caption = "docs/SIMULATOR.md"
    out = Table(title=escape(title), caption=escape(caption))
    out.add_column("chips", justify="right", no_wrap=True)
    for mode, m in columns:
        out.add_column(_label(mode, m), justify="right")
    for n in dict.fromkeys(r.chips for r in results):
        row = [f"{n:,}"]
        for mode, m in columns:
            cell = cells.get((n, mode, m))
            if cell is None:
                row.append("-")
                continue
            text = f"{100 * getattr(cell, value):.1f}"
            pub = PUBLISHED_GOODPUT.get(n, {}).get((mode, m)) if value == "goodput" else None
            row.append(text if pub is None else escape(f"{text} [{pub:g}]"))
        out.add_row(*row)
    return out


def _short(value: Any) -> str:
    """Compact text of a calibration input (numbers to 3 significant digits)."""
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_short(v)}" for k, v in value.items()) + "}"
    if isinstance(value, float):
        return f"{value:.3g}"
    return str(value)


def _label(mode: str, m: int) -> str:
    return {"dp": "DP", "elastic_dp": "elastic DP"}.get(mode, f"M={m}")


def render_sensitivity(rows: Sequence[SensitivityRow], title: str) -> Table:
    """A rich table of :func:`sensitivity` rows (goodput % with each parameter x0.5, x2)."""
    out = Table(title=title, caption="syncer_availability: 1 - availability halved / doubled")
    for name in ("parameter", "value", "x 0.5", "as given", "x 2"):
        out.add_column(name, justify="left" if name == "parameter" else "right")

    def fmt(x: float | None) -> str:
        return "n/a" if x is None else f"{x:.1f}"

    for r in rows:
        out.add_row(r.name, f"{r.value:g}", fmt(r.half), fmt(r.base), fmt(r.double))
    return out


def render_calibration(cal: Calibration) -> Table:
    """A rich table: per mode, measured goodput and availability next to the predictions."""
    mtbf = cal.inputs.get("mtbf_s")
    out = Table(title="Chaos run: measured vs predicted goodput",
                caption=(f"{cal.inputs['learners']} learners, {cal.inputs['learner_faults']} "
                         f"learner faults in {cal.inputs['window_s']:g} s (MTBF "
                         f"{'-' if mtbf is None else f'{mtbf:g} s'} per learner)"))
    for name in ("mode", "measured goodput", "availability", "predicted (this run's faults)",
                 "error (points)", "predicted (Poisson, same MTBF)"):
        out.add_column(name, justify="left" if name == "mode" else "right")

    def pct(x: float | None) -> str:
        return "-" if x is None else f"{100 * x:.1f}%"

    errors = cal.errors()
    for mode in cal.predicted:
        err = errors.get(mode)
        out.add_row(mode, pct(cal.measured[mode].get("goodput")),
                    pct(cal.measured[mode].get("availability")), pct(cal.predicted[mode]),
                    "-" if err is None else f"{err:+.1f}", pct(cal.poisson[mode]))
    return out


def parse_params(items: Sequence[str]) -> dict[str, Any]:
    """``["detect_s=10", "hot_spares=false"]`` -> :class:`SimParams` overrides, each value
    converted to its field's type (``chips`` and ``learners`` excluded: they are the table's).

    Raises:
        ConfigError: not ``name=value``, an unknown field, or a value of the wrong type.
    """
    kinds = {f.name: f.type for f in fields(SimParams)}
    out: dict[str, Any] = {}
    for item in items:
        name, sep, text = item.partition("=")
        name = name.strip().replace("-", "_")
        if not sep or name not in kinds or name in ("chips", "learners"):
            raise ConfigError(f"--param {item!r}: expected NAME=VALUE with NAME one of "
                              + ", ".join(sorted(set(kinds) - {"chips", "learners"})))
        kind = str(kinds[name])
        try:
            if kind == "bool":
                if text.strip().lower() not in ("true", "false", "1", "0", "yes", "no"):
                    raise ValueError(text)
                out[name] = text.strip().lower() in ("true", "1", "yes")
            elif kind == "int":
                out[name] = int(text)
            else:
                out[name] = float(text)
        except ValueError as exc:
            raise ConfigError(f"--param {item!r}: {name} must be a {kind}") from exc
    return out


def main(json_out: bool, seed: int, chips: list[int] | None, learners: list[int] | None,
         monte_carlo: bool = False, show_sensitivity: bool = False,
         calibrate_path: str | None = None, **overrides: Any) -> None:
    """``ddiloco simulate``: the table (with the paper's cells), the sensitivity of M = 8 at
    1.2M chips, or the model fitted to a chaos run (``calibrate_path``).

    With ``json_out``, one JSON document on stdout only: the table as a list of ``{"chips",
    "mode", "learners", "goodput", "uptime", "published"}``; with ``show_sensitivity``,
    ``{"table": [...], "max_abs_error_points": x, "sensitivity": [...]}``; with
    ``calibrate_path``, the calibration's JSON. ``overrides`` are :class:`SimParams` fields
    (``None`` values are ignored so CLI options can default to None).

    Raises:
        ConfigError: a bad parameter, or a chaos report that cannot be read.
    """
    given = {k: v for k, v in overrides.items() if v is not None}
    if calibrate_path is not None:
        try:
            with open(calibrate_path) as fh:
                report = json.load(fh)
        except (OSError, ValueError) as exc:
            raise ConfigError(f"--calibrate {calibrate_path}: {exc}") from exc
        cal = calibrate_report(report, seed=seed)
        if json_out:
            sys.stdout.write(json.dumps(cal.to_json(), default=str) + "\n")
        else:
            console = Console()
            console.print(render_calibration(cal))
            console.print("fitted from the run: " + ", ".join(
                f"{k} {_short(v)}" for k, v in cal.inputs.items()))
            if cal.unmodelled:
                console.print("not modelled: " + ", ".join(cal.unmodelled))
        return
    kwargs: dict[str, Any] = {"seed": seed, "monte_carlo": monte_carlo}
    if chips:
        kwargs["chips"] = tuple(chips)
    if learners:
        kwargs["learners"] = tuple(learners)
    results = table(**kwargs, **given)
    cmp = compare_published(results)
    worst = max((abs(c.error) for c in cmp), default=None)
    sens_params = SimParams(chips=1_200_000, learners=8, **given)
    sens = sensitivity(sens_params, "diloco") if show_sensitivity else []
    if json_out:
        pub = {(c.chips, c.mode, c.learners): c.published for c in cmp}
        rows = [{"chips": r.chips, "mode": r.mode, "learners": r.learners,
                 "goodput": r.goodput, "uptime": r.uptime,
                 "published": None if (p := pub.get((r.chips, r.mode, r.learners))) is None
                 else p / 100.0}
                for r in results]
        doc: Any = rows
        if show_sensitivity:
            doc = {"table": rows, "max_abs_error_points": worst,
                   "sensitivity": [asdict(s) for s in sens]}
        sys.stdout.write(json.dumps(doc) + "\n")
        return
    console = Console()
    console.print(render_table(results))
    console.print(render_table(results, "uptime"))
    if worst is not None:
        console.print(f"published cells: {len(cmp)}, largest |predicted - published| "
                      f"{worst:.1f} goodput points")
    if show_sensitivity:
        console.print(render_sensitivity(sens, "Decoupled DiLoCo M=8 at 1,200,000 chips: "
                                               "goodput % with one parameter changed"))
