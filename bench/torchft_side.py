"""ddiloco's PyTorch learners and torchft's DiLoCo on one config, side by side in one run.

Both train the built-in GPT's PyTorch twin (:mod:`ddiloco.workers.task.torch_gpt`) from the
same initial values on the same data split (learner/replica ``m`` reads shard ``m`` of M), with
the same batch, AdamW, schedule and per-tensor clip, the same H and the same token budget, and
both are scored by the same loss on the same held-out batches. Then it prints wall time,
tokens/s, the final validation loss and the bytes each sent per trained token.

* **torchft** (``torchft`` from PyPI, its own Rust lighthouse): M replica processes, each a
  ``torchft.Manager`` with a Gloo process group and ``torchft.local_sgd.DiLoCo`` (every H inner
  steps a synchronous all-reduce of the fp32 outer gradients, then its outer optimizer: SGD
  with Nesterov momentum, ``--outer-lr``/``--outer-momentum``, the DiLoCo paper's 0.7/0.9).
  Its wire bytes are the ring all-reduce's, 2 (M - 1) / M x 4 bytes per parameter per
  replica per sync (Gloo keeps no counters). It evaluates after training.
* **ddiloco**: ``ddiloco run --set run.torch_learners=M`` (every learner a PyTorch one) with
  the run's own outer step and codecs; its evaluator runs during training, as in any run.
  ``--jax``: the same run with JAX learners (the model the twin is written after).
  ``--variant NAME:K=V[,K=V...]`` (repeatable) adds a ddiloco run with those settings on top
  (e.g. another codec, or the evaluator after the run), one row each, in the same bench run,
  so that every row has a ratio to the same torchft run.

    python bench/torchft_side.py [--config configs/ci-tiny.yaml] [--steps 300] [--learners 4]
                                 [--H 24] [--jax] [--set K=V ...] [--json PATH]
                                 [--ddiloco-first] [--variant NAME:K=V,K=V ...]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import subprocess
import sys
import tempfile
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def _config(args: argparse.Namespace) -> Any:
    from ddiloco.workers.run.config import load_config

    return load_config(args.config, _overrides(args))


def _overrides(args: argparse.Namespace, extra: tuple[str, ...] = ()) -> dict[str, Any]:
    from ddiloco.workers.run.config import parse_override

    out: dict[str, Any] = {"run.learners": args.learners, "train.steps": args.steps,
                           "sync.H": args.H,
                           "run.torch_learners": 0 if args.jax else args.learners}
    out.update(parse_override(kv) for kv in (*args.sets, *extra))
    return out


def parse_variant(text: str) -> tuple[str, tuple[str, ...]]:
    """``NAME:K=V[,K=V...]`` -> ``(NAME, ("K=V", ...))`` (``--variant``).

    >>> parse_variant("topk20:sync.codec_up=topk-d20-b4,sync.codec_down=topk-d20-b4")
    ('topk20', ('sync.codec_up=topk-d20-b4', 'sync.codec_down=topk-d20-b4'))

    Raises:
        argparse.ArgumentTypeError: no name, or a setting without ``=``.
    """
    name, sep, rest = text.partition(":")
    sets = tuple(kv.strip() for kv in rest.split(",") if kv.strip())
    if not sep or not name.strip() or not sets or any("=" not in kv for kv in sets):
        raise argparse.ArgumentTypeError(
            f"--variant {text!r}: expected NAME:K=V[,K=V...], e.g. "
            "evaluator-after:run.evaluator=after")
    return name.strip(), sets


def _replica(index: int, lighthouse: str, args: argparse.Namespace, out: Any) -> None:
    """One torchft replica: a Manager, Gloo, DiLoCo around the GPT twin; it reports its wall
    time and, for replica 0, the final model's validation loss."""
    import torch
    from torchft import Manager, ProcessGroupGloo
    from torchft.local_sgd import DiLoCo

    from ddiloco.workers.task.api import DataShard
    from ddiloco.workers.task.gpt import gpt_data
    from ddiloco.workers.task.gpt_params import model_config_of
    from ddiloco.workers.task.torch_gpt import TorchGPT, loss, torch_optimizer

    torch.set_num_threads(1)
    t0 = time.monotonic()
    cfg = _config(args)
    mcfg = model_config_of(cfg.model)
    model = TorchGPT(mcfg, seed=cfg.train.seed)
    make_opt, schedule, clip = torch_optimizer(cfg.train)
    inner = make_opt(model)
    sched = torch.optim.lr_scheduler.LambdaLR(inner, schedule)
    outer = torch.optim.SGD(model.parameters(), lr=args.outer_lr, momentum=args.outer_momentum,
                            nesterov=args.outer_momentum > 0)
    batches, eval_batches = gpt_data(cfg, mcfg.seq_len)
    data = batches(DataShard(index, args.learners, 0, cfg.train.seed))
    store = torch.distributed.TCPStore("localhost", 0, is_master=True, wait_for_workers=False)
    manager = Manager(
        pg=ProcessGroupGloo(timeout=timedelta(seconds=120)), min_replica_size=args.learners,
        load_state_dict=lambda sd: (model.load_state_dict(sd["model"]),
                                    inner.load_state_dict(sd["optim"])),
        state_dict=lambda: {"model": model.state_dict(), "optim": inner.state_dict()},
        use_async_quorum=False, replica_id=f"replica-{index}", store_addr="localhost",
        store_port=store.port, rank=0, world_size=1, lighthouse_addr=lighthouse,
        timeout=timedelta(seconds=120), quorum_timeout=timedelta(seconds=600),
        connect_timeout=timedelta(seconds=60))
    t_start = time.monotonic()
    try:
        with DiLoCo(manager, [model], inner, outer, sync_every=args.H):
            for _ in range(args.steps):
                value = loss(model, torch.as_tensor(next(data)))
                inner.zero_grad(set_to_none=True)
                value.backward()
                if clip is not None:
                    with torch.no_grad():
                        for p in model.parameters():
                            if p.grad is not None:
                                p.grad.mul_(clip / torch.clamp(
                                    torch.linalg.vector_norm(p.grad), min=clip))
                inner.step()  # DiLoCo's post-step hook syncs every H steps
                sched.step()
        train_s = time.monotonic() - t_start
        val = None
        if index == 0:
            with torch.no_grad():
                vals = [float(loss(model, torch.as_tensor(b))) for b in eval_batches()]
            val = sum(vals) / len(vals)
        out.put({"replica": index, "train_s": train_s, "wall_s": time.monotonic() - t0,
                 "val_loss": val, "params": sum(p.numel() for p in model.parameters())})
    finally:
        manager.shutdown(wait=False)


def run_torchft(args: argparse.Namespace) -> dict[str, Any]:
    """The torchft side: a lighthouse here, M replica processes."""
    import os

    # torchft's Rust side logs every quorum at INFO; its warnings and errors still show
    os.environ.setdefault("RUST_LOG", "warn")
    from torchft.coordination import LighthouseServer

    t0 = time.monotonic()
    lighthouse = LighthouseServer(bind="[::]:0", min_replicas=args.learners)
    ctx = mp.get_context("spawn")
    out = ctx.Queue()
    procs = [ctx.Process(target=_replica, args=(i, lighthouse.address(), args, out))
             for i in range(args.learners)]
    for p in procs:
        p.start()
    got = []
    try:
        for _ in procs:
            got.append(out.get(timeout=args.timeout))
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
        lighthouse.shutdown()
    wall = time.monotonic() - t0
    cfg = _config(args)
    tokens = args.learners * args.steps * cfg.train.batch_size * cfg.model_config_obj().seq_len
    params = got[0]["params"]
    syncs = args.steps // args.H
    m = args.learners
    wire = m * syncs * 2 * (m - 1) / m * 4 * params
    val = next(g["val_loss"] for g in got if g["val_loss"] is not None)
    return {"system": "torchft", "wall_s": round(wall, 1),
            "train_s": round(max(g["train_s"] for g in got), 1), "tokens": tokens,
            "tokens_per_s": round(tokens / wall), "final_val_loss": val,
            "wire_bytes_per_token": round(wire / tokens, 2),
            "wire": "ring all-reduce, fp32 (analytic)"}


def run_ddiloco(args: argparse.Namespace, out: Path, name: str = "",
                extra: tuple[str, ...] = ()) -> dict[str, Any]:
    """The ddiloco side: ``ddiloco run`` with every learner a PyTorch one (``--jax``: JAX
    ones), with the settings ``extra`` on top; its row is named ``ddiloco[-jax][ name]``."""
    cmd = [sys.executable, "-m", "ddiloco.cli", "run", "--config", args.config, "--no-live",
           "--out", str(out), "--force"]
    for key, value in _overrides(args, extra).items():
        cmd += ["--set", f"{key}={json.dumps(value)}"]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    wall = time.monotonic() - t0
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    r = json.loads((out / "report.json").read_text())["diloco"]
    system = "ddiloco-jax" if args.jax else "ddiloco"
    return {"system": f"{system} {name}" if name else system, "wall_s": round(wall, 1),
            "train_s": round(r["wall_s"], 1),
            "tokens": r["tokens"], "tokens_per_s": round(r["tokens"] / wall),
            "final_val_loss": r["final_val_loss"],
            "wire_bytes_per_token": round(r["wire_bytes_per_token"], 2),
            "wire": "measured (both directions)", "settings": list(extra)}


def ratios_of(row: dict[str, Any], tft: dict[str, Any]) -> dict[str, float]:
    """A ddiloco row over the torchft row: wall time, tokens/s, final validation loss and
    wire bytes per token (each < 1 is less of it)."""
    return {"wall_s": round(row["wall_s"] / tft["wall_s"], 3),
            "tokens_per_s": round(row["tokens_per_s"] / tft["tokens_per_s"], 3),
            "final_val_loss": round(row["final_val_loss"] / tft["final_val_loss"], 4),
            "wire_bytes_per_token": round(row["wire_bytes_per_token"]
                                          / tft["wire_bytes_per_token"], 4)}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--config", default=str(ROOT / "configs" / "ci-tiny.yaml"))
    ap.add_argument("--steps", type=int, default=300, help="inner steps per learner")
    ap.add_argument("--learners", type=int, default=4, help="M")
    ap.add_argument("--H", type=int, default=24, help="inner steps between syncs")
    ap.add_argument("--outer-lr", type=float, default=0.7, help="torchft's outer SGD lr")
    ap.add_argument("--outer-momentum", type=float, default=0.9,
                    help="torchft's outer Nesterov momentum")
    ap.add_argument("--jax", action="store_true",
                    help="ddiloco's side with JAX learners (the same model in JAX) instead of "
                    "PyTorch ones")
    ap.add_argument("--timeout", type=float, default=1800, help="seconds for each side")
    ap.add_argument("--set", dest="sets", action="append", default=[], metavar="K=V")
    ap.add_argument("--json", type=Path, default=None, help="also write the result here")
    ap.add_argument("--ddiloco-first", action="store_true",
                    help="run ddiloco's side first (default: torchft's)")
    ap.add_argument("--variant", dest="variants", action="append", default=[],
                    type=parse_variant, metavar="NAME:K=V,K=V",
                    help="also run ddiloco with these settings (one more row each)")
    args = ap.parse_args(argv)
    try:
        import torchft  # noqa: F401
    except ImportError:
        raise SystemExit("bench/torchft_side.py needs torchft: pip install torchft") from None
    sides: list[tuple[str, tuple[str, ...]]] = [("", ()), *args.variants]
    dd_rows: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="ddiloco-torchft-") as tmp:
        # A machine that speeds up or slows down during the bench favours one side: a second
        # bench run in the other order shows how much.
        order = ["ddiloco", "torchft"] if args.ddiloco_first else ["torchft", "ddiloco"]
        for side in order:
            if side == "torchft":
                print("torchft ...", file=sys.stderr, flush=True)
                tft = run_torchft(args)
                continue
            for i, (name, extra) in enumerate(sides):
                print(f"ddiloco {name or '(as set)'} ...", file=sys.stderr, flush=True)
                dd_rows.append(run_ddiloco(args, Path(tmp) / f"ddiloco-{i}", name, extra))
    rows = [tft, *dd_rows]
    print(f"\n{'system':>24} {'wall s':>7} {'train s':>7} {'tokens/s':>9} {'val loss':>9} "
          f"{'bytes/token':>11}  wire")
    for r in rows:
        print(f"{r['system']:>24} {r['wall_s']:>7} {r['train_s']:>7} {r['tokens_per_s']:>9} "
              f"{r['final_val_loss']:>9.4f} {r['wire_bytes_per_token']:>11}  {r['wire']}")
    per_row = {r["system"]: ratios_of(r, tft) for r in dd_rows}
    for system, ratios in per_row.items():
        print(f"{system} / torchft: {ratios}")
    result = {"bench": "torchft_side", "config": args.config, "steps": args.steps,
              "first": "ddiloco" if args.ddiloco_first else "torchft",
              "learners": args.learners, "H": args.H, "sets": args.sets, "rows": rows,
              "ddiloco_over_torchft": per_row[dd_rows[0]["system"]],
              "over_torchft": per_row}
    print(json.dumps(result))
    if args.json is not None:
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
