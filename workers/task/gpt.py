"""The built-in byte-level GPT as a :class:`ddiloco.workers.task.api.Task`: one user of the task
API.

``model.task`` unset means this task: the model of :mod:`ddiloco.workers.task.model` (preset and
overrides of the ``model`` section), AdamW from the ``train`` section, byte windows of the
``data`` section's corpus (Shakespeare by default), non-IID shards by document.
"""

from __future__ import annotations

import functools
from collections.abc import Iterator
from pathlib import Path

import numpy as np

from ddiloco.workers.task.api import DataShard, Task, TaskContext


def gpt_task(ctx: TaskContext) -> Task:
    """The built-in GPT task of ``ctx.config`` (see the module docstring).

    Raises:
        ddiloco.pipeline.errors.CorpusUnavailable: the corpus cannot be read or fetched.
        ddiloco.pipeline.errors.ConfigError: the corpus is too small for the model's windows.
    """
    from ddiloco.workers.task.data import (
        BatchStream,
        load_documents,
        shard_documents,
        split_documents,
        val_batches,
    )
    from ddiloco.workers.task.model import (
        embedding_names,
        init_params,
        loss_fn,
        optimizer_from_config,
    )

    cfg = ctx.config
    mcfg = cfg.model_config_obj()
    t = cfg.train

    @functools.cache
    def documents() -> tuple[dict[str, bytes], dict[str, bytes]]:
        docs = load_documents([Path(p) for p in cfg.data.corpus] or None)
        return split_documents(docs, cfg.data.val_fraction, seed=t.seed)

    def batches(shard: DataShard) -> Iterator[np.ndarray]:
        train_docs, _ = documents()
        shards = shard_documents(train_docs, shard.count, iid=cfg.data.iid, seed=t.seed)
        stream = BatchStream(shards[shard.index % len(shards)], t.batch_size, mcfg.seq_len,
                             seed=t.seed * 1000 + shard.index, position=shard.start)
        while True:
            yield stream.next()

    def eval_batches() -> list[np.ndarray]:
        _, val_docs = documents()
        return list(val_batches(val_docs, t.batch_size, mcfg.seq_len, cfg.data.eval_batches,
                                seed=1))

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
