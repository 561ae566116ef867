"""One learner's inner steps on 1 device against N devices (data parallel and FSDP).

Runs the same global batches through :class:`ddiloco.workers.learner.inner.InnerLoop` on a mesh of
1 device
and of N devices and reports the largest parameter difference after the last step and the
tokens/s of each layout, plus bf16 compute and gradient accumulation (``accumulate`` micro-
batches of B/accumulate against one batch of B). On a CPU machine N host devices are emulated
(``--xla_force_host_platform_device_count``), so the N-device tokens/s measures the layout's
overhead, not a speed-up.

    python bench/mesh.py --devices 4 --steps 20 [--task examples/nnx_transformer.py:task]

Prints a table and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--devices", type=int, default=4)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--config", default=str(ROOT / "configs" / "ci-tiny.yaml"))
    ap.add_argument("--task", default=None, help="model.task reference (default: built-in)")
    ap.add_argument("--batch", type=int, default=8, help="global batch size")
    ap.add_argument("--set", dest="sets", action="append", default=[])
    ap.add_argument("--skip", action="append", default=[], help="leave leaves whose path "
                    "contains this out of the comparison (e.g. attn/key/bias: its gradient is "
                    "exactly zero, softmax ignores a per-query shift, and Adam turns float "
                    "noise there into lr-sized steps)")
    args = ap.parse_args(argv)
    if args.steps < 3:
        ap.error("--steps must be >= 3 (two compile)")
    platform = os.environ.setdefault("JAX_PLATFORMS", "cpu")
    if platform == "cpu":
        flag = f"--xla_force_host_platform_device_count={args.devices}"
        os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " " + flag).strip()
    sys.path.insert(0, str(ROOT))
    import jax
    import numpy as np

    from ddiloco.workers.learner.inner import InnerLoop
    from ddiloco.workers.run.config import load_config
    from ddiloco.workers.task.api import DataShard, initial_values
    from ddiloco.workers.task.loader import build_task

    sets = [f"train.batch_size={args.batch}", *args.sets]
    if args.task:
        sets.append(f"model.task={args.task}")
    cfg = load_config(args.config, sets)
    task = build_task(cfg)
    it = task.batches(DataShard(0, 1, 0, cfg.train.seed))
    batches = [next(it) for _ in range(args.steps)]
    init = initial_values(task)

    def run(devices: int, sharding: str = "replicated", dtype: str = "float32",
            accumulate: int = 1) -> tuple[dict[str, np.ndarray], float, float]:
        inner = InnerLoop(task, devices=devices, sharding=sharding,  # type: ignore[arg-type]
                          compute_dtype=dtype, accumulate=accumulate)
        params = inner.place_all(init)
        opt = inner.init_opt(params)

        def micro(b: object) -> list[object]:
            if accumulate == 1:
                return [b]
            return [jax.tree_util.tree_map(lambda x, i=i: np.array_split(x, accumulate)[i], b)
                    for i in range(accumulate)]

        # The first two steps compile (the second again: the optimizer state's layout out of
        # init differs from the one out of a step).
        for b in batches[:2]:
            params, opt, loss = inner.step(params, opt, micro(b))
        jax.block_until_ready(params)
        t0 = time.perf_counter()
        for b in batches[2:]:
            params, opt, loss = inner.step(params, opt, micro(b))
        jax.block_until_ready(params)
        dt = time.perf_counter() - t0
        tps = task.tokens_per_batch * (len(batches) - 2) / dt
        return {k: inner.host(v) for k, v in params.items()}, tps, float(loss)

    ref, ref_tps, ref_loss = run(1)
    worst_leaf: dict[str, str] = {}
    rows = [("1 device", 0.0, ref_tps, ref_loss)]
    if cfg.model.task is None:
        # The built-in model's own jitted step, as learners ran it before the task API: the
        # InnerLoop's tokens/s relative to it is the API's cost.
        from ddiloco.workers.task.model import make_train_step

        step = make_train_step(cfg.model_config_obj(), task.optimizer)
        params = {k: jax.device_put(v) for k, v in init.items()}
        opt = task.optimizer.init(params)
        for b in batches[:2]:
            params, opt, loss = step(params, opt, b)
        jax.block_until_ready(params)
        t0 = time.perf_counter()
        for b in batches[2:]:
            params, opt, loss = step(params, opt, b)
        jax.block_until_ready(params)
        tps = task.tokens_per_batch * (len(batches) - 2) / (time.perf_counter() - t0)
        diff = max(float(np.max(np.abs(np.asarray(params[k]) - ref[k]))) for k in ref)
        rows.append(("1 device, model.make_train_step", diff, tps, float(loss)))
    cases = [(f"{args.devices} devices, data parallel", dict(devices=args.devices)),
             (f"{args.devices} devices, fsdp", dict(devices=args.devices, sharding="fsdp")),
             ("1 device, accumulate 2", dict(devices=1, accumulate=2)),
             ("1 device, bf16 compute", dict(devices=1, dtype="bfloat16"))]
    for label, kw in cases:
        got, tps, loss = run(**kw)  # type: ignore[arg-type]
        per_leaf = {k: float(np.max(np.abs(got[k] - ref[k]))) for k in ref
                    if not any(x in k for x in args.skip)}
        worst = max(per_leaf, key=per_leaf.__getitem__)
        rows.append((label, per_leaf[worst], tps, loss))
        worst_leaf[label] = worst
    print(f"{'layout':34} {'max |param - 1 device|':>22} {'tokens/s':>10} {'loss':>8}  worst leaf")
    for label, diff, tps, loss in rows:
        print(f"{label:34} {diff:22.2e} {tps:10.0f} {loss:8.4f}  {worst_leaf.get(label, '')}")
    print(json.dumps({"bench": "mesh", "task": task.name, "steps": args.steps,
                      "devices": args.devices, "platform": jax.devices()[0].platform,
                      "rows": [{"layout": r[0], "max_abs_diff": r[1], "tokens_per_s": r[2],
                                "loss": r[3], "worst_leaf": worst_leaf.get(r[0])}
                               for r in rows]}))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
