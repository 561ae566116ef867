"""A Hugging Face ``transformers`` GPT-2, trained from scratch by PyTorch learners.

    pip install 'ddiloco[torch]' transformers
    python examples/hf_gpt2.py                         # 4 learners, 2 shards, this machine
    python examples/hf_gpt2.py --set run.learners=2 --set train.steps=100

The model is built from a ``GPT2Config`` (no download): a small byte-level GPT-2 whose
``named_parameters()`` (``transformer.wte.weight``, ``transformer.h.0.attn.c_attn.weight``...)
are the run's fragments. ``task`` returns a :class:`ddiloco.TorchTask`, so every learner is a
PyTorch learner and no JAX code is written or run for the model; shards, the store and the wire
are the same as for a JAX model. Buffers (GPT-2's causal mask) stay each learner's own; the
output head is tied to ``wte`` and so is one parameter.
"""

from __future__ import annotations

import numpy as np
import torch
from transformers import GPT2Config, GPT2LMHeadModel

import ddiloco
from ddiloco.workers.task.torch_api import warmup_decay

SEQ = 64


def gpt2_config() -> GPT2Config:
    """A 2-layer, 64-wide GPT-2 over bytes (vocabulary 256), without dropout."""
    return GPT2Config(vocab_size=256, n_positions=SEQ, n_embd=64, n_layer=2, n_head=4,
                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)


def task(ctx: ddiloco.TaskContext) -> ddiloco.TorchTask:
    """GPT-2 on the run's corpus (Shakespeare by default), next-byte cross-entropy."""
    train_text, val_text = ddiloco.text_corpus(ctx.config)
    as_ids = lambda b: np.frombuffer(b, np.uint8).astype(np.int32)  # noqa: E731
    tokens, val = as_ids(train_text), as_ids(val_text)
    t = ctx.config.train
    B = t.batch_size

    def model() -> GPT2LMHeadModel:
        torch.manual_seed(ctx.seed)  # every learner builds the same version 0
        return GPT2LMHeadModel(gpt2_config())

    def loss(m: torch.nn.Module, batch: torch.Tensor) -> torch.Tensor:
        batch = batch.long()  # ddiloco.windows gives int32 token windows [B, SEQ + 1]
        logits = m(input_ids=batch[:, :-1]).logits
        return torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]),
                                                 batch[:, 1:].reshape(-1))

    def optimizer(m: torch.nn.Module) -> torch.optim.Optimizer:
        return torch.optim.AdamW(m.parameters(), lr=3e-3, betas=(0.9, 0.95),
                                 weight_decay=t.weight_decay)

    return ddiloco.TorchTask(
        model=model, optimizer=optimizer, loss=loss,
        batches=lambda shard: ddiloco.windows(tokens, B, SEQ, shard),
        tokens_per_batch=B * SEQ,
        schedule=warmup_decay(3e-3, t.warmup_steps, t.steps),
        clip=1.0,
        embeddings=["transformer.wte.weight", "transformer.wpe.weight"],
        eval_batches=lambda: ddiloco.eval_windows(val, B, SEQ, 4),
        name="hf-gpt2-bytes", loss_unit="nats/byte", device="cpu")


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description="Train a Hugging Face GPT-2 on bytes with "
                                     "PyTorch learners and Decoupled DiLoCo (4 learners, 2 "
                                     "syncer shards on this machine by default).")
    parser.add_argument("--config", "-c", default=None, help="TOML or YAML config file")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, e.g. --set run.learners=2 (repeatable)")
    parser.add_argument("--out", "-o", default="out/hf-gpt2", help="run directory")
    parser.add_argument("--force", action="store_true", help="replace the run in --out")
    args = parser.parse_args()
    ddiloco.train(task, args.config, out=args.out, overrides=args.sets, force=args.force)
