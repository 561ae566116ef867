"""The evaluator: validation loss of the *global* model, read from the store.

Every ``eval_every_s`` seconds it reads the latest version of every fragment, assembles the
parameters and computes the mean next-byte cross-entropy (nats per byte) on fixed windows of
the held-out documents. Each result is an ``eval`` event with the tokens trained so far (sum of
the learners' token counters), so every report plots the same loss against tokens.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import numpy as np

from pipeline.errors import StoreUnavailable
from workers.runtime import decode_blob, manifest_config, manifest_layout, setup_logging


class Evaluator:
    """Validation loss of the global model in the store.

    Args:
        store: the run's parameter store.
    """

    def __init__(self, store: Any, manifest: dict[str, Any]) -> None:
        import jax.numpy as jnp

        from workers.data import load_documents, split_documents, val_batches
        from workers.model import make_eval_fn

        self.store = store
        self.manifest = manifest
        self.cfg = manifest_config(manifest)
        self.layout = manifest_layout(manifest)
        self.model_cfg = self.cfg.model_config_obj()
        docs = load_documents([Path(p) for p in self.cfg.data.corpus] or None)
        _, val_docs = split_documents(docs, self.cfg.data.val_fraction, seed=self.cfg.train.seed)
        self.batches = jnp.asarray(val_batches(val_docs, self.cfg.train.batch_size,
                                               self.model_cfg.seq_len,
                                               self.cfg.data.eval_batches, seed=1))
        self.eval_fn = make_eval_fn(self.model_cfg)
        self.last_versions: list[int] | None = None
        self.last_loss: float | None = None

    def evaluate(self) -> tuple[float, list[int]]:
        """Validation loss (nats/byte) of the latest global model and the versions used.

        Raises:
            pipeline.errors.DDilocoError: a fragment has no version yet.
        """
        import jax.numpy as jnp

        from pipeline.errors import DDilocoError

        blobs = self.store.get_latest_many(list(range(self.layout.n_fragments)))
        params: dict[str, Any] = {}
        versions = []
        for p, blob in enumerate(blobs):
            if blob is None:
                raise DDilocoError(f"fragment {p} has no version yet")
            versions.append(blob.version)
            params.update(zip(self.layout.names(p),
                              decode_blob(blob.value, self.layout.shapes(p)), strict=True))
        if versions == self.last_versions and self.last_loss is not None:
            return self.last_loss, versions
        jparams = {k: jnp.asarray(v) for k, v in params.items()}
        losses = [float(self.eval_fn(jparams, b)) for b in self.batches]
        self.last_versions, self.last_loss = versions, float(np.mean(losses))
        return self.last_loss, versions

    def record(self) -> dict[str, Any]:
        """Evaluate and append an ``eval`` event; returns its fields."""
        t0 = time.monotonic()
        loss, versions = self.evaluate()
        tokens = sum(self.store.counters("tokens").values())
        wire = self.store.counters("wire")
        fields = {"loss": loss, "tokens": tokens, "versions": versions,
                  "wire_bytes": int(wire.get("up", 0)) + int(wire.get("down", 0)),
                  "eval_s": time.monotonic() - t0}
        self.store.add_event("eval", fields)
        return fields


def run_evaluator(store: Any, every_s: float | None = None, once: bool = False) -> int:
    """Process entry: evaluate every ``every_s`` seconds until SIGTERM (then once more)."""
    from workers.runtime import wait_for_manifest

    log = setup_logging("evaluator")
    stopping = {"flag": False}

    def _stop(signum: int, _frame: Any) -> None:
        stopping["flag"] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    manifest = wait_for_manifest(store)
    ev = Evaluator(store, manifest)
    period = every_s or ev.cfg.run.eval_every_s
    while True:
        try:
            blobs = store.heads(ev.layout.n_fragments)
            if all(b is not None for b in blobs):
                fields = ev.record()
                log.info("val loss %.4f nats/byte at %d tokens", fields["loss"],
                         fields["tokens"])
        except StoreUnavailable as exc:
            log.warning("store unavailable: %s", exc)  # evaluate again when it is back
        if once or stopping["flag"]:
            break
        deadline = time.monotonic() + period
        while time.monotonic() < deadline and not stopping["flag"]:
            time.sleep(0.05)
    return 0
