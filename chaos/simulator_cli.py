"""``ddiloco simulate``: rendering of the goodput model's tables (goodput, uptime, sensitivity,
calibration) with rich, ``--param NAME=VALUE`` parsing, and the command's body."""

from __future__ import annotations

import json
import sys
from collections.abc import Sequence
from dataclasses import asdict, fields
from typing import Any, Literal

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from ddiloco.chaos.calibration import (
    Calibration,
    calibrate_report,
)
from ddiloco.chaos.simulator import (
    MODES,
    SimParams,
    SimResult,
)
from ddiloco.chaos.simulator_table import (
    PUBLISHED_GOODPUT,
    SensitivityRow,
    compare_published,
    sensitivity,
    table,
)
from ddiloco.pipeline.errors import ConfigError

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
