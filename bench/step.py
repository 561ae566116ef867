"""Inner-step throughput of the learner model on CPU, in trained tokens per second.

Usage::

    python bench/step.py [--preset tiny] [--batch 16] [--seq 64] [--procs 4] [--steps 50]
    python bench/step.py --configs 8x64,16x64,4x128,16x128 --repeat 3   # sweep (B x L)
    python bench/step.py --configs 32x64 --framework both   # the PyTorch twin beside JAX
    python bench/step.py --configs 32x64 --compile-cache DIR  # twice: compiled, then loaded

For every (B, L) it measures, after compilation and warm-up:

(a) ``1 proc``: one process, XLA free to use every core (its default);
(b) ``N procs``: N processes at once, each with one XLA thread, as N learners sharing the
    machine run. Their timed loops start together.

Two numbers per measurement:

* ``tokens/s``: all tokens trained / (last end - first start), wall clock. This is what a run
  gets, but on a shared machine it also measures everyone else's load.
* ``tokens/CPU-s``: tokens / CPU time the processes used (user + system, all threads), and
  ``capacity`` = that x the number of usable cores: the wall-clock rate the machine would give
  if these processes had it to themselves. It is much less sensitive to other load, so it is
  the number to compare configurations with on a busy machine (the load average before each
  measurement is in the JSON).

Threading on XLA:CPU (jax 0.10): ``--xla_cpu_multi_thread_eigen=false`` makes GEMMs
single-threaded, but the PjRt CPU client sizes its thread pool from the process's affinity
mask, so each process is also pinned to one core (round-robin; ``--no-pin`` to disable).
``intra_op_parallelism_threads`` is a TensorFlow option, not an XLA flag: XLA ignores it. Both
are applied by :func:`ddiloco.workers.run.runtime.configure_cpu_runtime`, which also keeps freed
memory
in the
heap (``--no-malloc`` to measure without: every step then page-faults its temporaries back in
once they pass glibc's 32 MiB mmap threshold).

``--framework torch`` times the PyTorch learner's step instead
(:class:`ddiloco.workers.learner.torch_inner.TorchInner` on the twin
:mod:`ddiloco.workers.task.torch_gpt`, ``torch.set_num_threads(1)`` and the same pinning);
``both`` measures the two frameworks one after the other for every (B, L) and adds the
PyTorch/JAX ratio of each mode to the JSON (``torch_vs_jax``), with the CPU model and the BLAS
PyTorch was built with: a mixed run's learners step at that ratio, and its loss depends on it
(docs/TORCH.md).

The timed loop is the learner's: a :class:`ddiloco.workers.task.data.BatchStream` batch from a
random
shard
(host sampling included), the jitted ``train_step`` (donated unless ``--no-donate``), and a
host read of the loss after every step so per-step times are real. Prints a rich table and, last,
one JSON line with every measurement.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]


@dataclass
class Result:
    """One measurement of one (B, L) in one mode."""

    mode: str  # "single" (1 process, all threads) or "procs" (N processes, 1 thread each)
    framework: str  # "jax" or "torch"
    batch: int
    seq: int
    procs: int
    tokens_per_s: float  # aggregate over processes, wall clock
    tokens_per_cpu_s: float  # aggregate tokens / aggregate CPU seconds
    capacity: float  # tokens_per_cpu_s x usable cores (x procs for 1 process: min(procs, cores))
    step_ms: float  # median per-step wall time, median over processes
    compile_s: float  # first call (trace + compile), max over processes
    load_before: float  # 1-minute load average before the group started


# ----------------------------------------------------------------------------------------------
# Worker: one process, one timed loop. Talks to the parent through stdin/stdout lines.
# ----------------------------------------------------------------------------------------------


def _torch_worker(args: argparse.Namespace) -> None:
    """The PyTorch learner's inner step on the twin model, as :func:`_worker` times JAX's."""
    sys.path.insert(0, str(ROOT))
    if args.cpu is not None:
        os.sched_setaffinity(0, {args.cpu})
    import functools

    import numpy as np
    import torch

    from ddiloco.workers.learner.torch_inner import TorchInner
    from ddiloco.workers.run.config import load_config
    from ddiloco.workers.task.data import BatchStream
    from ddiloco.workers.task.gpt_params import model_config_of
    from ddiloco.workers.task.torch_api import TorchTask
    from ddiloco.workers.task.torch_gpt import TorchGPT, loss, torch_optimizer

    # the JAX worker's optimizer settings (make_optimizer(lr=1e-3, warmup_steps=10, ...))
    cfg = load_config(overrides={"model.preset": args.preset, "model.seq_len": args.seq,
                                 "train.lr": 1e-3, "train.warmup_steps": 10,
                                 "train.weight_decay": 0.1})
    optimizer, schedule, clip = torch_optimizer(cfg.train)
    shard = np.random.default_rng(args.rank).integers(0, 256, 1 << 20, dtype=np.uint8)
    stream = BatchStream(shard, args.batch, args.seq, seed=args.rank)
    task = TorchTask(model=functools.partial(TorchGPT, model_config_of(cfg.model), seed=0),
                     optimizer=optimizer, loss=loss, batches=lambda _shard: iter(()),
                     tokens_per_batch=stream.tokens_per_batch, schedule=schedule, clip=clip,
                     device="cpu")
    inner = TorchInner(task, threads=1 if args.single_thread else None)
    params = inner.named
    opt_state = inner.init_opt(params)

    def one_step() -> float:
        nonlocal params, opt_state
        params, opt_state, loss_value = inner.step(params, opt_state, [stream.next()])
        return float(loss_value)  # the host read the learner makes after every step

    _timed_loop(args, one_step, stream.tokens_per_batch, threads=torch.get_num_threads())


def _timed_loop(args: argparse.Namespace, one_step: Callable[[], Any], tokens_per_batch: int,
                **extra: Any) -> None:
    """A worker's measurement, either framework's: the first call (which compiles), the
    warm-up, ``ready``, the parent's ``go`` on stdin (every process starts its timed loop
    together), ``--steps`` timed steps, then one ``result`` JSON line. ``one_step`` runs one
    inner step to completion and returns its loss."""
    import numpy as np

    t0 = time.perf_counter()
    one_step()
    compile_s = time.perf_counter() - t0
    for _ in range(args.warmup):
        one_step()
    print("ready", flush=True)
    sys.stdin.readline()
    start, cpu0 = time.time(), time.process_time()
    times = []
    for _ in range(args.steps):
        t = time.perf_counter()
        loss = one_step()
        times.append(time.perf_counter() - t)
    end, cpu1 = time.time(), time.process_time()
    report = {
        "start": start,
        "end": end,
        "cpu_s": cpu1 - cpu0,
        "tokens": args.steps * tokens_per_batch,
        "step_ms": 1e3 * float(np.median(times)),
        "compile_s": compile_s,
        "loss": float(loss),
        **extra,
    }
    print("result " + json.dumps(report), flush=True)


def _worker(args: argparse.Namespace) -> None:
    if args.framework == "torch":
        _torch_worker(args)
        return
    sys.path.insert(0, str(ROOT))
    from ddiloco.workers.run.runtime import configure_cpu_runtime

    # Before the first JAX computation: XLA_FLAGS and the affinity mask are read when the CPU
    # backend starts.
    configure_cpu_runtime(
        cpu=args.cpu, single_thread=args.single_thread, keep_freed_memory=args.malloc
    )
    if args.compile_cache:
        from ddiloco.workers.run.runtime import JAX_CACHE_SETTINGS

        # the learners' persistent cache settings (setup_jax): an empty folder compiles and
        # writes the entry, a filled one loads it, as a run's first and later learners do
        for key, value in {**JAX_CACHE_SETTINGS,
                           "jax_compilation_cache_dir": args.compile_cache}.items():
            os.environ[key.upper()] = str(value)
    import jax
    import numpy as np

    from ddiloco.workers.task.data import BatchStream
    from ddiloco.workers.task.model import PRESETS, init_params, make_optimizer, make_train_step

    # The preset at context L (only the positional table changes size).
    cfg = dataclasses.replace(PRESETS[args.preset], seq_len=args.seq)
    optimizer = make_optimizer(lr=1e-3, warmup_steps=10, weight_decay=0.1)
    params = jax.device_put(init_params(cfg, seed=0))
    opt_state = optimizer.init(params)
    step = make_train_step(cfg, optimizer, donate=args.donate)
    shard = np.random.default_rng(args.rank).integers(0, 256, 1 << 20, dtype=np.uint8)
    stream = BatchStream(shard, args.batch, args.seq, seed=args.rank)

    def one_step() -> Any:
        nonlocal params, opt_state
        params, opt_state, loss = step(params, opt_state, stream.next())
        loss.block_until_ready()  # per-step times are real
        return loss

    _timed_loop(args, one_step, stream.tokens_per_batch)


# ----------------------------------------------------------------------------------------------
# Parent
# ----------------------------------------------------------------------------------------------


def _spawn(
    args: argparse.Namespace, batch: int, seq: int, rank: int, cpu: int | None, single: bool,
    framework: str,
) -> subprocess.Popen[str]:
    cmd = [
        sys.executable, __file__, "--worker", "--framework", framework,
        "--preset", args.preset, "--batch", str(batch),
        "--seq", str(seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
        "--rank", str(rank), "--single-thread" if single else "--no-single-thread",
        "--donate" if args.donate else "--no-donate", "--malloc" if args.malloc else "--no-malloc",
    ]  # fmt: skip
    if args.compile_cache:
        cmd += ["--compile-cache", args.compile_cache]
    if cpu is not None:
        cmd += ["--cpu", str(cpu)]
    return subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, cwd=ROOT)


def _run_group(
    args: argparse.Namespace, batch: int, seq: int, n: int, single_thread: bool,
    framework: str = "jax",
) -> Result:
    cpus = sorted(os.sched_getaffinity(0))
    load_before = os.getloadavg()[0]
    procs = [
        _spawn(
            args,
            batch,
            seq,
            rank=r,
            cpu=cpus[r % len(cpus)] if (single_thread and args.pin) else None,
            single=single_thread,
            framework=framework,
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
    tokens = sum(r["tokens"] for r in reports)
    per_cpu_s = tokens / sum(r["cpu_s"] for r in reports)
    return Result(
        mode="procs" if single_thread else "single",
        framework=framework,
        batch=batch,
        seq=seq,
        procs=n,
        tokens_per_s=tokens / span,
        tokens_per_cpu_s=per_cpu_s,
        capacity=per_cpu_s * min(len(cpus), n if single_thread else len(cpus)),
        step_ms=sorted(r["step_ms"] for r in reports)[len(reports) // 2],
        compile_s=max(r["compile_s"] for r in reports),
        load_before=load_before,
    )


def _parse_configs(args: argparse.Namespace) -> list[tuple[int, int]]:
    if not args.configs:
        if args.seq is None:
            sys.path.insert(0, str(ROOT))
            from ddiloco.workers.task.model import PRESETS

            return [(args.batch, PRESETS[args.preset].seq_len)]
        return [(args.batch, args.seq)]
    out = []
    for item in args.configs.split(","):
        batch, _, seq = item.lower().partition("x")
        out.append((int(batch), int(seq)))
    return out


def _best(results: list[Result]) -> list[Result]:
    """Per (framework, mode, B, L), the repeat with the highest capacity (least disturbed by
    other load)."""
    best: dict[tuple[str, str, int, int], Result] = {}
    for r in results:
        key = (r.framework, r.mode, r.batch, r.seq)
        if key not in best or r.capacity > best[key].capacity:
            best[key] = r
    return list(best.values())


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run the measurements, print the table and the JSON line."""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--seq", type=int, default=None, help="default: the preset's seq_len")
    parser.add_argument("--configs", default="", help="comma list of BxL, e.g. 8x64,16x128")
    parser.add_argument("--procs", type=int, default=4)
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--repeat", type=int, default=1, help="rounds over all configs")
    parser.add_argument("--no-single", action="store_true", help="skip mode (a)")
    parser.add_argument(
        "--pin", action=argparse.BooleanOptionalAction, default=True,
        help="pin each single-thread process to one core (default on)",
    )  # fmt: skip
    parser.add_argument(
        "--donate", action=argparse.BooleanOptionalAction, default=True,
        help="donate params/opt_state to the jitted step (default on)",
    )  # fmt: skip
    parser.add_argument(
        "--malloc", action=argparse.BooleanOptionalAction, default=True,
        help="keep freed memory in the heap (configure_cpu_runtime; default on)",
    )  # fmt: skip
    parser.add_argument(
        "--single-thread", action=argparse.BooleanOptionalAction, default=True,
        help=argparse.SUPPRESS,
    )  # fmt: skip
    parser.add_argument(
        "--framework", choices=("jax", "torch", "both"), default="jax",
        help="whose inner step: the JAX learner's (default), the PyTorch twin's, or both",
    )  # fmt: skip
    parser.add_argument(
        "--compile-cache", default=None, metavar="DIR",
        help="JAX's persistent compilation cache for the workers, as a run's learners use it: "
        "run twice on one empty folder to time a compiled step against a loaded one",
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
    frameworks = ("jax", "torch") if args.framework == "both" else (args.framework,)
    results: list[Result] = []
    for _ in range(args.repeat):
        for batch, seq in _parse_configs(args):
            groups = [(1, False)] if not args.no_single else []
            for n, single_thread in [*groups, (args.procs, True)]:
                # the frameworks back to back: a machine that slows down slows both
                for fw in frameworks:
                    results.append(_run_group(args, batch, seq, n, single_thread, fw))
                    r = results[-1]
                    console.log(
                        f"{fw} {r.mode} B={batch} L={seq}: {r.tokens_per_s:,.0f} tok/s wall, "
                        f"{r.capacity:,.0f} capacity, load {r.load_before:.1f}"
                    )

    ncpu = len(os.sched_getaffinity(0))
    table = Table(
        title=f"inner-step throughput, preset {args.preset}, {ncpu} cores "
        f"(best of {args.repeat} by capacity)"
    )
    cols = ("fw", "mode", "B", "L", "tokens/s", "tokens/CPU-s", "capacity", "step ms", "load")
    for col in cols:
        table.add_column(col, justify="right")
    best = _best(results)
    for r in best:
        mode = "1 proc, all threads" if r.mode == "single" else f"{r.procs} procs x 1 thread"
        table.add_row(
            r.framework, mode, str(r.batch), str(r.seq), f"{r.tokens_per_s:,.0f}",
            f"{r.tokens_per_cpu_s:,.0f}", f"{r.capacity:,.0f}", f"{r.step_ms:.1f}",
            f"{r.load_before:.1f}",
        )  # fmt: skip
    console.print(table)
    line: dict[str, Any] = {
        "preset": args.preset,
        "cores": ncpu,
        "cpu_model": _cpu_model(),
        "pin": args.pin,
        "donate": args.donate,
        "malloc_tuned": args.malloc,
        "results": [asdict(r) for r in results],
    }
    procs = [r for r in best if r.mode == "procs"]
    if any(r.framework == "jax" for r in procs):
        top = max((r for r in procs if r.framework == "jax"), key=lambda r: r.capacity)
        line["best_procs"] = {"batch": top.batch, "seq": top.seq, "capacity": top.capacity}
    if "torch" in frameworks:
        line["torch_blas"] = _torch_blas()
    if len(frameworks) == 2:
        line["torch_vs_jax"] = torch_vs_jax(best)
        for row in line["torch_vs_jax"]:
            console.print(f"PyTorch / JAX, {row['mode']} B={row['batch']} L={row['seq']}: "
                          f"tokens/s x{row['tokens_per_s']:.3f}, "
                          f"capacity x{row['capacity']:.3f}")
    print(json.dumps(line))


def torch_vs_jax(best: list[Result]) -> list[dict[str, Any]]:
    """Per (mode, B, L) measured in both frameworks, PyTorch's tokens/s and capacity over
    JAX's (below 1: the PyTorch learner is the slower one).

    >>> r = lambda fw, tps: Result("procs", fw, 32, 64, 4, tps, 1.0, tps, 1.0, 0.0, 0.0)
    >>> torch_vs_jax([r("jax", 200.0), r("torch", 100.0)])
    [{'mode': 'procs', 'batch': 32, 'seq': 64, 'tokens_per_s': 0.5, 'capacity': 0.5}]
    """
    by = {(r.framework, r.mode, r.batch, r.seq): r for r in best}
    out = []
    for (fw, mode, batch, seq), t in by.items():
        j = by.get(("jax", mode, batch, seq))
        if fw != "torch" or j is None:
            continue
        out.append({"mode": mode, "batch": batch, "seq": seq,
                    "tokens_per_s": round(t.tokens_per_s / j.tokens_per_s, 4),
                    "capacity": round(t.capacity / j.capacity, 4)})
    return out


def _cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; the platform's processor string elsewhere)."""
    try:
        for text in Path("/proc/cpuinfo").read_text().splitlines():
            if text.startswith("model name"):
                return text.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.processor()


def _torch_blas() -> str:
    """The BLAS PyTorch was built with (its matmuls' speed on CPU depends on it: Intel's MKL
    takes its slower generic code path on AMD CPUs)."""
    proc = subprocess.run(
        [sys.executable, "-c", "import torch; print(torch.__config__.show())"],
        capture_output=True, text=True)
    for text in proc.stdout.splitlines():
        if "Math Kernel Library" in text or "BLAS_INFO" in text or "OpenBLAS" in text:
            return text.strip().lstrip("- ").split(", CUDA_FLAGS")[0][:160]
    return "unknown"


if __name__ == "__main__":
    main()
