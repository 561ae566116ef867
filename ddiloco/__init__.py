"""ddiloco: Decoupled DiLoCo around your own JAX model (docs/API.md).

The library API::

    import ddiloco
    ddiloco.train(my_task, "configs/default.toml", out="runs/mine")

where ``my_task(ctx: ddiloco.TaskContext) -> ddiloco.Task``. This package is also the
application layer (command line, local runner, reports) on top of pipeline/, store/,
workers/ and chaos/.
"""

from importlib.metadata import PackageNotFoundError, version

from ddiloco.api import cache_dir, eval_windows, task_reference, text_corpus, train, windows
from workers.task import DataShard, ParamTree, Task, TaskContext, TaskError

try:
    __version__ = version("ddiloco")
except PackageNotFoundError:  # running from a source tree that was not installed
    __version__ = "0.0.0+unknown"

__all__ = ["DataShard", "ParamTree", "Task", "TaskContext", "TaskError", "__version__", "cache_dir",
           "eval_windows", "task_reference", "text_corpus", "train", "windows"]
