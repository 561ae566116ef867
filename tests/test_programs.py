"""The inner step's programs (workers/learner/programs.py): one set per task object, and a
trace made before the learner's engine exists (a fork server's) is the engine's own.

A task's loss is Python code that runs only while JAX traces it, so counting its calls
tells whether a step was traced again."""

from __future__ import annotations

import subprocess
import sys
from typing import Any

import numpy as np
import optax
import pytest

from ddiloco.workers.learner.inner import InnerLoop
from ddiloco.workers.learner.programs import (
    abstract_args,
    cpu_mesh,
    host_device_count,
    layouts,
    pretrace,
    step_programs,
)
from ddiloco.workers.task.api import Task, TaskError


def counting_task(calls: list[int]) -> Task:
    def loss(p: dict[str, Any], batch: Any) -> Any:
        import jax.numpy as jnp

        calls.append(1)
        return jnp.mean((p["w"] * batch["x"]) ** 2) + jnp.sum(p["b"] ** 2)

    return Task(params={"w": np.ones(4, np.float32), "b": np.zeros(2, np.float32)},
                loss=loss, optimizer=optax.adamw(1e-2), batches=lambda s: iter(()),
                tokens_per_batch=4, name="counting")


def batch() -> dict[str, np.ndarray]:
    return {"x": np.arange(8, dtype=np.float32).reshape(2, 4)}


def train_three_steps(task: Task) -> float:
    loop = InnerLoop(task)
    params = loop.place_all(task.initial_values())
    state = loop.init_opt(params)
    loss = None
    for _ in range(3):
        params, state, loss = loop.step(params, state, [batch()])
    return float(loss)


def test_one_task_object_has_one_set_of_programs_per_option() -> None:
    task = counting_task([])
    first = step_programs(task)
    assert step_programs(task) is first
    assert step_programs(task, "bfloat16") is not first
    assert step_programs(task, accumulate=2) is not first
    assert isinstance(step_programs(task, accumulate=2).tx, optax.MultiSteps)
    assert step_programs(counting_task([])) is not first  # an equal task, another object
    with pytest.raises(TaskError, match=r"train\.accumulate must be >= 1, got 0"):
        step_programs(task, accumulate=0)


def test_a_pretraced_task_trains_without_tracing_again_and_to_the_same_loss() -> None:
    traced: list[int] = []
    warm = counting_task(traced)
    out = pretrace(warm, batch())
    assert out["traced"] == ["init", "train"] and out["trace_s"] >= 0
    after_pretrace = len(traced)
    assert after_pretrace >= 1
    warm_loss = train_three_steps(warm)
    assert len(traced) == after_pretrace, "the engine traced the step again"

    cold_calls: list[int] = []
    cold_loss = train_three_steps(counting_task(cold_calls))
    assert cold_calls, "the control: a task nobody traced is traced by its engine"
    assert warm_loss == cold_loss


def test_the_baseline_pretraces_its_gradient_and_update() -> None:
    traced: list[int] = []
    task = counting_task(traced)
    assert pretrace(task, batch(), dp=True)["traced"] == ["init", "grad", "apply"]
    n = len(traced)
    loop = InnerLoop(task)
    params = loop.place_all(task.initial_values())
    state = loop.init_opt(params)
    grads, _ = loop.grad(params, batch())
    loop.apply(params, state, grads)
    assert len(traced) == n


def test_abstract_args_give_a_learners_argument_types_without_a_device() -> None:
    import jax
    import numpy as np
    from jax.sharding import Mesh

    task = counting_task([])
    programs = step_programs(task)
    lay = layouts(task, programs, cpu_mesh(1))
    flat, opt, spec = abstract_args(task, programs, {"x": np.zeros((2, 4), np.int64)}, lay)
    assert flat["w"].shape == (4,) and flat["w"].dtype == np.float32
    assert spec["x"].dtype == jax.dtypes.canonicalize_dtype(np.int64)
    assert jax.tree_util.tree_structure(opt) == jax.tree_util.tree_structure(
        jax.eval_shape(task.optimizer.init, {"b": flat["b"], "w": flat["w"]}))
    # the abstract mesh is the one a learner's real mesh of one CPU device has
    real = Mesh(np.array(jax.devices("cpu")[:1]), ("data",))
    assert cpu_mesh(1) == real.abstract_mesh
    assert layouts(task, programs, real).params["w"].spec == lay.params["w"].spec


def test_host_device_count_reads_xla_flags() -> None:
    assert host_device_count("") == 1
    assert host_device_count("--xla_force_host_platform_device_count=4 --foo") == 4
    assert host_device_count("--xla_force_host_platform_device_count=2 "
                             "--xla_force_host_platform_device_count=8") == 8


def test_the_built_in_tasks_pretrace_starts_no_backend() -> None:
    # in a fresh process: what the fork server does before it forks
    code = ("from jax._src import xla_bridge\n"
            "from ddiloco.workers.run.config import load_config\n"
            "from ddiloco.workers.task.api import DataShard\n"
            "from ddiloco.workers.task.loader import build_task, prebuild_task\n"
            "from ddiloco.workers.learner.programs import pretrace\n"
            "cfg = load_config(None, {'model.seq_len': 32, 'train.batch_size': 4})\n"
            "task = prebuild_task(cfg)\n"
            "b = next(iter(task.batches(DataShard(0, 4, 0, 0))))\n"
            "print(pretrace(task, b)['traced'], xla_bridge.backends_are_initialized(),\n"
            "      build_task(cfg) is task,\n"
            "      build_task(load_config(None, {'model.seq_len': 32})) is task)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=300, check=True).stdout.strip()
    assert out == "['init', 'train'] False True False"
