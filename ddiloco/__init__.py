"""ddiloco: Decoupled DiLoCo around your own JAX or PyTorch model (docs/API.md).

The library API::

    import ddiloco
    ddiloco.train(my_task, "configs/default.toml", out="runs/mine")

where ``my_task(ctx: ddiloco.TaskContext) -> ddiloco.Task`` (JAX) or ``ddiloco.TorchTask``
(PyTorch, ``pip install 'ddiloco[torch]'``). Who keeps their own training loop
uses the pure pieces instead (codecs, merge rules, outer optimizer, adoption rule):
``from ddiloco import core`` (docs/API.md, "Your own loop"). This package is also the
application layer (command line, local runner, reports) on top of its layers
``ddiloco.pipeline`` < ``ddiloco.store`` < ``ddiloco.workers`` < ``ddiloco.chaos``
(docs/ARCHITECTURE.md).

The public names are loaded on first use (PEP 562): importing a lower layer, e.g.
``ddiloco.workers.learner.core`` in a worker process, does not import the application layer.
"""

from __future__ import annotations

import importlib
from importlib.metadata import PackageNotFoundError, version
from typing import TYPE_CHECKING, Any

try:
    __version__ = version("ddiloco")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

#: public name -> the module that defines it
_EXPORTS = {
    "cache_dir": "ddiloco.api",
    "eval_windows": "ddiloco.api",
    "task_reference": "ddiloco.api",
    "text_corpus": "ddiloco.api",
    "train": "ddiloco.api",
    "windows": "ddiloco.api",
    "DataShard": "ddiloco.workers.task.api",
    "ParamTree": "ddiloco.workers.task.api",
    "Task": "ddiloco.workers.task.api",
    "TaskContext": "ddiloco.workers.task.api",
    "TaskError": "ddiloco.workers.task.api",
    "TorchTask": "ddiloco.workers.task.torch_api",
    "CheckpointMismatch": "ddiloco.workers.learner.checkpoint",
    "core": "ddiloco.core",
    "load_params": "ddiloco.export",
    "ParamsMismatch": "ddiloco.export",
    "bundled_chaos_scripts": "ddiloco.bundled",
    "bundled_configs": "ddiloco.bundled",
}

if TYPE_CHECKING:
    from ddiloco import core
    from ddiloco.api import cache_dir, eval_windows, task_reference, text_corpus, train, windows
    from ddiloco.bundled import bundled_chaos_scripts, bundled_configs
    from ddiloco.export import ParamsMismatch, load_params
    from ddiloco.workers.learner.checkpoint import CheckpointMismatch
    from ddiloco.workers.task.api import DataShard, ParamTree, Task, TaskContext, TaskError
    from ddiloco.workers.task.torch_api import TorchTask


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'ddiloco' has no attribute {name!r}")
    imported = importlib.import_module(module)
    value = imported if module == f"ddiloco.{name}" else getattr(imported, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])


__all__ = ["CheckpointMismatch", "DataShard", "ParamTree", "ParamsMismatch", "Task",
           "TaskContext", "TaskError", "TorchTask", "__version__", "bundled_chaos_scripts",
           "bundled_configs",
           "cache_dir", "core", "eval_windows", "load_params", "task_reference", "text_corpus",
           "train", "windows"]
