"""Inner-step throughput of the learner model on CPU, in trained tokens per second.

Usage::

    python bench/step.py [--preset tiny] [--batch 16] [--seq 128] [--procs 4] [--steps 50]
    python bench/step.py --configs 4x128,8x64,16x64,16x128     # sweep (B x L) shapes

For every (B, L) it measures, after compilation and warm-up:

(a) ``single``: one process, XLA free to use every core (its default);
(b) ``procs``: N processes at once, each restricted to one XLA thread, as N learners sharing
    the machine would run. Aggregate tokens/s = all tokens trained / (last end - first start),
    with the timed loops started together.

Threading on XLA:CPU (jax 0.10): ``--xla_cpu_multi_thread_eigen=false`` makes the Eigen
GEMM/conv kernels single-threaded, but the PjRt CPU client still sizes its intra-op pool by
the CPUs the process may run on (affinity-aware), and the thunk executor may run independent
ops concurrently on it. ``intra_op_parallelism_threads`` is a TensorFlow session option, not an
XLA flag: XLA_FLAGS ignores it. So ``--pin`` (default on) also restricts each process to one
core with ``os.sched_setaffinity`` before jax starts, round-robin over the allowed cores.

The timed loop is the learner's: a :class:`workers.data.BatchStream` batch from a random shard
(host sampling included), the jitted, donated ``train_step``, and one host read of the loss
at the end. Prints a rich table and, last, one JSON line with every measurement.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SINGLE_THREAD_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false"


@dataclass
class Result:
    """One measurement."""

    mode: str  # "single" or "procs"
    batch: int
    seq: int
    procs: int
    tokens_per_s: float  # aggregate over processes
    step_ms: float  # median per-step wall time of one process
    compile_s: float  # first call (trace + compile), max over processes


# ----------------------------------------------------------------------------------------------
# Worker: one process, one timed loop. Talks to the parent through stdin/stdout lines.
# ----------------------------------------------------------------------------------------------


def _worker(args: argparse.Namespace) -> None:
    if args.cpu is not None:
        # Before importing jax: the CPU client sizes its thread pool from the affinity mask.
        os.sched_setaffinity(0, {args.cpu})
    sys.path.insert(0, str(ROOT))
    import jax
    import numpy as np

    from workers.data import BatchStream
    from workers.model import PRESETS, init_params, make_optimizer, make_train_step

    cfg = PRESETS[args.preset]
    if args.seq > cfg.seq_len:
        raise SystemExit(f"--seq {args.seq} exceeds the preset's seq_len {cfg.seq_len}")
    optimizer = make_optimizer(lr=1e-3, warmup_steps=10, weight_decay=0.1)
    params = jax.device_put(init_params(cfg, seed=0))
    opt_state = optimizer.init(params)
    step = make_train_step(cfg, optimizer)
    shard = np.random.default_rng(args.rank).integers(0, 256, 1 << 20, dtype=np.uint8)
    stream = BatchStream(shard, args.batch, args.seq, seed=args.rank)

    t0 = time.perf_counter()
    params, opt_state, loss = step(params, opt_state, stream.next())
    loss.block_until_ready()
    compile_s = time.perf_counter() - t0
    for _ in range(args.warmup):
        params, opt_state, loss = step(params, opt_state, stream.next())
    loss.block_until_ready()

    print("ready", flush=True)
    sys.stdin.readline()  # the parent's "go": every process starts its timed loop together
    start = time.time()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        params, opt_state, loss = step(params, opt_state, stream.next())
        # Sync every step: the per-step time is then real, and async dispatch cannot run
        # ahead of the measurement window.
        loss.block_until_ready()
        times.append(time.perf_counter() - t)
    end = time.time()
    report = {
        "start": start,
        "end": end,
        "tokens": args.steps * stream.tokens_per_batch,
        "step_ms": 1e3 * float(np.median(times)),
        "compile_s": compile_s,
        "loss": float(loss),
    }
    print("result " + json.dumps(report), flush=True)


# ----------------------------------------------------------------------------------------------
# Parent
# ----------------------------------------------------------------------------------------------


def _spawn(args: argparse.Namespace, batch: int, seq: int, rank: int, cpu: int | None, flags: str):
    env = dict(os.environ)
    if flags:
        env["XLA_FLAGS"] = (env.get("XLA_FLAGS", "") + " " + flags).strip()
    cmd = [
        sys.executable, __file__, "--worker", "--preset", args.preset, "--batch", str(batch),
        "--seq", str(seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--rank", str(rank),
    ]  # fmt: skip
    if cpu is not None:
        cmd += ["--cpu", str(cpu)]
    return subprocess.Popen(
        cmd, env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT
    )


def _run_group(
    args: argparse.Namespace, batch: int, seq: int, n: int, single_thread: bool
) -> Result:
    cpus = sorted(os.sched_getaffinity(0))
    procs = [
        _spawn(
            args,
            batch,
            seq,
            rank=r,
            cpu=cpus[r % len(cpus)] if (single_thread and args.pin) else None,
            flags=SINGLE_THREAD_XLA_FLAGS if single_thread else "",
        )
        for r in range(n)
    ]
    try:
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if line.strip() != "ready":
                raise RuntimeError(f"worker failed before the timed loop: {line!r}")
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        reports = []
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()
            if not line.startswith("result "):
                raise RuntimeError(f"worker failed in the timed loop: {line!r}")
            reports.append(json.loads(line.removeprefix("result ")))
    finally:
        for p in procs:
            if p.stdin is not None:
                p.stdin.close()
            p.wait(timeout=60)
    span = max(r["end"] for r in reports) - min(r["start"] for r in reports)
    step_ms = sorted(r["step_ms"] for r in reports)[len(reports) // 2]
    return Result(
        mode="procs" if single_thread else "single",
        batch=batch,
        seq=seq,
        procs=n,
        tokens_per_s=sum(r["tokens"] for r in reports) / span,
        step_ms=step_ms,
        compile_s=max(r["compile_s"] for r in reports),
    )


def _parse_configs(args: argparse.Namespace) -> list[tuple[int, int]]:
    if not args.configs:
        return [(args.batch, args.seq)]
    out = []
    for item in args.configs.split(","):
        b, _, l = item.lower().partition("x")
        out.append((int(b), int(l)))
    return out


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run the measurements, print the table and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--configs", default="", help="comma list of BxL, e.g. 4x128,8x64")
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--no-single", action="store_true", help="skip mode (a)")
    parser.add_argument(
        "--pin", action=argparse.BooleanOptionalAction, default=True,
        help="pin each single-thread process to one core (default on)",
    )  # fmt: skip
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    parser.add_argument("--cpu", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        _worker(args)
        return

    from rich.console import Console
    from rich.table import Table

    console = Console(stderr=True)
    results: list[Result] = []
    for batch, seq in _parse_configs(args):
        if not args.no_single:
            results.append(_run_group(args, batch, seq, 1, single_thread=False))
            console.log(results[-1])
        results.append(_run_group(args, batch, seq, args.procs, single_thread=True))
        console.log(results[-1])

    table = Table(title=f"inner-step throughput, preset {args.preset}, {os.cpu_count()} CPUs")
    for col in ("mode", "B", "L", "procs", "tokens/s", "step ms (median, 1 proc)", "compile s"):
        table.add_column(col, justify="right")
    for r in results:
        mode = "1 proc, all threads" if r.mode == "single" else f"{r.procs} procs x 1 thread"
        table.add_row(
            mode, str(r.batch), str(r.seq), str(r.procs), f"{r.tokens_per_s:,.0f}",
            f"{r.step_ms:.1f}", f"{r.compile_s:.1f}",
        )  # fmt: skip
    console.print(table)
    best = max((r for r in results if r.mode == "procs"), key=lambda r: r.tokens_per_s)
    print(
        json.dumps(
            {
                "preset": args.preset,
                "cpus": os.cpu_count(),
                "pin": args.pin,
                "xla_flags_single_thread": SINGLE_THREAD_XLA_FLAGS,
                "results": [asdict(r) for r in results],
                "best_procs": {"batch": best.batch, "seq": best.seq, "tokens_per_s": best.tokens_per_s},
            }
        )
    )


if __name__ == "__main__":
    main()
