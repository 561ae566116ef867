"""The evaluator: validation loss of the *global* model, read from the store.

Every ``eval_every_s`` seconds it reads the latest version of every fragment, assembles the
parameters and computes the task's loss averaged over the task's ``eval_batches`` (for the
built-in GPT: next-byte cross-entropy, nats per byte, on fixed windows of the held-out
documents). Each result is an ``eval`` event with the tokens trained so far (sum of
the learners' token counters), so every report plots the same loss against tokens.
"""

from __future__ import annotations

import signal
import time
from typing import Any

import numpy as np

from ddiloco.pipeline.errors import StoreUnavailable
from ddiloco.workers.runtime import decode_blob, manifest_config, manifest_layout, setup_logging


class Evaluator:
    """Validation loss of the global model in the store.

    Args:
        store: the run's parameter store.
    """

    def __init__(self, store: Any, manifest: dict[str, Any]) -> None:
        import jax

        from ddiloco.workers.task import build_task

        self.store = store
        self.manifest = manifest
        self.cfg = manifest_config(manifest)
        self.layout = manifest_layout(manifest)
        self.task = build_task(self.cfg)
        self.tree = self.task.tree()
        self.batches = list(self.task.eval_batches()) if self.task.eval_batches else []
        loss = self.task.loss
        tree = self.tree
        self.eval_fn = jax.jit(lambda flat, batch: loss(tree.unflatten(flat), batch))
        self.last_versions: list[int] | None = None
        self.last_loss: float | None = None
        #: the last ``eval`` event's fields (metrics)
        self.last_fields: dict[str, Any] = {}

    def evaluate(self) -> tuple[float, list[int]]:
        """Validation loss (nats/byte) of the latest global model and the versions used.

        Raises:
            pipeline.errors.DDilocoError: a fragment has no version yet.
        """
        import jax.numpy as jnp

        from ddiloco.pipeline.errors import DDilocoError

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
        if not self.batches:
            raise DDilocoError(f"task {self.task.name!r} has no eval_batches: nothing to "
                               "evaluate")
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
        self.last_fields = fields
        return fields


def run_evaluator(store: Any, every_s: float | None = None, once: bool = False,
                  metrics_port: int | None = None) -> int:
    """Process entry: evaluate every ``every_s`` seconds until SIGTERM (then once more);
    ``metrics_port``: serve Prometheus metrics there (:mod:`workers.metrics`)."""
    from ddiloco.workers.runtime import wait_for_manifest

    log = setup_logging("evaluator")
    stopping = {"flag": False}

    def _stop(signum: int, _frame: Any) -> None:
        stopping["flag"] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    manifest = wait_for_manifest(store)
    ev = Evaluator(store, manifest)
    if metrics_port is not None:
        from ddiloco.workers.metrics import EvaluatorCollector, serve_metrics

        serve_metrics(EvaluatorCollector(ev), metrics_port)
    period = every_s or ev.cfg.run.eval_every_s
    started = time.time()
    last_check = 0.0
    while True:
        try:
            blobs = store.heads(ev.layout.n_fragments)
            if not ev.batches:
                log.warning("task %s has no eval_batches: the evaluator only waits",
                            ev.task.name)
                period = float("inf") if not once else period
            elif all(b is not None for b in blobs):
                fields = ev.record()
                log.info("val loss %.4f nats/byte at %d tokens", fields["loss"],
                         fields["tokens"])
        except StoreUnavailable as exc:
            log.warning("store unavailable: %s", exc)  # evaluate again when it is back
        if once or stopping["flag"]:
            break
        deadline = time.monotonic() + min(period, 1e9)
        while time.monotonic() < deadline and not stopping["flag"]:
            time.sleep(0.05)
            if time.monotonic() - last_check > 1.0:
                last_check = time.monotonic()
                try:
                    # The run is over (``ddiloco finish``): evaluate once more, as on SIGTERM.
                    stopping["flag"] |= store.stop_requested("evaluator", since=started)
                except StoreUnavailable:
                    pass
    try:
        store.add_event("evaluator_stop", {"loss": ev.last_loss})
    except StoreUnavailable as exc:
        log.warning("store unavailable at stop: %s", exc)
    return 0
