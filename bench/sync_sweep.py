"""Synchronous DiLoCo in one process: the ladder's rung 3, computed exactly, to sweep it.

Rung 3 of the ablation ladder (docs/QUALITY.md) is synchronous DiLoCo: P = 1, tau = 0, fp32 both
ways, IID shards, every learner in every round (``sync.blocking = true``, K = M). Nothing in it
depends on timing, so its arithmetic can be done without processes, sockets or a store: M
learners take H inner steps each from the same global model, their outer gradients
``Delta_m = Theta - theta_m`` are merged and one outer step gives the next global model
(DESIGN §2; DiLoCo, arXiv 2311.08105, Algorithm 1). This script does exactly that, with the
run's own parts: the task (:func:`ddiloco.workers.task.loader.build_task`: the same model,
initial values, data shards, batch order and inner AdamW schedule), the shard's merge rules
(:func:`ddiloco.workers.syncer.merge.merge_fragment`: RDA or the average, embeddings averaged)
and its outer optimizer (:class:`ddiloco.workers.syncer.merge.OuterOptimizer`: optax's
Nesterov; SGD at momentum 0). The data-parallel baseline (rung 1) is computed the same way: one
model, the M learners' batches as one global batch, AdamW at ``train.dp_lr``.

What it leaves out, all of which is idle on rung 3: codecs (fp32 is exact), the update guard
(it refuses only non-finite or far-out-of-range updates), token weights (equal in a
synchronous round), rejoins and faults. ``--check`` compares it with real ``ddiloco run``
results of rung 3 (bench/results or a quality.json).

Many runs share one compiled step: the runs of a group (same H, inner lr and model) are stacked
along one axis of R x M learner copies, vmapped, and H inner steps run in one ``lax.scan`` per
dispatch; only the outer step is on the host. On a GPU a whole grid takes minutes.

Usage::

    python bench/sync_sweep.py --grid issue36 --seeds 0,1,2 --json OUT.json --plot OUT.png
    python bench/sync_sweep.py --cells rda:sgd:1.0 --H 24 --seeds 0,1      # rung 3 as in the ladder
    python bench/sync_sweep.py --cells average:nesterov:0.6 --H 12 --lr-scale 0.7,1,1.4
    python bench/sync_sweep.py --from-best OUT.json --lr-scale 0.7,1.4 --seeds 0,1,2
    python bench/sync_sweep.py --set model.d_model=256 --cells average:nesterov:0.6 --H 12

A cell is ``MERGE:STEP:LR`` with MERGE ``rda`` or ``average`` and STEP ``sgd`` (momentum 0) or
``nesterov`` (momentum ``--momentum``, 0.9). Prints, per group, progress; then a table of final
validation losses per cell (median and min..max over seeds) and their ratio to DP of the same
seed (median and min..max), and one JSON line. Memory: R x M copies of the parameters and
AdamW state (16 bytes per parameter each) plus activations.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
import time
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]

#: The ladder's rung 3 on top of the base configuration (docs/QUALITY.md, "The ablation ladder").
RUNG3 = ("sync.fragments=1", "sync.tau=0", "sync.codec_up=fp32", "sync.codec_down=fp32",
         "data.iid=true")

#: The grid of issue "loss parity, part 3", item 1: (merge, step, outer lr).
GRIDS: dict[str, list[tuple[str, str, float]]] = {
    "issue36": ([("average", "nesterov", lr) for lr in (0.2, 0.4, 0.6, 0.8)]
                + [("average", "sgd", lr) for lr in (1.0, 1.4, 2.0)]
                + [("rda", "nesterov", lr) for lr in (0.2, 0.4)]
                + [("rda", "sgd", 1.0)]),
}


@dataclass(frozen=True)
class Cell:
    """One outer-step setting of a synchronous run (all of one group's runs share H and lr).

    Attributes:
        merge: ``rda`` or ``average`` (``sync.merge``).
        step: ``sgd`` (momentum 0) or ``nesterov``.
        outer_lr: the outer learning rate (``sync.outer_lr``).
        momentum: the outer momentum for ``nesterov`` (``sync.outer_momentum``), else 0.
    """

    merge: str
    step: str
    outer_lr: float
    momentum: float = 0.0

    @property
    def name(self) -> str:
        """``merge:step:lr`` as on the command line."""
        return f"{self.merge}:{self.step}:{self.outer_lr:g}"


@dataclass
class RunResult:
    """One simulated run (DiLoCo cell or DP) of one seed.

    Attributes:
        kind: ``diloco`` or ``dp``.
        cell: the cell's name (``dp`` for the baseline).
        H, lr_scale, seed: the group's H, the inner lr multiplier and the seed.
        final_loss: validation loss of the final global model (nats/byte for the built-in GPT).
        curve: ``[tokens, loss]`` pairs, global tokens (all learners) at each evaluation.
        outer_steps: outer steps applied.
    """

    kind: str
    cell: str
    H: int
    lr_scale: float
    seed: int
    final_loss: float
    curve: list[list[float]] = field(default_factory=list)
    outer_steps: int = 0


def parse_cells(text: str, momentum: float) -> list[Cell]:
    """Cells from ``MERGE:STEP:LR[,...]``.

    Raises:
        SystemExit: a malformed cell (the message names it).
    """
    cells = []
    for item in filter(None, (s.strip() for s in text.split(","))):
        parts = item.split(":")
        if len(parts) != 3 or parts[0] not in ("rda", "average") \
                or parts[1] not in ("sgd", "nesterov"):
            raise SystemExit(f"--cells: {item!r} is not MERGE:STEP:LR (MERGE rda|average, "
                             "STEP sgd|nesterov)")
        lr = float(parts[2])
        if not lr > 0:
            raise SystemExit(f"--cells: {item!r}: the outer lr must be > 0")
        cells.append(Cell(parts[0], parts[1], lr, momentum if parts[1] == "nesterov" else 0.0))
    return cells


def build_config(seed: int, H: int, lr_scale: float, extra: Sequence[str]) -> Any:
    """The run's configuration for one seed of a group: defaults, rung 3, the group's H and
    inner lr (``train.lr`` x ``lr_scale``; ``train.dp_lr`` is left alone), ``--set`` items.

    Raises:
        ConfigError: an invalid ``--set`` item.
    """
    from ddiloco.workers.run.config import load_config

    base = load_config(None, list(extra))
    items = [*RUNG3, *extra, f"sync.H={H}", f"train.seed={seed}",
             f"train.lr={base.train.lr * lr_scale!r}"]
    return load_config(None, items)


class SeedData:
    """One seed's task, initial values, batches of every learner and evaluation batches.

    Attributes:
        task: the run's task (:func:`ddiloco.workers.task.loader.build_task`).
        init: initial values, ``{path: float32 array}``.
        batches: int32 ``[steps, M, B, L + 1]``, learner m's batch at each inner step.
        evals: the evaluator's batches (``task.eval_batches()``).
        cfg: the seed's configuration.
    """

    def __init__(self, cfg: Any) -> None:
        self.cfg = cfg
        from ddiloco.workers.task.api import DataShard, initial_values
        from ddiloco.workers.task.loader import build_task

        self.task = build_task(cfg)
        self.init = initial_values(self.task)
        M, steps = cfg.run.learners, cfg.train.steps
        streams = [self.task.batches(DataShard(index=m, count=M, start=0,
                                               seed=cfg.train.seed)) for m in range(M)]
        self.batches = np.stack([np.stack([next(s) for s in streams]) for _ in range(steps)])
        assert self.task.eval_batches is not None
        self.evals = list(self.task.eval_batches())


class Group:
    """R runs x C copies each (M learners, or one DP model), trained together.

    Every copy takes the same inner optimizer (one compiled step); copy ``r * C + c`` belongs to
    run r. ``step(k, batches)`` runs k inner steps of every copy in one dispatch.
    """

    def __init__(self, task: Any, optimizer: Any, copies: list[dict[str, np.ndarray]]) -> None:
        import jax
        import optax

        self.tree = task.tree()
        self.names = self.tree.names
        tree, tx, loss = self.tree, optimizer, task.loss

        def one_step(flat: dict[str, Any], state: Any, batch: Any) -> Any:
            value, grads = jax.value_and_grad(lambda f: loss(tree.unflatten(f), batch))(flat)
            params = tree.unflatten(flat)
            updates, state = tx.update(tree.unflatten(grads), state, params)
            return tree.flatten(optax.apply_updates(params, updates)), state, value

        vstep = jax.vmap(one_step)

        def chunk(flat: dict[str, Any], state: Any, batches: Any) -> Any:
            def body(carry: Any, b: Any) -> Any:
                f, s = carry
                f, s, value = vstep(f, s, b)
                return (f, s), value
            (flat, state), values = jax.lax.scan(body, (flat, state), batches)
            return flat, state, values

        self._chunk = jax.jit(chunk, donate_argnums=(0, 1))
        self.params = {n: jax.numpy.asarray(np.stack([c[n] for c in copies])) for n in self.names}
        self.state = jax.jit(jax.vmap(lambda f: tx.init(tree.unflatten(f))))(self.params)

        def eval_loss(flat: dict[str, Any], batch: Any) -> Any:
            return loss(tree.unflatten(flat), batch)

        self._eval = jax.jit(eval_loss)

    def step(self, batches: np.ndarray) -> None:
        """Inner steps: ``batches`` is ``[k, copies, ...]``, one batch per step and copy."""
        self.params, self.state, _ = self._chunk(self.params, self.state, batches)

    def host(self) -> dict[str, np.ndarray]:
        """Every copy's parameters as float32 host arrays ``{path: [copies, ...]}``."""
        return {n: np.asarray(v, np.float32) for n, v in self.params.items()}

    def evaluate(self, flat: dict[str, np.ndarray], batches: Iterable[Any]) -> float:
        """Mean loss of one model over the evaluation batches (the evaluator's number)."""
        values = [float(self._eval(flat, b)) for b in batches]
        return float(np.mean(values))


def outer_steps(values: dict[str, Any], locals_: dict[str, Any], momentum: dict[str, Any],
                lr: Any, mu: Any, rda: Any, embeddings: frozenset[str]) -> tuple[Any, Any]:
    """One synchronous round of R runs at once, on the device: merge each run's M outer
    gradients, then step its global model. The same arithmetic as the shard's
    :func:`ddiloco.workers.syncer.merge.merge_fragment` (equal token weights: a synchronous
    round) followed by :class:`ddiloco.workers.syncer.merge.OuterOptimizer` (optax's Nesterov:
    ``b <- mu b + g``, ``theta <- theta - lr (g + mu b)``; at ``mu = 0`` outer SGD);
    ``tests/test_sync_sweep.py`` checks it against them.

    Args:
        values: ``{path: [R, ...]}`` float32, each run's global model.
        locals_: ``{path: [R, M, ...]}`` float32, each run's learners after H inner steps.
        momentum: ``{path: [R, ...]}`` float32, each run's outer momentum (zeros at mu = 0).
        lr, mu: ``[R]`` float32, each run's outer lr and momentum.
        rda: ``[R]`` bool, RDA (else the average) on non-embedding tensors.
        embeddings: paths always averaged (paper: embeddings by weighted average).

    Returns:
        ``(values, momentum)`` after the round, same shapes.
    """
    import jax.numpy as jnp

    from ddiloco.workers.syncer.merge import NORM_FLOOR

    new_v, new_m = {}, {}
    for name, v in values.items():
        R = v.shape[0]
        deltas = v[:, None] - locals_[name]                          # [R, M, ...]
        axes = tuple(range(2, deltas.ndim))
        average = deltas.mean(axis=1)
        g = average
        if name not in embeddings:
            norms = jnp.sqrt((deltas * deltas).sum(axis=axes))       # [R, M]
            live = norms > NORM_FLOOR
            unit = jnp.where(live.reshape(*live.shape, *([1] * len(axes))),
                             deltas / jnp.where(live, norms, 1.0).reshape(
                                 *norms.shape, *([1] * len(axes))), 0.0)
            direction = unit.mean(axis=1)                            # [R, ...]
            dnorm = jnp.sqrt((direction * direction).sum(axis=tuple(range(1, direction.ndim))))
            radius = norms.mean(axis=1)
            scale = jnp.where(dnorm > NORM_FLOOR, radius / jnp.where(dnorm > 0, dnorm, 1.0), 0.0)
            rda_g = direction * scale.reshape(R, *([1] * (direction.ndim - 1)))
            use = (rda & (dnorm > NORM_FLOOR)).reshape(R, *([1] * (v.ndim - 1)))
            g = jnp.where(use, rda_g, average)
        shape = (R, *([1] * (v.ndim - 1)))
        b = mu.reshape(shape) * momentum[name] + g
        new_m[name] = b
        new_v[name] = v - lr.reshape(shape) * (g + mu.reshape(shape) * b)
    return new_v, new_m


def run_diloco_group(data: dict[int, SeedData], cells: list[Cell], H: int, lr_scale: float,
                     evals: int, log: Any) -> list[RunResult]:
    """Every cell x seed of one (H, inner lr) group, trained together.

    Args:
        data: the seeds' data, built with this group's configuration.
        cells: the outer steps.
        H: inner steps per round.
        lr_scale: the inner lr's multiplier (for the results only).
        evals: evaluations of the global model spread over the run (the last is the final).
        log: ``log(str)`` for progress.
    """
    import jax
    import jax.numpy as jnp

    from ddiloco.workers.task.model import optimizer_from_config

    seeds = sorted(data)
    first = data[seeds[0]]
    cfg = first.cfg
    M, steps = cfg.run.learners, cfg.train.steps
    runs = [(c, s) for c in cells for s in seeds]
    R = len(runs)
    copies = [data[s].init for (_, s) in runs for _ in range(M)]
    group = Group(first.task, optimizer_from_config(cfg.train), copies)
    names = group.names
    emb = frozenset(first.task.embedding_paths())
    lr = jnp.asarray([c.outer_lr for c, _ in runs], jnp.float32)
    mu = jnp.asarray([c.momentum for c, _ in runs], jnp.float32)
    rda = jnp.asarray([c.merge == "rda" for c, _ in runs])
    value = {n: jnp.asarray(np.stack([data[s].init[n] for (_, s) in runs])) for n in names}
    mom = {n: jnp.zeros_like(v) for n, v in value.items()}

    @jax.jit
    def round_end(params: dict[str, Any], value: dict[str, Any], mom: dict[str, Any]
                  ) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
        locs = {n: p.reshape(R, M, *p.shape[1:]) for n, p in params.items()}
        value, mom = outer_steps(value, locs, mom, lr, mu, rda, emb)
        params = {n: jnp.repeat(v, M, axis=0) for n, v in value.items()}
        return params, value, mom

    curves: dict[int, list[list[float]]] = {i: [] for i in range(R)}
    rounds = math.ceil(steps / H)
    eval_at = {round(rounds * (k + 1) / evals) for k in range(evals)}
    tokens_per_round_step = M * first.task.tokens_per_batch
    done, t0 = 0, time.monotonic()
    for r in range(1, rounds + 1):
        k = min(H, steps - done)
        batch = np.stack([np.concatenate([data[s].batches[done + j] for (_, s) in runs])
                          for j in range(k)])
        group.step(batch)
        done += k
        group.params, value, mom = round_end(group.params, value, mom)
        if r in eval_at:
            for i, (_, s) in enumerate(runs):
                loss = group.evaluate({n: value[n][i] for n in names}, data[s].evals)
                curves[i].append([float(done * tokens_per_round_step), loss])
            losses = [curves[i][-1][1] for i in range(R)]
            log(f"H={H} lr x{lr_scale:g}: round {r}/{rounds}, step {done}, "
                f"losses {min(losses):.4f}..{max(losses):.4f}, {time.monotonic() - t0:.0f} s")
    return [RunResult("diloco", c.name, H, lr_scale, s, curves[i][-1][1], curves[i], rounds)
            for i, (c, s) in enumerate(runs)]


def run_dp(data: dict[int, SeedData], evals: int, log: Any) -> list[RunResult]:
    """The data-parallel baseline of each seed: the M learners' batches as one global batch,
    AdamW at ``train.dp_lr`` (as ``ddiloco run --baseline dp``: the mean of M learners'
    gradients is the gradient of the mean loss over their batches)."""
    from ddiloco.workers.task.model import optimizer_from_config

    seeds = sorted(data)
    first = data[seeds[0]]
    cfg = first.cfg
    steps = cfg.train.steps
    group = Group(first.task, optimizer_from_config(cfg.train, dp=True),
                  [data[s].init for s in seeds])
    names = group.names
    curves: dict[int, list[list[float]]] = {s: [] for s in seeds}
    chunk = max(1, steps // evals)
    done, t0 = 0, time.monotonic()
    while done < steps:
        k = min(chunk, steps - done)
        # [k, seeds, M * B, L + 1]: learner m's rows follow learner m - 1's
        batch = np.stack([np.stack([data[s].batches[done + j].reshape(
            -1, data[s].batches.shape[-1]) for s in seeds]) for j in range(k)])
        group.step(batch)
        done += k
        host = group.host()
        for i, s in enumerate(seeds):
            flat = {n: host[n][i] for n in names}
            loss = group.evaluate(flat, data[s].evals)
            curves[s].append([float(done * cfg.run.learners * first.task.tokens_per_batch), loss])
        log(f"DP: step {done}/{steps}, losses "
            f"{', '.join(f'{curves[s][-1][1]:.4f}' for s in seeds)}, {time.monotonic() - t0:.0f} s")
    return [RunResult("dp", "dp", 0, 1.0, s, curves[s][-1][1], curves[s]) for s in seeds]


def load_data(seeds: Sequence[int], H: int, lr_scale: float, extra: Sequence[str]
              ) -> dict[int, SeedData]:
    """:class:`SeedData` of each seed under the group's configuration."""
    out = {}
    for s in seeds:
        out[s] = SeedData(build_config(s, H, lr_scale, extra))
    return out


def summarize(results: list[RunResult]) -> list[dict[str, Any]]:
    """Per (cell, H, lr_scale): final losses, their median and range, and the ratio to DP of
    the same seed (median and range), best first."""
    dp = {r.seed: r.final_loss for r in results if r.kind == "dp"}
    keys = sorted({(r.cell, r.H, r.lr_scale) for r in results if r.kind == "diloco"})
    rows = []
    for cell, H, lr_scale in keys:
        rs = sorted((r for r in results if (r.cell, r.H, r.lr_scale) == (cell, H, lr_scale)
                     and r.kind == "diloco"), key=lambda r: r.seed)
        losses = [r.final_loss for r in rs]
        ratios = [r.final_loss / dp[r.seed] for r in rs if r.seed in dp]
        row: dict[str, Any] = {
            "cell": cell, "H": H, "lr_scale": lr_scale, "seeds": [r.seed for r in rs],
            "losses": losses, "loss_median": statistics.median(losses),
            "ratios": ratios,
            "ratio_median": statistics.median(ratios) if ratios else None,
            "ratio_min": min(ratios) if ratios else None,
            "ratio_max": max(ratios) if ratios else None,
        }
        rows.append(row)
    rows.sort(key=lambda r: float(r["ratio_median"] if r["ratio_median"] is not None
                                  else r["loss_median"]))
    return rows


def print_table(rows: list[dict[str, Any]], dp: list[RunResult]) -> None:
    """The summary as a rich table, best first."""
    from rich.console import Console
    from rich.table import Table

    table = Table(title="synchronous DiLoCo (rung 3), final validation loss; ratio to DP of "
                        "the same seed")
    for col in ("cell", "H", "inner lr x", "loss median (min..max)", "ratio median (min..max)"):
        table.add_column(col)
    for r in rows:
        ls = r["losses"]
        ratio = ("-" if r["ratio_median"] is None else
                 f"{r['ratio_median']:.4f} ({r['ratio_min']:.4f}..{r['ratio_max']:.4f})")
        table.add_row(r["cell"], str(r["H"]), f"{r['lr_scale']:g}",
                      f"{statistics.median(ls):.4f} ({min(ls):.4f}..{max(ls):.4f})", ratio)
    for d in dp:
        table.add_row("dp", "-", "-", f"{d.final_loss:.4f} (seed {d.seed})", "1")
    Console(width=130).print(table)


def plot(rows: list[dict[str, Any]], results: list[RunResult], path: Path) -> None:
    """Left: ratio to DP against the outer lr per (merge, step, H); right: the best cell's and
    DP's loss against tokens (seed 0 or the first seed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(13, 5))
    series: dict[tuple[str, str, int, float], list[tuple[float, float]]] = {}
    for r in rows:
        if r["ratio_median"] is None:
            continue
        merge, step, lr = r["cell"].split(":")
        series.setdefault((merge, step, r["H"], r["lr_scale"]), []).append(
            (float(lr), r["ratio_median"]))
    colors = {6: "tab:green", 12: "tab:blue", 24: "tab:red", 48: "tab:purple"}
    for (merge, step, H, scale), pts in sorted(series.items()):
        pts.sort()
        label = f"{merge} {step} H={H}" + (f" lr x{scale:g}" if scale != 1 else "")
        # colour: H; line: the outer step (SGD solid); marker: the merge (RDA circles)
        ax1.plot([p[0] for p in pts], [p[1] for p in pts], color=colors.get(H, "black"),
                 linestyle="-" if step == "sgd" else "--",
                 marker="o" if merge == "rda" else "s", label=label)
    ax1.axhline(1.0, color="grey", lw=0.8)
    ax1.set_xlabel("outer lr")
    ax1.set_ylabel("final loss / DP (median over seeds)")
    ax1.legend(fontsize=7)
    if rows:
        best = rows[0]
        seed = best["seeds"][0]
        for run in results:
            if run.seed == seed and ((run.kind == "dp") or (run.cell, run.H, run.lr_scale) ==
                                     (best["cell"], best["H"], best["lr_scale"])):
                xs, ys = zip(*run.curve, strict=True)
                ax2.plot(xs, ys, marker=".",
                         label=f"{run.cell} H={run.H}" if run.kind == "diloco" else "DP")
        ax2.set_xlabel("global tokens")
        ax2.set_ylabel(f"validation loss (seed {seed})")
        ax2.set_yscale("log")
        ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def check(rows: list[dict[str, Any]], results: list[RunResult], reference: Path) -> list[str]:
    """Compare with real runs: ``reference`` is a JSON list of ``{"cell", "H", "seed",
    "final_loss"}`` (real ``ddiloco run`` results of the same settings). Returns lines
    ``cell H seed: simulated vs real (relative difference)``."""
    real = json.loads(reference.read_text())
    lines = []
    for ref in real:
        for r in results:
            if (r.cell, r.H, r.seed) == (ref["cell"], ref["H"], ref["seed"]) \
                    or (r.kind == "dp" and ref["cell"] == "dp" and r.seed == ref["seed"]):
                lines.append(f"{ref['cell']} H={ref['H']} seed {ref['seed']}: simulated "
                             f"{r.final_loss:.4f}, real {ref['final_loss']:.4f} "
                             f"({(r.final_loss / ref['final_loss'] - 1) * 100:+.2f} %)")
    return lines


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--grid", choices=sorted(GRIDS), help="a named grid of cells")
    ap.add_argument("--cells", default="", help="MERGE:STEP:LR[,...] (added to --grid)")
    ap.add_argument("--momentum", type=float, default=0.9, help="nesterov cells' momentum")
    ap.add_argument("--H", default="24", help="comma list of H (inner steps per round)")
    ap.add_argument("--lr-scale", default="1", help="comma list of inner lr multipliers")
    ap.add_argument("--seeds", default="0", help="comma list of seeds")
    ap.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                    help="a configuration override for every run (model size, steps, ...)")
    ap.add_argument("--evals", type=int, default=10, help="evaluations per run")
    ap.add_argument("--no-dp", action="store_true", help="leave the DP baseline out")
    ap.add_argument("--json", type=Path, help="write every run and the summary here")
    ap.add_argument("--plot", type=Path, help="write the plot here (png)")
    ap.add_argument("--check", type=Path, help="real runs to compare with (see check())")
    ap.add_argument("--from-best", type=Path, metavar="JSON",
                    help="take the cell and H of the best row of an earlier --json (for an "
                         "inner-lr sweep at the winner); --grid, --cells and --H are ignored")
    ap.add_argument("--replot", type=Path, metavar="JSON",
                    help="print the table and write --plot from an earlier --json; runs nothing")
    args = ap.parse_args(argv)
    if args.replot:
        runs = [RunResult(**r) for r in json.loads(args.replot.read_text())["runs"]]
        rows = summarize(runs)
        print_table(rows, [r for r in runs if r.kind == "dp"])
        if args.plot:
            plot(rows, runs, args.plot)
        return 0
    if args.from_best:
        best = json.loads(args.from_best.read_text())["rows"][0]
        args.grid, args.cells, args.H = None, best["cell"], str(best["H"])
    cells = [Cell(m, s, lr, args.momentum if s == "nesterov" else 0.0)
             for m, s, lr in GRIDS.get(args.grid or "", [])]
    cells += [c for c in parse_cells(args.cells, args.momentum) if c not in cells]
    if not cells:
        raise SystemExit("no cells: give --grid or --cells")
    seeds = [int(s) for s in args.seeds.split(",")]
    Hs = [int(h) for h in args.H.split(",")]
    scales = [float(x) for x in args.lr_scale.split(",")]

    def log(msg: str) -> None:
        print(f"[sync_sweep {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)

    import jax

    log(f"{len(cells)} cells x H {Hs} x inner lr x{scales} x seeds {seeds} on "
        f"{jax.devices()[0].platform}")
    t0 = time.monotonic()
    results: list[RunResult] = []
    if not args.no_dp:
        results += run_dp(load_data(seeds, Hs[0], 1.0, args.set), args.evals, log)
    for H in Hs:
        for scale in scales:
            data = load_data(seeds, H, scale, args.set)
            results += run_diloco_group(data, cells, H, scale, args.evals, log)
            if args.json:  # what is done so far, should a later group not finish
                args.json.parent.mkdir(parents=True, exist_ok=True)
                args.json.write_text(json.dumps({"partial": True,
                                                 "rows": summarize(results),
                                                 "runs": [asdict(r) for r in results]}))
    rows = summarize(results)
    cfg = build_config(seeds[0], Hs[0], 1.0, args.set)
    from ddiloco.workers.task.model import param_count

    params = param_count(cfg.model_config_obj()) if cfg.model.task is None else None
    print_table(rows, [r for r in results if r.kind == "dp"])
    wall = time.monotonic() - t0
    summary = {"bench": "sync_sweep", "device": jax.devices()[0].platform,
               "params": params, "learners": cfg.run.learners, "steps": cfg.train.steps,
               "overrides": args.set, "wall_s": round(wall, 1), "rows": rows}
    if args.check:
        for line in check(rows, results, args.check):
            print(line)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({**summary, "runs": [asdict(r) for r in results]},
                                        indent=1))
    if args.plot:
        plot(rows, results, args.plot)
    print(json.dumps({k: v for k, v in summary.items() if k != "rows"}
                     | {"best": rows[0] if rows else None}))
    return 0


if __name__ == "__main__":
    sys.exit(main())
