"""Calibration of the goodput model (:mod:`ddiloco.chaos.simulator`) against a measured chaos
run: fault times, detection, rejoin, restart and step times read from a ``chaos.json`` report,
the prediction on the run's own faults and at its MTBF, next to the measured goodput
(``ddiloco simulate --calibrate``; docs/SIMULATOR.md)."""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from typing import Any

import numpy as np

from ddiloco.chaos.simulator import (
    MODES,
    Failure,
    Mode,
    SimParams,
    _check_mode,
    _draw_trace,
    _run,
    simulate_events,
)
from ddiloco.pipeline.errors import ConfigError

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
