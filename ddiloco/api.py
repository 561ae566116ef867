"""The library API: train your own JAX model with Decoupled DiLoCo (docs/API.md).

A task factory returns a :class:`ddiloco.Task` (initial parameter pytree, loss, optax inner
optimizer, batch iterator factory); :func:`train` runs a whole local job around it: the
embedded Redis, S syncer shards, M learner processes that each call the factory, and the
evaluator, then writes ``OUT/report.json``. The same factory reference
(``"path/to/file.py:factory"``) in ``model.task`` of a config file runs it on separate hosts.
"""

from __future__ import annotations

import inspect
import json
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ddiloco.pipeline.errors import ConfigError
from ddiloco.workers.task.api import DataShard, Task, TaskContext
from ddiloco.workers.task.torch_api import TorchTask


def task_reference(factory: str | Callable[[TaskContext], Task | TorchTask]) -> str:
    """The ``model.task`` reference of a factory, which learner processes import it by.

    Args:
        factory: a top-level function ``(TaskContext) -> Task``, or a reference string.

    Returns:
        A string is returned as it is (a ``file.py:name`` path made absolute); a function
        defined in a script run as ``__main__`` becomes ``"/abs/path/script.py:name"``, one in
        an importable module ``"package.module:name"``.

    Raises:
        ConfigError: a lambda, a nested function or a callable without a source file (worker
            processes import the factory by name).
    """
    if isinstance(factory, str):
        file, sep, name = factory.rpartition(":")
        if sep and file.endswith(".py") and Path(file).is_file():
            return f"{Path(file).resolve()}:{name}"  # workers may start in another folder
        return factory
    name = getattr(factory, "__qualname__", "")
    if not name or "<" in name or "." in name:
        raise ConfigError(f"task factory {factory!r}: define it at the top level of a module "
                          "(learner processes import it by name)")
    module = getattr(factory, "__module__", None)
    if module and module != "__main__" and not module.startswith("_ddiloco_task_"):
        return f"{module}:{name}"
    source = inspect.getsourcefile(factory)
    if source is None:
        raise ConfigError(f"task factory {name}: no source file to import it from")
    return f"{Path(source).resolve()}:{name}"


def train(task: str | Callable[[TaskContext], Task | TorchTask],
          config: str | Path | None = None, *, out: str | Path = "out",
          overrides: Mapping[str, Any] | Sequence[str] | None = None, live: bool = True,
          force: bool = False) -> dict[str, Any]:
    """Train ``task`` with Decoupled DiLoCo on this machine; returns the run's report.

    Args:
        task: a task factory (a top-level function ``(TaskContext) -> Task`` for JAX, or
            ``-> TorchTask`` for PyTorch learners) or its
            reference ``"path/to/file.py:factory"`` / ``"package.module:factory"``.
        config: a TOML/YAML configuration (``configs/``); None: defaults.
        out: the run directory (logs, checkpoints, report.json, report.png).
        overrides: dotted overrides, e.g. ``{"run.learners": 2, "sync.H": 12}``.
        live: show the live table while training.
        force: replace the run ``out`` already holds (its checkpoints, Redis data, logs and
            report); without it such an ``out`` is refused.

    Returns:
        The report (also in ``out/report.json``): tokens, tokens/s, wire bytes, merges,
        the final validation loss when the task has ``eval_batches``.

    Raises:
        ConfigError: a bad configuration or task; OutHoldsRun: ``out`` holds another run
            and ``force`` is False; DDilocoError: a worker failed.
    """
    from ddiloco.localrun import run_local
    from ddiloco.workers.run.config import load_config

    ref = task_reference(task)
    items: dict[str, Any] | list[str]
    if isinstance(overrides, Mapping):
        items = {**overrides, "model.task": ref}
    else:  # "a.b=v" strings, parsed as YAML values like --set
        items = [*(overrides or ()), "model.task=" + json.dumps(ref)]
    return run_local(load_config(config, items), Path(out), live=live, force=force)


def text_corpus(config: Any = None) -> tuple[bytes, bytes]:
    """The run's text, split into (train, validation) bytes by document: the ``data``
    section's corpus (Shakespeare by default, fetched once and cached).

    Raises:
        CorpusUnavailable: the corpus cannot be read or fetched.
    """
    from ddiloco.workers.task.data import load_documents, split_documents

    cfg = config
    if cfg is None:
        from ddiloco.workers.run.config import Config

        cfg = Config()
    docs = load_documents([Path(p) for p in cfg.data.corpus] or None)
    train_docs, val_docs = split_documents(docs, cfg.data.val_fraction, seed=cfg.train.seed)
    return b"\n".join(train_docs.values()), b"\n".join(val_docs.values())


def cache_dir() -> Path:
    """The cache folder of corpora and derived data: ``$DDILOCO_CACHE_DIR`` when set, else
    ddiloco's folder in the user cache. Tokenizers and encoded corpora belong here.

    Returns:
        The folder's path (it may not exist yet).
    """
    from ddiloco.workers.task.data import cache_root

    return cache_root()


def windows(tokens: np.ndarray, batch_size: int, seq_len: int,
            shard: DataShard) -> Iterator[np.ndarray]:
    """Random training windows of one learner: int32 ``[batch_size, seq_len + 1]`` batches
    from its contiguous ``1/shard.count`` part of ``tokens``, starting at batch
    ``shard.start``. Batch ``i`` depends only on (seed, index, i), so a rejoining learner
    resumes the same stream.

    Raises:
        ConfigError: the learner's part is shorter than ``seq_len + 1`` tokens.
    """
    tokens = np.asarray(tokens)
    part = len(tokens) // shard.count
    mine = tokens[shard.index * part:(shard.index + 1) * part]
    if len(mine) < seq_len + 1:
        raise ConfigError(f"learner {shard.index}: {len(mine)} tokens, fewer than seq_len + 1 "
                          f"= {seq_len + 1}")
    offsets = np.arange(seq_len + 1)
    i = shard.start
    while True:
        rng = np.random.default_rng([shard.seed, shard.index, i])
        starts = rng.integers(0, len(mine) - seq_len, size=batch_size)
        yield mine[starts[:, None] + offsets].astype(np.int32)
        i += 1


def eval_windows(tokens: np.ndarray, batch_size: int, seq_len: int,
                 n_batches: int) -> list[np.ndarray]:
    """Fixed evaluation windows spread evenly over ``tokens``: ``n_batches`` int32 arrays
    ``[batch_size, seq_len + 1]``.

    Raises:
        ConfigError: fewer than ``seq_len + 1`` tokens.
    """
    tokens = np.asarray(tokens)
    if len(tokens) < seq_len + 1:
        raise ConfigError(f"{len(tokens)} evaluation tokens, fewer than seq_len + 1")
    starts = np.linspace(0, len(tokens) - seq_len - 1, n_batches * batch_size).round()
    w = tokens[starts.astype(np.int64)[:, None] + np.arange(seq_len + 1)].astype(np.int32)
    return list(w.reshape(n_batches, batch_size, seq_len + 1))

