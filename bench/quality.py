"""Quality at equal tokens: Decoupled DiLoCo against the data-parallel baseline over a grid.

A cell is one setting: the base configuration (``--config`` plus ``--set`` and ``--steps``)
with one axis changed (or, with ``--full-grid``, one point of the cartesian product of the
axes given). Axes, each a comma list; an axis not given keeps the base value, and no axis at
all gives the single cell ``base``:

* ``--learners`` (``run.learners``, M), ``--iid`` (``data.iid``), ``--adopt`` (``sync.adopt``),
  ``--H`` (``sync.H``), ``--codec`` (``sync.codec_up``), ``--outer-lr`` (``sync.outer_lr``),
  ``--outer-momentum`` (``sync.outer_momentum``), ``--norm-clip`` (``sync.norm_clip``),
  ``--partial-merge`` (``sync.partial_merge``), ``--optimizer`` (``train.optimizer``, both modes).

Every cell runs once per seed (``--seeds``, ``train.seed``) as its own ``ddiloco run``
subprocess in ``OUT/<cell>/seed-<s>``. The data-parallel baseline does not depend on the
adoption policy, H, the uplink codec, the outer optimizer, the norm clip or the partial-merge
rule, so it runs once per
distinct (M, iid, inner optimizer, seed), with the
first cell of that group (``--baseline dp``), and the other cells of the group are compared
with it. A run whose ``report.json`` is already there (from the same settings) is reused unless
``--fresh``, so an interrupted grid resumes where it stopped.

``--ladder`` runs the ablation ladder instead of a grid (docs/QUALITY.md, "The ablation
ladder"): eight rungs from the tuned data-parallel baseline to today's Decoupled DiLoCo, each
adding one feature (:func:`ladder_rungs`), every rung against rung 1's DP at the same seed. Its
table adds the step from the previous rung (:func:`ladder_steps`): the loss a feature costs,
with its spread over seeds.

``--deterministic`` adds ``run.deterministic=true`` to every run that does not set
``sync.blocking=false`` (:func:`deterministic_overrides`): the ladder's rungs 1-6, and every grid
cell, each of which it makes a synchronous run decided by step counts. Two runs of one seed
then give the same losses bit for bit, so what spreads over seeds is the seeds' doing, not merge
timing's (docs/QUALITY.md, "Deterministic mode").

Per run it records the final validation loss of both modes and their ratio (DiLoCo / DP),
tokens and tokens/s, wire bytes per token of both modes and their ratio (DP / DiLoCo), the
downlink / uplink bytes ratio, the token fate shares (merged, discarded by reason, lost) and
the learners per merge; per cell, over seeds, the mean, min..max and std (2+ seeds) of the
loss ratio and of the final losses. Prints a table, writes ``OUT/quality.json`` (every run,
the aggregates and the exact commands) and ``OUT/quality.png`` (validation loss vs tokens per
cell; token fate per cell), and ends with one JSON line.

    python bench/quality.py [--config FILE] [--set k=v ...] [--steps N]
                            [--learners 2,4,8] [--iid false,true] [--adopt overwrite,mix,carry]
                            [--H 24,48,96] [--codec int4,...] [--outer-lr 0.7,1.0]
                            [--outer-momentum 0,0.5,0.9] [--norm-clip none,median]
                            [--optimizer adamw,muon] [--seeds 0,1] [--full-grid]
                            [--dp | --no-dp] [--only NAME ...] [--dry-run] [--fresh]
                            [--deterministic] [--out bench-out/quality]
    python bench/quality.py --ladder [--config FILE] [--set k=v ...] [--seeds 0,1]
                            [--deterministic] ...
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

AXES: tuple[tuple[str, str, str], ...] = (
    # (CLI option, config field, short label used in cell names)
    ("learners", "run.learners", "M"),
    ("iid", "data.iid", "iid"),
    ("adopt", "sync.adopt", "adopt"),
    ("H", "sync.H", "H"),
    ("codec", "sync.codec_up", "codec"),
    ("outer-lr", "sync.outer_lr", "olr"),
    ("outer-momentum", "sync.outer_momentum", "mom"),
    ("norm-clip", "sync.norm_clip", "clip"),
    ("partial-merge", "sync.partial_merge", "partial"),
    ("optimizer", "train.optimizer", "opt"),
)
"""The grid's axes."""

DILOCO_ONLY = frozenset({"sync.adopt", "sync.H", "sync.codec_up", "sync.outer_lr",
                         "sync.outer_momentum", "sync.norm_clip", "sync.partial_merge"})
"""Axis fields the data-parallel baseline ignores: cells differing only in these share a DP."""

RUN_RECORD = "quality-run.json"
"""The bench's note in each run directory: the settings of the run (for resuming)."""

FATE_PARTS = ("merged", "overwritten", "other_discarded", "lost")
"""Token fate categories of the plot and the table, in stacking order."""


@dataclass(frozen=True)
class Cell:
    """One setting of the grid.

    Attributes:
        name: ``base`` or ``label=value`` parts joined by ``,`` (e.g. ``M=4,adopt=mix``).
        overrides: config field -> value this cell sets on top of the base configuration.
        same_as: names of requested cells dropped because their effective setting is this one.
    """

    name: str
    overrides: dict[str, Any]
    same_as: tuple[str, ...] = ()


@dataclass(frozen=True)
class Run:
    """One ``ddiloco run`` of the grid: a cell at one seed.

    Attributes:
        cell: the cell's name.
        seed: ``train.seed``.
        overrides: the cell's overrides plus ``train.seed``.
        with_dp: this run also trains the DP baseline (``--baseline dp``) of its group.
        dp_key: the (M, iid, seed, ...) group whose DP baseline this run is compared with;
            None when DP is off.
        dp_from: the cell that carries that DP baseline (this cell when ``with_dp``).
    """

    cell: str
    seed: int
    overrides: dict[str, Any] = field(default_factory=dict)
    with_dp: bool = False
    dp_key: str | None = None
    dp_from: str | None = None


# -- pure helpers ---------------------------------------------------------------------------


def parse_list(text: str) -> list[Any]:
    """A comma list of values, each read as YAML as ``--set`` does (``24`` -> 24,
    ``true`` -> True, ``int4`` -> "int4"); repeated values are kept once, in order.

    Raises:
        ValueError: an empty list.
    """
    values: list[Any] = []
    for raw in text.split(","):
        raw = raw.strip()
        if not raw:
            continue
        try:
            value = yaml.safe_load(raw)
        except yaml.YAMLError:
            value = raw
        if value not in values:
            values.append(value)
    if not values:
        raise ValueError(f"empty list: {text!r}")
    return values


def fmt_value(value: Any) -> str:
    """A value as ``--set`` reads it back: ``true``/``false`` for booleans, else ``str``."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def _setting(value: Any) -> str:
    """A value as a setting: numbers compare by value (``0`` is ``0.0``)."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return repr(float(value))
    return fmt_value(value)


def cell_name(overrides: Mapping[str, Any]) -> str:
    """The name of a cell from its overrides (axis fields by their short label)."""
    labels = {f: label for _, f, label in AXES}
    parts = [f"{labels.get(k, k)}={fmt_value(v)}" for k, v in overrides.items()]
    return ",".join(parts) or "base"


def expand_cells(axes: Mapping[str, Sequence[Any]], base: Mapping[str, Any],
                 full_grid: bool = False) -> list[Cell]:
    """The grid's cells.

    Args:
        axes: config field -> values, for the axes given (in :data:`AXES` order).
        base: config field -> its value in the base configuration, for every axis field.
        full_grid: the cartesian product of the axes; else one cell per axis value with only
            that axis changed.

    Returns:
        The cells in order; a cell whose effective setting (base plus overrides, on the axis
        fields) equals an earlier one's is dropped and named in that one's ``same_as``. The
        cell with the base setting is named ``base`` (no overrides). No axis: that cell alone.
    """
    wanted: list[dict[str, Any]]
    if not axes:
        wanted = [{}]
    elif full_grid:
        fields = list(axes)
        wanted = [dict(zip(fields, combo, strict=True))
                  for combo in itertools.product(*(axes[f] for f in fields))]
    else:
        wanted = [{f: v} for f, values in axes.items() for v in values]
    cells: list[Cell] = []
    seen: dict[tuple[tuple[str, str], ...], int] = {}
    for overrides in wanted:
        key = tuple(sorted((f, _setting(v)) for f, v in {**base, **overrides}.items()))
        # The base setting is always the cell "base", whichever axis value spelled it: its
        # runs (and the DP baseline it carries) are then reused across invocations.
        is_base = all(_setting(base.get(f)) == _setting(v) for f, v in overrides.items())
        if is_base:
            overrides = {}
        name = cell_name(overrides)
        if key in seen:
            i = seen[key]
            if name != cells[i].name and name not in cells[i].same_as:
                cells[i] = Cell(cells[i].name, cells[i].overrides, (*cells[i].same_as, name))
            continue
        seen[key] = len(cells)
        cells.append(Cell(name, dict(overrides)))
    return cells


def dp_key(overrides: Mapping[str, Any], base: Mapping[str, Any], seed: int) -> str:
    """The DP group of a cell at a seed: its effective setting without the DiLoCo-only fields
    (:data:`DILOCO_ONLY`), e.g. ``M=4,iid=false,seed=0``."""
    eff = {**base, **overrides}
    order = [f for _, f, _ in AXES if f in eff] + sorted(set(eff) - {f for _, f, _ in AXES})
    labels = {f: label for _, f, label in AXES}
    parts = [f"{labels.get(f, f)}={fmt_value(eff[f])}" for f in order if f not in DILOCO_ONLY]
    return ",".join([*parts, f"seed={seed}"])


def plan_runs(cells: Sequence[Cell], seeds: Sequence[int], base: Mapping[str, Any],
              dp: bool = True) -> list[Run]:
    """Every run of the grid, seed by seed (all cells at the first seed come first).

    With ``dp``, the first cell of each DP group (:func:`dp_key`) carries the baseline and the
    others are compared with it.
    """
    carriers: dict[str, str] = {}
    runs: list[Run] = []
    for seed in seeds:
        for cell in cells:
            overrides = {**cell.overrides, "train.seed": seed}
            if not dp:
                runs.append(Run(cell.name, seed, overrides))
                continue
            key = dp_key(cell.overrides, base, seed)
            carrier = carriers.setdefault(key, cell.name)
            runs.append(Run(cell.name, seed, overrides, carrier == cell.name, key, carrier))
    return runs


def deterministic_overrides(overrides: Mapping[str, Any]) -> dict[str, Any]:
    """A run's overrides with ``run.deterministic=true`` (``--deterministic``), unless they set
    ``sync.blocking=false``: such a run (the ladder's asynchronous rungs 7 and 8) measures
    what asynchrony costs, which a deterministic run, synchronous by construction, cannot."""
    if overrides.get("sync.blocking") is False:
        return dict(overrides)
    return {**overrides, "run.deterministic": True}


def safe_name(name: str) -> str:
    """A cell name as a directory name."""
    return re.sub(r"[^A-Za-z0-9._=,+-]", "_", name)


def run_dir(out: Path, run: Run) -> Path:
    """``OUT/<cell>/seed-<s>``."""
    return out / safe_name(run.cell) / f"seed-{run.seed}"


def set_args(config_sets: Sequence[str], steps: int | None,
             overrides: Mapping[str, Any]) -> list[str]:
    """The ``section.field=value`` overrides of a run, in the order they apply: the bench's
    ``--set`` items, ``train.steps``, then the cell's own (which win)."""
    items = list(config_sets)
    if steps is not None:
        items.append(f"train.steps={steps}")
    items += [f"{k}={fmt_value(v)}" for k, v in overrides.items()]
    return items


def build_command(python: str, out_dir: Path, config: Path | None, sets: Sequence[str],
                  with_dp: bool, dp_only: bool = False) -> list[str]:
    """The argv of one run: ``python -m ddiloco.cli run --out DIR --no-live [--config F]
    --set ... [--baseline dp [--baseline-only]]`` (``dp_only``: the baseline alone)."""
    argv = [python, "-m", "ddiloco.cli", "run", "--out", str(out_dir), "--no-live"]
    if config is not None:
        argv += ["--config", str(config)]
    for item in sets:
        argv += ["--set", item]
    if with_dp or dp_only:
        argv += ["--baseline", "dp"]
    if dp_only:
        argv += ["--baseline-only"]
    return argv


# -- the ablation ladder --------------------------------------------------------------------


@dataclass(frozen=True)
class Rung:
    """One rung of the ablation ladder.

    Attributes:
        name: the cell (and directory) name, ``<number>-<short>``.
        label: what the rung is, for the table.
        overrides: config field -> value, complete for the features the ladder varies (a rung
            does not depend on the previous one's, nor on the base configuration's, values
            of those fields).
        dp: the rung is the data-parallel baseline itself (``--baseline-only``).
    """

    name: str
    label: str
    overrides: dict[str, Any]
    dp: bool = False


def ladder_rungs(learners: int, batch_size: int, dp_lr: float | None) -> list[Rung]:
    """The rungs of the ablation ladder, in order; each adds one feature to the previous.

    1. DP tuned (``train.dp_lr``), IID shards.
    2. DiLoCo with M = 1 at DP's global batch (``learners * batch_size`` sequences per step,
       ``train.lr = dp_lr``, the rate tuned for that batch): equal tokens and inner steps.
    3. Synchronous DiLoCo with M = ``learners`` (DiLoCo, arXiv 2311.08105): ``sync.blocking``,
       K = M, P = 1, tau = 0, fp32 both ways, IID shards.
    4. the same with P = 12 fragments (Streaming DiLoCo, arXiv 2501.18512);
    5. the same with tau = 2 (overlap);
    6. the same with int4 both ways;
    7. non-blocking with K = 1 (today's asynchrony, Decoupled DiLoCo arXiv 2604.21428);
    8. non-IID shards: today's default.

    Args:
        learners: M of the base configuration (``run.learners``).
        batch_size: sequences per learner step of the base configuration.
        dp_lr: ``train.dp_lr`` of the base configuration (None: rung 2 keeps ``train.lr``).
    """
    sync = {"sync.blocking": True, "sync.min_quorum": learners, "sync.fragments": 1,
            "sync.tau": 0, "sync.codec_up": "fp32", "sync.codec_down": "fp32",
            "data.iid": True}
    m1: dict[str, Any] = {**sync, "run.learners": 1, "sync.min_quorum": 1,
                          "train.batch_size": learners * batch_size}
    if dp_lr is not None:
        m1["train.lr"] = dp_lr
    p12 = {**sync, "sync.fragments": 12}
    tau2 = {**p12, "sync.tau": 2}
    int4 = {**tau2, "sync.codec_up": "int4", "sync.codec_down": "int4"}
    asynchronous = {**int4, "sync.blocking": False, "sync.min_quorum": 1}
    return [
        Rung("1-dp", "DP tuned (IID)", {"data.iid": True}, dp=True),
        Rung("2-diloco-M1", "DiLoCo M = 1, DP's global batch", m1),
        Rung("3-sync", f"synchronous DiLoCo M = {learners}, P = 1, tau = 0, fp32, IID", sync),
        Rung("4-P12", "+ P = 12 fragments", p12),
        Rung("5-tau2", "+ overlap tau = 2", tau2),
        Rung("6-int4", "+ int4 both ways", int4),
        Rung("7-async-K1", "+ non-blocking, K = 1", asynchronous),
        Rung("8-non-iid", "+ non-IID shards (today's default)", {**asynchronous,
                                                               "data.iid": False}),
    ]


def plan_ladder(rungs: Sequence[Rung], seeds: Sequence[int]) -> list[Run]:
    """Every run of the ladder, seed by seed; each rung is compared with the DP rung of its
    seed (the first rung with ``dp``; none: no comparison)."""
    dp_rung = next((r.name for r in rungs if r.dp), None)
    return [Run(r.name, seed, {**r.overrides, "train.seed": seed}, r.dp,
                f"ladder,seed={seed}" if dp_rung else None, dp_rung)
            for seed in seeds for r in rungs]


def ladder_summary(rungs: Sequence[Rung],
                   records: Sequence[Mapping[str, Any]]) -> list[dict[str, Any]]:
    """One row per rung, in order: its final loss and loss ratio to DP (:func:`stats` over
    seeds; a failed run, with ``error``, counts as missing) and the step from the previous
    rung (:func:`ladder_steps`)."""
    losses = {r.name: {int(rec["seed"]): (None if rec.get("error")
                                          else rec.get("final_val_loss"))
                       for rec in records if rec["cell"] == r.name} for r in rungs}
    steps = ladder_steps(losses, [r.name for r in rungs])
    rows = []
    for r in rungs:
        mine = [rec for rec in records if rec["cell"] == r.name and not rec.get("error")]
        rows.append({"rung": r.name, "label": r.label, "dp": r.dp, "overrides": r.overrides,
                     "loss": stats(rec.get("final_val_loss") for rec in mine),
                     "loss_ratio": stats(rec.get("loss_ratio") for rec in mine),
                     "step": steps[r.name]})
    return rows


def ladder_steps(losses: Mapping[str, Mapping[int, float | None]],
                 order: Sequence[str]) -> dict[str, dict[str, Any] | None]:
    """The step from the previous rung: per seed, this rung's final loss minus the previous
    rung's (nats/byte; positive: the feature costs loss), and the same as a share of the
    previous rung's loss; :func:`stats` of each over the seeds both rungs have.

    Args:
        losses: rung -> seed -> final validation loss (None: the run failed).
        order: the rungs in ladder order.

    Returns:
        rung -> ``{"delta": stats, "relative": stats}``; None for the first rung.
    """
    out: dict[str, dict[str, Any] | None] = {}
    for i, name in enumerate(order):
        if i == 0:
            out[name] = None
            continue
        prev, cur = losses.get(order[i - 1], {}), losses.get(name, {})
        pairs = [(seed, float(c), float(p)) for seed, c in cur.items()
                 if c is not None and (p := prev.get(seed)) is not None]
        out[name] = {"seeds": [seed for seed, _, _ in pairs],
                     "delta": stats(c - p for _, c, p in pairs),
                     "relative": stats(c / p - 1.0 for _, c, p in pairs)}
    return out


def val_curve(block: Mapping[str, Any] | None) -> list[tuple[float, float]]:
    """A mode's validation loss as (tokens, loss) pairs sorted by tokens, one per token count
    (the last evaluation at that count), without missing or non-finite losses."""
    if not block:
        return []
    points: dict[float, float] = {}
    for pair in block.get("val_loss") or []:
        tokens, loss = pair[0], pair[1]
        if tokens is None or loss is None or not math.isfinite(float(loss)):
            continue
        points[float(tokens)] = float(loss)
    return sorted(points.items())


def mean_curve(curves: Sequence[Sequence[tuple[float, float]]],
               points: int = 50) -> list[tuple[float, float]]:
    """The mean of several loss curves: each linearly interpolated on ``points`` token counts
    from the smallest shared start to the smallest last count. One curve: itself. None or an
    empty one: []."""
    curves = [c for c in curves if c]
    if not curves:
        return []
    if len(curves) == 1:
        return list(curves[0])
    lo = max(c[0][0] for c in curves)
    hi = min(c[-1][0] for c in curves)
    if hi <= lo:
        return []
    xs = [lo + (hi - lo) * i / (points - 1) for i in range(points)]
    ys = [statistics.fmean(_interp(x, c) for c in curves) for x in xs]
    return list(zip(xs, ys, strict=True))


def _interp(x: float, curve: Sequence[tuple[float, float]]) -> float:
    """Linear interpolation of ``curve`` at ``x`` (held at the ends)."""
    if x <= curve[0][0]:
        return curve[0][1]
    for (x0, y0), (x1, y1) in itertools.pairwise(curve):
        if x <= x1:
            return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
    return curve[-1][1]


def fate_shares(block: Mapping[str, Any] | None) -> dict[str, Any]:
    """Token fate of a mode as shares of its processed tokens: ``merged``, ``discarded``
    (total), ``discarded_by`` (per reason: ``overwritten``, ``drain``, ``dropped:<reason>``),
    ``overwritten``, ``other_discarded`` (every other reason), ``lost`` (total), ``lost_by``
    and ``processed`` (tokens). Shares are None when the report has no token fate or nothing
    was processed."""
    fate = (block or {}).get("token_fate") or {}
    processed = float(fate.get("processed") or 0)
    discarded = {k: float(v) for k, v in (fate.get("discarded") or {}).items()}
    lost = {k: float(v) for k, v in (fate.get("lost") or {}).items()}
    if processed <= 0:
        return {"processed": processed, "merged": None, "discarded": None, "discarded_by": {},
                "overwritten": None, "other_discarded": None, "lost": None, "lost_by": {}}

    def share(x: float) -> float:
        return round(x / processed, 6)

    over = discarded.get("overwritten", 0.0)
    return {
        "processed": processed,
        "merged": share(float(fate.get("merged") or 0)),
        "discarded": share(sum(discarded.values())),
        "discarded_by": {k: share(v) for k, v in discarded.items()},
        "overwritten": share(over),
        "other_discarded": share(sum(discarded.values()) - over),
        "lost": share(sum(lost.values())),
        "lost_by": {k: share(v) for k, v in lost.items()},
    }


def participation(block: Mapping[str, Any] | None) -> tuple[float | None, str | None]:
    """Mean learners per merge of a DiLoCo block, and where it came from: ``participation``
    (a number or ``{"mean": ...}``) when the report has it, else ``merge_contributors_mean``;
    (None, None) when neither is there."""
    block = block or {}
    part = block.get("participation")
    if isinstance(part, Mapping):
        part = part.get("mean")
    if isinstance(part, (int, float)) and not isinstance(part, bool):
        return float(part), "participation"
    mean = block.get("merge_contributors_mean")
    if isinstance(mean, (int, float)) and not isinstance(mean, bool):
        return float(mean), "merge_contributors_mean"
    return None, None


def _ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


def run_record(report: Mapping[str, Any], dp_block: Mapping[str, Any] | None) -> dict[str, Any]:
    """The figures of one run from its ``report.json`` and the DP block it is compared with
    (its own ``report["dp"]`` or the DP carrier's; None without DP)."""
    d = report.get("diloco") or {}
    wire = d.get("wire_bytes") or {}
    up, down = wire.get("up"), wire.get("down")
    part, part_src = participation(d)
    learners = d.get("learners")
    rec: dict[str, Any] = {
        "final_val_loss": d.get("final_val_loss"),
        "tokens": d.get("tokens"),
        "tokens_per_s": d.get("tokens_per_s"),
        "wall_s": d.get("wall_s"),
        "wire_bytes_per_token": d.get("wire_bytes_per_token"),
        "wire_bytes": {"up": up, "down": down},
        "down_over_up": _ratio(down, up),
        "merges": d.get("merges"),
        "participation": part,
        "participation_source": part_src,
        "participation_share": _ratio(part, learners),
        "fate": fate_shares(d),
        "val_loss": val_curve(d),
        "dp": None,
        "loss_ratio": None,
        "bytes_ratio": None,
    }
    if dp_block:
        rec["dp"] = {
            "final_val_loss": dp_block.get("final_val_loss"),
            "tokens": dp_block.get("tokens"),
            "tokens_per_s": dp_block.get("tokens_per_s"),
            "wall_s": dp_block.get("wall_s"),
            "wire_bytes_per_token": dp_block.get("wire_bytes_per_token"),
            "val_loss": val_curve(dp_block),
        }
        rec["loss_ratio"] = _ratio(rec["final_val_loss"], dp_block.get("final_val_loss"))
        rec["bytes_ratio"] = _ratio(dp_block.get("wire_bytes_per_token"),
                                    rec["wire_bytes_per_token"])
        rec["equal_tokens"] = rec["tokens"] == dp_block.get("tokens")
    return rec


def stats(values: Iterable[float | None]) -> dict[str, Any]:
    """``n``, ``mean``, ``min``, ``max`` and ``std`` (sample, None below 2 values) of the
    values that are not None; all None when there are none."""
    xs = [float(v) for v in values if v is not None]
    if not xs:
        return {"n": 0, "mean": None, "min": None, "max": None, "std": None}
    return {"n": len(xs), "mean": statistics.fmean(xs), "min": min(xs), "max": max(xs),
            "std": statistics.stdev(xs) if len(xs) >= 2 else None}


def aggregate(records: Sequence[Mapping[str, Any]]) -> dict[str, Any]:
    """A cell's figures over its seeds (runs that failed, i.e. with ``error``, left out): full
    :func:`stats` of the loss ratio and of both final losses, and the mean of the rest."""
    ok = [r for r in records if not r.get("error")]

    def mean(get: Any) -> float | None:
        return stats(get(r) for r in ok)["mean"]

    return {
        "seeds": [r["seed"] for r in ok],
        "n_seeds": len(ok),
        "single_seed": len(ok) == 1,
        "failed_seeds": [r["seed"] for r in records if r.get("error")],
        "loss_ratio": stats(r["loss_ratio"] for r in ok),
        "final_val_loss": stats(r["final_val_loss"] for r in ok),
        "final_val_loss_dp": stats((r["dp"] or {}).get("final_val_loss") for r in ok),
        "tokens": mean(lambda r: r["tokens"]),
        "tokens_per_s": mean(lambda r: r["tokens_per_s"]),
        "tokens_per_s_dp": mean(lambda r: (r["dp"] or {}).get("tokens_per_s")),
        "wire_bytes_per_token": mean(lambda r: r["wire_bytes_per_token"]),
        "wire_bytes_per_token_dp": mean(lambda r: (r["dp"] or {}).get("wire_bytes_per_token")),
        "bytes_ratio": mean(lambda r: r["bytes_ratio"]),
        "down_over_up": mean(lambda r: r["down_over_up"]),
        "participation": mean(lambda r: r["participation"]),
        "participation_share": mean(lambda r: r["participation_share"]),
        "fate": {k: mean(lambda r, k=k: r["fate"][k])
                 for k in (*FATE_PARTS, "discarded")},
    }


def headline(cell: str, agg: Mapping[str, Any]) -> dict[str, Any]:
    """The final JSON line's entry for a cell."""
    lr = agg["loss_ratio"]
    return {"cell": cell, "seeds": agg["n_seeds"], "loss_ratio_mean": _round(lr["mean"]),
            "loss_ratio_spread": [_round(lr["min"]), _round(lr["max"])],
            "loss_ratio_std": _round(lr["std"]),
            "bytes_ratio": _round(agg["bytes_ratio"], 1),
            "discarded_share": _round(agg["fate"]["discarded"]),
            "participation": _round(agg["participation"], 3)}


def _round(x: float | None, nd: int = 4) -> float | None:
    return round(x, nd) if x is not None else None


# -- running --------------------------------------------------------------------------------


def _interrupt(signum: int, frame: Any) -> None:
    """SIGTERM acts as Ctrl-C: the running ``ddiloco run`` is stopped cleanly."""
    raise KeyboardInterrupt


def _log(msg: str) -> None:
    print(msg, flush=True)


def reusable(path: Path, sets: Sequence[str], config: Path | None, with_dp: bool,
             dp_only: bool = False) -> bool:
    """Whether ``path`` holds a finished run of these settings: ``report.json`` with the modes
    needed (``dp_only``: the baseline alone), and (when the bench's note is there) the same
    config file and overrides."""
    report_path = path / "report.json"
    if not report_path.exists():
        return False
    try:
        report = json.loads(report_path.read_text())
    except (OSError, json.JSONDecodeError):
        return False
    if ("diloco" not in report and not dp_only) or ((with_dp or dp_only) and "dp" not in report):
        return False
    note = path / RUN_RECORD
    if note.exists():
        try:
            saved = json.loads(note.read_text())
        except (OSError, json.JSONDecodeError):
            return False
        if saved.get("sets") != list(sets) or saved.get("config") != (
                str(config) if config else None):
            return False
    return True


def execute(argv: list[str], path: Path, label: str, heartbeat_s: float = 60.0) -> int:
    """Run one ``ddiloco run`` with its output in ``path/bench.log``, printing a line every
    ``heartbeat_s``. Ctrl-C or SIGTERM stops the run (it stops its workers) and re-raises."""
    t0 = time.monotonic()
    with (path / "bench.log").open("w") as log:
        proc = subprocess.Popen(argv, cwd=REPO, stdout=log, stderr=subprocess.STDOUT)
        try:
            while True:
                try:
                    return proc.wait(timeout=heartbeat_s)
                except subprocess.TimeoutExpired:
                    _log(f"      {label}: {time.monotonic() - t0:,.0f} s")
        except KeyboardInterrupt:
            if proc.poll() is None:
                proc.send_signal(signal.SIGTERM)
                try:
                    proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            raise


def _log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join((path / "bench.log").read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def _fmt(x: float | None, spec: str = ".3f") -> str:
    return "-" if x is None else format(x, spec)


def _plot(cells: Sequence[Cell], records: Sequence[Mapping[str, Any]],
          aggs: Mapping[str, Mapping[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    n = len(cells)
    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, max(4.5, 1.2 + 0.45 * n)),
                                   gridspec_kw={"width_ratios": [1.4, 1]})
    colours = plt.get_cmap("tab10" if n <= 10 else "tab20")
    for i, cell in enumerate(cells):
        colour = colours(i % colours.N)
        mine = [r for r in records if r["cell"] == cell.name and not r.get("error")]
        group = next((r["dp_key"] for r in mine if r.get("with_dp")), None) or ""
        for key, style, label in (("val_loss", "-", cell.name),
                                  ("dp", "--", "DP " + group.rsplit(",seed=", 1)[0])):
            if key == "dp":
                # A shared DP baseline is drawn once, with the cell that carries it.
                curves = [r["dp"]["val_loss"] for r in mine if r["dp"] and r.get("with_dp")]
            else:
                curves = [r["val_loss"] for r in mine]
            curves = [c for c in curves if c]
            if not curves:
                continue
            if len(curves) > 1:
                for c in curves:
                    ax1.plot([t for t, _ in c], [v for _, v in c], style, color=colour,
                             lw=0.6, alpha=0.35)
            avg = mean_curve(curves)
            if avg:
                ax1.plot([t for t, _ in avg], [v for _, v in avg], style, color=colour, lw=1.6,
                         marker="o" if len(curves) == 1 else None, ms=2.5, label=label)
    ax1.set_xlabel("tokens trained (all learners)")
    ax1.set_ylabel("validation loss (nats/byte)")
    ax1.set_title("Validation loss: DiLoCo solid, DP dashed (mean over seeds)")
    ax1.grid(alpha=0.3)
    if ax1.get_legend_handles_labels()[0]:
        ax1.legend(fontsize=7)
    names = [c.name for c in cells]
    left = [0.0] * n
    fate_colours = {"merged": "tab:green", "overwritten": "tab:orange",
                    "other_discarded": "tab:red", "lost": "tab:gray"}
    for part in FATE_PARTS:
        widths = [aggs[c]["fate"][part] or 0.0 for c in names]
        ax2.barh(names, widths, left=left, height=0.6, color=fate_colours[part],
                 label=part.replace("_", " "))
        left = [a + b for a, b in zip(left, widths, strict=True)]
    ax2.set_ylim(n - 0.4, -0.6)  # first cell on top; bars keep their height for few cells
    ax2.set_xlim(0, 1)
    ax2.set_xlabel("share of processed tokens (DiLoCo, mean over seeds)")
    ax2.set_title("Token fate")
    ax2.legend(fontsize=7, ncol=len(FATE_PARTS), loc="upper center",
               bbox_to_anchor=(0.5, -0.16), frameon=False)
    for y, c in enumerate(names):
        merged = aggs[c]["fate"]["merged"]
        if merged is not None:
            ax2.text(0.02, y, f"merged {merged:.1%}", va="center", fontsize=7, color="white")
    ax2.tick_params(axis="y", labelsize=8)
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _tables(cells: Sequence[Cell], aggs: Mapping[str, Mapping[str, Any]],
            dp_from: Mapping[str, str | None], dp: bool, title: str,
            participation_from: Sequence[str]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    loss = Table(title=f"{title}: final validation loss (nats/byte) at equal tokens")
    for col in ("cell", "seeds", "DiLoCo", "DP", "DiLoCo / DP", "min..max", "std", "DP from"):
        loss.add_column(col, justify="left" if col in ("cell", "DP from") else "right")
    for c in cells:
        a = aggs[c.name]
        lr, fd, fp = a["loss_ratio"], a["final_val_loss"], a["final_val_loss_dp"]
        single = a["n_seeds"] <= 1
        src = dp_from.get(c.name)
        failed = f" ({len(a['failed_seeds'])} failed)" if a["failed_seeds"] else ""
        loss.add_row(
            c.name + (f" (= {', '.join(c.same_as)})" if c.same_as else ""),
            f"{a['n_seeds']}{'*' if a['n_seeds'] == 1 else ''}{failed}",
            _fmt(fd["mean"], ".4f") if single else f"{_fmt(fd['mean'], '.4f')} "
            f"({_fmt(fd['min'])}..{_fmt(fd['max'])})",
            _fmt(fp["mean"], ".4f"),
            _fmt(lr["mean"], ".4f"),
            f"{_fmt(lr['min'])}..{_fmt(lr['max'])}" if lr["n"] > 1 else "-",
            _fmt(lr["std"], ".4f"),
            "-" if not dp or src is None else ("own" if src == c.name else src))
    notes = ["* single seed: no spread"]
    if dp:
        notes.append("DP runs once per (M, iid, seed): cells with another 'DP from' reuse "
                     "that cell's DP run")
    loss.caption = "; ".join(notes)
    console.print(loss)
    cost = Table(title=f"{title}: traffic, throughput and token fate (DiLoCo; mean over seeds)")
    for col in ("cell", "tokens", "tok/s", "tok/s DP", "B/tok", "B/tok DP", "DP / DiLoCo B",
                "down / up", "merged", "overwritten", "other disc.", "lost", "learners/merge"):
        cost.add_column(col, justify="left" if col == "cell" else "right")
    for c in cells:
        a = aggs[c.name]
        f = a["fate"]
        cost.add_row(c.name, _fmt(a["tokens"], ",.0f"), _fmt(a["tokens_per_s"], ",.0f"),
                     _fmt(a["tokens_per_s_dp"], ",.0f"), _fmt(a["wire_bytes_per_token"], ",.1f"),
                     _fmt(a["wire_bytes_per_token_dp"], ",.1f"),
                     "-" if a["bytes_ratio"] is None else f"{a['bytes_ratio']:,.1f}x",
                     _fmt(a["down_over_up"], ".3f"), _fmt(f["merged"], ".1%"),
                     _fmt(f["overwritten"], ".1%"), _fmt(f["other_discarded"], ".1%"),
                     _fmt(f["lost"], ".1%"), _fmt(a["participation"], ".2f"))
    cost.caption = "shares of processed tokens; learners/merge: " + (
        f"mean learners per merge, from report.json's {' and '.join(participation_from)}"
        if participation_from else "not in report.json")
    console.print(cost)


def _ladder_table(summary: Sequence[Mapping[str, Any]]) -> None:
    from rich.console import Console
    from rich.table import Table

    console = Console()
    if not console.is_terminal:
        console = Console(width=160)
    table = Table(title="The ablation ladder: final validation loss (nats/byte) at equal tokens")
    for col in ("rung", "seeds", "loss", "min..max", "/ DP", "step from previous rung",
                "step min..max", "step std", "step %"):
        table.add_column(col, justify="left" if col == "rung" else "right")
    for row in summary:
        lo, st = row["loss"], row["step"]
        d = st["delta"] if st else None
        table.add_row(
            f"{row['rung']}: {row['label']}", str(lo["n"]), _fmt(lo["mean"], ".4f"),
            f"{_fmt(lo['min'])}..{_fmt(lo['max'])}" if lo["n"] > 1 else "-",
            _fmt(row["loss_ratio"]["mean"], ".4f"),
            "-" if d is None else _fmt(d["mean"], "+.4f"),
            "-" if d is None or d["n"] < 2 else f"{_fmt(d['min'], '+.4f')}.."
            f"{_fmt(d['max'], '+.4f')}",
            "-" if d is None else _fmt(d["std"], ".4f"),
            "-" if st is None else _fmt(st["relative"]["mean"], "+.2%"))
    table.caption = ("step: this rung's final loss minus the previous rung's, per seed, then "
                     "mean and spread over the seeds both have; positive: the feature costs loss")
    console.print(table)


def _dest(option: str) -> str:
    """argparse's attribute name of ``--option``."""
    return option.replace("-", "_")


def _parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--config", type=Path, default=None, help="TOML or YAML file")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    help="section.field=value, repeated; applies to every cell")
    ap.add_argument("--steps", type=int, default=None, help="train.steps of every run")
    for opt, fld, _ in AXES:
        ap.add_argument(f"--{opt}", type=parse_list, default=None, metavar="V1,V2,...",
                        help=f"axis: {fld} values")
    ap.add_argument("--seeds", type=parse_list, default=[0, 1], metavar="S1,S2,...",
                    help="train.seed values, each cell runs once per seed (default 0,1)")
    ap.add_argument("--ladder", action="store_true",
                    help="the ablation ladder (eight rungs from tuned DP to today's defaults) "
                    "instead of a grid; no axes")
    ap.add_argument("--full-grid", action="store_true",
                    help="the cartesian product of the axes instead of one axis at a time")
    ap.add_argument("--dp", action=argparse.BooleanOptionalAction, default=True,
                    help="train the DP baseline once per (M, iid, seed) (default on)")
    ap.add_argument("--only", action="append", default=[], metavar="NAME",
                    help="run only these cells (repeated or a comma list)")
    ap.add_argument("--dry-run", action="store_true", help="print the cells and commands only")
    ap.add_argument("--fresh", action="store_true", help="rerun cells already finished")
    ap.add_argument("--deterministic", action="store_true",
                    help="run.deterministic=true for every run that does not set "
                    "sync.blocking=false (the ladder's rungs 1-6; every grid cell, which it "
                    "makes synchronous): two runs of one seed give the same losses bit for "
                    "bit, so only the seeds spread (docs/QUALITY.md, Deterministic mode)")
    ap.add_argument("--out", type=Path, default=Path("bench-out/quality"))
    return ap.parse_args(argv)


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    from ddiloco.pipeline.errors import ConfigError
    from ddiloco.workers.run.config import load_config

    config = args.config.resolve() if args.config else None
    out = args.out.resolve()
    seeds = [int(s) for s in args.seeds]
    axes = {fld: getattr(args, _dest(opt)) for opt, fld, _ in AXES
            if getattr(args, _dest(opt)) is not None}
    common = set_args(args.overrides, args.steps, {})
    try:
        base_cfg = load_config(config, common).model_dump(mode="json")
    except ConfigError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    base = {}
    for _, fld, _ in AXES:
        section, name = fld.split(".")
        base[fld] = base_cfg[section][name]
    rungs: list[Rung] = []
    if args.ladder:
        if axes or args.full_grid:
            print("error: --ladder has its own cells: leave out the axes and --full-grid",
                  file=sys.stderr)
            return 2
        rungs = [r for r in ladder_rungs(base["run.learners"], base_cfg["train"]["batch_size"],
                                         base_cfg["train"]["dp_lr"]) if args.dp or not r.dp]
        cells = [Cell(r.name, r.overrides) for r in rungs]
    else:
        cells = expand_cells(axes, base, args.full_grid)
    only = [n.strip() for item in args.only for n in item.split(",") if n.strip()]
    if only:
        known = {c.name for c in cells} | {a for c in cells for a in c.same_as}
        unknown = [n for n in only if n not in known]
        if unknown:
            print(f"error: --only {', '.join(unknown)}: no such cell; cells: "
                  f"{', '.join(c.name for c in cells)}", file=sys.stderr)
            return 2
        cells = [c for c in cells if c.name in only or set(c.same_as) & set(only)]
        rungs = [r for r in rungs if r.name in only]
    dp_only = {r.name for r in rungs if r.dp}

    def mode(overrides: Mapping[str, Any]) -> dict[str, Any]:
        return deterministic_overrides(overrides) if args.deterministic else dict(overrides)

    for cell in cells:
        try:
            load_config(config, set_args(common, None, {**mode(cell.overrides),
                                                        "train.seed": seeds[0]}))
        except ConfigError as exc:
            print(f"error: cell {cell.name}: {exc}", file=sys.stderr)
            return 2
    runs = plan_ladder(rungs, seeds) if args.ladder else plan_runs(cells, seeds, base, args.dp)
    runs = [replace(r, overrides=mode(r.overrides)) for r in runs]
    plan = []
    for run in runs:
        sets = set_args(common, None, run.overrides)
        path = run_dir(out, run)
        plan.append((run, sets, path, build_command(
            sys.executable, path, config, sets, run.with_dp and run.cell not in dp_only,
            dp_only=run.cell in dp_only)))
    commands = [shlex.join(argv_) for *_, argv_ in plan]
    title = (f"M={base['run.learners']}, H={base['sync.H']}, adopt={base['sync.adopt']}, "
             f"iid={fmt_value(base['data.iid'])}, codec={base['sync.codec_up']}, "
             f"{base_cfg['train']['steps']} steps")

    _log(f"quality: {len(cells)} cell(s) x {len(seeds)} seed(s) = {len(runs)} run(s), "
         f"{sum(r.with_dp for r in runs)} with DP; base {title}; out {out}")
    for cell in cells:
        same = f"  (same setting as {', '.join(cell.same_as)})" if cell.same_as else ""
        _log(f"  cell {cell.name}: {cell.overrides or 'base configuration'}{same}")
    if args.dry_run:
        for (run, _, _, _), cmd in zip(plan, commands, strict=True):
            dp_note = (" [DP only]" if run.cell in dp_only else " [+DP]" if run.with_dp
                       else f" [DP from {run.dp_from}]") if args.dp and run.dp_from else ""
            _log(f"  {run.cell} seed {run.seed}{dp_note}: {cmd}")
        print(json.dumps({"bench": "quality", "dry_run": True, "base": base,
                          "cells": [{"name": c.name, "overrides": c.overrides,
                                     "same_as": list(c.same_as)} for c in cells],
                          "ladder": [{"rung": r.name, "label": r.label, "dp": r.dp}
                                     for r in rungs] if args.ladder else None,
                          "runs": [{"cell": r.cell, "seed": r.seed, "with_dp": r.with_dp,
                                    "dp_from": r.dp_from, "command": cmd}
                                   for (r, *_), cmd in zip(plan, commands, strict=True)]}))
        return 0

    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, _interrupt)
    reports: dict[tuple[str, int], dict[str, Any] | None] = {}
    errors: dict[tuple[str, int], str] = {}
    t_all = time.monotonic()
    for i, (run, sets, path, argv_) in enumerate(plan, 1):
        label = f"[{i}/{len(plan)}] {run.cell} seed {run.seed}" + (
            " DP only" if run.cell in dp_only else " +DP" if run.with_dp else "")
        if not args.fresh and reusable(path, sets, config, run.with_dp,
                                       dp_only=run.cell in dp_only):
            reports[(run.cell, run.seed)] = json.loads((path / "report.json").read_text())
            _log(f"{label}: reused {path}")
            continue
        if path.exists():
            shutil.rmtree(path)
        path.mkdir(parents=True)
        (path / RUN_RECORD).write_text(json.dumps(
            {"cell": run.cell, "seed": run.seed, "config": str(config) if config else None,
             "sets": sets, "with_dp": run.with_dp, "command": argv_}, indent=2))
        _log(f"{label}: started")
        t0 = time.monotonic()
        try:
            rc = execute(argv_, path, label)
        except KeyboardInterrupt:
            _log(f"{label}: interrupted after {time.monotonic() - t0:,.0f} s; rerun the same "
                 "command to resume")
            return 130
        took = time.monotonic() - t0
        if rc != 0 or not (path / "report.json").exists():
            errors[(run.cell, run.seed)] = f"exit {rc}: {_log_tail(path, 5)}"
            reports[(run.cell, run.seed)] = None
            _log(f"{label}: FAILED (exit {rc}) after {took:,.0f} s; {path / 'bench.log'}:\n"
                 f"{_log_tail(path)}")
            continue
        report = json.loads((path / "report.json").read_text())
        reports[(run.cell, run.seed)] = report
        d = (report.get("diloco") or {}).get("final_val_loss")
        p = (report.get("dp") or {}).get("final_val_loss")
        _log(f"{label}: done in {took:,.0f} s"
             + ("" if run.cell in dp_only else f", DiLoCo loss {_fmt(d, '.4f')}")
             + (f", DP loss {_fmt(p, '.4f')}" if run.with_dp else ""))

    records: list[dict[str, Any]] = []
    for (run, _, path, _), cmd in zip(plan, commands, strict=True):
        report = reports.get((run.cell, run.seed))
        carrier = reports.get((run.dp_from, run.seed)) if run.dp_from else None
        meta = {"cell": run.cell, "seed": run.seed, "run_dir": str(path), "command": cmd,
                "with_dp": run.with_dp, "dp_from": run.dp_from, "dp_key": run.dp_key}
        if report is None:
            records.append({**meta, "error": errors.get((run.cell, run.seed), "no report")})
            continue
        dp_block = (carrier or {}).get("dp") if run.dp_from else None
        if run.cell in dp_only:
            # The baseline rung: its own loss is DP's (ratio 1 by construction).
            report = {"diloco": report.get("dp")}
        records.append({**meta, **run_record(report, dp_block)})
    aggs = {c.name: aggregate([r for r in records if r["cell"] == c.name]) for c in cells}
    dp_from = {c.name: next((r.dp_from for r in runs if r.cell == c.name), None) for c in cells}
    result = {
        "bench": "quality", "config": str(config) if config else None, "sets": args.overrides,
        "steps": base_cfg["train"]["steps"], "seeds": seeds, "axes": axes,
        "full_grid": args.full_grid, "dp": args.dp, "deterministic": args.deterministic,
        "base": base,
        "cells": [{"name": c.name, "overrides": c.overrides, "same_as": list(c.same_as),
                   "dp_from": dp_from[c.name]} for c in cells],
        "runs": records, "aggregates": aggs, "commands": commands,
        "wall_s": round(time.monotonic() - t_all, 1),
        "ladder": ladder_summary(rungs, records) if args.ladder else None,
    }
    (out / "quality.json").write_text(json.dumps(result, indent=2))
    _plot(cells, records, aggs, out / "quality.png", f"base {title}")
    sources = sorted({r["participation_source"] for r in records
                      if r.get("participation_source")})
    _tables(cells, aggs, dp_from, args.dp, f"base {title}", sources)
    if result["ladder"]:
        _ladder_table(result["ladder"])
    _log(f"wrote {out / 'quality.json'} and {out / 'quality.png'}")
    failed = [f"{r['cell']} seed {r['seed']}" for r in records if r.get("error")]
    print(json.dumps({"bench": "quality", "steps": result["steps"], "seeds": seeds,
                      "cells": [headline(c.name, aggs[c.name]) for c in cells],
                      "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
