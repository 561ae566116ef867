"""What the system costs a learner: the pure inner-step ceiling against whole runs, part by part.

For each config, in one bench run (these VMs change speed from day to day: only same-run ratios
mean anything):

1. **ceiling**: the learner model's pure inner step, M single-thread processes at once
   (``bench/step.py --procs M``: the jitted step and host batch sampling, nothing else), in
   tokens per second of wall clock;
2. **run**: the whole ``ddiloco run --no-live`` on the same model, batch, sequence, M and
   token budget; tokens per second of the run's wall clock (the report's ``tokens_per_s``:
   from the start to the last learner's exit, start-up and compilation included) and of the
   learners' own rates (the sum of the report's ``per_learner`` ``tokens_per_s``), and the
   steady state (:func:`steady_tokens_per_s`: each learner's tokens per step over its mean
   step time after its first 20 steps). The ceiling less the steady state is what the system
   costs a learner while it trains; the steady state less the whole run is start-up (processes,
   imports, compilation, the first steps), the drain and the learners' uneven finish;
3. **parts**: the same run with one part changed at a time, so its cost is a measured share:
   ``evaluator-after`` (``run.evaluator=after``: nothing evaluates during training),
   ``evaluator-5s`` (the evaluator every 5 s at full priority, as before the token cadence:
   ``run.eval_every_tokens=0``, ``run.eval_nice=0``), ``no-curve`` (``--insecure``: plain TCP
   instead of CURVE), ``live`` (the terminal's live view on, as ``make run`` has it),
   ``fork-server`` (``run.fork_server=false``: every worker a process of its own),
   ``warm-cache`` (the base run again in its folder, on the compilation cache it filled: a
   run in a fresh folder compiles, one in a folder that has run before loads).

A part's share is ``(rate without it - rate with it) / ceiling``: positive when it costs the
learners. Configs: ``default`` (the defaults: tiny model, batch 32, seq 64, M = 4, 600 steps) and
``seq128`` (batch 16, seq 128, M = 4, H = 24, 378 steps: 3.10M tokens).

Usage::

    python bench/overhead.py [--configs default,seq128] [--parts all] [--json PATH]
    python bench/overhead.py --configs seq128 --parts evaluator-after --steps 120   # quick

Prints a table per config and one JSON line; ``--json`` writes ``{"configs": [{"name",
"ceiling_tokens_per_s", "run_tokens_per_s", "ratio", "parts": {...}}]}``. Each run takes
its budget's time (about 3 minutes per run on 2 cores at the defaults): 5 runs per config.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


@dataclass(frozen=True)
class BenchConfig:
    """One measured configuration: ``ddiloco run`` overrides and the matching step bench."""

    name: str
    batch: int
    seq: int
    learners: int
    steps: int
    sets: tuple[str, ...] = ()

    def run_sets(self, steps: int | None) -> list[str]:
        """The run's ``--set`` items."""
        return [f"train.batch_size={self.batch}", f"model.seq_len={self.seq}",
                f"run.learners={self.learners}", f"train.steps={steps or self.steps}",
                *self.sets]


CONFIGS = {
    "default": BenchConfig("default", 32, 64, 4, 600),
    "seq128": BenchConfig("seq128", 16, 128, 4, 378, ("sync.H=24",)),
}

#: part -> (extra ``ddiloco run`` arguments, whether the part is *on* in the variant)
PARTS: dict[str, tuple[list[str], bool]] = {
    "evaluator-after": (["--set", "run.evaluator=after"], False),
    "evaluator-5s": (["--set", "run.eval_every_tokens=0", "--set", "run.eval_nice=0",
                      "--set", "run.eval_every_s=5"], True),
    "no-curve": (["--insecure"], False),
    "live": (["--live"], True),
    # off in the variant (on by default): a negative share is what forking the workers from
    # one process that has imported their modules saves
    "fork-server": (["--set", "run.fork_server=false"], False),
    # the base run again in its own folder, whose compilation cache (out/diloco/jax_cache,
    # kept by --force) the base run filled, as a second `make run` in one --out folder: its
    # share is what compiling costs a run in a fresh folder
    "warm-cache": ([], False),
}
#: parts that run in the base run's folder instead of their own
SAME_FOLDER = {"warm-cache"}


@dataclass
class Measured:
    """One config's figures (tokens per second of wall clock)."""

    name: str
    ceiling_tokens_per_s: float
    run_tokens_per_s: float
    run_learner_tokens_per_s: float
    wall_s: float
    steady_tokens_per_s: float = float("nan")
    parts: dict[str, dict[str, float]] = field(default_factory=dict)

    @property
    def ratio(self) -> float:
        """The whole run's rate over the ceiling."""
        return self.run_tokens_per_s / self.ceiling_tokens_per_s


def ceiling(cfg: BenchConfig) -> float:
    """The pure inner step's tokens/s, M single-thread processes (``bench/step.py``)."""
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "step.py"), "--configs",
         f"{cfg.batch}x{cfg.seq}", "--procs", str(cfg.learners), "--no-single", "--steps", "80"],
        capture_output=True, text=True, check=True, cwd=ROOT)
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    return float(max(r["tokens_per_s"] for r in out["results"] if r["mode"] == "procs"))


def steady_tokens_per_s(block: dict[str, Any]) -> float:
    """The learners' steady-state rate in a run's report block (tokens per second): per
    learner, the run's tokens per inner step (``tokens / (learners * steps)``: a run without
    kills) over its ``step_time_mean_s`` (the mean step time after its first 20 steps:
    compilation and first adoptions left out), summed. NaN when a learner has no mean.

    >>> steady_tokens_per_s({"tokens": 800, "learners": 2, "steps": 100, "per_learner": {
    ...     "learner-0": {"step_time_mean_s": 0.5}, "learner-1": {"step_time_mean_s": 0.25}}})
    24.0
    """
    per_step = block["tokens"] / (block["learners"] * block["steps"])
    means = [v.get("step_time_mean_s") for v in (block.get("per_learner") or {}).values()]
    if not means or any(not m for m in means):
        return float("nan")
    return float(sum(per_step / m for m in means))


def run_once(cfg: BenchConfig, extra: list[str], steps: int | None, out: Path
             ) -> dict[str, float]:
    """One ``ddiloco run``: its wall-clock and steady-state rates, from the report."""
    argv = [sys.executable, "-m", "ddiloco.cli", "run", "--out", str(out), "--force"]
    if "--live" not in extra:
        argv.append("--no-live")
    for item in cfg.run_sets(steps):
        argv += ["--set", item]
    argv += extra
    proc = subprocess.run(argv, capture_output=True, text=True, cwd=ROOT)
    if proc.returncode != 0:
        raise RuntimeError(f"ddiloco run failed ({' '.join(extra) or 'base'}):\n"
                           + proc.stderr[-2000:])
    block = json.loads((out / "report.json").read_text())["diloco"]
    per = {k: v["tokens_per_s"] for k, v in (block.get("per_learner") or {}).items()
           if v.get("tokens_per_s")}
    block.setdefault("steps", cfg.steps if steps is None else steps)
    return {"tokens_per_s": float(block["tokens_per_s"]),
            "learner_tokens_per_s": float(sum(per.values())) if per else float("nan"),
            "steady_tokens_per_s": steady_tokens_per_s(block),
            "wall_s": float(block["wall_s"]),
            "evaluator_cpu_s": float((block.get("evaluator") or {}).get("cpu_s", 0.0))}


def measure(cfg: BenchConfig, parts: list[str], steps: int | None, work: Path,
            log: Any) -> Measured:
    """The ceiling, the base run and one run per part."""
    top = ceiling(cfg)
    log(f"{cfg.name}: ceiling {top:,.0f} tokens/s")
    base = run_once(cfg, [], steps, work / f"{cfg.name}-base")
    log(f"{cfg.name}: run {base['tokens_per_s']:,.0f} tokens/s ({base['wall_s']:.0f} s), "
        f"{base['tokens_per_s'] / top:.3f}x the ceiling")
    m = Measured(cfg.name, top, base["tokens_per_s"], base["learner_tokens_per_s"],
                 base["wall_s"], base["steady_tokens_per_s"])
    log(f"{cfg.name}: steady state {m.steady_tokens_per_s:,.0f} tokens/s, "
        f"{m.steady_tokens_per_s / top:.3f}x the ceiling")
    for part in parts:
        extra, on = PARTS[part]
        folder = work / f"{cfg.name}-{'base' if part in SAME_FOLDER else part}"
        r = run_once(cfg, extra, steps, folder)
        with_rate, without = ((r["tokens_per_s"], base["tokens_per_s"]) if on
                              else (base["tokens_per_s"], r["tokens_per_s"]))
        m.parts[part] = {"tokens_per_s": r["tokens_per_s"], "wall_s": r["wall_s"],
                         "ratio": r["tokens_per_s"] / top,
                         "share": (without - with_rate) / top,
                         "evaluator_cpu_s": r["evaluator_cpu_s"]}
        log(f"{cfg.name}: {part}: {r['tokens_per_s']:,.0f} tokens/s, "
            f"{r['tokens_per_s'] / top:.3f}x, share {m.parts[part]['share']:+.3f}")
    return m


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=(__doc__ or "").splitlines()[0])
    ap.add_argument("--configs", default="default,seq128",
                    help=f"comma list of {', '.join(CONFIGS)}")
    ap.add_argument("--parts", default="all", help=f"comma list of {', '.join(PARTS)}, or all")
    ap.add_argument("--steps", type=int, default=None, help="train.steps of every run "
                    "(default: each config's)")
    ap.add_argument("--json", type=Path, help="write the figures here")
    ap.add_argument("--work", type=Path, default=None, help="run folders (default: a temp dir)")
    args = ap.parse_args(argv)
    names = [c for c in args.configs.split(",") if c]
    parts = list(PARTS) if args.parts == "all" else [p for p in args.parts.split(",") if p]
    for bad in [c for c in names if c not in CONFIGS] + [p for p in parts if p not in PARTS]:
        raise SystemExit(f"unknown config or part {bad!r}: configs {list(CONFIGS)}, "
                         f"parts {list(PARTS)}")

    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)

    def log(msg: str) -> None:
        console.log(msg)

    results = []
    with tempfile.TemporaryDirectory(prefix="ddiloco-overhead-") as tmp:
        work = args.work or Path(tmp)
        t0 = time.monotonic()
        for name in names:
            results.append(measure(CONFIGS[name], parts, args.steps, work, log))
        elapsed = time.monotonic() - t0
    for m in results:
        table = Table(title=f"{m.name}: tokens/s against the pure inner-step ceiling")
        for col in ("what", "tokens/s", "x ceiling", "share of the ceiling"):
            table.add_column(col, justify="right")
        table.add_row("ceiling (pure inner step)", f"{m.ceiling_tokens_per_s:,.0f}", "1", "-")
        steady = m.steady_tokens_per_s / m.ceiling_tokens_per_s
        table.add_row("the run's steady state", f"{m.steady_tokens_per_s:,.0f}",
                      f"{steady:.3f}", f"{1 - steady:.3f} (the system while learners train)")
        table.add_row("run", f"{m.run_tokens_per_s:,.0f}", f"{m.ratio:.3f}",
                      f"{1 - m.ratio:.3f} (all of the system; start-up, drain and the "
                      f"uneven finish {steady - m.ratio:.3f})")
        for part, r in m.parts.items():
            table.add_row(part, f"{r['tokens_per_s']:,.0f}", f"{r['ratio']:.3f}",
                          f"{r['share']:+.3f}")
        Console().print(table)
    doc = {"bench": "overhead", "elapsed_s": round(elapsed, 1), "configs": [
        {"name": m.name, "ceiling_tokens_per_s": round(m.ceiling_tokens_per_s, 1),
         "run_tokens_per_s": round(m.run_tokens_per_s, 1),
         "run_learner_tokens_per_s": round(m.run_learner_tokens_per_s, 1),
         "steady_tokens_per_s": round(m.steady_tokens_per_s, 1),
         "steady_ratio": round(m.steady_tokens_per_s / m.ceiling_tokens_per_s, 4),
         "ratio": round(m.ratio, 4), "wall_s": m.wall_s,
         "parts": {k: {kk: round(vv, 4) for kk, vv in v.items()} for k, v in m.parts.items()}}
        for m in results]}
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(doc, indent=1))
    print(json.dumps(doc))
    return 0


if __name__ == "__main__":
    sys.exit(main())
