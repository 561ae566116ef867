"""The quality matrix: a setting judged over six cells, each against the DP tuned for that cell.

A default that wins on one setting may lose on another, and one run at the default setting
moves by up to 4 % with merge timing alone (docs/QUALITY.md). So a new default is judged
here, not on single runs: every cell runs today's defaults (the ``default`` variant) and, with
``--candidate``, the candidate setting, at least three times each (``--seeds`` x
``--repeats``), and the rule of :func:`verdict` decides.

Cells (:func:`matrix_cells`), each a change to the base configuration (``--config``, ``--set``):

* ``default``: the base configuration itself;
* ``iid``: ``data.iid=true``;
* ``seq128-b16``: ``model.seq_len=128``, ``train.batch_size=16`` (the same tokens per step);
* ``M2``, ``M8``: ``run.learners`` 2 and 8 (DP's global batch changes with M: its rate is the
  cell's own, see below);
* ``small``: ``model.preset=small`` (10.8M parameters) at a shorter budget
  (``train.batch_size=8``, ``train.steps=200``, ``train.warmup_steps=20``, ``sync.H=12``): the
  same tokens per step as the default, a quarter of its steps. Against ``default`` it shows
  whether the gap to DP shrinks with model size.

The DP of a cell is run once per seed (``--baseline dp --baseline-only``), shared by both
variants. Its rate: with ``--dp-lrs A,B,...`` the bench first runs DP at each rate at the first
seed and keeps the lowest final loss for that cell (:func:`pick_dp_lr`); without it, the base
configuration's ``train.dp_lr`` scaled by the square root of the cell's global batch against
the default's (:func:`scaled_dp_lr`).

Per cell and variant: the median, min..max and spread ((max - min) / median) of the final
DiLoCo loss and of its ratio to DP (each run against the DP of its seed). The verdict compares
the candidate's median loss with the default's per cell (:func:`verdict`). Prints the table,
writes ``OUT/matrix.json`` with every run and the exact commands, and ends with one JSON line.
Runs whose ``report.json`` is there from the same settings are reused, so an interrupted matrix
resumes, and a second candidate reuses the default's runs and the DP runs.

    python bench/matrix.py [--config FILE] [--set k=v ...] [--candidate k=v ...]
                           [--cells default,iid,...] [--seeds 0,1,2] [--repeats 1]
                           [--dp-lrs 3e-3,6e-3,1.2e-2] [--dp-set k=v ...]
                           [--tolerance 0.005]
                           [--dry-run | --summarize] [--fresh] [--out bench-out/matrix]

``--summarize`` starts nothing: it judges the runs already finished and counts the rest as
missing, so a matrix stopped part-way still gives its table (a missing run blocks the verdict).
"""

from __future__ import annotations

import argparse
import json
import math
import shlex
import shutil
import signal
import statistics
import sys
import time
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

BENCH = Path(__file__).resolve().parent
sys.path.insert(0, str(BENCH))

import quality as q  # noqa: E402  (bench/quality.py: run plumbing and per-run records)

MATRIX: tuple[tuple[str, dict[str, Any]], ...] = (
    ("default", {}),
    ("iid", {"data.iid": True}),
    ("seq128-b16", {"model.seq_len": 128, "train.batch_size": 16}),
    ("M2", {"run.learners": 2}),
    ("M8", {"run.learners": 8}),
    ("small", {"model.preset": "small", "train.batch_size": 8, "train.steps": 200,
               "train.warmup_steps": 20, "sync.H": 12}),
)
"""The cells: name -> overrides on top of the base configuration."""

DEFAULT_TOLERANCE = 0.005
"""The most a new default may lose on any cell, as a share of the old default's median."""


@dataclass(frozen=True)
class MatrixCell:
    """One cell of the matrix.

    Attributes:
        name: the cell's name (:data:`MATRIX`).
        overrides: config field -> value on top of the base configuration.
        dp_lr: the DP rate of the cell without ``--dp-lrs`` (:func:`scaled_dp_lr`).
    """

    name: str
    overrides: dict[str, Any]
    dp_lr: float | None = None


@dataclass(frozen=True)
class MatrixRun:
    """One ``ddiloco run`` of the matrix.

    Attributes:
        cell: the cell's name.
        kind: ``dp`` (the cell's baseline at one seed), ``tune`` (DP at one rate of
            ``--dp-lrs``, first seed), ``default`` or ``candidate``.
        seed: ``train.seed``.
        repeat: 0, 1, ...: runs of the same seed (the same-seed spread).
        overrides: every override of the run, the cell's last (they win).
        dp_lr: the DP rate of a ``dp`` or ``tune`` run (None: decided by the tuning).
    """

    cell: str
    kind: str
    seed: int
    repeat: int = 0
    overrides: dict[str, Any] = field(default_factory=dict)
    dp_lr: float | None = None

    @property
    def dp_only(self) -> bool:
        return self.kind in ("dp", "tune")

    def path(self, out: Path) -> Path:
        """``OUT/<cell>/dp/seed-<s>``, ``OUT/<cell>/tune/lr-<lr>`` or
        ``OUT/<cell>/<variant>/seed-<s>[-r<k>]``."""
        base = out / q.safe_name(self.cell)
        if self.kind == "tune":
            return base / "tune" / f"lr-{self.dp_lr:g}"
        suffix = f"-r{self.repeat}" if self.repeat else ""
        return base / self.kind / f"seed-{self.seed}{suffix}"


# -- pure helpers ---------------------------------------------------------------------------


def scaled_dp_lr(base_lr: float, base_batch: int, batch: int) -> float:
    """DP's rate for a global batch of ``batch`` tokens, from ``base_lr`` tuned at
    ``base_batch`` tokens: square-root scaling (Adam's rule of thumb, Malladi et al., arXiv
    2205.10287), a starting point that ``--dp-lrs`` replaces with a sweep.

    Raises:
        ValueError: a batch or rate that is not positive.
    """
    if base_lr <= 0 or base_batch <= 0 or batch <= 0:
        raise ValueError(f"rates and batches must be > 0: {base_lr}, {base_batch}, {batch}")
    return base_lr * math.sqrt(batch / base_batch)


def matrix_cells(base: Mapping[str, Any], names: Sequence[str] | None = None) -> list[MatrixCell]:
    """The cells (all of :data:`MATRIX`, or ``names`` in that order), each with its DP rate.

    Args:
        base: the base configuration as ``load_config(...).model_dump(mode="json")``.
        names: cell names to keep.

    Raises:
        ValueError: an unknown cell name.
    """
    known = [n for n, _ in MATRIX]
    wanted = list(names) if names else known
    unknown = [n for n in wanted if n not in known]
    if unknown:
        raise ValueError(f"no such cell: {', '.join(unknown)}; cells: {', '.join(known)}")
    from ddiloco.workers.task.model import PRESETS

    train, run, model = base["train"], base["run"], base["model"]

    def seq_len(preset: str, override: int | None) -> int:
        return override if override is not None else PRESETS[preset].seq_len

    base_lr = train["dp_lr"] if train["dp_lr"] is not None else train["lr"]
    base_batch = (run["learners"] * train["batch_size"]
                  * seq_len(model["preset"], model["seq_len"]))
    cells = []
    for name, overrides in MATRIX:
        if name not in wanted:
            continue
        length = seq_len(overrides.get("model.preset", model["preset"]),
                         overrides.get("model.seq_len", model["seq_len"]))
        batch = (overrides.get("run.learners", run["learners"])
                 * overrides.get("train.batch_size", train["batch_size"]) * length)
        # four significant digits: the rate appears in commands and directory names
        lr = float(f"{scaled_dp_lr(base_lr, base_batch, batch):.4g}")
        cells.append(MatrixCell(name, dict(overrides), lr))
    return cells


def plan_matrix(cells: Sequence[MatrixCell], seeds: Sequence[int], repeats: int,
                candidate: Mapping[str, Any] | None,
                dp_lrs: Sequence[float] | None = None,
                dp_overrides: Mapping[str, Any] | None = None) -> list[MatrixRun]:
    """Every run, cell by cell: the DP tuning (``dp_lrs``, first seed), the DP per seed, then
    per seed and repeat the default and the candidate.

    ``dp_overrides`` (``--dp-set``) apply to the DP runs only, under the cell's own: the
    baseline as tuned for itself (e.g. its warm-up) when the candidate changes a setting that
    both modes share.

    Raises:
        ValueError: no seeds, or ``repeats`` < 1.
    """
    if not seeds or repeats < 1:
        raise ValueError(f"need seeds and repeats >= 1: {list(seeds)}, {repeats}")
    runs: list[MatrixRun] = []
    dp_base = dict(dp_overrides or {})
    for cell in cells:
        if dp_lrs:
            runs += [MatrixRun(cell.name, "tune", seeds[0], 0,
                               {**dp_base, **cell.overrides, "train.seed": seeds[0],
                                "train.dp_lr": lr}, float(lr)) for lr in dp_lrs]
        for seed in seeds:
            dp = None if dp_lrs else cell.dp_lr
            over = {**dp_base, **cell.overrides, "train.seed": seed}
            if dp is not None:
                over["train.dp_lr"] = dp
            runs.append(MatrixRun(cell.name, "dp", seed, 0, over, dp))
        for seed in seeds:
            for k in range(repeats):
                runs.append(MatrixRun(cell.name, "default", seed, k,
                                      {**cell.overrides, "train.seed": seed}))
                if candidate:
                    runs.append(MatrixRun(cell.name, "candidate", seed, k,
                                          {**candidate, **cell.overrides, "train.seed": seed}))
    return runs


def pick_dp_lr(losses: Mapping[float, float | None]) -> float:
    """The rate with the lowest final DP loss (ties: the smaller rate).

    Raises:
        ValueError: no rate finished with a finite loss.
    """
    ok = {lr: v for lr, v in losses.items() if v is not None and math.isfinite(v)}
    if not ok:
        raise ValueError(f"no DP rate finished: {dict(losses)}")
    return min(ok, key=lambda lr: (ok[lr], lr))


def summary(values: Iterable[float | None]) -> dict[str, Any]:
    """``n``, ``median``, ``min``, ``max`` and ``spread`` ((max - min) / median) of the values
    that are not None; all None when there are none."""
    xs = sorted(float(v) for v in values if v is not None)
    if not xs:
        return {"n": 0, "median": None, "min": None, "max": None, "spread": None}
    med = statistics.median(xs)
    return {"n": len(xs), "median": med, "min": xs[0], "max": xs[-1],
            "spread": (xs[-1] - xs[0]) / med if med else None}


def verdict(default: Mapping[str, float | None], candidate: Mapping[str, float | None],
            tolerance: float = DEFAULT_TOLERANCE) -> dict[str, Any]:
    """The rule for a new default: it wins on the mean over the cells and loses no cell by
    more than ``tolerance``.

    Args:
        default: cell -> the default's median final loss.
        candidate: cell -> the candidate's median final loss.
        tolerance: the largest loss on any cell, as a share of the default's median.

    Returns:
        ``{"change": cell -> candidate / default - 1, "mean_change", "worst_cell",
        "worst_change", "missing": cells without both medians, "accepted"}``; not accepted
        while a cell is missing.
    """
    change = {c: cand / d - 1.0 for c, d in default.items()
              if d and (cand := candidate.get(c)) is not None}
    missing = sorted((set(default) | set(candidate)) - set(change))
    worst = max(change, key=lambda c: change[c]) if change else None
    mean_change = statistics.fmean(change.values()) if change else None
    accepted = (not missing and mean_change is not None and worst is not None
                and mean_change < 0 and change[worst] <= tolerance)
    return {"change": change, "mean_change": mean_change, "worst_cell": worst,
            "worst_change": change[worst] if worst else None, "missing": missing,
            "accepted": accepted, "tolerance": tolerance}


def cell_records(runs: Sequence[MatrixRun], losses: Sequence[float | None],
                 ) -> dict[str, dict[str, Any]]:
    """Per cell: the DP's final loss per seed and, per variant, :func:`summary` of the final
    losses and of their ratios to the DP of the same seed.

    Args:
        runs: the matrix's runs.
        losses: the final loss of each run, in the same order (None: failed or not run).
    """
    out: dict[str, dict[str, Any]] = {}
    for cell in dict.fromkeys(r.cell for r in runs):
        mine = [(r, loss) for r, loss in zip(runs, losses, strict=True) if r.cell == cell]
        dp = {r.seed: loss for r, loss in mine if r.kind == "dp"}
        row: dict[str, Any] = {"dp": {str(s): v for s, v in dp.items()},
                               "dp_loss": summary(dp.values())}
        for kind in ("default", "candidate"):
            vs = [(r, loss) for r, loss in mine if r.kind == kind]
            if not vs:
                continue
            row[kind] = {"loss": summary(loss for _, loss in vs),
                         "ratio": summary(q._ratio(loss, dp.get(r.seed)) for r, loss in vs),
                         "runs": [{"seed": r.seed, "repeat": r.repeat, "loss": loss}
                                  for r, loss in vs]}
        out[cell] = row
    return out


# -- running --------------------------------------------------------------------------------


def _final_loss(path: Path, dp_only: bool) -> float | None:
    try:
        report = json.loads((path / "report.json").read_text())
    except (OSError, json.JSONDecodeError):
        return None
    return (report.get("dp" if dp_only else "diloco") or {}).get("final_val_loss")


def _run(run: MatrixRun, out: Path, config: Path | None, common: Sequence[str], fresh: bool,
         label: str, summarize: bool = False) -> float | None:
    """One run (reused when finished with the same settings); its final loss or None.

    With ``summarize`` nothing is started: a run not finished counts as missing (None)."""
    sets = q.set_args(common, None, run.overrides)
    path = run.path(out)
    argv = q.build_command(sys.executable, path, config, sets, False, dp_only=run.dp_only)
    if not fresh and q.reusable(path, sets, config, False, dp_only=run.dp_only):
        q._log(f"{label}: reused {path}")
        return _final_loss(path, run.dp_only)
    if summarize:
        q._log(f"{label}: missing")
        return None
    if path.exists():
        shutil.rmtree(path)
    path.mkdir(parents=True)
    (path / q.RUN_RECORD).write_text(json.dumps(
        {"cell": run.cell, "kind": run.kind, "seed": run.seed, "repeat": run.repeat,
         "config": str(config) if config else None, "sets": sets, "command": argv}, indent=2))
    q._log(f"{label}: started")
    t0 = time.monotonic()
    rc = q.execute(argv, path, label)
    loss = _final_loss(path, run.dp_only)
    if rc != 0 or loss is None:
        q._log(f"{label}: FAILED (exit {rc}); {path / 'bench.log'}:\n{q._log_tail(path)}")
        return None
    q._log(f"{label}: done in {time.monotonic() - t0:,.0f} s, loss {loss:.4f}")
    return float(loss)


def _parse_args(argv: Sequence[str] | None = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--config", type=Path, default=None, help="TOML or YAML file")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    help="section.field=value, repeated; the base of every run")
    ap.add_argument("--candidate", action="append", default=[], metavar="K=V",
                    help="section.field=value, repeated: the candidate default")
    ap.add_argument("--dp-set", dest="dp_overrides", action="append", default=[],
                    metavar="K=V", help="section.field=value, repeated: the DP runs only")
    ap.add_argument("--cells", type=q.parse_list, default=None, metavar="C1,C2,...",
                    help=f"cells to run (default all: {', '.join(n for n, _ in MATRIX)})")
    ap.add_argument("--seeds", type=q.parse_list, default=[0, 1, 2], metavar="S1,S2,...")
    ap.add_argument("--repeats", type=int, default=1, help="runs per seed and variant")
    ap.add_argument("--dp-lrs", type=q.parse_list, default=None, metavar="LR1,LR2,...",
                    help="tune each cell's DP rate over these at the first seed")
    ap.add_argument("--tolerance", type=float, default=DEFAULT_TOLERANCE,
                    help="the most a candidate may lose on any cell (share, default 0.005)")
    ap.add_argument("--dry-run", action="store_true", help="print the runs and commands only")
    ap.add_argument("--fresh", action="store_true", help="rerun runs already finished")
    ap.add_argument("--summarize", action="store_true",
                    help="start nothing: judge the runs already finished, the rest missing")
    ap.add_argument("--out", type=Path, default=Path("bench-out/matrix"))
    return ap.parse_args(argv)


def _key_values(items: Sequence[str], option: str = "--candidate") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        key, sep, value = item.partition("=")
        if not sep or "." not in key:
            raise ValueError(f"{option} {item!r}: expected section.field=value")
        try:
            out[key.strip()] = yaml.safe_load(value)
        except yaml.YAMLError:
            out[key.strip()] = value
    return out


def _table(cells: Mapping[str, Mapping[str, Any]], decision: Mapping[str, Any] | None) -> None:
    f = q._fmt
    q._log(f"{'cell':<11} {'DP':>7} {'default loss (min..max)':>26} {'ratio':>7} "
           f"{'spread':>7}" + (f" {'candidate loss (min..max)':>28} {'ratio':>7} "
                               f"{'change':>7}" if decision else ""))
    for name, row in cells.items():
        d = row.get("default") or {"loss": summary([]), "ratio": summary([])}
        line = (f"{name:<11} {f(row['dp_loss']['median'], '.4f'):>7} "
                f"{f(d['loss']['median'], '.4f'):>7} ({f(d['loss']['min'], '.4f')}.."
                f"{f(d['loss']['max'], '.4f')}) {f(d['ratio']['median'], '.4f'):>7} "
                f"{f(d['loss']['spread'], '.2%'):>7}")
        if decision:
            c = row.get("candidate") or {"loss": summary([]), "ratio": summary([])}
            ch = decision["change"].get(name)
            line += (f" {f(c['loss']['median'], '.4f'):>9} ({f(c['loss']['min'], '.4f')}.."
                     f"{f(c['loss']['max'], '.4f')}) {f(c['ratio']['median'], '.4f'):>7} "
                     f"{f(ch, '+.2%'):>7}")
        q._log(line)
    if decision:
        q._log(f"verdict: mean change {q._fmt(decision['mean_change'], '+.2%')}, worst cell "
               f"{decision['worst_cell']} {q._fmt(decision['worst_change'], '+.2%')} "
               f"(tolerance {decision['tolerance']:.2%}); missing {decision['missing'] or '-'}"
               + (f", {decision['missing_runs']} run(s) missing"
                  if decision.get("missing_runs") else "")
               + f": {'ACCEPTED' if decision['accepted'] else 'not accepted'}")


def main(argv: Sequence[str] | None = None) -> int:
    args = _parse_args(argv)
    from ddiloco.pipeline.errors import ConfigError
    from ddiloco.workers.run.config import load_config

    config = args.config.resolve() if args.config else None
    out = args.out.resolve()
    seeds = [int(s) for s in args.seeds]
    common = q.set_args(args.overrides, None, {})
    try:
        candidate = _key_values(args.candidate)
        dp_overrides = _key_values(args.dp_overrides, "--dp-set")
        base_cfg = load_config(config, common).model_dump(mode="json")
        cells = matrix_cells(base_cfg, [str(c) for c in args.cells] if args.cells else None)
        dp_lrs = [float(x) for x in args.dp_lrs] if args.dp_lrs else None
        runs = plan_matrix(cells, seeds, args.repeats, candidate, dp_lrs, dp_overrides)
        for run in runs:
            load_config(config, q.set_args(common, None, run.overrides))
    except (ConfigError, ValueError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    q._log(f"matrix: {len(cells)} cell(s), seeds {seeds} x {args.repeats} repeat(s), "
           f"{len(runs)} run(s){', candidate ' + str(candidate) if candidate else ''}; "
           f"out {out}")
    if args.dry_run:
        for run in runs:
            sets = q.set_args(common, None, run.overrides)
            q._log(f"  {run.cell} {run.kind} seed {run.seed} r{run.repeat}: " + shlex.join(
                q.build_command(sys.executable, run.path(out), config, sets, False,
                                dp_only=run.dp_only)))
        print(json.dumps({"bench": "matrix", "dry_run": True,
                          "cells": [c.name for c in cells], "runs": len(runs)}))
        return 0

    out.mkdir(parents=True, exist_ok=True)
    signal.signal(signal.SIGTERM, q._interrupt)
    losses: list[float | None] = [None] * len(runs)
    chosen: dict[str, float | None] = {c.name: c.dp_lr for c in cells}
    t_all = time.monotonic()
    try:
        for i, run in enumerate(runs, 1):
            if run.kind == "dp" and run.dp_lr is None:
                tuned = {r.dp_lr: loss for r, loss in zip(runs, losses, strict=True)
                         if r.cell == run.cell and r.kind == "tune" and r.dp_lr is not None}
                try:
                    chosen[run.cell] = pick_dp_lr(tuned)
                except ValueError as exc:
                    q._log(f"{run.cell}: {exc}")
                    continue
                run = MatrixRun(run.cell, "dp", run.seed, 0,
                                {**run.overrides, "train.dp_lr": chosen[run.cell]},
                                chosen[run.cell])
                runs[i - 1] = run
            label = f"[{i}/{len(runs)}] {run.cell} {run.kind} seed {run.seed}" + (
                f" r{run.repeat}" if run.repeat else "") + (
                f" dp_lr {run.dp_lr:g}" if run.dp_only else "")
            losses[i - 1] = _run(run, out, config, common, args.fresh and not args.summarize,
                                 label, args.summarize)
    except KeyboardInterrupt:
        q._log("interrupted; rerun the same command to resume")
        return 130
    table = cell_records(runs, losses)
    decision = None
    if candidate:
        decision = verdict({c: (r.get("default") or {}).get("loss", {}).get("median")
                            for c, r in table.items()},
                           {c: (r.get("candidate") or {}).get("loss", {}).get("median")
                            for c, r in table.items()}, args.tolerance)
    failed = [f"{r.cell} {r.kind} seed {r.seed}"
              for r, loss in zip(runs, losses, strict=True) if loss is None]
    if decision is not None and failed:
        # medians over fewer runs than planned are not the rule's evidence
        decision = {**decision, "missing_runs": len(failed), "accepted": False}
    size = None
    if "default" in table and "small" in table:
        size = {"tiny_ratio": table["default"]["default"]["ratio"]["median"],
                "small_ratio": table["small"]["default"]["ratio"]["median"]}
    result = {"bench": "matrix", "config": str(config) if config else None,
              "sets": args.overrides, "candidate": candidate, "dp_sets": dp_overrides,
              "seeds": seeds,
              "repeats": args.repeats, "dp_lr": chosen, "cells": table, "verdict": decision,
              "model_size": size, "wall_s": round(time.monotonic() - t_all, 1),
              "runs": [{"cell": r.cell, "kind": r.kind, "seed": r.seed, "repeat": r.repeat,
                        "dp_lr": r.dp_lr, "loss": loss, "dir": str(r.path(out))}
                       for r, loss in zip(runs, losses, strict=True)]}
    (out / "matrix.json").write_text(json.dumps(result, indent=2))
    _table(table, decision)
    q._log(f"wrote {out / 'matrix.json'}")
    print(json.dumps({"bench": "matrix", "cells": {
        c: {"dp": q._round(r["dp_loss"]["median"]),
            **{k: {"loss_median": q._round(r[k]["loss"]["median"]),
                   "ratio_median": q._round(r[k]["ratio"]["median"]),
                   "spread": q._round(r[k]["loss"]["spread"])}
               for k in ("default", "candidate") if k in r}} for c, r in table.items()},
        "verdict": None if decision is None else {
            k: decision[k] for k in ("mean_change", "worst_cell", "worst_change", "accepted")},
        "model_size": size, "failed": failed}))
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
