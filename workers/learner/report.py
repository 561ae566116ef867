"""What a learner tells the run: its state and progress, and the records it writes to the store.

A learner's :class:`Progress` exists before anything reads it: the training thread writes it,
the heartbeat ticker (:class:`Reporter`) and the metrics thread
(:class:`ddiloco.workers.run.metrics.LearnerCollector`) read it without locks, from JOINING on. The
:class:`Reporter` of a leader writes the TTL heartbeat, the token fate of its incarnation
(DESIGN §5), the wire counters and the learner's events (``join``, ``first_step``, ``adopted``,
``round_wait``, ``leave``) to the store. A follower of a multi-process learner
(:mod:`ddiloco.workers.learner.multihost`) has a progress record and no reporter: the leader
reports for
the learner.
"""

from __future__ import annotations

import json
import logging
import math
import os
import socket
import time
from collections import deque
from dataclasses import dataclass, field
from enum import Enum
from typing import Any

from ddiloco.pipeline.errors import StoreUnavailable
from ddiloco.store.base import ParameterStore
from ddiloco.store.core import Batch
from ddiloco.workers.learner.blocking import Release
from ddiloco.workers.learner.comms import Comms
from ddiloco.workers.run.config import Config
from ddiloco.workers.run.liveness import Ticker, heartbeat_ttl_s

__all__ = ["Progress", "Reporter", "State"]


class State(Enum):
    """Learner states (STYLE: one state machine, transitions in one place:
    :meth:`Progress.transition`)."""

    JOINING = "joining"
    SYNCING = "syncing"
    TRAINING = "training"
    DRAINING = "draining"
    STOPPED = "stopped"


#: a learner's start-up stages, in order (:attr:`Progress.stages`)
STAGES = ("process", "main", "joined", "synced", "first_step")


def process_age_s(stat: str, since_boot_s: float, ticks_per_s: int) -> float:
    """How long ago a process started, seconds, from its ``/proc/<pid>/stat`` line.

    Field 22 (``starttime``) counts clock ticks from boot to the process's start; its command
    name (field 2) may hold spaces and parentheses, so the fields are counted from the last
    ``)``. ``since_boot_s`` is ``clock_gettime(CLOCK_BOOTTIME)`` now, on the kernel's clock of
    the same origin. (psutil's ``create_time`` adds ``starttime`` to the boot time in whole
    seconds from ``/proc/stat``: up to 1 s early, the same for every process of a boot.)

    >>> process_age_s("42 (a) b) S 1 " + " ".join(["0"] * 17) + " 1234 0", 20.0, 100)
    7.66

    Raises:
        ValueError: not a stat line.
    """
    fields = stat[stat.rindex(")") + 2:].split()
    return round(since_boot_s - int(fields[19]) / ticks_per_s, 6)


def process_start_time() -> float | None:
    """This process's start, ``time.time()`` seconds, to the kernel's clock tick (10 ms on
    most Linux builds); elsewhere psutil's ``create_time``; None when neither is at hand.
    A forked process starts at its fork."""
    try:
        with open("/proc/self/stat") as f:
            stat = f.read()
        now_boot, now = time.clock_gettime(time.CLOCK_BOOTTIME), time.time()
        return now - process_age_s(stat, now_boot, os.sysconf("SC_CLK_TCK"))
    except (OSError, ValueError, AttributeError):
        pass
    try:
        import psutil

        return float(psutil.Process().create_time())
    except (ImportError, OSError):
        return None


def stage_durations(stamps: dict[str, float]) -> dict[str, float]:
    """Seconds spent reaching each start-up stage from the one before (:data:`STAGES`; a
    stage not stamped is left out and the next counts from the last one stamped), and
    ``total`` from the first stamp to the last.

    >>> stage_durations({"process": 10.0, "main": 11.5, "joined": 11.75, "first_step": 13.0})
    {'main': 1.5, 'joined': 0.25, 'first_step': 1.25, 'total': 3.0}
    """
    out: dict[str, float] = {}
    prev: float | None = None
    first: float | None = None
    for name in STAGES:
        if name not in stamps:
            continue
        t = stamps[name]
        if prev is not None:
            out[name] = round(t - prev, 4)
        else:
            first = t
        prev = t
    if prev is not None and first is not None and out:
        out["total"] = round(prev - first, 4)
    return out


@dataclass
class Progress:
    """A learner's state and counters, as its other threads see them.

    The training thread writes them; the heartbeat, metrics and comms threads read them
    without locks, so a field that holds several numbers (``fate``, ``versions``) is replaced
    as a whole, never changed in place: a reader sees one consistent value.

    Attributes:
        log: the learner process's logger (transitions are logged there).
        state: where the learner is in its state machine.
        incarnation: this life's incarnation; 0 until JOINING registers, always 0 on a
            follower (which never registers).
        comms: the comms thread once JOINING started it, for the metrics thread; None before,
            and always on a follower (which has none).
        step: inner steps taken (restored at SYNCING).
        start_step: the step TRAINING started at in this incarnation.
        tokens_total: tokens trained, over every incarnation (restored at SYNCING).
        loss: the loss of the last logged step (NaN: none yet).
        ema_step: EMA of the inner step time, seconds (what deltas report; None: warming up).
        step_time_mean: mean steady-state step time, seconds (None: not measured yet).
        fate: this incarnation's (processed, overwritten, drain) fragment-tokens (DESIGN §5).
        versions: the version of each fragment adopted; empty until SYNCING read them, and
            always on a follower.
        stages: wall-clock times (``time.time()``, seconds) this incarnation reached each
            stage of its start: ``process`` (the OS started it), ``main`` (interpreter,
            imports and JAX set up), ``joined`` (manifest read, registered, comms thread and
            its CURVE sockets up), ``synced`` (task built, versions read from the store,
            checkpoint restored, inner step traced), ``first_step`` (the first inner step's
            result is ready: its compilation is behind it); :func:`stage_durations`.
    """

    log: logging.Logger
    state: State = State.JOINING
    incarnation: int = 0
    comms: Comms | None = None
    step: int = 0
    start_step: int = 0
    tokens_total: int = 0
    loss: float = math.nan
    ema_step: float | None = None
    step_time_mean: float | None = None
    fate: tuple[int, int, int] = (0, 0, 0)
    versions: list[int] = field(default_factory=list)
    stages: dict[str, float] = field(default_factory=dict)

    def stage(self, name: str) -> None:
        """Stamp the time this incarnation reached start-up stage ``name`` (``stages``)."""
        self.stages[name] = time.time()

    def transition(self, new: State, **detail: Any) -> None:
        """Move to ``new``; every transition is logged with ``detail`` (e.g. its versions)."""
        self.log.info("%s -> %s %s", self.state.value, new.value,
                      json.dumps(detail, default=str) if detail else "")
        self.state = new

    def stepped(self, tokens: int, n_fragments: int) -> None:
        """One inner step on ``tokens`` tokens is done: each of the ``n_fragments`` fragments
        processed them."""
        self.step += 1
        self.tokens_total += tokens
        processed, overwritten, drain = self.fate
        self.fate = (processed + tokens * n_fragments, overwritten, drain)

    def discard(self, overwritten: int = 0, drain: int = 0) -> None:
        """Count fragment-tokens of unsent work as discarded: ``overwritten`` by an adoption
        (``sync.adopt`` overwrite or mix), or left at the ``drain``."""
        processed, was_overwritten, was_drain = self.fate
        self.fate = (processed, was_overwritten + overwritten, was_drain + drain)


class Reporter:
    """A leader's reports to the store: its heartbeat on a ticker thread (from JOINING on, so a
    long SYNCING or a JIT compilation does not let the learner's TTL entry lapse), its token
    fate, its events and its leave.

    Args:
        store: the run's parameter store.
        learner_id: e.g. "learner-0".
        cfg: the run's configuration (``run.heartbeat_s``, ``run.learner_ttl_s``).
        incarnation: this life's incarnation (registered).
        comms: the learner's comms thread (its byte and sent-token counters).
        progress: the learner's progress (read on every tick).
    """

    def __init__(self, store: ParameterStore, learner_id: str, cfg: Config, incarnation: int,
                 comms: Comms, progress: Progress) -> None:
        self.store = store
        self.id = learner_id
        self.cfg = cfg
        self.incarnation = incarnation
        self.comms = comms
        self.progress = progress
        #: durations of the last heartbeat ticks, seconds (they set the entry's TTL)
        self.heartbeat_ticks: deque[float] = deque(maxlen=20)
        self.heartbeat_tick_max = 0.0
        #: tokens and wire bytes already added to the run's counters
        self.tokens_reported = 0
        self._bytes_reported = (0, 0)
        self.ticker = Ticker(cfg.run.heartbeat_s, self.heartbeat, f"{learner_id}-heartbeat")

    def start(self) -> Reporter:
        """Start the heartbeat ticker (its first tick happens at once); returns self."""
        self.ticker.start()
        return self

    def stop(self) -> None:
        """Stop the heartbeat ticker (joins its thread, at most 5 s)."""
        self.ticker.stop()

    def resumed(self, tokens_total: int) -> None:
        """SYNCING restored ``tokens_total`` from a checkpoint: a previous incarnation added
        those to the run's counter already. Call before the progress record holds them, so
        that a tick in between does not add them again."""
        self.tokens_reported = tokens_total

    # ---------------------------------------------------------------- liveness
    def heartbeat(self) -> None:
        """One round trip to the store: the TTL entry, the fate record and the counters in one
        pipeline, so a slow link costs one queueing delay per tick, not one per write. The
        entry's TTL covers the worst recent tick
        (:func:`ddiloco.workers.run.liveness.heartbeat_ttl_s`).

        Raises:
            StoreUnavailable: the store did not answer (the ticker logs it and ticks on).
        """
        t0 = time.monotonic()
        pr = self.progress
        ttl_s = heartbeat_ttl_s(self.cfg.run.learner_ttl_s, self.cfg.run.heartbeat_s,
                                self.heartbeat_ticks)
        up, down = self.comms.bytes_up, self.comms.bytes_down
        info = {"state": pr.state.value, "step": pr.step, "tokens": pr.tokens_total,
                "loss": None if pr.loss != pr.loss else round(pr.loss, 4),
                "incarnation": self.incarnation, "pid": os.getpid(),
                "host": socket.gethostname(), "bytes_up": up, "bytes_down": down,
                "versions": pr.versions, "ttl_s": round(ttl_s, 3)}
        pipe = self.store.pipeline()
        self.store.heartbeat_learner(self.id, info, int(ttl_s * 1000), pipe=pipe)
        self.write_fate("running", pipe)
        total = pr.tokens_total  # one read: the trainer keeps counting meanwhile
        if total > self.tokens_reported:
            self.store.incr_counter("tokens", self.id, total - self.tokens_reported, pipe=pipe)
        prev_up, prev_down = self._bytes_reported
        if up > prev_up or down > prev_down:
            self.store.incr_counter("wire", "up", up - prev_up, pipe=pipe)
            self.store.incr_counter("wire", "down", down - prev_down, pipe=pipe)
        self.store.set_wire_peers(self.id, self.incarnation, self.comms.peer_bytes_snapshot(),
                                  pipe=pipe)
        pipe.execute()  # StoreUnavailable in an outage: the heartbeat ticker's to handle
        # Only now: a failed tick must not count its increments as reported.
        self.tokens_reported = max(self.tokens_reported, total)
        if up > prev_up or down > prev_down:
            self._bytes_reported = (up, down)
        tick = time.monotonic() - t0
        self.heartbeat_ticks.append(tick)
        self.heartbeat_tick_max = max(self.heartbeat_tick_max, tick)

    def write_fate(self, ended: str, pipe: Batch | None = None) -> None:
        """Store this incarnation's cumulative token fate (DESIGN §5). ``sent`` is read before
        the trainer's triple, so every sent token is already counted as processed.

        Args:
            ended: ``running`` while the learner trains, ``drained`` at its leave.
            pipe: a store pipeline to add the write to (the caller executes it); None: write
                now.

        Raises:
            StoreUnavailable: written now, and the store did not answer.
        """
        sent = self.comms.sent_tokens
        pr = self.progress
        processed, overwritten, drain = pr.fate
        self.store.set_fate(self.id, self.incarnation, {
            "processed": processed, "sent": sent,
            "discarded": {"overwritten": overwritten, "drain": drain},
            "start_step": pr.start_step, "step": pr.step, "ended": ended,
            "step_time_mean_s": pr.step_time_mean, "time": time.time()}, pipe=pipe)

    # ---------------------------------------------------------------- events
    def event(self, kind: str, fields: dict[str, Any]) -> None:
        """Record an event; a store outage must not stop training (the event is lost)."""
        try:
            self.store.add_event(kind, fields)
        except StoreUnavailable as exc:
            self.progress.log.warning("event %s not recorded: %s", kind, exc)

    def record_join(self) -> None:
        """The ``join`` event of this incarnation.

        Raises:
            StoreUnavailable: the store did not answer (a learner that cannot record its join
                does not start).
        """
        self.store.add_event("join", {"learner": self.id, "incarnation": self.incarnation})

    def record_rejoin(self, digests: dict[str, str]) -> None:
        """Record, for audits, exactly what this incarnation adopted from the store.

        Args:
            digests: fragment (as a string) -> digest of the values adopted at SYNCING
                (:func:`ddiloco.workers.run.blobs.digest`).
        """
        pr = self.progress
        self.event("adopted", {"learner": self.id, "incarnation": self.incarnation,
                               "versions": pr.versions, "digests": digests, "step": pr.step})

    def record_first_step(self, first_calls: dict[str, str]) -> None:
        """The ``first_step`` event: this incarnation's first inner step is done (the caller
        waited for its loss, so the step's compilation is behind it). ``first_calls``:
        program -> "compiled" (in this process), "loaded" (from the persistent cache) or
        its turn at the cache (:attr:`ddiloco.workers.learner.inner.InnerLoop.first_calls`;
        empty for the PyTorch engine)."""
        pr = self.progress
        pr.stage("first_step")
        self.event("first_step", {"learner": self.id, "incarnation": self.incarnation,
                                  "step": pr.step, "versions": pr.versions,
                                  "stages_s": stage_durations(pr.stages),
                                  "first_calls": dict(first_calls)})

    def record_release(self, r: Release) -> None:
        """A ``round_wait`` event: which round, the version that released it, whether that
        merge included this learner, and the steps taken by then (at most the send step +
        tau: the check that no learner ran ahead of its round's merge)."""
        a = r.awaited
        self.event("round_wait", {"learner": self.id, "incarnation": self.incarnation,
                                  "fragment": a.fragment, "base": a.base,
                                  "sent_step": a.step, "version": r.version,
                                  "included": r.included, "timed_out": r.timed_out,
                                  "waited_s": round(r.waited_s, 4), "step": self.progress.step})

    def leave(self, eager_estimates: int) -> None:
        """The end of DRAINING, once the ticker and the comms thread stopped (their counts are
        final): a last heartbeat, the ``drained`` fate, deregistration and the ``leave`` event.

        Args:
            eager_estimates: eager moves made in this incarnation (``sync.eager``).

        Raises:
            StoreUnavailable: the store did not answer.
        """
        pr = self.progress
        self.heartbeat()
        self.write_fate("drained")
        self.store.remove_learner(self.id)
        self.store.add_event("leave", {"learner": self.id, "incarnation": self.incarnation,
                                       "step": pr.step, "tokens": pr.tokens_total,
                                       "step_time_mean_s": pr.step_time_mean,
                                       "deltas_sent": self.comms.sent,
                                       "deltas_folded": self.comms.folded,
                                       "eager_estimates": eager_estimates,
                                       "bytes_up": self.comms.bytes_up,
                                       "bytes_down": self.comms.bytes_down,
                                       "heartbeat_tick_max_s": self.heartbeat_tick_max})
