"""The built-in byte-level GPT as a :class:`ddiloco.workers.task.api.Task`: one user of the task
API.

``model.task`` unset means this task: the model of :mod:`ddiloco.workers.task.model` (preset and
overrides of the ``model`` section), AdamW from the ``train`` section, byte windows of the
``data`` section's corpus (Shakespeare by default), non-IID shards by document. Its data
(:func:`gpt_data`) is shared with the PyTorch twin, :mod:`ddiloco.workers.task.torch_gpt`.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

from ddiloco.workers.task.api import DataShard, Task, TaskContext


def gpt_data(cfg: Any, seq_len: int) -> tuple[Callable[[DataShard], Iterator[np.ndarray]],
                                               Callable[[], list[np.ndarray]]]:
    """The built-in GPT's data, shared by the JAX task and its PyTorch twin
    (:mod:`ddiloco.workers.task.torch_gpt`): ``(batches, eval_batches)``.

    ``batches(shard)`` yields int32 windows [train.batch_size, seq_len + 1] of the shard's
    training documents from batch ``shard.start`` on; ``eval_batches()`` is
    ``data.eval_batches`` such windows of the held-out documents. The corpus is read once, on
    first use.

    Args:
        cfg: the run's :class:`ddiloco.workers.run.config.Config` (``data`` and ``train``).
        seq_len: the model's context L.

    Raises:
        ddiloco.pipeline.errors.CorpusUnavailable: (on first use) the corpus cannot be read or
            fetched.
        ddiloco.pipeline.errors.ConfigError: (on first use) the corpus is too small for the
            windows.
    """
    from ddiloco.workers.task.data import (
        BatchStream,
        load_documents,
        shard_documents,
        split_documents,
        val_batches,
    )

    t = cfg.train

    @functools.cache
    def documents() -> tuple[dict[str, bytes], dict[str, bytes]]:
        docs = load_documents([Path(p) for p in cfg.data.corpus] or None)
        return split_documents(docs, cfg.data.val_fraction, seed=t.seed)

    def batches(shard: DataShard) -> Iterator[np.ndarray]:
        train_docs, _ = documents()
        shards = shard_documents(train_docs, shard.count, iid=cfg.data.iid, seed=t.seed)
        stream = BatchStream(shards[shard.index % len(shards)], t.batch_size, seq_len,
                             seed=t.seed * 1000 + shard.index, position=shard.start)
        while True:
            yield stream.next()

    def eval_batches() -> list[np.ndarray]:
        _, val_docs = documents()
        return list(val_batches(val_docs, t.batch_size, seq_len, cfg.data.eval_batches,
                                seed=1))

    return batches, eval_batches


def gpt_task(ctx: TaskContext) -> Task:
    """The built-in GPT task of ``ctx.config`` (see the module docstring).

    Raises:
        ddiloco.pipeline.errors.CorpusUnavailable: the corpus cannot be read or fetched.
        ddiloco.pipeline.errors.ConfigError: the corpus is too small for the model's windows.
    """
    from ddiloco.workers.task.model import (
        embedding_names,
        init_params,
        loss_fn,
        optimizer_from_config,
    )

    cfg = ctx.config
    mcfg = cfg.model_config_obj()
    t = cfg.train
    batches, eval_batches = gpt_data(cfg, mcfg.seq_len)

    return Task(
        params=init_params(mcfg, ctx.seed),
        loss=functools.partial(loss_fn, cfg=mcfg),
        optimizer=optimizer_from_config(t, dp=cfg.run.mode == "dp"),
        batches=batches,
        tokens_per_batch=t.batch_size * mcfg.seq_len,
        embeddings=sorted(embedding_names(mcfg)),
        eval_batches=eval_batches,
        name=f"gpt-{cfg.model.preset}",
        loss_unit="nats/byte",  # next-byte cross-entropy: a token is a byte
    )
