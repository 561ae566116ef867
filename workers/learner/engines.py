"""Which inner-step engine a learner runs: JAX or PyTorch, chosen by its task.

A run's task is a JAX :class:`ddiloco.workers.task.api.Task` or a
:class:`ddiloco.workers.task.torch_api.TorchTask` (``model.task``'s factory returns either).
With the built-in GPT, ``run.torch_learners = n`` makes learners ``learner-0`` to
``learner-<n-1>`` train its PyTorch twin (:mod:`ddiloco.workers.task.torch_gpt`: the same
parameter names, shapes, initial values and loss), so that learners of both frameworks train
one model through one set of shards. The data-parallel baseline's learners are JAX ones.
"""

from __future__ import annotations

from typing import Any

from ddiloco.workers.run.config import Config
from ddiloco.workers.task.api import Task, TaskContext
from ddiloco.workers.task.loader import build_task
from ddiloco.workers.task.torch_api import TorchTask

__all__ = ["build_engine", "learner_index", "learner_task", "uses_torch"]


def learner_index(learner_id: str) -> int:
    """A learner's index m, the trailing integer of its id (``learner-3`` -> 3; 0 without)."""
    tail = learner_id.rsplit("-", 1)[-1]
    return int(tail) if tail.isdigit() else 0


def uses_torch(cfg: Config, learner_id: str) -> bool:
    """Whether the built-in GPT's learner ``learner_id`` trains in PyTorch
    (``run.torch_learners``; DiLoCo runs only)."""
    return (cfg.model.task is None and cfg.run.mode == "diloco"
            and learner_index(learner_id) < cfg.run.torch_learners)


def learner_task(cfg: Config, learner_id: str) -> Task | TorchTask:
    """The task learner ``learner_id`` trains: the PyTorch GPT where :func:`uses_torch`, else
    the run's task (:func:`ddiloco.workers.task.loader.build_task`).

    Raises:
        TaskError: the task cannot be built (for PyTorch: torch is not installed).
    """
    if uses_torch(cfg, learner_id):
        from ddiloco.workers.task.torch_gpt import gpt_torch_task

        return gpt_torch_task(TaskContext(config=cfg, seed=cfg.train.seed))
    return build_task(cfg)


def build_engine(task: Task | TorchTask, cfg: Config) -> Any:
    """The inner-step engine of ``task`` with the run's device options:
    :class:`ddiloco.workers.learner.inner.InnerLoop` (JAX) or
    :class:`ddiloco.workers.learner.torch_inner.TorchInner` (PyTorch).

    Raises:
        TaskError: an option the engine does not have, or more devices than exist.
    """
    t = cfg.train
    if isinstance(task, TorchTask):
        from ddiloco.workers.learner.torch_inner import TorchInner

        return TorchInner(task, accumulate=t.accumulate, devices=cfg.run.devices,
                          sharding=cfg.run.sharding, compute_dtype=t.compute_dtype)
    from ddiloco.workers.learner.inner import InnerLoop

    return InnerLoop(task, devices=cfg.run.devices, sharding=cfg.run.sharding,
                     compute_dtype=t.compute_dtype, accumulate=t.accumulate)
