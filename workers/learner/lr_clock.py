"""The inner learning-rate schedule driven by the run's global tokens (``train.lr_clock``).

By default (``own``) a learner's warm-up and decay follow its own inner step count, the step
count in its optimizer state. With learners of unequal speed that count is not the run's
progress: a slow learner is still warming up or at its peak rate while the global model, fed
mostly by the fast ones, is near the end of its token budget, and a learner that joins late
starts its warm-up from zero. With ``global`` the schedule's step is the run's progress in one
learner's inner steps: the tokens every learner has processed, divided by M times a learner's
tokens per step, estimated from the steps the versions report (each broadcast names the step
at which every merged delta was sent). With equal batches that is the mean inner step of the
M learners (:func:`global_step`). Only the clock changes (ours); the schedule is
``train.schedule``'s.

Mechanism: the optimizer runs at its peak rate and a last stage, ``optax.inject_hyperparams(
optax.scale)``, multiplies the update by the schedule's value at the global step, which the
learner sets before each inner step (:func:`set_lr_scale`). Weight decay is scaled with it, as
with optax's own schedules. The data-parallel baseline ignores the setting: its step count is
the global one.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import numpy as np

from ddiloco.pipeline.errors import ConfigError

__all__ = ["global_step", "schedule_share", "set_lr_scale"]

#: the injected hyper-parameter that scales the update
SCALE_NAME = "step_size"


def global_step(own_step: int, peer_steps: Mapping[str, int], own_id: str,
                learners: int) -> int:
    """The run's progress in one learner's inner steps: ``sum(steps) / M``, rounded down.

    Args:
        own_step: this learner's inner step.
        peer_steps: learner id -> the latest step a version reported for it (this learner's
            own entry is ignored: ``own_step`` is newer).
        own_id: this learner's id.
        learners: M, ``run.learners``.

    Returns:
        The estimate, inner steps. A learner not heard from yet counts as at ``own_step``
        (the best guess before the first versions; it matters for a few steps only); more
        reported learners than M (replacements) are all counted, over their number.
    """
    others = [int(s) for lid, s in peer_steps.items() if lid != own_id]
    unknown = max(0, learners - 1 - len(others))
    n = 1 + len(others) + unknown
    return int((own_step * (1 + unknown) + sum(others)) // n)


#: peak-1 schedules by their parameters (built once: an optax schedule per step is slow)
_SCHEDULES: dict[tuple[Any, ...], Any] = {}


def schedule_share(train: Any, step: int) -> float:
    """The inner schedule's value at ``step`` as a share of its peak rate (in [0, 1]).

    Args:
        train: the run's ``train`` section (warm-up, steps, schedule, floor).
        step: the step, inner steps (:func:`global_step`).
    """
    key = (train.warmup, train.steps, train.lr_floor, train.schedule)
    if key not in _SCHEDULES:
        from ddiloco.workers.task.model import lr_schedule

        _SCHEDULES[key] = lr_schedule(1.0, train.warmup, train.steps, train.lr_floor,
                                      train.schedule)
    return float(_SCHEDULES[key](step))


def set_lr_scale(opt_state: Any, scale: float) -> None:
    """Set the update's scale in an optimizer state built with ``train.lr_clock = global``
    (:func:`ddiloco.workers.task.model.make_optimizer` with ``clock="global"``), in place.

    Args:
        opt_state: the inner optimizer's state (a pytree of optax states).
        scale: the schedule's value at the global step, a share of the peak rate (float).

    Raises:
        ConfigError: the state has no injected scale (a task whose optimizer was not built
            by :func:`ddiloco.workers.task.model.optimizer_from_config`).
    """
    if not _set(opt_state, np.asarray(scale, np.float32)):
        raise ConfigError("train.lr_clock=global: the inner optimizer has no injected "
                          "update scale (a task with its own optimizer); use lr_clock=own")


def _set(state: Any, value: np.ndarray) -> bool:
    hyper = getattr(state, "hyperparams", None)
    if isinstance(hyper, dict) and SCALE_NAME in hyper:
        hyper[SCALE_NAME] = value
        return True
    if isinstance(state, tuple | list):
        return any(_set(s, value) for s in state)
    if isinstance(state, dict):
        return any(_set(s, value) for s in state.values())
    return False
