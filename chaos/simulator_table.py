"""The paper's Table 1 from the goodput model (:mod:`ddiloco.chaos.simulator`): the table over
cluster sizes and learner counts, the published cells it is compared against, and the
sensitivity of a cell to each parameter (docs/SIMULATOR.md)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, fields, replace
from typing import Any

import numpy as np

from ddiloco.chaos.simulator import (
    TABLE_CHIPS,
    TABLE_LEARNERS,
    Mode,
    SimParams,
    SimResult,
    _draw_trace,
    _run,
    expected,
)
from ddiloco.pipeline.errors import ConfigError

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
