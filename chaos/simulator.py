"""Goodput of DP, elastic DP and Decoupled DiLoCo on a large failing cluster (DESIGN §5).

One failure and recovery model, evaluated two ways:

* :func:`expected` gives its long-run expectation in closed form (renewal-reward arguments,
  derived in docs/SIMULATOR.md). It is exact, instant and noise-free, so the paper-scale table,
  the comparison with the paper and the sensitivity analysis use it.
* :func:`simulate` and :func:`simulate_events` run the *same rules* event by event on a drawn
  failure trace or on an explicit list of failures (a chaos run's script). They check the closed
  form (tests: agreement within a fraction of a point at paper scale) and predict runs too
  small or too irregular for an expectation (:func:`calibrate_report`).

Cluster:

``chips`` chips in slices of ``chips_per_slice``. Every chip is interrupted as a Poisson process
of rate ``1 / chip_mtbi_s``; an interruption takes its slice out of service for
``slice_repair_s`` (swapped from a spare pool and health-checked); interruptions of a slice
already out are absorbed. A job of ``n`` chips therefore fails at rate ``n / chip_mtbi_s``.

Modes and their rules:

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

Outputs:

``goodput`` = useful chip-time / allocated chip-time (``chips * horizon``). ``uptime`` = share of
wall time in which the global model progresses: ``dp``, running time whose work is kept;
``elastic_dp``, time the job trains; ``diloco``, time at least one learner trains (times the
syncer's availability).

Parameters (:class:`SimParams`, docs/SIMULATOR.md has the table with sources):

The per-chip failure rate, H and the syncer's availability are the paper's (Decoupled DiLoCo,
arXiv 2604.21428; DESIGN §2, §5), the detection time ours. The other times are assumptions,
chosen once: the elastic ones (``downscale_s``, ``upscale_s``, ``upscale_wait_s``) against the
paper's fifteen elastic cells (elastic DP and Decoupled DiLoCo, M = 2..16), the DP ones
(``restart_s``, ``checkpoint_cost_s``) against its three DP cells; every published cell is then
within 2.1 points. :data:`PUBLISHED_GOODPUT` holds the paper's cells for comparison only; nothing
here reads it to compute a prediction.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np
import numpy.typing as npt

from ddiloco.pipeline.errors import ConfigError

Mode = Literal["dp", "elastic_dp", "diloco"]
MODES: tuple[Mode, ...] = get_args(Mode)

YEAR_S = 365 * 24 * 3600
"""One year in seconds: the paper's per-chip mean time between interruptions."""

TABLE_CHIPS: tuple[int, ...] = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)
"""Cluster sizes of the table (the paper's range, DESIGN §5)."""

TABLE_LEARNERS: tuple[int, ...] = (2, 4, 8, 16)
"""Learner counts M of the table (the paper's Table 1)."""
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
