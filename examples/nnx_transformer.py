"""Your own Flax NNX transformer, trained with Decoupled DiLoCo.

    python examples/nnx_transformer.py                 # 4 learners, 2 shards, this machine
    python examples/nnx_transformer.py --set run.learners=2 --set train.steps=100

Everything ddiloco needs is the ``task`` function: initial parameters, a loss, an optax inner
optimizer and a batch iterator per learner. Learner processes import this file and call
``task``; the ``__main__`` block only runs in the process you start.
"""

from __future__ import annotations

import argparse

import jax
import numpy as np
import optax
from flax import nnx

import ddiloco


class Block(nnx.Module):
    def __init__(self, d: int, heads: int, rngs: nnx.Rngs) -> None:
        self.ln1, self.ln2 = nnx.RMSNorm(d, rngs=rngs), nnx.RMSNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(heads, d, decode=False, rngs=rngs)
        self.up, self.down = nnx.Linear(d, 4 * d, rngs=rngs), nnx.Linear(4 * d, d, rngs=rngs)

    def __call__(self, x: jax.Array, mask: jax.Array) -> jax.Array:
        x = x + self.attn(self.ln1(x), mask=mask)
        return x + self.down(nnx.gelu(self.up(self.ln2(x))))


class LM(nnx.Module):
    def __init__(self, vocab: int, d: int, heads: int, layers: int, seq: int,
                 rngs: nnx.Rngs) -> None:
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.pos = nnx.Param(jax.random.normal(rngs.params(), (seq, d)) * 0.02)
        self.blocks = nnx.List([Block(d, heads, rngs) for _ in range(layers)])
        self.ln = nnx.RMSNorm(d, rngs=rngs)

    def __call__(self, tokens: jax.Array) -> jax.Array:
        x = self.embed(tokens) + self.pos[: tokens.shape[1]]
        for block in self.blocks:
            x = block(x, nnx.make_causal_mask(tokens))
        return self.embed.attend(self.ln(x))


def lm_task(ctx: ddiloco.TaskContext, tokens: np.ndarray, val: np.ndarray, vocab: int,
            name: str, loss_unit: str = "nats/token") -> ddiloco.Task:
    """A causal LM task over token ids (shared with examples/bpe_transformer.py); its loss is
    the mean next-token cross-entropy in ``loss_unit`` (nats per byte when a token is a byte)."""
    B, L, d = ctx.config.train.batch_size, 64, 64
    graphdef, params, *rest = nnx.split(LM(vocab, d, 4, 2, L, nnx.Rngs(ctx.seed)), nnx.Param, ...)

    def loss(params: nnx.State, batch: jax.Array) -> jax.Array:
        logits = nnx.merge(graphdef, params, *rest)(batch[:, :-1])
        return optax.softmax_cross_entropy_with_integer_labels(logits, batch[:, 1:]).mean()

    return ddiloco.Task(
        params=params, loss=loss, optimizer=optax.adamw(3e-3, b2=0.95),
        batches=lambda shard: ddiloco.windows(tokens, B, L, shard),
        tokens_per_batch=B * L, embeddings=lambda path: path.startswith(("embed/", "pos/")),
        eval_batches=lambda: ddiloco.eval_windows(val, B, L, 4), name=name, loss_unit=loss_unit)


def task(ctx: ddiloco.TaskContext) -> ddiloco.Task:
    """A byte-level model on the run's corpus (Shakespeare by default)."""
    train_text, val_text = ddiloco.text_corpus(ctx.config)
    as_ids = lambda b: np.frombuffer(b, np.uint8).astype(np.int32)  # noqa: E731
    return lm_task(ctx, as_ids(train_text), as_ids(val_text), 256, "nnx-bytes",
                   loss_unit="nats/byte")


def parse_args(argv: list[str] | None, description: str, out: str) -> argparse.Namespace:
    """The examples' command line: ``--config``, ``--set`` (repeatable) and ``--out``."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--config", "-c", default=None,
                        help="TOML or YAML config file, or a bundled config's name (ci-tiny)")
    parser.add_argument("--set", dest="sets", action="append", default=[], metavar="KEY=VALUE",
                        help="config override, e.g. --set run.learners=2 (repeatable)")
    parser.add_argument("--out", "-o", default=out, help=f"run directory (default {out})")
    parser.add_argument("--force", action="store_true",
                        help="replace the run the run directory already holds")
    return parser.parse_args(argv)


if __name__ == "__main__":
    args = parse_args(None, "Train a Flax NNX transformer on bytes with Decoupled DiLoCo "
                      "(4 learners, 2 syncer shards on this machine by default).", "out/nnx")
    ddiloco.train(task, args.config, out=args.out, overrides=args.sets, force=args.force)
