"""JAX, PyTorch and mixed learners on one config, side by side in one invocation.

Runs the built-in GPT with ``run.torch_learners`` = 0 (every learner JAX), M/2 (half of them
PyTorch) and M (every learner PyTorch), each for every seed, with the same data, schedule and
token budget, and prints the final validation loss (the evaluator's, on the same held-out
batches), the ratio to the all-JAX run of the same seed, wall time and tokens/s. Under
``--deterministic`` (default) rounds and adoptions are decided by step counts
(``run.deterministic``), so a difference between the columns is the frameworks' float32
arithmetic, not merge timing. The runs alternate by seed so a machine that slows down during
the bench slows every column.

    python bench/frameworks.py [--config configs/ci-tiny.yaml] [--steps 300] [--seeds 0 1]
                               [--learners 4] [--set K=V ...] [--json PATH]
    python bench/frameworks.py --merge A.json B.json [--json PATH]

``--merge`` runs nothing: it judges together the runs of benches made in pieces (one seed
each, say), against each seed's all-JAX runs.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def one_run(out: Path, config: str, steps: int, seed: int, learners: int, torch_learners: int,
            deterministic: bool, sets: list[str]) -> dict[str, Any]:
    """One ``ddiloco run`` (DiLoCo only); its loss, wall time and throughput."""
    cmd = [sys.executable, "-m", "ddiloco.cli", "run", "--config", config, "--steps",
           str(steps), "--no-live", "--out", str(out), "--force"]
    for kv in [f"train.seed={seed}", f"run.learners={learners}",
               f"run.torch_learners={torch_learners}",
               f"run.deterministic={str(deterministic).lower()}", *sets]:
        cmd += ["--set", kv]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    r = json.loads((out / "report.json").read_text())["diloco"]
    # the first evaluation after some training: before float32 differences between the
    # frameworks have had many steps to grow
    early = next((loss for tokens, loss in r["val_loss"] if tokens > 0), None)
    return {"seed": seed, "torch_learners": torch_learners,
            "early_val_loss": early, "final_val_loss": r["final_val_loss"],
            "wall_s": round(r["wall_s"], 1),
            "tokens": r["tokens"], "tokens_per_s": round(r["tokens_per_s"]),
            "merged_share": r["token_fate"]["shares"]["merged"],
            "total_s": round(time.monotonic() - t0, 1)}


def summarize(rows: list[dict[str, Any]], m: int, config: str, steps: int,
              deterministic: bool) -> dict[str, Any]:
    """The bench's result from its runs: each run's loss over the mean of the all-JAX runs of
    its seed (``loss_vs_jax``), whether it lies inside their range (``within_jax_spread``),
    and per kind (0, M/2, M PyTorch learners) the mean and median of those ratios over seeds,
    with their min..max, and the mean tokens/s.

    Raises:
        SystemExit: a seed without an all-JAX run (nothing to compare it with).
    """
    seeds = sorted({r["seed"] for r in rows})
    jax = {seed: [r["final_val_loss"] for r in rows
                  if r["seed"] == seed and r["torch_learners"] == 0] for seed in seeds}
    if not all(jax.values()):
        raise SystemExit(f"seeds {[s for s, v in jax.items() if not v]} have no all-JAX run")
    base = {seed: statistics.mean(v) for seed, v in jax.items()}
    early_base = {r["seed"]: r["early_val_loss"] for r in rows if r["torch_learners"] == 0}
    spread = {str(seed): {"min": min(v), "max": max(v), "runs": len(v),
                          "spread": round((max(v) - min(v)) / statistics.mean(v), 5)}
              for seed, v in jax.items()}
    for r in rows:
        r["loss_vs_jax"] = round(r["final_val_loss"] / base[r["seed"]], 5)
        if r["early_val_loss"] and early_base[r["seed"]]:
            r["early_vs_jax"] = round(r["early_val_loss"] / early_base[r["seed"]], 6)
        lo, hi = spread[str(r["seed"])]["min"], spread[str(r["seed"])]["max"]
        r["within_jax_spread"] = lo <= r["final_val_loss"] <= hi
    summary = {}
    for k in sorted({r["torch_learners"] for r in rows}):
        ratios = [r["loss_vs_jax"] for r in rows if r["torch_learners"] == k]
        tps = [r["tokens_per_s"] for r in rows if r["torch_learners"] == k]
        summary[str(k)] = {"loss_vs_jax_mean": round(statistics.mean(ratios), 5),
                           "loss_vs_jax_median": round(statistics.median(ratios), 5),
                           "loss_vs_jax_min": min(ratios), "loss_vs_jax_max": max(ratios),
                           "loss_vs_jax_max_dev": round(max(abs(x - 1) for x in ratios), 5),
                           "runs": len(ratios),
                           "tokens_per_s_mean": round(statistics.mean(tps))}
    return {"bench": "frameworks", "config": config, "steps": steps, "jax_spread": spread,
            "learners": m, "deterministic": deterministic, "runs": rows, "summary": summary}


def print_table(result: dict[str, Any]) -> None:
    """The runs, the all-JAX spread per seed and the ratios per kind, on stdout."""
    m = result["learners"]
    print(f"\n{'PyTorch learners':>17} {'seed':>4} {'early loss':>10} {'vs JAX':>8} "
          f"{'final loss':>10} {'vs JAX':>7} {'wall s':>7} {'tokens/s':>9} {'merged':>7}")
    for r in result["runs"]:
        print(f"{r['torch_learners']:>11} of {m:<3} {r['seed']:>4} "
              f"{r['early_val_loss'] or float('nan'):>10.4f} "
              f"{r.get('early_vs_jax', float('nan')):>8.5f} {r['final_val_loss']:>10.4f} "
              f"{r['loss_vs_jax']:>7.4f} {r['wall_s']:>7} {r['tokens_per_s']:>9} "
              f"{r['merged_share']:>7.4f}")
    if any(v["runs"] > 1 for v in result["jax_spread"].values()):
        print(f"all-JAX same-seed spread: {result['jax_spread']}")
    for k, v in result["summary"].items():
        print(f"{k} of {m} in PyTorch: loss / all-JAX median {v['loss_vs_jax_median']:.4f} "
              f"({v['loss_vs_jax_min']:.4f}..{v['loss_vs_jax_max']:.4f}, {v['runs']} runs), "
              f"{v['tokens_per_s_mean']:,} tokens/s")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "ci-tiny.yaml"))
    ap.add_argument("--steps", type=int, default=300, help="inner steps per learner")
    ap.add_argument("--seeds", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--learners", type=int, default=4, help="M")
    ap.add_argument("--timing", action="store_true",
                    help="wall-clock rounds instead of run.deterministic")
    ap.add_argument("--jax-repeats", type=int, default=1,
                    help="all-JAX runs per seed: with --timing, their spread is the same-seed "
                    "spread the other columns are judged against")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="K=V")
    ap.add_argument("--json", type=Path, default=None, help="also write the result here")
    ap.add_argument("--merge", type=Path, nargs="+", default=None, metavar="JSON",
                    help="run nothing: judge the runs of these earlier --json results together "
                    "(one bench per seed, say; they must share config, steps, M and mode)")
    args = ap.parse_args(argv)
    m = args.learners
    if args.merge:
        parts = [json.loads(p.read_text()) for p in args.merge]
        keys = {(p["config"], p["steps"], p["learners"], p["deterministic"]) for p in parts}
        if len(keys) != 1:
            raise SystemExit(f"--merge: the results differ in config, steps, M or mode: {keys}")
        config, steps, m, det = keys.pop()
        result = summarize([r for p in parts for r in p["runs"]], m, config, steps, det)
        print_table(result)
        print(json.dumps(result))
        if args.json is not None:
            args.json.write_text(json.dumps(result, indent=1) + "\n")
        return 0
    kinds = [0, m // 2, m]
    rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ddiloco-frameworks-") as tmp:
        for seed in args.seeds:
            for i, k in enumerate([0] * (args.jax_repeats - 1) + kinds):
                row = one_run(Path(tmp) / f"s{seed}-t{k}-{i}", args.config, args.steps, seed,
                              m, k, not args.timing, args.sets)
                rows.append(row)
                print(f"  seed {seed}, {k} of {m} learners in PyTorch: loss "
                      f"{row['final_val_loss']:.4f}, {row['wall_s']} s", file=sys.stderr,
                      flush=True)
    result = summarize(rows, m, args.config, args.steps, not args.timing)
    print_table(result)
    print(json.dumps(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
