"""Heterogeneous learners: how the quorum and the grace window handle a slow learner.

Decoupled DiLoCo with M learners, one (or more) of them slowed by a speed factor
(``train.speed``: each of its inner steps is padded to 1 / factor of its compute time), under
four syncer policies, each a fixed-length run with no faults:

* ``K=1, no grace``: a fragment merges as soon as one delta arrives;
* ``K=1, grace``: the adaptive grace window waits a little for the others (DESIGN §2);
* ``K=1, grace >= H steps``: the window waits at least 24 step times (``sync.grace_steps``,
  under a cap of 30 s) for every live learner;
* ``K=M``: a fragment merges only when every learner's delta has arrived.

Learners are held to an equal CPU share (cgroup quota, as ``chaos run --isolate``) so that the
speed factor is the only difference between them. Prints a table of goodput, merged tokens/s,
final validation loss and mean participation per merge, writes ``OUT/hetero.json`` and
``OUT/hetero.png``, and one JSON line.

    python bench/hetero.py [--duration 120] [--speed learner-3=0.33] [--set k=v ...]
                           [--topology FILE] [--out bench-out/hetero]
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ddiloco.chaos.runner import run_chaos
from ddiloco.workers.run.config import load_config


def _variants(m: int) -> list[tuple[str, list[str]]]:
    return [
        ("K=1, no grace", ["sync.min_quorum=1", "sync.grace=false"]),
        ("K=1, grace", ["sync.min_quorum=1", "sync.grace=true"]),
        ("K=1, grace >= H steps", ["sync.min_quorum=1", "sync.grace=true", "sync.grace_steps=24",
                                   "sync.grace_cap_s=30"]),
        (f"K=M={m}", [f"sync.min_quorum={m}", "sync.grace=false"]),
    ]


def _participation(block: dict[str, Any]) -> float | None:
    mean = block["participation"]["mean"]
    return float(mean) if mean is not None else None


def _plot(rows: list[dict[str, Any]], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4))
    for row in rows:
        curve = row["val_loss"]
        if curve:
            ax1.plot([t for t, _ in curve], [v for _, v in curve], label=row["variant"])
    ax1.set_xlabel("seconds")
    ax1.set_ylabel("validation loss (nats/byte)")
    ax1.legend()
    ax2.bar([r["variant"] for r in rows], [r["tokens_per_s"] or 0 for r in rows])
    ax2.set_ylabel("merged tokens/s")
    fig.suptitle(title)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--config", type=Path, default=None)
    ap.add_argument("--duration", type=float, default=120.0, help="seconds per run")
    ap.add_argument("--speed", action="append", default=[],
                    help="LEARNER=FACTOR, repeated (default learner-<M-1>=0.33)")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--topology", type=Path, default=None, help="run in emulated regions")
    ap.add_argument("--out", type=Path, default=Path("bench-out/hetero"))
    ap.add_argument("--no-live", action="store_true")
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    base = load_config(args.config, args.overrides)
    m = base.run.learners
    pairs = [item.split("=", 1) for item in args.speed] or [[f"learner-{m - 1}", "0.33"]]
    speeds = {name: float(factor) for name, factor in pairs}
    speed_set = f"train.speed={json.dumps(speeds)}"
    args.out.mkdir(parents=True, exist_ok=True)
    script = args.out / "no-faults.yaml"
    script.write_text(f"name: no-faults\nduration_s: {args.duration}\nfaults: []\n")
    rows: list[dict[str, Any]] = []
    for i, (label, sets) in enumerate(_variants(m)):
        cfg = load_config(args.config, [*args.overrides, speed_set, *sets])
        report = run_chaos(cfg, script, args.out / f"v{i}", live=not args.no_live,
                           isolate=True, regions=args.topology, force=True)
        d = report["modes"]["diloco"]
        rows.append({"variant": label, "goodput": d["goodput"],
                     "tokens_per_s": d["tokens_per_s"], "final_val_loss": d["final_val_loss"],
                     "participation": _participation(d), "token_fate": d["token_fate"],
                     "val_loss": d["val_loss"]})
    result = {"learners": m, "speed": speeds, "duration_s": args.duration,
              "topology": str(args.topology) if args.topology else None, "variants": rows}
    (args.out / "hetero.json").write_text(json.dumps(result, indent=2))
    title = f"M={m}, speed {speeds}, {args.duration:g} s per run"
    _plot(rows, args.out / "hetero.png", title)
    table = Table(title=title)
    for col in ("variant", "goodput", "merged tokens/s", "final val loss", "learners/merge"):
        table.add_column(col, justify="left" if col == "variant" else "right")
    for r in rows:
        table.add_row(r["variant"], f"{r['goodput']:.1%}" if r["goodput"] is not None else "-",
                      f"{r['tokens_per_s']:,.0f}", f"{r['final_val_loss']:.3f}",
                      f"{r['participation']:.2f}" if r["participation"] is not None else "-")
    Console().print(table)
    print(json.dumps({"bench": "hetero", "speed": speeds, "variants": [
        {k: r[k] for k in ("variant", "goodput", "tokens_per_s", "final_val_loss",
                           "participation")} for r in rows]}))


if __name__ == "__main__":
    main()
