"""Which task a run trains: the factory ``model.task`` names, or the built-in GPT.

A run's configuration names its task by a reference ``model.task = "pkg.mod:factory"`` or
``"path/to/file.py:factory"``; every learner (and the evaluator) process calls
``factory(TaskContext)`` to build it. No reference: the built-in byte-level GPT
(:func:`ddiloco.workers.task.gpt.gpt_task`). The task API itself
(:class:`ddiloco.workers.task.api.Task`) knows
nothing of either: this module sits above both.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
from collections.abc import Callable
from pathlib import Path

from ddiloco.workers.run.config import Config
from ddiloco.workers.task.api import Task, TaskContext, TaskError
from ddiloco.workers.task.gpt import gpt_task
from ddiloco.workers.task.torch_api import TorchTask

__all__ = ["build_task", "forget_prebuilt", "load_factory", "prebuild_task", "prebuilt"]

#: the built-in task a fork server built before its fork, and the key of the settings it was
#: built from (:func:`prebuild_task`)
_PREBUILT: tuple[str, Task] | None = None


def builtin_task_key(cfg: Config) -> str | None:
    """What the built-in GPT task is a function of (``model``, ``train``, ``data`` and
    ``run.mode``: all :func:`ddiloco.workers.task.gpt.gpt_task` reads), as one JSON string;
    None for a task of the user's own (``model.task``), which may read anything."""
    if cfg.model.task is not None:
        return None
    import json

    return json.dumps({"model": cfg.model.model_dump(mode="json"),
                       "train": cfg.train.model_dump(mode="json"),
                       "data": cfg.data.model_dump(mode="json"), "mode": cfg.run.mode},
                      sort_keys=True)


def prebuild_task(cfg: Config) -> Task:
    """Build the built-in task of ``cfg`` and keep it: every later :func:`build_task` in this
    process (and in processes forked from it) with the same settings returns this object, so
    the inner-step programs traced for it are theirs too
    (:mod:`ddiloco.workers.learner.programs`).

    Raises:
        TaskError: ``cfg`` names a task of its own (``model.task``), or the build fails.
    """
    global _PREBUILT
    key = builtin_task_key(cfg)
    if key is None:
        raise TaskError("only the built-in task is built before a fork (model.task is set)")
    task = build_task(cfg)
    if not isinstance(task, Task):  # pragma: no cover - the built-in task is a JAX one
        raise TaskError("the built-in task is not a JAX task")
    _PREBUILT = (key, task)
    return task


def prebuilt() -> Task | None:
    """The task :func:`prebuild_task` kept in this process (or before its fork); None."""
    return None if _PREBUILT is None else _PREBUILT[1]


def forget_prebuilt() -> None:
    """Drop the kept task: later builds build their own."""
    global _PREBUILT
    _PREBUILT = None


def load_factory(ref: str) -> Callable[[TaskContext], Task | TorchTask]:
    """Import a task factory from ``"pkg.module:function"`` or ``"path/to/file.py:function"``.

    A file is imported under a private module name, so its ``if __name__ == "__main__"``
    block does not run in the learner processes.

    Raises:
        TaskError: a malformed reference, a missing module or file, or no such callable.
    """
    mod_name, sep, attr = ref.rpartition(":")
    if not sep or not mod_name or not attr:
        raise TaskError(f"model.task {ref!r}: expected 'package.module:factory' or "
                        "'path/to/file.py:factory'")
    if mod_name.endswith(".py"):
        path = Path(mod_name).resolve()
        if not path.is_file():
            raise TaskError(f"model.task {ref!r}: no file {path}")
        key = f"_ddiloco_task_{abs(hash(str(path)))}"
        module = sys.modules.get(key)
        if module is None:
            spec = importlib.util.spec_from_file_location(key, path)
            if spec is None or spec.loader is None:
                raise TaskError(f"model.task {ref!r}: cannot import {path}")
            module = importlib.util.module_from_spec(spec)
            sys.modules[key] = module
            # The file's own folder first, as for `python file.py`: its sibling imports work.
            sys.path.insert(0, str(path.parent))
            try:
                spec.loader.exec_module(module)
            except BaseException:
                del sys.modules[key]
                raise
            finally:
                sys.path.remove(str(path.parent))
    else:
        try:
            module = importlib.import_module(mod_name)
        except ImportError as exc:
            raise TaskError(f"model.task {ref!r}: cannot import {mod_name!r}: {exc}") from exc
    factory = getattr(module, attr, None)
    if not callable(factory):
        raise TaskError(f"model.task {ref!r}: {mod_name} has no callable {attr!r}")
    return factory  # type: ignore[no-any-return]


def build_task(cfg: Config) -> Task | TorchTask:
    """The task of a run's configuration: ``model.task``'s factory (a JAX
    :class:`~ddiloco.workers.task.api.Task` or a PyTorch
    :class:`~ddiloco.workers.task.torch_api.TorchTask`), or the built-in GPT (the object
    :func:`prebuild_task` kept, when its settings are these).

    Raises:
        TaskError: the reference cannot be loaded, the factory returned something else, or
            (PyTorch) torch is not installed.
    """
    if _PREBUILT is not None and _PREBUILT[0] == builtin_task_key(cfg):
        return _PREBUILT[1]
    ref = cfg.model.task
    factory: Callable[[TaskContext], Task | TorchTask] = (gpt_task if ref is None
                                                          else load_factory(ref))
    task = factory(TaskContext(config=cfg, seed=cfg.train.seed))
    if not isinstance(task, Task | TorchTask):
        raise TaskError(f"model.task {ref!r}: the factory returned {type(task).__name__}, "
                        "not ddiloco.Task or ddiloco.TorchTask")
    if task.tokens_per_batch < 1:
        raise TaskError(f"task {task.name!r}: tokens_per_batch must be >= 1")
    task.tree()  # validates the tree now, with a clear error
    return task
