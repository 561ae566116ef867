"""The syncer's pure core: token weights, merging, quorum and grace decisions, the outer step.

Nothing here touches a socket, the store or the wall clock; times are passed in (seconds, from
any monotonic clock), so every rule is tested with hand-computed numbers.

Sources (DESIGN §2): token weights w = c_tokens^2 / c_steps, the adaptive grace window and RDA
merging are from Decoupled DiLoCo (arXiv 2604.21428); the outer Nesterov step is DiLoCo
(arXiv 2311.08105), implemented with ``optax.sgd(lr, momentum, nesterov=True)``.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ddiloco.pipeline.errors import ConfigError, MergeRefused

if TYPE_CHECKING:
    import optax

#: Below this norm a direction is treated as undefined (RDA falls back to the average).
NORM_FLOOR = 1e-12


def token_weight(c_tokens: int, c_steps: int) -> float:
    """Token weight w = c_tokens^2 / c_steps of one contribution (paper).

    A learner that processed more tokens per inner step (bigger batches, fewer restarts) counts
    more; zero steps -> weight 0.

    Args:
        c_tokens: tokens processed on the fragment since the learner last adopted it.
        c_steps: inner steps since then.
    """
    if c_steps <= 0 or c_tokens <= 0:
        return 0.0
    return float(c_tokens) * float(c_tokens) / float(c_steps)


def learner_order(learners: Iterable[str]) -> list[str]:
    """Learner ids in the order a merge sums their contributions: by name, then by the
    trailing index as a number (``learner-2`` before ``learner-10``), then by the whole id.

    Float sums depend on their order, and the order contributions arrive in depends on timing;
    summing in a fixed order makes a round's merge a function of its contributions alone
    (``run.deterministic`` relies on it; every run gets it).
    """
    def key(learner: str) -> tuple[str, int, str]:
        head, _, tail = learner.rpartition("-")
        return (head, int(tail), learner) if head and tail.isdigit() else (learner, -1, learner)

    return sorted(learners, key=key)


def weighted_average(tensors: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """sum_m w_m v_m / sum_m w_m for same-shaped float32 tensors.

    Raises:
        ValueError: empty input or non-positive total weight.
    """
    total = float(sum(weights))
    if not tensors or total <= 0.0:
        raise ValueError("weighted_average: need at least one contribution with weight > 0")
    out = np.zeros_like(tensors[0], dtype=np.float32)
    for v, w in zip(tensors, weights, strict=True):
        out += np.float32(w / total) * v
    return out


def rda(tensors: Sequence[np.ndarray], weights: Sequence[float]) -> np.ndarray:
    """Radial-directional averaging of one tensor's outer gradients (paper, "RDA").

    RDA = (sum w_m ||v_m|| / sum w_m) * unit(sum w_m unit(v_m) / sum w_m), unit(x) = x / ||x||:
    the merged update keeps the contributors' average length and their average direction, so
    averaging near-orthogonal updates does not shrink the step the way plain averaging does.
    Zero-norm contributions have no direction and are left out of the direction term. When the
    directions cancel (mean direction below :data:`NORM_FLOOR`) it falls back to the weighted
    average.

    Args:
        tensors: M same-shaped float32 arrays.
        weights: M non-negative token weights, sum > 0.

    Returns:
        float32 array of the same shape.
    """
    total = float(sum(weights))
    if not tensors or total <= 0.0:
        raise ValueError("rda: need at least one contribution with weight > 0")
    norms = [float(np.linalg.norm(v)) for v in tensors]
    radius = sum(w * n for w, n in zip(weights, norms, strict=True)) / total
    direction = np.zeros_like(tensors[0], dtype=np.float32)
    for v, w, n in zip(tensors, weights, norms, strict=True):
        if n > NORM_FLOOR:
            direction += np.float32(w / (total * n)) * v
    dnorm = float(np.linalg.norm(direction))
    if dnorm <= NORM_FLOOR:
        return weighted_average(tensors, weights)
    return (direction * np.float32(radius / dnorm)).astype(np.float32, copy=False)


def merge_fragment(
    deltas: Sequence[Sequence[np.ndarray]],
    weights: Sequence[float],
    embedding_mask: Sequence[bool],
    method: str = "rda",
) -> list[np.ndarray]:
    """Merge M contributions of one fragment into one outer gradient.

    Args:
        deltas: ``deltas[m][i]`` is contribution m's outer gradient for tensor i (float32), all
            anchored at the same current version.
        weights: token weight of each contribution.
        embedding_mask: ``embedding_mask[i]`` is True for embedding tensors, which are merged by
            weighted average (paper); other tensors use ``method``.
        method: "rda" (paper default) or "average".

    Returns:
        One float32 array per tensor.

    Raises:
        ValueError: no contribution with weight > 0, or unknown method.
    """
    if method not in ("rda", "average"):
        raise ValueError(f"merge method: unknown {method!r} (expected 'rda' or 'average')")
    live = [(d, w) for d, w in zip(deltas, weights, strict=True) if w > 0.0]
    if not live:
        raise ValueError("merge_fragment: no contribution with weight > 0")
    ds = [d for d, _ in live]
    ws = [w for _, w in live]
    out = []
    for i, is_embedding in enumerate(embedding_mask):
        column = [d[i] for d in ds]
        if len(column) == 1:
            out.append(np.asarray(column[0], dtype=np.float32).copy())
        elif is_embedding or method == "average":
            out.append(weighted_average(column, ws))
        else:
            out.append(rda(column, ws))
    return out


def anchor_delta(
    delta: Sequence[np.ndarray],
    current: Sequence[np.ndarray],
    base: Sequence[np.ndarray],
) -> list[np.ndarray]:
    """Re-anchor a delta made against version b at the current version c (DESIGN §2 step 3).

    The learner sent delta_m = Theta_b - theta_m; the paper's outer gradient is
    Delta_m = Theta_c - theta_m = (Theta_c - Theta_b) + delta_m, exact given the kept history.
    """
    return [
        (np.asarray(c, np.float32) - np.asarray(b, np.float32)) + np.asarray(d, np.float32)
        for d, c, b in zip(delta, current, base, strict=True)
    ]


# ------------------------------------------------------------------------------------------
# Outer optimizer
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class OuterConfig:
    """Outer SGD with Nesterov momentum (lineage defaults lr 0.7, momentum 0.9)."""

    lr: float = 0.7
    momentum: float = 0.9

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ConfigError(f"outer.lr: must be > 0, got {self.lr}")
        if not 0 <= self.momentum < 1:
            raise ConfigError(f"outer.momentum: must be in [0, 1), got {self.momentum}")


class OuterOptimizer:
    """``optax.sgd(lr, momentum, nesterov=True)`` applied to one fragment at a time.

    The state of a fragment is its momentum buffer (one float32 array per tensor), stored in
    the parameter store beside the fragment value so a restarted shard keeps it. Optax's
    Nesterov: b <- mu b + g; update = -lr (g + mu b) (DESIGN §2 step 5).
    """

    def __init__(self, cfg: OuterConfig) -> None:
        # imported here: a shard on the fused int downlinks never builds this optimizer, and
        # without JAX and optax it holds about 130 MB less (docs/SCALE.md, shard memory)
        import jax
        import optax

        self.cfg = cfg
        self._tx = optax.sgd(cfg.lr, momentum=cfg.momentum, nesterov=True)

        def _step(params: tuple, grads: tuple, momentum: tuple) -> tuple[tuple, tuple]:
            updates, state = self._tx.update(grads, self._state_from(momentum), params)
            return optax.apply_updates(params, updates), self._momentum_of(state)

        # One compiled program per fragment layout; eager optax dispatches per tensor op.
        self._jit_step = jax.jit(_step)

    @staticmethod
    def init_momentum(params: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Zero momentum for a fragment's tensors."""
        return [np.zeros_like(np.asarray(p), dtype=np.float32) for p in params]

    def step(
        self,
        params: Sequence[np.ndarray],
        outer_grad: Sequence[np.ndarray],
        momentum: Sequence[np.ndarray],
    ) -> tuple[list[np.ndarray], list[np.ndarray]]:
        """One outer step: returns (new params, new momentum), float32 numpy arrays.

        Args:
            params: Theta_p, the fragment's current tensors.
            outer_grad: the merged outer gradient Delta (same shapes).
            momentum: the fragment's momentum buffer b.
        """
        p_t = tuple(np.asarray(p, np.float32) for p in params)
        g_t = tuple(np.asarray(g, np.float32) for g in outer_grad)
        m_t = tuple(np.asarray(b, np.float32) for b in momentum)
        new_params, new_mom = self._jit_step(p_t, g_t, m_t)
        return (
            [np.asarray(x, dtype=np.float32) for x in new_params],
            [np.asarray(x, dtype=np.float32) for x in new_mom],
        )

    def _state_from(self, momentum: tuple[np.ndarray, ...]) -> optax.OptState:
        # sgd(momentum) = chain(trace, scale): the trace holds the momentum buffer.
        empty = self._tx.init(momentum)
        trace_state = empty[0]._replace(trace=momentum)
        return (trace_state, *empty[1:])

    @staticmethod
    def _momentum_of(state: optax.OptState) -> tuple[np.ndarray, ...]:
        return tuple(state[0].trace)


def delayed_nesterov(
    g: np.ndarray, m: np.ndarray, buf: np.ndarray, t: int, n: int, beta: float, c: float,
    lr: float,
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """One outer step of delayed Nesterov momentum (Liu et al., arXiv 2401.09135, Algorithm
    "Delayed Nesterov"; the update rule of its reference code, also used by HALoS).

    Every step applies the outer gradient at ``lr / n`` and adds it to a buffer; the momentum
    is updated only every ``n``-th step, from the buffer's mean, so that gradients computed
    against stale versions do not each compound in the momentum::

        buf <- buf + g
        if (t + 1) % n == 0:   m <- beta m + buf / n;  d = lr (1 - c n + c) beta m + (lr/n) g;
                               buf <- 0
        else:                  d = lr c beta m + (lr/n) g

    and the new value is ``Theta - d``. With ``n = 1`` and ``c = 0`` this is optax's Nesterov
    (``b <- beta b + g``, update ``-lr (g + beta b)``).

    Args:
        g: the merged outer gradient, float32, any shape.
        m, buf: the fragment's momentum and gradient buffer (same shape); not modified.
        t: outer steps of this fragment before this one (its version: version 0 is the
            initial value).
        n: steps between momentum updates (``sync.outer_delay``), >= 1.
        beta: momentum (``sync.outer_momentum``).
        c: share of the momentum applied on the steps between, in ``[0, 1/n]``
            (``sync.outer_c``; 0 in the paper's experiments).
        lr: outer learning rate.

    Returns:
        ``(d, m', buf')``, float32 arrays of ``g``'s shape (new arrays: 3 x ``g.nbytes``).
    """
    if n < 1:
        raise ValueError(f"delayed_nesterov: n must be >= 1, got {n}")
    f32 = np.float32
    buf_new = (buf + g).astype(np.float32, copy=False)
    if (t + 1) % n == 0:
        m_new = (f32(beta) * m + buf_new * f32(1.0 / n)).astype(np.float32, copy=False)
        d = f32(lr * (1.0 - c * n + c) * beta) * m_new + f32(lr / n) * g
        buf_new = np.zeros_like(buf_new)
    else:
        m_new = m
        d = f32(lr * c * beta) * m + f32(lr / n) * g
    return d.astype(np.float32, copy=False), m_new, buf_new


def lr_prefix(train: Any) -> np.ndarray:
    """Prefix sums of the run's inner learning rates: entry ``s`` is ``sum lr(k) for k < s``,
    ``s = 0 .. train.steps + 1`` (float64); the schedule of
    :func:`ddiloco.workers.task.model.lr_schedule` for a ``train`` section."""
    import jax

    from ddiloco.workers.task.model import lr_schedule

    sched = lr_schedule(train.lr, train.warmup, train.steps, train.lr_floor,
                        train.schedule)
    # One compiled program: evaluated eagerly, the schedule's dozen jnp ops each compile on
    # their own (0.7 s of a shard's CPU at its first merge, 0.1 s jitted).
    vals = np.asarray(jax.jit(sched)(np.arange(train.steps + 1)), dtype=np.float64)
    return np.concatenate([[0.0], np.cumsum(vals)])


def lr_mass(cum: np.ndarray, step: int, c_steps: int) -> float:
    """Sum of the inner learning rates over the steps ``(step - c_steps, step]`` from the
    prefix sums ``cum`` (:func:`lr_prefix`), constant at the last rate after the schedule's
    end. O(1)."""
    n = len(cum) - 1
    tail = float(cum[-1] - cum[-2]) if n >= 1 else 0.0

    def upto(x: int) -> float:  # sum of lr(s) for s < x
        return float(cum[min(x, n)]) + max(0, x - n) * tail

    return upto(max(step, 1)) - upto(max(0, step - c_steps))


# ------------------------------------------------------------------------------------------
# Quorum and the adaptive grace window
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class GraceConfig:
    """Adaptive grace window parameters (paper: gamma < 1 and a cap).

    Attributes:
        min_quorum: K, contributions needed before a round may merge.
        tau: overlap in inner steps.
        gamma: share of the slack the window may use, in (0, 1].
        cap_s: upper bound of the window, seconds.
        ema: smoothing factor of the moving averages, in (0, 1].
        enabled: False -> merge as soon as K contributions are in.
        floor_steps: the window's floor in step times (ours, ``sync.grace_steps``), under
            the cap: the round waits that long for every live learner.
        period_steps: H, the inner steps between two outer gradients of one learner for a
            fragment; the floor is at most that (None: no bound). A longer wait only lets the
            first learner's next outer gradient replace its first, so the round would span
            two periods and every version would be twice as stale.
    """

    min_quorum: int = 1
    tau: int = 2
    gamma: float = 0.5
    cap_s: float = 2.0
    ema: float = 0.2
    enabled: bool = True
    floor_steps: float = 0.0
    period_steps: float | None = None

    def __post_init__(self) -> None:
        if self.min_quorum < 1:
            raise ConfigError(f"syncer.min_quorum (K): must be >= 1, got {self.min_quorum}")
        if self.tau < 0:
            raise ConfigError(f"syncer.tau: must be >= 0, got {self.tau}")
        if not 0 < self.gamma <= 1:
            raise ConfigError(f"syncer.gamma: must be in (0, 1], got {self.gamma}")
        if self.cap_s < 0:
            raise ConfigError(f"syncer.grace_cap_s: must be >= 0, got {self.cap_s}")
        if not 0 < self.ema <= 1:
            raise ConfigError(f"syncer.ema: must be in (0, 1], got {self.ema}")
        if self.floor_steps < 0:
            raise ConfigError(f"sync.grace_steps: must be >= 0, got {self.floor_steps}")
        if self.period_steps is not None and self.period_steps <= 0:
            raise ConfigError(f"sync.H: must be > 0, got {self.period_steps}")


@dataclass
class Timing:
    """Exponential moving averages feeding the grace window (seconds)."""

    step_time: float | None = None
    quorum_time: float | None = None
    sync_time: float | None = None

    def observe(self, name: str, value: float, alpha: float) -> None:
        """Fold one observation into EMA ``name`` (first observation initialises it)."""
        old = getattr(self, name)
        setattr(self, name, value if old is None else (1 - alpha) * old + alpha * value)


def grace_window(timing: Timing, cfg: GraceConfig) -> float:
    """grace = min(cap, max(gamma * max(0, tau * step_time - quorum_time - sync_time),
    min(floor_steps, H) * step_time)), seconds.

    The overlap gives the round tau inner steps of slack before learners want the result;
    waiting longer than the slack left after reaching quorum and syncing would make them train
    on older parameters (the paper's window). Under carry adoption a later version costs no
    work, only staleness, and a round that waits for every live learner merges the same
    contributions whatever the timing: ``floor_steps`` buys that for a wait bounded by the
    cap. Unknown terms count as 0 (step time unknown -> no slack -> 0).
    """
    if not cfg.enabled or timing.step_time is None:
        return 0.0
    slack = (
        cfg.tau * timing.step_time
        - (timing.quorum_time or 0.0)
        - (timing.sync_time or 0.0)
    )
    floor = cfg.floor_steps if cfg.period_steps is None else min(cfg.floor_steps,
                                                                 cfg.period_steps)
    return min(cfg.cap_s, max(cfg.gamma * max(0.0, slack), floor * timing.step_time))


@dataclass
class Round:
    """The contributions gathered for one fragment since its last merge.

    ``contributors`` maps learner id -> arrival time (seconds); a learner's newer contribution
    replaces its older one in the same round (deltas are cumulative since adoption).
    """

    started_at: float | None = None
    quorum_at: float | None = None
    contributors: dict[str, float] = field(default_factory=dict)
    #: learners that announced they are about to contribute to this round (round-open notices)
    joining: set[str] = field(default_factory=set)

    def add(self, learner: str, now: float, min_quorum: int) -> None:
        """Record a contribution arriving at ``now``."""
        if self.started_at is None:
            self.started_at = now
        self.contributors[learner] = now
        if self.quorum_at is None and len(self.contributors) >= min_quorum:
            self.quorum_at = now


#: weight of the newest merge in a fragment's update-norm EMA (:func:`guard_update`)
UPDATE_NORM_EMA = 0.3


#: accepted merges of a fragment before its norm bound applies (the EMA settles first)
GUARD_WARMUP_MERGES = 3


def guard_update(diff: Sequence[np.ndarray], recent: float | None, factor: float,
                 lr_mass: float = 1.0) -> float:
    """Refuse an outer update that is not finite or far outside the fragment's recent range.

    Ours (DESIGN §2 step 2, hostile input): one keyed but broken (or malicious) learner can
    send a delta that decodes to finite values whose merge overflows, or that dwarfs every
    honest update; publishing it would poison every learner at its next adoption.

    The norm is compared per unit of inner learning rate: an adaptive inner optimizer (AdamW)
    moves each parameter by about the learning rate per step whatever the gradient's scale,
    so an honest update's norm grows with the sum of the learning rates of the steps it
    holds (``lr_mass``). Without that, a merge of one early step in the warm-up (lr near 0)
    would set the reference and refuse every later, honest, merge.

    Args:
        diff: the fragment's update Theta_new - Theta_old, float32 tensors.
        recent: EMA of the fragment's accepted normalized norms (``norm / lr_mass``); None
            while the bound does not apply (before :data:`GUARD_WARMUP_MERGES` merges).
        factor: the bound is ``factor * recent``; 0 disables the norm bound.
        lr_mass: the sum of the inner learning rates over the steps the update holds
            (contribution-weighted); > 0.

    Returns:
        The update's normalized norm ``||diff||_2 / lr_mass`` (to fold into the EMA with
        :data:`UPDATE_NORM_EMA`).

    Raises:
        MergeRefused: a non-finite update, or a normalized norm above the bound.
    """
    sq = 0.0
    with np.errstate(over="ignore", invalid="ignore"):
        for d in diff:
            sq += float(np.sum(np.square(d, dtype=np.float64)))
    return guard_norm(sq, recent, factor, lr_mass)


def guard_norm(sq: float, recent: float | None, factor: float, lr_mass: float = 1.0) -> float:
    """:func:`guard_update` given the update's sum of squares ``sq`` (float64) instead of the
    update itself; same arguments, result and exceptions."""
    norm = float(np.sqrt(sq))
    if not np.isfinite(norm) or norm > float(np.finfo(np.float32).max):
        raise MergeRefused("the outer update is not finite in float32")
    normalized = norm / max(lr_mass, 1e-30)
    if factor > 0 and recent is not None and recent > 0 and normalized > factor * recent:
        raise MergeRefused(f"update norm per unit lr {normalized:.3g} exceeds {factor:g} x "
                           f"the recent {recent:.3g}")
    return normalized


def partial_share(n_contributions: int, live_learners: int) -> float:
    """The share of a merge that ``sync.partial_merge = "share"`` applies: ``n / max(n, M)``
    for ``n`` contributions of ``M`` live learners, in (0, 1].

    Ours. The paper anchors every contribution at the current version
    (``Delta_m = Theta_c - theta_m``) and applies the round's merge in full, so with outer lr
    1 a round of one contribution moves the fragment to that learner's model: nothing of the
    other learners' progress is averaged in. Counting the absent learners as zero outer
    gradients makes a split round (n, then M - n) move the fragment about as far as the full
    round would, each part by its own share. A learner that is not live does not count; an
    unknown set of live learners (M = 0) applies the merge in full.

    Raises:
        ValueError: ``n_contributions < 1`` or ``live_learners < 0``.
    """
    if n_contributions < 1 or live_learners < 0:
        raise ValueError(f"partial_share needs n >= 1 and M >= 0, got n={n_contributions}, "
                         f"M={live_learners}")
    return n_contributions / max(n_contributions, live_learners)


def merge_interval(timing: Timing, H: int, share: float) -> float:
    """Least time between two merges of one fragment: ``share * H * step_time``, seconds.

    Ours (paced merges): every learner sends a fragment once per H inner steps, so one merge
    per sync period can hold every learner's delta. A delta that misses a round then waits
    for the next period's round instead of forming a round (and a broadcast to every
    learner) of its own: versions per fragment per period stay at most 1 / share, and so do
    the downlink bytes per uplink byte (each learner receives every version and sends one
    delta per period). 0 (or an unknown step time) disables pacing.
    """
    if share <= 0 or timing.step_time is None:
        return 0.0
    return share * H * timing.step_time


def should_merge(
    rnd: Round, now: float, live_learners: set[str], grace_s: float, min_quorum: int,
    cap_s: float | None = None, not_before: float | None = None,
) -> bool:
    """Decide whether a round merges now (DESIGN §2 step 2).

    Merge when at least K contributions are in and either every live learner has contributed
    or the grace window (measured from the moment the quorum was reached) has passed. Ours:
    learners that announced they are joining (``rnd.joining``) are waited for past the grace
    window, but never past ``cap_s`` after the quorum; and no round merges before
    ``not_before`` (the previous merge plus :func:`merge_interval`), a full one included:
    learners out of phase would otherwise fill a round more than once per period.
    """
    if len(rnd.contributors) < min_quorum or rnd.quorum_at is None:
        return False
    if not_before is not None and now < not_before:
        return False
    if live_learners and live_learners.issubset(rnd.contributors):
        return True
    waited = now - rnd.quorum_at
    if waited < grace_s:
        return False
    pending = (rnd.joining & live_learners) - rnd.contributors.keys() if live_learners \
        else rnd.joining - rnd.contributors.keys()
    return not pending or cap_s is None or waited >= cap_s
