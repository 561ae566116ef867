"""The NNX transformer of examples/nnx_transformer.py on subword tokens: a byte-level BPE
tokenizer (Hugging Face ``tokenizers``, vocabulary 4096) trained offline on the run's corpus,
int32 token ids.

    python examples/bpe_transformer.py --set run.learners=2

The tokenizer and the encoded corpus are cached next to the corpus cache: the process you
start builds them once (while it writes the run manifest), learners load them.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path

import numpy as np
from nnx_transformer import lm_task, parse_args
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

import ddiloco

VOCAB = 4096


def bpe_ids(text: bytes, cache: Path) -> tuple[Tokenizer, np.ndarray]:
    """Train (once) a byte-level BPE on ``text`` and encode it: int32 ids, cached by hash."""
    key = hashlib.sha256(text).hexdigest()[:16]
    tok_path, ids_path = cache / f"bpe{VOCAB}-{key}.json", cache / f"bpe{VOCAB}-{key}.npy"
    if not tok_path.exists():
        tok = Tokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(vocab_size=VOCAB, show_progress=False,
                                      initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
        tok.train_from_iterator(text.decode().split("\n\n"), trainer)
        cache.mkdir(parents=True, exist_ok=True)
        tok.save(f"{tok_path}.{os.getpid()}")
        os.replace(f"{tok_path}.{os.getpid()}", tok_path)  # atomic: learners may read it
    tok = Tokenizer.from_file(str(tok_path))
    if not ids_path.exists():
        ids = np.asarray(tok.encode(text.decode()).ids, dtype=np.int32)
        np.save(f"{ids_path}.{os.getpid()}.npy", ids)
        os.replace(f"{ids_path}.{os.getpid()}.npy", ids_path)
    return tok, np.load(ids_path)


def task(ctx: ddiloco.TaskContext) -> ddiloco.Task:
    train_text, val_text = ddiloco.text_corpus(ctx.config)
    tok, ids = bpe_ids(train_text, ddiloco.cache_dir() / "bpe")
    val = np.asarray(tok.encode(val_text.decode()).ids, dtype=np.int32)
    return lm_task(ctx, ids, val, tok.get_vocab_size(), "nnx-bpe4k", loss_unit="nats/token")


if __name__ == "__main__":
    args = parse_args(None, "Train the NNX transformer on BPE tokens (vocabulary 4096) with "
                      "Decoupled DiLoCo (4 learners, 2 syncer shards on this machine by "
                      "default).", "out/bpe")
    ddiloco.train(task, args.config, out=args.out, overrides=args.sets, force=args.force)
