"""Prometheus metrics of a worker process (``prometheus_client``), read at scrape time.

Each worker started with ``--metrics-port N`` serves ``http://HOST:N/metrics``. The values
are read from the worker's own state when Prometheus scrapes (custom collectors), so the inner
loop and the shard's message path pay nothing for them. Names (all prefixed ``ddiloco_``):

learner (label ``learner``)
    ``learner_steps_total``, ``learner_tokens_total``, ``learner_step_seconds`` (EMA of the
    inner step), ``learner_loss``, ``learner_state{state}`` (1 for the current state),
    ``learner_incarnation`` (rises on every rejoin), ``learner_fragment_version{fragment}``,
    ``learner_version_lag{fragment}`` (newest version seen minus version adopted),
    ``learner_bytes_total{direction}`` (wire bytes up/down), ``learner_peer_bytes_total{src,dst}``,
    ``learner_processed_fragment_tokens_total``, ``learner_sent_fragment_tokens_total``,
    ``learner_discarded_fragment_tokens_total{why}`` (token fate, DESIGN §5).
syncer shard (label ``shard``)
    ``shard_merges_total``, ``shard_merged_contributions_total`` (participation = its rate over
    the merges' rate), ``shard_merged_fragment_tokens_total`` (goodput's numerator),
    ``shard_grace_wait_seconds_total`` (quorum to merge, summed), ``shard_drops_total{reason}``
    (every reason, zero until it happens), ``shard_corrected_tensors_total{action}``
    (``sync.correction``), ``shard_fragment_version{fragment}``.
evaluator
    ``eval_loss``, ``eval_tokens``, ``eval_wire_bytes``.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from ddiloco.pipeline import errors

if TYPE_CHECKING:
    from ddiloco.workers.learner.report import Progress


def drop_reasons() -> list[str]:
    """Every named drop reason (:class:`ddiloco.pipeline.errors.DropError` subclasses), sorted."""
    out: set[str] = set()
    stack: list[type] = [errors.DropError]
    while stack:
        cls = stack.pop()
        stack.extend(cls.__subclasses__())
        reason = getattr(cls, "reason", None)
        if isinstance(reason, str):
            out.add(reason)
    return sorted(out)


class LearnerCollector:
    """Metrics of a learner, from its :class:`ddiloco.workers.learner.report.Progress` (read
    without locks: a scrape may see a step's counters half updated, never a torn number).

    Args:
        learner_id: e.g. "learner-0" (the ``learner`` label).
        progress: the learner's progress; it exists before the learner joins, so the
            metrics are served from the start (zeros, and no wire counters until JOINING
            started the comms thread).
    """

    def __init__(self, learner_id: str, progress: Progress) -> None:
        self.id = learner_id
        self.progress = progress

    def collect(self) -> Iterator[Metric]:
        pr = self.progress
        lid = [self.id]
        steps = CounterMetricFamily("ddiloco_learner_steps", "inner steps", labels=["learner"])
        steps.add_metric(lid, pr.step)
        yield steps
        tokens = CounterMetricFamily("ddiloco_learner_tokens", "tokens trained",
                                     labels=["learner"])
        tokens.add_metric(lid, pr.tokens_total)
        yield tokens
        step_s = GaugeMetricFamily("ddiloco_learner_step_seconds",
                                   "inner step time (EMA), seconds", labels=["learner"])
        step_s.add_metric(lid, float(pr.ema_step or 0.0))
        yield step_s
        loss = GaugeMetricFamily("ddiloco_learner_loss", "training loss of the last logged step",
                                 labels=["learner"])
        loss.add_metric(lid, float(pr.loss))
        yield loss
        state = GaugeMetricFamily("ddiloco_learner_state", "1 for the learner's current state",
                                  labels=["learner", "state"])
        current = pr.state
        for s in type(current):  # the learner's State enum
            state.add_metric([self.id, s.value], 1.0 if s is current else 0.0)
        yield state
        inc = GaugeMetricFamily("ddiloco_learner_incarnation",
                                "incarnation (rises by one on every rejoin)", labels=["learner"])
        inc.add_metric(lid, float(pr.incarnation))
        yield inc
        versions = pr.versions
        comms = pr.comms
        ver = GaugeMetricFamily("ddiloco_learner_fragment_version", "version adopted",
                                labels=["learner", "fragment"])
        lag = GaugeMetricFamily("ddiloco_learner_version_lag",
                                "newest version seen minus version adopted",
                                labels=["learner", "fragment"])
        seen = dict(comms.view) if comms is not None else {}
        for p, v in enumerate(versions):
            ver.add_metric([self.id, str(p)], float(v))
            newest = seen.get(p, (v, None))[0]
            lag.add_metric([self.id, str(p)], float(max(0, newest - v)))
        yield ver
        yield lag
        wire = CounterMetricFamily("ddiloco_learner_bytes", "wire bytes (ZeroMQ frames)",
                                   labels=["learner", "direction"])
        wire.add_metric([self.id, "up"], comms.bytes_up if comms is not None else 0)
        wire.add_metric([self.id, "down"], comms.bytes_down if comms is not None else 0)
        yield wire
        peers = CounterMetricFamily("ddiloco_learner_peer_bytes",
                                    "application bytes per directed pair of workers",
                                    labels=["learner", "src", "dst"])
        snapshot = comms.peer_bytes_snapshot() if comms is not None else {}
        for pair, n in sorted(snapshot.items()):
            src, _, dst = pair.partition(">")
            peers.add_metric([self.id, src, dst], n)
        yield peers
        processed, overwritten, drain = pr.fate
        fate = CounterMetricFamily("ddiloco_learner_processed_fragment_tokens",
                                   "fragment-tokens processed (token fate)", labels=["learner"])
        fate.add_metric(lid, processed)
        yield fate
        sent = CounterMetricFamily("ddiloco_learner_sent_fragment_tokens",
                                   "fragment-tokens handed to a socket", labels=["learner"])
        sent.add_metric(lid, comms.sent_tokens if comms is not None else 0)
        yield sent
        disc = CounterMetricFamily("ddiloco_learner_discarded_fragment_tokens",
                                   "fragment-tokens discarded", labels=["learner", "why"])
        disc.add_metric([self.id, "overwritten"], overwritten)
        disc.add_metric([self.id, "drain"], drain)
        yield disc


class ShardCollector:
    """Metrics of a :class:`ddiloco.workers.syncer.core.ShardCore`."""

    def __init__(self, core: Any) -> None:
        self.core = core
        self.reasons = drop_reasons()

    def collect(self) -> Iterator[Metric]:
        c = self.core
        sid = [c.name]

        def counter(name: str, doc: str, value: float) -> Metric:
            m = CounterMetricFamily(name, doc, labels=["shard"])
            m.add_metric(sid, value)
            return m

        yield counter("ddiloco_shard_merges", "merges published", c.merges)
        yield counter("ddiloco_shard_merged_contributions",
                      "learner contributions merged (participation: per merge)",
                      c.merged_contributions)
        yield counter("ddiloco_shard_merged_fragment_tokens",
                      "fragment-tokens merged into the global model", c.merged_tokens)
        yield counter("ddiloco_shard_grace_wait_seconds",
                      "seconds from a round's quorum to its merge, summed", c.grace_wait_s)
        drops = CounterMetricFamily("ddiloco_shard_drops", "messages and contributions dropped",
                                    labels=["shard", "reason"])
        seen = dict(c.drops)
        for reason in sorted(set(self.reasons) | set(seen)):
            drops.add_metric([c.name, reason], seen.get(reason, 0))
        yield drops
        corrected = CounterMetricFamily(
            "ddiloco_shard_corrected_tensors", "tensors of contributions the heloco correction "
            "kept, shrunk or turned (sync.correction)", labels=["shard", "action"])
        for action in ("kept", "shrunk", "turned"):
            corrected.add_metric([c.name, action], float(sum(
                st.corrected.get(action, 0) for st in c.frags.values())))
        yield corrected
        ver = GaugeMetricFamily("ddiloco_shard_fragment_version", "newest published version",
                                labels=["shard", "fragment"])
        for p, st in sorted(c.frags.items()):
            ver.add_metric([c.name, str(p)], float(st.version))
        yield ver


class EvaluatorCollector:
    """Metrics of a :class:`ddiloco.workers.evaluator.Evaluator` (its last evaluation)."""

    def __init__(self, evaluator: Any) -> None:
        self.evaluator = evaluator

    def collect(self) -> Iterator[Metric]:
        last = getattr(self.evaluator, "last_fields", None) or {}
        for name, key, doc in (("ddiloco_eval_loss", "loss", "validation loss of the global "
                                "model (nats/byte for the built-in GPT)"),
                               ("ddiloco_eval_tokens", "tokens", "tokens trained at that "
                                "evaluation"),
                               ("ddiloco_eval_wire_bytes", "wire_bytes", "wire bytes then")):
            if key in last:
                g = GaugeMetricFamily(name, doc)
                g.add_metric([], float(last[key]))
                yield g


def serve_metrics(collector: Any, port: int, host: str = "0.0.0.0") -> int:
    """Serve ``collector`` at ``http://host:port/metrics`` from a daemon thread; returns the
    port (``port`` 0: an ephemeral one).

    Raises:
        OSError: the port is taken.
    """
    from prometheus_client import CollectorRegistry, start_http_server

    registry = CollectorRegistry(auto_describe=True)
    registry.register(collector)
    server, _thread = start_http_server(port, addr=host, registry=registry)
    return int(server.server_port)
