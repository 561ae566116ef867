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
    args = ap.parse_args(argv)
    m = args.learners
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
    jax = {seed: [r["final_val_loss"] for r in rows
                  if r["seed"] == seed and r["torch_learners"] == 0] for seed in args.seeds}
    base = {seed: statistics.mean(v) for seed, v in jax.items()}
    early_base = {r["seed"]: r["early_val_loss"] for r in rows if r["torch_learners"] == 0}
    for r in rows:
        r["loss_vs_jax"] = round(r["final_val_loss"] / base[r["seed"]], 5)
        if r["early_val_loss"] and early_base[r["seed"]]:
            r["early_vs_jax"] = round(r["early_val_loss"] / early_base[r["seed"]], 6)
    print(f"\n{'PyTorch learners':>17} {'seed':>4} {'early loss':>10} {'vs JAX':>8} "
          f"{'final loss':>10} {'vs JAX':>7} {'wall s':>7} {'tokens/s':>9} {'merged':>7}")
    for r in rows:
        print(f"{r['torch_learners']:>11} of {m:<3} {r['seed']:>4} "
              f"{r['early_val_loss'] or float('nan'):>10.4f} "
              f"{r.get('early_vs_jax', float('nan')):>8.5f} {r['final_val_loss']:>10.4f} "
              f"{r['loss_vs_jax']:>7.4f} {r['wall_s']:>7} {r['tokens_per_s']:>9} "
              f"{r['merged_share']:>7.4f}")
    summary = {}
    for k in kinds:
        ratios = [r["loss_vs_jax"] for r in rows if r["torch_learners"] == k]
        tps = [r["tokens_per_s"] for r in rows if r["torch_learners"] == k]
        summary[str(k)] = {"loss_vs_jax_mean": round(statistics.mean(ratios), 5),
                           "loss_vs_jax_max_dev": round(max(abs(x - 1) for x in ratios), 5),
                           "tokens_per_s_mean": round(statistics.mean(tps))}
    spread = {str(seed): {"min": min(v), "max": max(v),
                          "spread": round((max(v) - min(v)) / statistics.mean(v), 5)}
              for seed, v in jax.items()}
    for r in rows:
        lo, hi = spread[str(r["seed"])]["min"], spread[str(r["seed"])]["max"]
        r["within_jax_spread"] = lo <= r["final_val_loss"] <= hi
    if args.jax_repeats > 1:
        print(f"all-JAX same-seed spread: {spread}")
    result = {"bench": "frameworks", "config": args.config, "steps": args.steps,
              "jax_spread": spread,
              "learners": m, "deterministic": not args.timing, "runs": rows,
              "summary": summary}
    print(json.dumps(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
