"""The evaluator: validation loss of the *global* model, read from the store.

Each time the learners' global tokens have grown by ``run.eval_every_tokens`` (the token
budget / 20 by default; :func:`eval_due`) it reads the latest version of every fragment,
assembles the parameters and computes the task's loss averaged over the task's
``eval_batches`` (for the built-in GPT: next-byte cross-entropy, nats per byte, on fixed
windows of the held-out documents). Each result is an ``eval`` event with the tokens trained so
far (sum of the learners' token counters), so every report plots the same loss against tokens.
A cadence of tokens rather than seconds gives the same points whatever the machine's speed,
and a bounded number of evaluations per run. ``run.eval_every_tokens = 0`` evaluates every
``run.eval_every_s`` seconds instead.

Evaluation should not slow training: the process runs at CPU niceness ``run.eval_nice``, so on
cores it shares with learners and shards it gets only what they leave; it evaluates a snapshot
(the versions it read), never blocks a worker, and reports its cost (evaluations, their seconds
and the process's CPU seconds) in its ``evaluator_stop`` event and the run's report.
``run.evaluator = after`` starts it only when the learners are done (one evaluation of the
final model), ``off`` not at all.

Under ``run.deterministic`` what the store holds at a wall-clock tick depends on timing, so
the evaluator evaluates whole rounds instead: round k is version k of every fragment
(:func:`ddiloco.workers.run.deterministic.complete_round`), evaluated once every fragment has
it, in order, each ``eval`` event keyed by ``round`` with the tokens its versions hold; and at
the end the final model, keyed ``final``. Two runs of one seed then report the same losses
for the same keys.
"""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from ddiloco.pipeline.errors import DDilocoError, StoreUnavailable
from ddiloco.pipeline.waiting import poll_until
from ddiloco.store.base import FragmentBlob, ParameterStore
from ddiloco.workers.run.blobs import decode_blob
from ddiloco.workers.run.deterministic import complete_round, round_tokens
from ddiloco.workers.run.live import token_budget
from ddiloco.workers.run.manifest import (
    manifest_config,
    manifest_layout,
    tokens_per_batch,
    wait_for_manifest,
)
from ddiloco.workers.run.runtime import setup_logging
from ddiloco.workers.task.api import manifest_loss_unit
from ddiloco.workers.task.loader import build_task
from ddiloco.workers.task.torch_api import TorchTask
from ddiloco.workers.tracking import MergeCounter, open_tracker

#: How often a waiting evaluator asks the store whether the run is over, seconds.
STOP_CHECK_S = 1.0
#: Evaluations per run when ``run.eval_every_tokens`` is unset (:func:`eval_interval_tokens`).
EVALS_PER_RUN = 20


def eval_interval_tokens(every_tokens: int | None, budget_tokens: int) -> int:
    """The evaluator's cadence in global tokens: ``every_tokens``, or, unset (None), the
    run's token budget / :data:`EVALS_PER_RUN` (at least 1). 0 means a cadence of seconds
    (``run.eval_every_s``) and is returned as is.

    Args:
        every_tokens: ``run.eval_every_tokens`` (>= 0 or None).
        budget_tokens: the run's token budget (M x ``train.steps`` x tokens per step).
    """
    if every_tokens is not None:
        return every_tokens
    return max(1, budget_tokens // EVALS_PER_RUN)


def eval_due(tokens: int, last_tokens: int | None, every_tokens: int) -> bool:
    """Whether the global model is due for evaluation at ``tokens`` global tokens.

    Due when nothing was evaluated yet (the initial model's loss), when the cadence is one of
    seconds (``every_tokens`` 0: the caller's period decides), or when ``tokens`` reached the
    next multiple of ``every_tokens`` after ``last_tokens``: evaluations land near
    ``k x every_tokens`` whatever the machine's speed, one per multiple even if the counter
    jumped past several.
    """
    if last_tokens is None or every_tokens <= 0:
        return True
    return tokens // every_tokens > last_tokens // every_tokens

#: How often a deterministic run's evaluator looks for newly complete rounds, seconds: a round
#: is evaluated from the store's kept versions (``sync.history``), which a slow look misses.
ROUND_POLL_S = 0.2


class Evaluator:
    """Validation loss of the global model in the store.

    Args:
        store: the run's parameter store.
        manifest: the run manifest.

    Raises:
        TaskError: the run's task cannot be built here.
    """

    def __init__(self, store: ParameterStore, manifest: dict[str, Any]) -> None:
        self.store = store
        self.manifest = manifest
        self.cfg = manifest_config(manifest)
        self.layout = manifest_layout(manifest)
        self.task = build_task(self.cfg)
        self.tree = self.task.tree()
        self.batches = list(self.task.eval_batches()) if self.task.eval_batches else []
        #: the losses of the eval batches for flat host parameters (JAX or PyTorch)
        self.losses_of = self._losses_fn()
        self.last_versions: list[int] | None = None
        self.last_loss: float | None = None
        #: the last ``eval`` event's fields (metrics)
        self.last_fields: dict[str, Any] = {}
        #: ``run.deterministic`` (DiLoCo): evaluations keyed by round (:meth:`record_rounds`)
        self.deterministic = self.cfg.run.deterministic and manifest["mode"] == "diloco"
        #: the last round evaluated or passed over (-1: none yet)
        self.last_round = -1
        #: global tokens at the last evaluation (None: none yet; :func:`eval_due`)
        self.last_tokens: int | None = None
        #: evaluations so far and their wall seconds (the evaluator's cost, reported at stop)
        self.evals = 0
        self.eval_s = 0.0

    def evaluate(self) -> tuple[float, list[int]]:
        """Validation loss (nats/byte) of the latest global model and the versions used.

        Raises:
            ddiloco.pipeline.errors.DDilocoError: a fragment has no version yet.
        """
        blobs = self.store.get_latest_many(list(range(self.layout.n_fragments)), momentum=False)
        for p, blob in enumerate(blobs):
            if blob is None:
                raise DDilocoError(f"fragment {p} has no version yet")
        return self._loss([b for b in blobs if b is not None])

    def _loss(self, blobs: list[FragmentBlob]) -> tuple[float, list[int]]:
        """Validation loss of the model made of ``blobs`` (one per fragment, in order) and
        their versions; the last result again when the versions are the last ones.

        Raises:
            ddiloco.pipeline.errors.DDilocoError: the task has no evaluation batches.
        """
        params: dict[str, Any] = {}
        versions = []
        for p, blob in enumerate(blobs):
            versions.append(blob.version)
            params.update(zip(self.layout.names(p),
                              decode_blob(blob.value, self.layout.shapes(p)), strict=True))
        if versions == self.last_versions and self.last_loss is not None:
            return self.last_loss, versions
        if not self.batches:
            raise DDilocoError(f"task {self.task.name!r} has no eval_batches: nothing to "
                               "evaluate")
        losses = self.losses_of(params)
        self.last_versions, self.last_loss = versions, float(np.mean(losses))
        return self.last_loss, versions

    def _losses_fn(self) -> Callable[[dict[str, Any]], list[float]]:
        """``losses(flat host params) -> loss of each eval batch``: the task's loss, jitted
        (JAX) or under ``torch.no_grad`` on one reused module (PyTorch)."""
        task = self.task
        if isinstance(task, TorchTask):
            from ddiloco.workers.learner.torch_inner import torch_losses

            module: list[Any] = [None]

            def torch_eval(params: dict[str, Any]) -> list[float]:
                losses, module[0] = torch_losses(task, params, self.batches, module[0])
                return losses

            return torch_eval
        import jax
        import jax.numpy as jnp

        loss, tree = task.loss, self.tree
        eval_fn = jax.jit(lambda flat, batch: loss(tree.unflatten(flat), batch))

        def jax_eval(params: dict[str, Any]) -> list[float]:
            jparams = {k: jnp.asarray(v) for k, v in params.items()}
            return [float(eval_fn(jparams, b)) for b in self.batches]

        return jax_eval

    def record(self, final: bool = False) -> dict[str, Any]:
        """Evaluate the latest versions and append an ``eval`` event; returns its fields.

        Args:
            final: the run is over: the event is keyed ``final`` (``run.deterministic``).
        """
        t0 = time.monotonic()
        loss, versions = self.evaluate()
        tokens = sum(self.store.counters("tokens").values())
        return self._event(loss, versions, tokens, t0, {"final": True} if final else {})

    def _event(self, loss: float, versions: list[int], tokens: int, t0: float,
               key: dict[str, Any]) -> dict[str, Any]:
        """Append the ``eval`` event of one evaluation (``key``: its ``round`` or ``final``
        under ``run.deterministic``); returns its fields."""
        wire = self.store.counters("wire")
        fields = {"loss": loss, "tokens": tokens, "versions": versions,
                  "wire_bytes": int(wire.get("up", 0)) + int(wire.get("down", 0)),
                  "eval_s": time.monotonic() - t0, **key}
        self.store.add_event("eval", fields)
        self.last_fields = fields
        self.last_tokens = tokens
        self.evals += 1
        self.eval_s += fields["eval_s"]
        return fields

    def record_rounds(self, upto: int) -> list[dict[str, Any]]:
        """``run.deterministic``: evaluate every round after the last one evaluated up to
        round ``upto`` (version k of every fragment, read from the store's kept versions),
        each as an ``eval`` event keyed ``round`` whose tokens are those its versions hold
        (:func:`ddiloco.workers.run.deterministic.round_tokens`). A round whose versions the
        store no longer keeps is passed over with a warning. Returns the events' fields.
        """
        import logging

        out = []
        per_step = tokens_per_batch(self.manifest) * self.cfg.train.accumulate
        for k in range(self.last_round + 1, upto + 1):
            self.last_round = k
            t0 = time.monotonic()
            blobs = [self.store.get_version(p, k) for p in range(self.layout.n_fragments)]
            if any(b is None for b in blobs):
                logging.getLogger("ddiloco.evaluator").warning(
                    "round %d: not every fragment keeps version %d any more (sync.history); "
                    "not evaluated", k, k)
                continue
            kept = [b for b in blobs if b is not None]
            loss, versions = self._loss(kept)
            tokens = round_tokens([b.meta.get("merged") or {} for b in kept], per_step)
            out.append(self._event(loss, versions, tokens, t0, {"round": k}))
        return out


def run_evaluator(store: ParameterStore, every_s: float | None = None, once: bool = False,
                  metrics_port: int | None = None, run_dir: Path | None = None) -> int:
    """Process entry: evaluate every ``every_s`` seconds (default ``run.eval_every_s``) until
    SIGTERM or a stop request in the store (then once more); ``metrics_port``: serve Prometheus
    metrics there (:mod:`ddiloco.workers.run.metrics`); ``run_dir``: where the run's ``tracking``
    section puts TensorBoard and W&B files (:mod:`ddiloco.workers.tracking`; None: ``out``).
    Returns the exit code.

    Raises:
        StoreUnavailable: the run has no manifest after 60 s.
        TrackingUnavailable: the tracking section asks for a package that is not installed.
    """
    log = setup_logging("evaluator")
    stopping = {"flag": False}

    def _stop(signum: int, _frame: Any) -> None:
        stopping["flag"] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    manifest = wait_for_manifest(store)
    ev = Evaluator(store, manifest)
    unit = manifest_loss_unit(manifest)
    tracker = open_tracker(ev.cfg, Path("out") if run_dir is None else run_dir, store.run_id,
                           unit)
    merges = MergeCounter(store)
    if tracker is not None:
        log.info("tracking: %s", ", ".join(
            f"{name} in {path}" for name, path, on in
            (("TensorBoard", tracker.tb_dir, tracker.tb is not None),
             ("W&B", tracker.wandb_dir, tracker.wb is not None)) if on))
    if metrics_port is not None:
        from ddiloco.workers.run.metrics import EvaluatorCollector, serve_metrics

        serve_metrics(EvaluatorCollector(ev), metrics_port)
    if ev.cfg.run.eval_nice > 0:
        # Learners and shards share these cores: the evaluator takes what they leave.
        os.nice(ev.cfg.run.eval_nice)
    every_tokens = eval_interval_tokens(ev.cfg.run.eval_every_tokens,
                                        token_budget(ev.cfg, manifest))
    period = every_s or ev.cfg.run.eval_every_s
    if ev.deterministic:
        period = min(period, ROUND_POLL_S)
    started = time.time()
    last_check = 0.0

    def stop_or_over() -> bool:
        """SIGTERM, or (asked at most every STOP_CHECK_S) a stop request in the store."""
        nonlocal last_check
        if not stopping["flag"] and time.monotonic() - last_check > STOP_CHECK_S:
            last_check = time.monotonic()
            try:
                # The run is over (``ddiloco finish``): evaluate once more, as on SIGTERM.
                stopping["flag"] |= store.stop_requested("evaluator", since=started)
            except StoreUnavailable:
                pass
        return stopping["flag"]

    try:
        while True:
            try:
                blobs = store.heads(ev.layout.n_fragments)
                if not ev.batches:
                    log.warning("task %s has no eval_batches: the evaluator only waits",
                                ev.task.name)
                    period = float("inf") if not once else period
                elif all(b is not None for b in blobs):
                    if ev.deterministic:
                        done = ev.record_rounds(complete_round(
                            b.version if b is not None else None for b in blobs) or 0)
                        if once or stopping["flag"]:
                            done.append(ev.record(final=True))
                    elif once or stopping["flag"] or eval_due(
                            sum(store.counters("tokens").values()), ev.last_tokens,
                            every_tokens):
                        done = [ev.record()]
                    else:
                        done = []
                    for fields in done:
                        log.info("val loss %.4f %s at %d tokens%s", fields["loss"], unit,
                                 fields["tokens"], f" (round {fields['round']})"
                                 if "round" in fields else "")
                        log.debug("evaluated versions %s in %.3f s", fields["versions"],
                                  fields["eval_s"])
                        if tracker is not None:
                            tracker.log(fields, merges())
            except StoreUnavailable as exc:
                log.warning("store unavailable: %s", exc)  # evaluate again when it is back
            if once or stopping["flag"]:
                break
            poll_until(stop_or_over, timeout_s=min(period, 1e9), interval_s=0.05)
    finally:
        if tracker is not None:
            tracker.close()  # the last points reach the event file and the W&B run
    cost = {"evals": ev.evals, "eval_s": round(ev.eval_s, 3),
            "cpu_s": round(time.process_time(), 3)}
    log.info("evaluator: %d evaluations, %.1f s evaluating, %.1f CPU s in all", ev.evals,
             ev.eval_s, cost["cpu_s"])
    try:
        store.add_event("evaluator_stop", {"loss": ev.last_loss, **cost})
    except StoreUnavailable as exc:
        log.warning("store unavailable at stop: %s", exc)
    return 0
