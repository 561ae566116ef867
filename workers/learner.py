"""A learner: inner AdamW steps on its own shard, staggered fragment sync that never blocks.

One state machine, ``JOINING -> SYNCING -> TRAINING -> DRAINING -> STOPPED`` (DESIGN §2):

* JOINING: register (new incarnation), read the run manifest, start the comms thread
  (:mod:`ddiloco.workers.comms`), which subscribes to every shard's broadcast *before* the snapshot
  is
  read (zguide Clone pattern).
* SYNCING: read the latest version of every fragment from the store, adopt them, restore the
  inner optimizer state and data position from this learner's own checkpoint if it has one.
* TRAINING: the loop. Sends and receives happen on the comms thread; the training thread only
  copies the due fragment to the host, subtracts and hands it over (folding into a pending
  unsent delta for the same fragment), and adopts versions the comms thread has decoded.
* DRAINING (SIGTERM): send a final delta of every fragment with unsent work, wait briefly for
  the queue to empty, checkpoint, deregister.

This is the Decoupled DiLoCo learner; variants override its hooks (the data-parallel
baseline, :mod:`ddiloco.workers.dp`) and :mod:`ddiloco.workers.roles` picks the class of a run.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Sequence
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ddiloco.pipeline import codec
from ddiloco.pipeline.errors import (
    ConfigError,
    DDilocoError,
    StoreUnavailable,
    WorkerThreadDied,
)
from ddiloco.pipeline.fragments import due_fragments, fragment_offsets, initial_last_sends
from ddiloco.pipeline.waiting import poll_until, wait_until
from ddiloco.store.base import FragmentBlob, ParameterStore
from ddiloco.store.core import Batch
from ddiloco.workers.adoption import adopt_fragment, eager_move
from ddiloco.workers.blobs import decode_blob, digest
from ddiloco.workers.blocking import Gate, NoWait, Release, gate_for
from ddiloco.workers.comms import Comms, Outgoing
from ddiloco.workers.liveness import Ticker, heartbeat_ttl_s
from ddiloco.workers.lr_clock import global_step, schedule_share, set_lr_scale
from ddiloco.workers.manifest import manifest_config, manifest_layout, wait_for_manifest
from ddiloco.workers.runtime import setup_logging

if TYPE_CHECKING:
    from ddiloco.workers.multihost import HostGroup

__all__ = ["STEP_TIME_SKIP", "Learner", "State", "run"]


#: Inner steps after a (re)start left out of the reported step time (they hold compilation).
STEP_TIME_SKIP = 3
#: How long SYNCING waits for every fragment to have a version, seconds.
VERSIONS_WAIT_S = 120.0
#: How long DRAINING waits for the comms thread to hand the last deltas to a socket, seconds.
DRAIN_WAIT_S = 3.0


class State(Enum):
    """Learner states (STYLE: one state machine, transitions in one place)."""

    JOINING = "joining"
    SYNCING = "syncing"
    TRAINING = "training"
    DRAINING = "draining"
    STOPPED = "stopped"


class Learner:
    """One learner process's training side (Decoupled DiLoCo; a variant, such as the
    data-parallel baseline, subclasses it and overrides its hooks).

    Args:
        store: parameter store of the run (heartbeats, events, SYNCING's reads).
        comms_store: the comms thread's own connection to the same store.
        learner_id: e.g. "learner-0"; its index (trailing int) picks its data shard.
        run_dir: where checkpoints and the compilation cache live.
        max_steps: stop after this many inner steps (None: ``train.steps``).
        group: the processes of a multi-process learner (:mod:`ddiloco.workers.multihost`).
    """

    #: the network side (a variant's learner brings its own)
    comms_class: type[Comms] = Comms
    #: whether a (re)join reads the fragments' momentum blobs: DiLoCo learners need values
    #: alone; the data-parallel job keeps its optimizer state there
    reads_momentum = False

    def __init__(self, store: ParameterStore, comms_store: ParameterStore, learner_id: str,
                 run_dir: Path,
                 max_steps: int | None = None, group: HostGroup | None = None) -> None:
        #: the processes of a multi-process learner (:mod:`ddiloco.workers.multihost`); None: one
        self.group = group
        #: a follower computes only: the leader (process 0) talks to shards and the store
        self.follower = group is not None and not group.leader
        self._shared_stop = False
        self.store = store
        self.comms_store = comms_store
        self.id = learner_id
        self.run_dir = run_dir
        self.log = setup_logging(learner_id if group is None or group.leader
                                 else f"{learner_id}.p{group.index}")
        self.state = State.JOINING
        self.stop = threading.Event()
        self.max_steps = max_steps
        self.step = 0
        self.tokens_total = 0
        self.tokens_reported = 0
        self._bytes_reported = (0, 0)
        #: durations of the last heartbeat ticks, seconds (they set the entry's TTL)
        self.heartbeat_ticks: deque[float] = deque(maxlen=20)
        self.heartbeat_tick_max = 0.0
        self.loss = float("nan")
        self.step_time_mean: float | None = None
        #: EMA of the inner step time, seconds (what deltas report; metrics)
        self.ema_step: float | None = None
        #: (processed, overwritten, drain) fragment-tokens of this incarnation (DESIGN §5);
        #: replaced as a whole so other threads read a consistent triple.
        self.fate: tuple[int, int, int] = (0, 0, 0)
        self.start_step = 0
        #: whether an inner step waits for the merge of this learner's round (chosen at
        #: JOINING from ``sync.blocking``; :mod:`ddiloco.workers.blocking`)
        self.gate: Gate = NoWait()
        #: learner -> the latest step a version reported for it (``train.lr_clock``)
        self.peer_steps: dict[str, int] = {}

    def transition(self, new: State, **detail: Any) -> None:
        """Move to ``new``; every transition is logged and recorded with its versions."""
        self.log.info("%s -> %s %s", self.state.value, new.value,
                      json.dumps(detail, default=str) if detail else "")
        self.state = new

    # ---------------------------------------------------------------- set-up
    def join(self) -> None:
        """JOINING: register, read the manifest, subscribe."""
        self.manifest = wait_for_manifest(self.store)
        self.cfg = manifest_config(self.manifest)
        self.layout = manifest_layout(self.manifest)
        if self.group is not None:
            if self.manifest["mode"] != "diloco":
                raise DDilocoError("multi-process learners train DiLoCo runs only (run.mode "
                                   "= diloco)")
            self.group.layout = self.layout
        s = self.cfg.sync
        # The data-parallel half of `ddiloco run --baseline dp` carries the DiLoCo run's
        # sync.blocking; its steps are synchronous already.
        blocking = s.blocking and self.manifest["mode"] == "diloco"
        if blocking and self.group is not None:
            raise DDilocoError("sync.blocking: a multi-process learner cannot wait for its "
                               "round (its processes adopt together); run it as one process "
                               "or set sync.blocking=false")
        self.gate = gate_for(blocking, self.id, s.tau, s.blocking_timeout_s)
        if self.follower:
            self.incarnation = 0
            return
        self.incarnation = self.store.register_learner(self.id)
        self.comms = self.comms_class(self.comms_store, self.manifest, self.id,
                                      self.incarnation, self.log)
        self.comms.fate_source = lambda: self.fate
        self.comms.start()
        self.ticker = Ticker(self.cfg.run.heartbeat_s, self._heartbeat,
                             f"{self.id}-heartbeat").start()
        self.store.add_event("join", {"learner": self.id, "incarnation": self.incarnation})

    def sync(self) -> None:
        """SYNCING: build the task, adopt the store's latest versions, restore the checkpoint.

        Raises:
            TaskError: this process's task does not have the run's parameters.
            CheckpointMismatch: the checkpoint's optimizer tree is not this task's.
        """
        from ddiloco.workers.checkpoint import LearnerCheckpoint
        from ddiloco.workers.inner import InnerLoop
        from ddiloco.workers.task import DataShard, TaskError
        from ddiloco.workers.task_loader import build_task

        self.transition(State.SYNCING, incarnation=self.incarnation)
        cfg = self.cfg
        self.task = build_task(cfg)
        tree = self.task.tree()
        want = {n: s for p in range(self.layout.n_fragments)
                for n, s in zip(self.layout.names(p), self.layout.shapes(p), strict=True)}
        if tree.shapes != want:
            diff = sorted(set(tree.shapes.items()) ^ set(want.items()))[:4]
            raise TaskError(f"task {self.task.name!r} does not have the run's parameters "
                            f"(first differences, path and shape: {diff}): every learner of a "
                            "run must train the same model")
        index = int(self.id.rsplit("-", 1)[-1]) if self.id.rsplit("-", 1)[-1].isdigit() else 0
        n_shards = max(cfg.run.learners, index + 1)
        t = cfg.train
        self.inner = InnerLoop(self.task, devices=cfg.run.devices, sharding=cfg.run.sharding,
                               compute_dtype=t.compute_dtype, accumulate=t.accumulate)
        self.log.info("task %s: %d parameters in %d leaves on %d %s device(s), %s, %s compute",
                      self.task.name, tree.n_values(), len(tree.names), self.inner.n_devices,
                      self.inner.mesh.devices.flat[0].platform, cfg.run.sharding,
                      t.compute_dtype)
        P = self.layout.n_fragments
        if self.follower:
            assert self.group is not None
            _, got = self.group.share(False, {})  # the leader's adopted versions
            self.params = self.inner.place_all(
                {n: t for p in range(P) for n, t in zip(self.layout.names(p), got[p],
                                                         strict=True)})
            self.opt_state = self.inner.init_opt(self.params)
            self.ckpt = LearnerCheckpoint(self.ckpt_dir / "ckpt", run_id=self.store.run_id)
            self._restore()
            self.step, self.position = self.group.share_ints([0, 0])
            self.batches = self.task.batches(DataShard(index, n_shards, self.position, t.seed))
            return
        # Wait until every fragment has a version (shards write version 0 at first start);
        # DP: until every fragment is at the same checkpoint (shards roll back at start).

        def heads_when_ready() -> list[FragmentBlob | None]:
            """The heads when ready (or stopping); ``[]`` (falsy: poll again) otherwise."""
            got = self.store.get_latest_many(list(range(self.layout.n_fragments)),
                                              momentum=self.reads_momentum)
            self.comms.count_store_read(got)
            return got if self._versions_ready(got) or self.stop.is_set() else []

        blobs = wait_until(heads_when_ready, timeout_s=VERSIONS_WAIT_S, interval_s=0.1,
                           what="every fragment to have a version (is a syncer up?)")
        params: dict[str, Any] = {}
        self.version: list[int] = []
        self.anchor: list[list[np.ndarray]] = []
        for p, blob in enumerate(blobs):
            assert blob is not None
            value = decode_blob(blob.value, self.layout.shapes(p), own=True)
            self.comms.seed(p, blob.version, value)
            self.version.append(blob.version)
            self.anchor.append(value)
            params.update(zip(self.layout.names(p), value, strict=True))
        if self.group is not None:
            self.group.share(False, dict(enumerate(self.anchor)))
        self.params = self.inner.place_all(params)
        self.opt_state = self.inner.init_opt(self.params)
        self.c_steps = [0] * P
        self.c_tokens = [0] * P
        self.unsent_tokens = [0] * P
        self.unsent_steps = [0] * P
        #: where unsent work is measured from (carry adoption): anchor after an adoption,
        #: anchor - decoded delta after a send
        self.ref: list[list[np.ndarray]] = list(self.anchor)
        #: sync.eager: each fragment's last outer step per version (previous version - anchor),
        #: None until the learner has adopted two versions of it (after a restart as well)
        self.last_step: list[list[np.ndarray] | None] = [None] * P
        #: sync.eager: the eager move made since the fragment's last adoption, if any
        self.jump: list[list[np.ndarray] | None] = [None] * P
        self.eager_estimates = 0
        if cfg.sync.eager and self.group is not None:
            raise ConfigError("sync.eager: not supported for a learner of several processes "
                              "(its followers would not see the estimate); set "
                              "sync.eager=false")
        self.ckpt = LearnerCheckpoint(self.ckpt_dir / "ckpt", run_id=self.store.run_id)
        position = self._resume(blobs)
        if self.group is not None:
            self.group.share_ints([self.step, position])
        #: batches consumed from this learner's data shard (the resume position)
        self.position = position
        self.batches = self.task.batches(DataShard(index, n_shards, position, t.seed))
        self.offsets = fragment_offsets(P, cfg.sync.H)
        self.last_send = initial_last_sends(self.offsets, cfg.sync.H, self.step)

    def _versions_ready(self, blobs: Sequence[FragmentBlob | None]) -> bool:
        """Every fragment has a version (shards write version 0 at first start)."""
        return all(b is not None for b in blobs)

    def _resume(self, blobs: Sequence[FragmentBlob | None]) -> int:
        """Restore this learner's own checkpoint; returns the data position to resume at."""
        return self._restore()

    # ---------------------------------------------------------------- checkpoints
    @property
    def ckpt_dir(self) -> Path:
        """This learner's checkpoint directory."""
        return self.run_dir / "learners" / self.id

    def checkpoint(self) -> None:
        """Checkpoint the inner optimizer state (by tree path), data position and counters
        (orbax, atomic; :mod:`ddiloco.workers.checkpoint`)."""
        meta = {"step": self.step, "position": self.position,
                "tokens_total": self.tokens_total, "versions": getattr(self, "version", []),
                "incarnation": self.incarnation, "time": time.time()}
        self.ckpt.save(self.step, self.opt_state, meta)

    def _restore(self) -> int:
        if self.ckpt.removed:
            self.log.warning("removed checkpoint steps %s torn by a crash", self.ckpt.removed)
        got = self.ckpt.restore(self.opt_state)
        if got is None:
            return 0
        self.opt_state, meta = got
        self.step = int(meta["step"])
        self.tokens_total = self.tokens_reported = int(meta["tokens_total"])
        self.log.info("restored checkpoint at step %d (data position %d)", self.step,
                      meta["position"])
        return int(meta["position"])

    # ---------------------------------------------------------------- adoption and sends
    def adopt(self) -> int:
        """Adopt newer versions (:meth:`adopt_values`) and place them on the mesh (a
        multi-process learner shares them with its followers first). Returns how many."""
        new = self.adopt_values()
        if self.group is not None:
            stop, new = self.group.share(self.stop.is_set(), new)
            self._shared_stop = self._shared_stop or stop
        if self.cfg.train.lr_clock == "global":  # the next step's rate (lr_clock module)
            g = global_step(self.step, self.peer_steps, self.id, self.cfg.run.learners)
            set_lr_scale(self.opt_state, schedule_share(self.cfg.train, g if self.group is None
                                                        else self.group.share_ints([g])[0]))
        for p, values in new.items():
            for name, t in zip(self.layout.names(p), values, strict=True):
                self.params[name] = self.inner.place(name, t)
        return len(new)

    def adopt_values(self) -> dict[int, list[np.ndarray]]:
        """The new values of every fragment with a newer version in the comms thread's inbox
        (DESIGN §2 step 3); the learner's bookkeeping moves to them (the caller places them).

        ``carry`` (default, ours): theta = Theta + (theta - ref): the local work that has not
        left yet (steps since the last send, plus the codec's error on that send) is kept and
        leaves in the next delta, so no processed token is thrown away. ``overwrite`` (paper):
        theta = Theta; unsent work is discarded (counted as ``discarded_overwritten``).
        ``mix`` (Streaming DiLoCo): theta = a*theta + (1-a)*Theta, unsent work discarded.
        Either way the anchor becomes Theta. The fragment's counters restart at what theta -
        anchor holds: the unsent steps and tokens under ``carry``, zero otherwise.
        """
        if self.follower:
            return {}
        got = self.comms.take_inbox()
        policy = self.cfg.sync.adopt
        out: dict[int, list[np.ndarray]] = {}
        for p, (ver, value, merged) in got.items():
            if ver <= self.version[p]:
                continue
            self.gate.adopted(p, ver, merged)
            self.peer_steps.update(merged)
            theta = (self._host_fragment(p)
                     if policy != "overwrite" else value)
            out[p] = adopt_fragment(policy, theta, value, alpha=self.cfg.sync.alpha,
                                    ref=self.ref[p])
            if policy == "carry":
                self.c_steps[p], self.c_tokens[p] = self.unsent_steps[p], self.unsent_tokens[p]
            else:
                if self.unsent_tokens[p]:
                    processed, overwritten, drain = self.fate
                    self.fate = (processed, overwritten + self.unsent_tokens[p], drain)
                self.c_steps[p] = self.c_tokens[p] = 0
                self.unsent_tokens[p] = self.unsent_steps[p] = 0
            if self.cfg.sync.eager:
                span = np.float32(ver - self.version[p])
                self.last_step[p] = [(a - v) / span
                                     for a, v in zip(self.anchor[p], value, strict=True)]
            self.anchor[p] = value
            self.ref[p] = value
            self.version[p] = ver
            self.jump[p] = None
            if self.cfg.sync.phase_lock:
                # Send p again H steps after adopting it: every learner adopts a version at
                # about the same time (one broadcast), so their next deltas of p arrive
                # together and meet in one round instead of splitting it.
                self.last_send[p] = self.step
        return out

    def _host_fragment(self, p: int) -> list[np.ndarray]:
        """Fragment ``p``'s current parameters as float32 host copies (gathered from the
        learner's devices)."""
        return [np.array(self.inner.host(self.params[n]), dtype=np.float32, copy=True)
                for n in self.layout.names(p)]

    def due(self) -> list[int]:
        """Fragments to send after this step: H steps after their last send, or now for an
        open round this learner decided to join (:meth:`will_join`)."""
        return due_fragments(self.step, self.last_send, self.cfg.sync.H,
                             self.comms.take_round_open())

    def will_join(self, p: int) -> bool:
        """Called by the comms thread on a round-open notice: join if at least
        (1 - early_fraction) * H steps have passed since this learner last sent p (never
        under ``sync.blocking``: :attr:`Gate.joins_rounds_early`)."""
        if (self.state is not State.TRAINING or not self.cfg.sync.round_notice
                or not self.gate.joins_rounds_early):
            return False
        early = self.cfg.sync.H * (1.0 - self.cfg.sync.early_fraction)
        return self.step - self.last_send[p] >= early

    def send_delta(self, p: int, step_time: float) -> None:
        """Compute delta = anchor - theta for fragment p and hand it to the comms thread.

        The delta is quantized here with the uplink codec (what the shard will decode), and
        ``ref`` becomes anchor - decoded delta: under ``carry`` adoption the quantization
        error is then carried like unsent work and leaves with the next delta (error
        feedback). Nothing is sent when no step was made since the last adoption."""
        self.last_send[p] = self.step
        if self.c_steps[p] == 0:
            return
        theta = self._host_fragment(p)
        jump = self.jump[p]
        if jump is not None:
            # an eager move since the adoption is not this learner's work: not in its delta
            theta = [t - j for t, j in zip(theta, jump, strict=True)]
        exact = [a - t for a, t in zip(self.anchor[p], theta, strict=True)]
        delta = exact
        if self.cfg.sync.adopt == "carry":
            delta = codec.quantize_roundtrip(exact, self.cfg.sync.codec_up)
            self.ref[p] = [a - d for a, d in zip(self.anchor[p], delta, strict=True)]
            last = self.last_step[p]
            if self.cfg.sync.eager and last is not None:
                self._eager(p, theta, delta, exact, last)
        self.comms.submit(Outgoing(p, self.version[p], delta, self.c_steps[p], self.c_tokens[p],
                                   self.unsent_tokens[p], self.step, step_time))
        self.gate.sent(p, self.version[p], self.step)
        self.unsent_tokens[p] = self.unsent_steps[p] = 0

    def _eager(self, p: int, own: list[np.ndarray], sent: list[np.ndarray],
               exact: list[np.ndarray], last: list[np.ndarray]) -> None:
        """``sync.eager``: move fragment ``p`` to the estimate of its next version
        (:func:`ddiloco.workers.adoption.eager_move`). ``ref`` moves with it, so that what
        carry adoption keeps is unchanged, and the move is remembered, so that a second send
        before the next adoption does not count it as this learner's work."""
        est, self.ref[p], self.jump[p] = eager_move(
            self.anchor[p], own, sent, exact, last, 1.0 / self.cfg.run.learners,
            self.cfg.sync.outer_lr)
        for name, t in zip(self.layout.names(p), est, strict=True):
            self.params[name] = self.inner.place(name, t)
        self.eager_estimates += 1

    # ---------------------------------------------------------------- liveness
    def _heartbeat(self) -> None:
        """One round trip to the store: the TTL entry, the fate record and the counters in one
        pipeline, so a slow link costs one queueing delay per tick, not one per write. The
        entry's TTL covers the worst recent tick
        (:func:`ddiloco.workers.liveness.heartbeat_ttl_s`)."""
        t0 = time.monotonic()
        ttl_s = heartbeat_ttl_s(self.cfg.run.learner_ttl_s, self.cfg.run.heartbeat_s,
                                self.heartbeat_ticks)
        info = {"state": self.state.value, "step": self.step, "tokens": self.tokens_total,
                "loss": None if self.loss != self.loss else round(self.loss, 4),
                "incarnation": self.incarnation, "pid": os.getpid(),
                "host": socket.gethostname(),
                "bytes_up": self.comms.bytes_up if hasattr(self, "comms") else 0,
                "bytes_down": self.comms.bytes_down if hasattr(self, "comms") else 0,
                "versions": getattr(self, "version", []), "ttl_s": round(ttl_s, 3)}
        pipe = self.store.pipeline()
        self.store.heartbeat_learner(self.id, info, int(ttl_s * 1000), pipe=pipe)
        self._write_fate("running", pipe)
        total = self.tokens_total  # one read: the trainer keeps counting meanwhile
        if total > self.tokens_reported:
            self.store.incr_counter("tokens", self.id, total - self.tokens_reported, pipe=pipe)
        up = down = 0
        prev_up, prev_down = self._bytes_reported
        if hasattr(self, "comms"):
            up, down = self.comms.bytes_up, self.comms.bytes_down
            if up > prev_up or down > prev_down:
                self.store.incr_counter("wire", "up", up - prev_up, pipe=pipe)
                self.store.incr_counter("wire", "down", down - prev_down, pipe=pipe)
            self.store.set_wire_peers(self.id, self.incarnation,
                                      self.comms.peer_bytes_snapshot(), pipe=pipe)
        pipe.execute()  # StoreUnavailable in an outage: the heartbeat ticker's to handle
        # Only now: a failed tick must not count its increments as reported.
        self.tokens_reported = max(self.tokens_reported, total)
        if up > prev_up or down > prev_down:
            self._bytes_reported = (up, down)
        tick = time.monotonic() - t0
        self.heartbeat_ticks.append(tick)
        self.heartbeat_tick_max = max(self.heartbeat_tick_max, tick)

    def _write_fate(self, ended: str, pipe: Batch | None = None) -> None:
        """Store this incarnation's cumulative token fate (DESIGN §5). ``sent`` is read before
        the trainer's triple, so every sent token is already counted as processed. ``pipe``: a
        store pipeline to add the write to (the caller executes it)."""
        if not hasattr(self, "comms"):
            return
        sent = self.comms.sent_tokens
        processed, overwritten, drain = self.fate
        self.store.set_fate(self.id, self.incarnation, {
            "processed": processed, "sent": sent,
            "discarded": {"overwritten": overwritten, "drain": drain},
            "start_step": self.start_step, "step": self.step, "ended": ended,
            "step_time_mean_s": self.step_time_mean, "time": time.time()}, pipe=pipe)

    # ---------------------------------------------------------------- the loop
    def _inner_step(self, micro: list[Any]) -> Any:
        """One inner step on ``accumulate`` micro-batches; returns the loss (a device scalar),
        or None to stop."""
        self.params, self.opt_state, loss = self.inner.step(self.params, self.opt_state, micro)
        return loss

    def _after_step(self, step_time: float) -> None:
        """After each inner step: adopt newer versions, send the fragments that are due."""
        self.adopt()
        if not self.follower:
            for p in self.due():
                self.send_delta(p, step_time)

    def train(self) -> None:
        """TRAINING until the step budget, or SIGTERM, then DRAINING."""
        budget = self.max_steps if self.max_steps is not None else self.cfg.train.steps
        k = self.inner.accumulate
        leader = not self.follower
        if leader:
            self.comms.ready.wait(timeout=30)
            self.comms.will_join = self.will_join
            self.transition(State.TRAINING, step=self.step, versions=getattr(self, "version", []))
            self._record_rejoin()
        else:
            self.transition(State.TRAINING, step=self.step)
        # A multi-process learner stops when the leader says so (at the same step everywhere).
        stopping = ((lambda: self._shared_stop) if self.group is not None
                    else self.stop.is_set)
        ema_step: float | None = None
        t_prev = time.perf_counter()
        loss_dev = None
        tpb = self.task.tokens_per_batch * k
        P = self.layout.n_fragments
        first_step = self.start_step = self.step
        # Steady-state timing starts after warm-up (compilation, first adoptions).
        warm_step, warm_t = first_step + 20, 0.0
        # Heterogeneous learners: a speed factor s < 1 stretches every step to 1/s of its time.
        pad = 1.0 / self.cfg.train.speed.get(self.id, 1.0) - 1.0
        while self.step < budget and not stopping():
            if not self.follower and self.comms.failure is not None:
                raise WorkerThreadDied(f"{self.id}: its comms thread stopped "
                                       f"({self.comms.failure}); exiting so that it restarts "
                                       "and rejoins from the store")
            # Waiting for a round's merge (sync.blocking) is not step time: shards pace
            # merges by H step times, which must not grow with the wait.
            t_prev += self._await_rounds()
            if stopping():
                break
            micro = [next(self.batches) for _ in range(k)]
            self.position += k
            loss = self._inner_step(micro)
            if loss is None:
                break
            loss_dev = loss
            self.step += 1
            self.tokens_total += tpb
            processed, overwritten, drain = self.fate
            self.fate = (processed + tpb * P, overwritten, drain)
            if leader:
                for p in range(P):
                    self.c_steps[p] += 1
                    self.c_tokens[p] += tpb
                    self.unsent_steps[p] += 1
                    self.unsent_tokens[p] += tpb
            self._after_step(ema_step or 0.0)
            if self.step == first_step + 1 and loss_dev is not None and leader:
                loss_dev.block_until_ready()
                self._event("first_step", {"learner": self.id, "incarnation": self.incarnation,
                                           "step": self.step, "versions": self.version})
            now = time.perf_counter()
            dt = now - t_prev
            if pad > 0:
                self.stop.wait(dt * pad)
                now = time.perf_counter()
                dt = now - t_prev
            t_prev = now
            if self.step == warm_step:
                warm_t = now
            if self.step > first_step + STEP_TIME_SKIP:
                # The first steps after a (re)start hold compilation: a shard paces merges by
                # H times this, so they would hold every merge of a short run back.
                ema_step = dt if ema_step is None else 0.9 * ema_step + 0.1 * dt
                self.ema_step = ema_step
            if self.step % self.cfg.train.checkpoint_every == 0:
                self.checkpoint()
            if self.step % 10 == 0 and loss_dev is not None:
                self.loss = float(loss_dev)
                if self.step > warm_step and warm_t > 0:
                    # Kept current for heartbeats: a killed incarnation reports it too.
                    self.step_time_mean = (now - warm_t) / (self.step - warm_step)
        if loss_dev is not None:
            self.loss = float(loss_dev)
        self.step_time = ema_step or 0.0
        if self.step > warm_step and warm_t > 0:
            self.step_time_mean = (time.perf_counter() - warm_t) / (self.step - warm_step)

    def _await_rounds(self) -> float:
        """Before an inner step: adopt until no round holds it (:meth:`Gate.held`; never
        under Decoupled DiLoCo), giving up on a round after ``sync.blocking_timeout_s``
        with a warning; SIGTERM ends the wait. Records every released round as a
        ``round_wait`` event. Returns the seconds waited."""
        nxt = self.step + 1
        t0 = time.perf_counter()
        while self.gate.held(nxt) and not self.stop.is_set():
            self.comms.wait_inbox(0.05)
            self.adopt()
            for r in self.gate.expire(nxt):
                a = r.awaited
                self.log.warning("fragment %d: no version newer than %d %.1f s after the send "
                                 "at step %d (sync.blocking_timeout_s); training on", a.fragment,
                                 a.base, r.waited_s, a.step)
        for r in self.gate.releases():
            self._record_release(r)
        return time.perf_counter() - t0

    def _record_release(self, r: Release) -> None:
        """A ``round_wait`` event: which round, the version that released it, whether that
        merge included this learner, and the steps taken by then (at most the send step +
        tau: the check that no learner ran ahead of its round's merge)."""
        a = r.awaited
        self._event("round_wait", {"learner": self.id, "incarnation": self.incarnation,
                                   "fragment": a.fragment, "base": a.base,
                                   "sent_step": a.step, "version": r.version,
                                   "included": r.included, "timed_out": r.timed_out,
                                   "waited_s": round(r.waited_s, 4), "step": self.step})

    def _drain_sends(self) -> None:
        """Send fragments with at least H/2 steps of unsent work; count the rest as
        ``discarded_drain`` (see :meth:`drain`)."""
        for p in range(self.layout.n_fragments):
            if self.c_steps[p] >= self.cfg.sync.H / 2 and self.unsent_tokens[p] > 0:
                self.send_delta(p, getattr(self, "step_time", 0.0))
            elif self.unsent_tokens[p] > 0:
                processed, overwritten, drain = self.fate
                self.fate = (processed, overwritten, drain + self.unsent_tokens[p])
                self.unsent_tokens[p] = 0

    def _event(self, kind: str, fields: dict[str, Any]) -> None:
        """Record an event; a store outage must not stop training (the event is lost)."""
        try:
            self.store.add_event(kind, fields)
        except StoreUnavailable as exc:
            self.log.warning("event %s not recorded: %s", kind, exc)

    def _record_rejoin(self) -> None:
        """Record, for audits, exactly what this incarnation adopted from the store."""
        digests = {str(p): digest(self._host_fragment(p))
                   for p in range(self.layout.n_fragments)}
        self._event("adopted", {"learner": self.id, "incarnation": self.incarnation,
                                "versions": self.version, "digests": digests, "step": self.step})

    def drain(self) -> None:
        """DRAINING: send substantial unsent work, wait for the queue (at most 3 s),
        checkpoint, leave.

        Only fragments with at least H/2 steps of unsent work are sent: every merge also
        applies the outer momentum, so a burst of tiny final deltas (one merge each) would
        move the global model by momentum alone. Smaller remainders are counted as
        ``discarded_drain`` tokens.
        """
        self.transition(State.DRAINING, step=self.step)
        if self.follower:
            self.checkpoint()  # orbax: every process of the learner writes together
            self.ckpt.close()
            self.transition(State.STOPPED, step=self.step)
            return
        self._drain_sends()
        # Whatever is still queued after the wait is lost with the process: bounded, since a
        # dead shard must not hold the learner's exit.
        poll_until(lambda: not self.comms.pending(), timeout_s=DRAIN_WAIT_S, interval_s=0.02)
        self.checkpoint()
        self.ckpt.close()
        self.ticker.stop()
        self.comms.stop_flag.set()
        self.comms.join(timeout=2)
        self._heartbeat()  # after the comms thread: its byte counts are final
        self._write_fate("drained")
        self.store.remove_learner(self.id)
        self.store.add_event("leave", {"learner": self.id, "incarnation": self.incarnation,
                                       "step": self.step, "tokens": self.tokens_total,
                                       "step_time_mean_s": self.step_time_mean,
                                       "deltas_sent": self.comms.sent,
                                       "deltas_folded": self.comms.folded,
                                       "eager_estimates": self.eager_estimates,
                                       "bytes_up": self.comms.bytes_up,
                                       "bytes_down": self.comms.bytes_down,
                                       "heartbeat_tick_max_s": self.heartbeat_tick_max})
        self.transition(State.STOPPED, step=self.step, tokens=self.tokens_total)


def run(learner: Learner, metrics_port: int | None = None) -> int:
    """Process body of one learner (or, in a multi-process learner, of this process's part):
    JOINING to STOPPED, with SIGTERM/SIGINT starting the drain; ``metrics_port``: serve
    Prometheus metrics there (:mod:`ddiloco.workers.metrics`; the leader only). Returns the exit
    code.

    The learner's class (DiLoCo or a variant) is the caller's choice: :mod:`ddiloco.workers.roles`.
    """
    if metrics_port is not None and not learner.follower:
        from ddiloco.workers.metrics import LearnerCollector, serve_metrics

        serve_metrics(LearnerCollector(learner), metrics_port)

    def _stop(signum: int, _frame: Any) -> None:
        learner.stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    learner.join()
    learner.sync()
    learner.train()
    learner.drain()
    return 0
