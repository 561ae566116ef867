"""A learner's lifecycle and training loop: inner steps on its shard, sync that never blocks.

One state machine, ``JOINING -> SYNCING -> TRAINING -> DRAINING -> STOPPED`` (DESIGN §2):

* JOINING (:func:`join`): read the run manifest, register (new incarnation), start the comms
  thread (:mod:`ddiloco.workers.learner.comms`), which subscribes to every shard's broadcast
  *before* the snapshot is read (zguide Clone pattern), and the heartbeat
  (:mod:`ddiloco.workers.learner.report`).
* SYNCING (:meth:`Learner.sync`): read the latest version of every fragment from the store,
  adopt them, restore the inner optimizer state and data position from this learner's own
  checkpoint if it has one.
* TRAINING (:meth:`Learner.train`): the loop. Sends and receives happen on the comms thread;
  the training thread only copies the due fragment to the host, subtracts and hands it over
  (:mod:`ddiloco.workers.learner.send`, folding into a pending unsent delta for the same fragment),
  and
  adopts versions the comms thread has decoded.
* DRAINING (:meth:`Learner.drain`, at SIGTERM): send a final delta of every fragment with unsent
  work, wait briefly for the queue to empty, checkpoint, deregister.

:func:`run` builds a learner whole, phase by phase: JOINING yields a :class:`Joined` record,
SYNCING a :class:`Synced` one, and the :class:`Learner` made of them trains and drains. The
threads that run from JOINING on (comms, heartbeat, metrics) read only what exists by then:
the comms thread, the reporter and the :class:`~ddiloco.workers.learner.report.Progress`
record.

This is the Decoupled DiLoCo learner; variants override its hooks (the data-parallel
baseline, :mod:`ddiloco.workers.dp`) and :mod:`ddiloco.workers.roles` picks the class of a run.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from ddiloco.pipeline.errors import ConfigError, DDilocoError, WorkerThreadDied
from ddiloco.pipeline.fragments import FragmentLayout
from ddiloco.pipeline.waiting import poll_until, wait_until
from ddiloco.store.base import FragmentBlob, ParameterStore
from ddiloco.workers.learner.adoption import adopt_fragment
from ddiloco.workers.learner.blocking import END, Gate, StepGate, gate_for
from ddiloco.workers.learner.comms import Comms
from ddiloco.workers.learner.lr_clock import global_step, schedule_share
from ddiloco.workers.learner.report import Progress, Reporter, State, process_start_time
from ddiloco.workers.learner.send import Sender
from ddiloco.workers.run.blobs import decode_blob, digest
from ddiloco.workers.run.config import Config
from ddiloco.workers.run.deterministic import check_learner_start
from ddiloco.workers.run.manifest import manifest_config, manifest_layout, wait_for_manifest
from ddiloco.workers.run.runtime import setup_logging

if TYPE_CHECKING:
    import logging

    from ddiloco.workers.learner.checkpoint import LearnerCheckpoint
    from ddiloco.workers.learner.inner import InnerLoop
    from ddiloco.workers.learner.multihost import HostGroup
    from ddiloco.workers.learner.standby import Prepared
    from ddiloco.workers.learner.torch_inner import TorchCheckpoint, TorchInner
    from ddiloco.workers.task.api import Batch, Task
    from ddiloco.workers.task.torch_api import TorchTask

__all__ = ["STEP_TIME_SKIP", "Joined", "Leader", "Learner", "Link", "Resumed", "State", "Synced",
           "join", "restore", "run"]


#: Inner steps after a (re)start left out of the reported step time (they hold compilation).
STEP_TIME_SKIP = 3
#: How long SYNCING waits for every fragment to have a version, seconds.
VERSIONS_WAIT_S = 120.0
#: How long DRAINING waits for the comms thread to hand the last deltas to a socket, seconds.
DRAIN_WAIT_S = 3.0


# ---------------------------------------------------------------- JOINING
@dataclass(frozen=True)
class Link:
    """A leader's running connection to the run, from JOINING on.

    Attributes:
        comms: the comms thread (started).
        report: the reporter (its heartbeat ticker started).
    """

    comms: Comms
    report: Reporter


@dataclass(frozen=True)
class Joined:
    """What JOINING fixed for this incarnation.

    Attributes:
        id: the learner's id, e.g. "learner-0"; its index (trailing int) picks its data shard.
        manifest: the run manifest.
        cfg: the run's configuration (the manifest's).
        layout: the run's fragment layout (the manifest's).
        incarnation: this life's incarnation (0 on a follower, which never registers).
        gate: whether an inner step waits for the merge of this learner's round
            (``sync.blocking``; :mod:`ddiloco.workers.learner.blocking`).
        group: the processes of a multi-process learner (:mod:`ddiloco.workers.learner.multihost`);
            None: one process.
        link: the leader's comms thread and reporter, both running; None on a follower
            (process > 0 of a multi-process learner computes only).
    """

    id: str
    manifest: dict[str, Any]
    cfg: Config
    layout: FragmentLayout
    incarnation: int
    gate: Gate
    group: HostGroup | None
    link: Link | None


def join(comms_class: type[Comms], store: ParameterStore, comms_store: ParameterStore,
         learner_id: str, group: HostGroup | None, progress: Progress) -> Joined:
    """JOINING: read the manifest, pick the gate; on the leader, register, start the comms
    thread and the heartbeat, and record the join.

    Args:
        comms_class: the network side of the learner's variant.
        store: the run's parameter store (registration, heartbeats, events).
        comms_store: the comms thread's own connection to the same store.
        learner_id: e.g. "learner-0".
        group: the processes of a multi-process learner; None: one process.
        progress: the learner's progress (its incarnation and comms thread are set here,
            before either thread starts).

    Returns:
        The joined record.

    Raises:
        DDilocoError: a multi-process learner in a run that is not DiLoCo, or under
            ``sync.blocking``.
        StoreUnavailable: the store did not answer (or has no manifest after 60 s).
        ConfigError: ``security.curve`` without ``security.keys_dir``; under
            ``run.deterministic``, a learner ``ddiloco run`` did not start, or one that starts
            again (:func:`ddiloco.workers.run.deterministic.check_learner_start`).
    """
    manifest = wait_for_manifest(store)
    cfg = manifest_config(manifest)
    layout = manifest_layout(manifest)
    if group is not None:
        if manifest["mode"] != "diloco":
            raise DDilocoError("multi-process learners train DiLoCo runs only (run.mode "
                               "= diloco)")
        group.layout = layout
    s = cfg.sync
    # The data-parallel half of `ddiloco run --baseline dp` carries the DiLoCo run's
    # sync.blocking; its steps are synchronous already.
    blocking = s.blocking and manifest["mode"] == "diloco"
    deterministic = cfg.run.deterministic and manifest["mode"] == "diloco"
    if deterministic:
        # Before registering: a refused learner leaves the run's registry as it was.
        check_learner_start(learner_id, store.run_id, os.environ)
    if blocking and group is not None:
        raise DDilocoError("sync.blocking: a multi-process learner cannot wait for its "
                           "round (its processes adopt together); run it as one process "
                           "or set sync.blocking=false")
    gate = gate_for(blocking, learner_id, s.tau, s.blocking_timeout_s,
                    deterministic=deterministic)
    if group is not None and not group.leader:
        return Joined(learner_id, manifest, cfg, layout, 0, gate, group, None)
    incarnation = progress.incarnation = store.register_learner(learner_id)
    if deterministic:
        check_learner_start(learner_id, store.run_id, os.environ, incarnation)
    comms = comms_class(comms_store, manifest, learner_id, incarnation, progress.log)
    comms.fate_source = lambda: progress.fate
    progress.comms = comms
    comms.start()
    report = Reporter(store, learner_id, cfg, incarnation, comms, progress).start()
    report.record_join()
    return Joined(learner_id, manifest, cfg, layout, incarnation, gate, group,
                  Link(comms, report))


# ---------------------------------------------------------------- SYNCING
@dataclass(frozen=True)
class Resumed:
    """Where a learner resumes (SYNCING).

    Attributes:
        opt_state: the inner optimizer state.
        step: the inner step.
        tokens_total: tokens trained by earlier incarnations.
        position: batches consumed from the data shard.
    """

    opt_state: Any
    step: int
    tokens_total: int
    position: int


def restore(ckpt: LearnerCheckpoint | TorchCheckpoint, opt_state: Any,
            log: logging.Logger) -> Resumed:
    """Resume from this learner's own checkpoint (``opt_state`` shapes the restore); from
    step 0 when it has none.

    Raises:
        CheckpointMismatch: the checkpoint's optimizer tree is not ``opt_state``'s.
    """
    if ckpt.removed:
        log.warning("removed checkpoint steps %s torn by a crash", ckpt.removed)
    got = ckpt.restore(opt_state)
    if got is None:
        return Resumed(opt_state, 0, 0, 0)
    opt_state, meta = got
    log.info("restored checkpoint at step %d (data position %d)", int(meta["step"]),
             meta["position"])
    return Resumed(opt_state, int(meta["step"]), int(meta["tokens_total"]),
                   int(meta["position"]))


@dataclass(frozen=True)
class Synced:
    """What SYNCING built: the model to train and where the data resumes.

    Attributes:
        task: the run's task, built in this process (JAX or PyTorch).
        inner: the inner-step engine over this process's devices
            (:mod:`ddiloco.workers.learner.engines`).
        params: the adopted parameters, placed on the mesh.
        opt_state: the inner optimizer state (restored, or fresh).
        ckpt: this learner's checkpoint.
        position: batches consumed from this learner's data shard.
        batches: the data shard's batches from ``position`` on.
        versions: the version of each fragment adopted (empty on a follower, which took the
            leader's values).
        anchors: their values, float32 host copies (empty on a follower).
    """

    task: Task | TorchTask
    inner: InnerLoop | TorchInner
    params: dict[str, Any]
    opt_state: Any
    ckpt: LearnerCheckpoint | TorchCheckpoint
    position: int
    batches: Iterator[Batch]
    versions: list[int]
    anchors: list[list[np.ndarray]]


# ---------------------------------------------------------------- TRAINING
@dataclass(frozen=True)
class Leader:
    """The parts of a learner only its leader has (a follower neither talks to the run nor
    sends).

    Attributes:
        comms: the comms thread.
        report: the reporter.
        send: the send path.
    """

    comms: Comms
    report: Reporter
    send: Sender


class Learner:
    """One learner process's training side (Decoupled DiLoCo; a variant, such as the
    data-parallel baseline, subclasses it and overrides its hooks). Built by :func:`run`
    from what JOINING and SYNCING made; it trains (:meth:`train`) and drains
    (:meth:`drain`).

    Args:
        joined: what JOINING fixed (:func:`join`).
        synced: what SYNCING built (:meth:`sync`).
        progress: the learner's progress, read by its other threads since JOINING.
        stop: set at SIGTERM/SIGINT: the learner drains.
        max_steps: stop after this many inner steps (None: ``train.steps``).
    """

    #: the network side (a variant's learner brings its own)
    comms_class: ClassVar[type[Comms]] = Comms
    #: whether a (re)join reads the fragments' momentum blobs: DiLoCo learners need values
    #: alone; the data-parallel job keeps its optimizer state there
    reads_momentum: ClassVar[bool] = False
    #: whether the first inner step waits until every shard is known: a DiLoCo step needs
    #: no shard (only the sends and adoptions after it do, and they wait); a variant whose
    #: step exchanges with the shards waits before it, so that its subscriptions are up
    #: before the shards' first broadcast
    shards_before_first_step: ClassVar[bool] = False

    def __init__(self, joined: Joined, synced: Synced, progress: Progress,
                 stop: threading.Event, max_steps: int | None = None) -> None:
        self.id = joined.id
        self.cfg = joined.cfg
        self.layout = joined.layout
        self.incarnation = joined.incarnation
        self.gate = joined.gate
        #: ``run.deterministic``: versions adopt at their round's step, and the last rounds
        #: (the drain's included) are waited for before the learner leaves
        self.deterministic = isinstance(self.gate, StepGate)
        #: decoded versions not yet due for adoption (:meth:`Gate.may_adopt`), by fragment
        self.parked: dict[int, tuple[int, list[np.ndarray], dict[str, int]]] = {}
        #: the processes of a multi-process learner
        #: (:mod:`ddiloco.workers.learner.multihost`); None: one
        self.group = joined.group
        self.progress = progress
        self.log = progress.log
        self.stop = stop
        self.max_steps = max_steps
        self.task = synced.task
        self.inner = synced.inner
        self.params = synced.params
        self.opt_state = synced.opt_state
        self.ckpt = synced.ckpt
        #: batches consumed from this learner's data shard (the resume position)
        self.position = synced.position
        self.batches = synced.batches
        #: learner -> the latest step a version reported for it (``train.lr_clock``)
        self.peer_steps: dict[str, int] = {}
        #: EMA of the inner step time at the end of TRAINING, seconds (the drain's deltas)
        self.step_time = 0.0
        #: a multi-process learner's stop, as its leader decided it (the same step everywhere)
        self._shared_stop = False
        link = joined.link
        self.lead: Leader | None = None if link is None else Leader(
            link.comms, link.report,
            Sender(self.cfg, self.layout, link.comms, self.gate, progress, synced.versions,
                   synced.anchors, self._host_fragment, self._place))

    # ---------------------------------------------------------------- SYNCING
    @classmethod
    def sync(cls, joined: Joined, store: ParameterStore, run_dir: Path, progress: Progress,
             stop: threading.Event, prepared: Prepared | None = None) -> Synced:
        """SYNCING: build the task, adopt the store's latest versions, restore the checkpoint.

        Args:
            joined: what JOINING fixed.
            store: the run's parameter store.
            run_dir: where checkpoints live (``run_dir/learners/<id>/ckpt``).
            progress: the learner's progress (its step, tokens and versions are set here).
            stop: set at SIGTERM: the wait for versions ends.
            prepared: the task and warm inner-step engine a standby built for this run
                (:mod:`ddiloco.workers.learner.standby`); None: built here.

        Returns:
            The synced record.

        Raises:
            TaskError: this process's task does not have the run's parameters.
            CheckpointMismatch: the checkpoint's optimizer tree is not this task's.
            ConfigError: ``sync.eager`` for a learner of several processes.
            WaitTimeout: a fragment still has no version after ``VERSIONS_WAIT_S`` seconds.
        """
        from ddiloco.workers.learner.engines import build_engine, learner_task, uses_torch
        from ddiloco.workers.task.api import DataShard, TaskError

        progress.transition(State.SYNCING, incarnation=joined.incarnation)
        cfg, layout, group, log = joined.cfg, joined.layout, joined.group, progress.log
        # A standby built the run's task: not the PyTorch twin of a run.torch_learners learner
        warm = (prepared is not None and prepared.run_id == store.run_id
                and not uses_torch(cfg, joined.id))
        task = prepared.task if prepared is not None and warm else learner_task(cfg, joined.id)
        tree = task.tree()
        want = {n: s for p in range(layout.n_fragments)
                for n, s in zip(layout.names(p), layout.shapes(p), strict=True)}
        if tree.shapes != want:
            diff = sorted(set(tree.shapes.items()) ^ set(want.items()))[:4]
            raise TaskError(f"task {task.name!r} does not have the run's parameters "
                            f"(first differences, path and shape: {diff}): every learner of a "
                            "run must train the same model")
        tail = joined.id.rsplit("-", 1)[-1]
        index = int(tail) if tail.isdigit() else 0
        n_shards = max(cfg.run.learners, index + 1)
        t = cfg.train
        inner = (prepared.inner if prepared is not None and warm else
                 build_engine(task, cfg))
        log.info("task %s (%s): %d parameters in %d leaves on %s, %s, %s compute",
                 task.name, type(inner).__name__, tree.n_values(), len(tree.names),
                 inner.describe(), cfg.run.sharding, t.compute_dtype)
        P = layout.n_fragments
        ckpt_path = run_dir / "learners" / joined.id / "ckpt"
        if joined.link is None:
            assert group is not None  # a follower is process > 0 of a group
            _, got = group.share(False, {})  # the leader's adopted versions
            params = inner.place_all(
                {n: v for p in range(P) for n, v in zip(layout.names(p), got[p], strict=True)})
            ckpt = inner.checkpoint(ckpt_path, run_id=store.run_id)
            resumed = restore(ckpt, inner.init_opt(params), log)
            progress.tokens_total = resumed.tokens_total
            progress.step, position = group.share_ints([0, 0])
            return Synced(task, inner, params, resumed.opt_state, ckpt, position,
                          task.batches(DataShard(index, n_shards, position, t.seed)),
                          versions=[], anchors=[])
        comms = joined.link.comms
        # Wait until every fragment has a version (shards write version 0 at first start);
        # DP: until every fragment is at the same checkpoint (shards roll back at start).

        def heads_when_ready() -> list[FragmentBlob | None]:
            """The heads when ready (or stopping); ``[]`` (falsy: poll again) otherwise."""
            got = store.get_latest_many(list(range(P)), momentum=cls.reads_momentum)
            comms.count_store_read(got)
            return got if cls._versions_ready(got) or stop.is_set() else []

        blobs = wait_until(heads_when_ready, timeout_s=VERSIONS_WAIT_S, interval_s=0.1,
                           what="every fragment to have a version (is a syncer up?)")
        values: dict[str, Any] = {}
        versions: list[int] = []
        anchors: list[list[np.ndarray]] = []
        for p, blob in enumerate(blobs):
            assert blob is not None
            value = decode_blob(blob.value, layout.shapes(p), own=True)
            comms.seed(p, blob.version, value)
            versions.append(blob.version)
            anchors.append(value)
            values.update(zip(layout.names(p), value, strict=True))
        progress.versions = versions
        if group is not None:
            group.share(False, dict(enumerate(anchors)))
        params = inner.place_all(values)
        opt_state = inner.init_opt(params)
        if cfg.sync.eager and group is not None:
            raise ConfigError("sync.eager: not supported for a learner of several processes "
                              "(its followers would not see the estimate); set "
                              "sync.eager=false")
        ckpt = inner.checkpoint(ckpt_path, run_id=store.run_id)
        resumed = cls._resume(blobs, ckpt, opt_state, log)
        joined.link.report.resumed(resumed.tokens_total)
        progress.tokens_total = resumed.tokens_total
        progress.step = resumed.step
        if group is not None:
            group.share_ints([resumed.step, resumed.position])
        return Synced(task, inner, params, resumed.opt_state, ckpt, resumed.position,
                      task.batches(DataShard(index, n_shards, resumed.position, t.seed)),
                      versions, anchors)

    @classmethod
    def _versions_ready(cls, blobs: Sequence[FragmentBlob | None]) -> bool:
        """Every fragment has a version (shards write version 0 at first start)."""
        return all(b is not None for b in blobs)

    @classmethod
    def _resume(cls, blobs: Sequence[FragmentBlob | None],
                ckpt: LearnerCheckpoint | TorchCheckpoint,
                opt_state: Any, log: logging.Logger) -> Resumed:
        """Where the leader resumes, given the heads it adopted: from this learner's own
        checkpoint (:func:`restore`).

        Raises:
            CheckpointMismatch: the checkpoint's optimizer tree is not ``opt_state``'s.
        """
        return restore(ckpt, opt_state, log)

    # ---------------------------------------------------------------- checkpoints
    def checkpoint(self) -> None:
        """Checkpoint the inner optimizer state (by tree path), data position and counters
        (orbax, atomic; :mod:`ddiloco.workers.learner.checkpoint`)."""
        pr = self.progress
        meta = {"step": pr.step, "position": self.position, "tokens_total": pr.tokens_total,
                "versions": pr.versions, "incarnation": self.incarnation, "time": time.time()}
        self.ckpt.save(pr.step, self.opt_state, meta)

    # ---------------------------------------------------------------- adoption
    def adopt(self, at: int | None = None) -> int:
        """Adopt newer versions (:meth:`adopt_values`) and place them on the mesh (a
        multi-process learner shares them with its followers first). Returns how many.

        Args:
            at: the inner step count the gate judges adoption at (:meth:`Gate.may_adopt`;
                :data:`ddiloco.workers.learner.blocking.END`: the end of training); None: the
                learner's step.
        """
        new = self.adopt_values(at)
        if self.group is not None:
            stop, new = self.group.share(self.stop.is_set(), new)
            self._shared_stop = self._shared_stop or stop
        if self.cfg.train.lr_clock == "global":  # the next step's rate (lr_clock module)
            g = global_step(self.progress.step, self.peer_steps, self.id, self.cfg.run.learners)
            share = schedule_share(self.cfg.train, g if self.group is None
                                   else self.group.share_ints([g])[0])
            self.inner.set_lr_scale(self.opt_state, share)
        for p, values in new.items():
            self._place(p, values)
        return len(new)

    def adopt_values(self, at: int | None = None) -> dict[int, list[np.ndarray]]:
        """The new values of every fragment with a newer version in the comms thread's inbox
        (DESIGN §2 step 3); the send path re-anchors at them (the caller places them).
        A version the gate does not let in yet at step ``at`` (None: the learner's step;
        ``run.deterministic``, :meth:`Gate.may_adopt`) is kept for a later call.

        ``carry`` (default, ours): theta = Theta + (theta - ref): the local work that has not
        left yet (steps since the last send, plus the codec's error on that send) is kept and
        leaves in the next delta, so no processed token is thrown away. ``overwrite`` (paper):
        theta = Theta; unsent work is discarded (counted as ``discarded_overwritten``).
        ``mix`` (Streaming DiLoCo): theta = a*theta + (1-a)*Theta, unsent work discarded.
        Either way the anchor becomes Theta (:meth:`ddiloco.workers.learner.send.Sender.adopted`).
        A follower adopts what its leader shares (:meth:`adopt`): nothing here.
        """
        if self.lead is None:
            return {}
        send = self.lead.send
        step = self.progress.step if at is None else at
        # The inbox holds the newest version of each fragment: it replaces a parked older one.
        got = {**self.parked, **self.lead.comms.take_inbox()}
        self.parked = {}
        policy = self.cfg.sync.adopt
        out: dict[int, list[np.ndarray]] = {}
        for p, entry in got.items():
            ver, value, merged = entry
            if ver <= send.version[p]:
                continue
            if not self.gate.may_adopt(p, ver, step):
                self.parked[p] = entry
                continue
            self.gate.adopted(p, ver, merged)
            self.peer_steps.update(merged)
            theta = (self._host_fragment(p)
                     if policy != "overwrite" else value)
            out[p] = adopt_fragment(policy, theta, value, alpha=self.cfg.sync.alpha,
                                    ref=send.ref[p])
            send.adopted(p, ver, value, self.progress.step)
        if out:
            self.progress.versions = list(send.version)
        return out

    def _host_fragment(self, p: int) -> list[np.ndarray]:
        """Fragment ``p``'s current parameters as float32 host copies (gathered from the
        learner's devices)."""
        return [np.array(self.inner.host(self.params[n]), dtype=np.float32, copy=True)
                for n in self.layout.names(p)]

    def _place(self, p: int, values: Sequence[np.ndarray]) -> None:
        """Put ``values`` (payload order) as fragment ``p``'s parameters on the mesh."""
        for name, t in zip(self.layout.names(p), values, strict=True):
            self.params[name] = self.inner.place(name, t)

    # ---------------------------------------------------------------- the loop
    def _inner_step(self, micro: list[Any]) -> Any:
        """One inner step on ``accumulate`` micro-batches; returns the loss (a device scalar),
        or None to stop."""
        self.params, self.opt_state, loss = self.inner.step(self.params, self.opt_state, micro)
        return loss

    def _after_step(self, step_time: float) -> None:
        """After each inner step: adopt newer versions, send the fragments that are due
        (``step_time``: EMA of the inner step time, seconds; 0.0 while warming up)."""
        self.adopt()
        if self.lead is not None:
            send, step = self.lead.send, self.progress.step
            for p in send.due(step):
                send.send(p, step, step_time)

    def train(self) -> None:
        """TRAINING until the step budget, or SIGTERM, then DRAINING. Under
        ``run.deterministic`` it ends once the versions of its last rounds are adopted.

        Raises:
            WorkerThreadDied: the comms thread stopped on an error.
            DeterminismBroken: under ``run.deterministic``, a round it waited for did not
                merge within ``sync.blocking_timeout_s``.
        """
        pr = self.progress
        budget = self.max_steps if self.max_steps is not None else self.cfg.train.steps
        k = self.inner.accumulate
        lead = self.lead
        if lead is not None:
            if self.shards_before_first_step:
                lead.comms.ready.wait(timeout=30)
            lead.comms.will_join = lead.send.will_join
            pr.transition(State.TRAINING, step=pr.step, versions=pr.versions)
            lead.report.record_rejoin({str(p): digest(self._host_fragment(p))
                                       for p in range(self.layout.n_fragments)})
        else:
            pr.transition(State.TRAINING, step=pr.step)
        # A multi-process learner stops when the leader says so (at the same step everywhere).
        stopping: Callable[[], bool] = ((lambda: self._shared_stop) if self.group is not None
                                        else self.stop.is_set)
        ema_step: float | None = None
        t_prev = time.perf_counter()
        loss_dev = None
        tpb = self.task.tokens_per_batch * k
        P = self.layout.n_fragments
        first_step = pr.start_step = pr.step
        # Steady-state timing starts after warm-up (compilation, first adoptions).
        warm_step, warm_t = first_step + 20, 0.0
        # Heterogeneous learners: a speed factor s < 1 stretches every step to 1/s of its time.
        pad = 1.0 / self.cfg.train.speed.get(self.id, 1.0) - 1.0
        while pr.step < budget and not stopping():
            if lead is not None and lead.comms.failure is not None:
                raise WorkerThreadDied(f"{self.id}: its comms thread stopped "
                                       f"({lead.comms.failure}); exiting so that it restarts "
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
            if (lead is not None and pr.step == first_step
                    and not self.shards_before_first_step):
                # Only sends and adoptions need the shards: the first step (its compilation
                # above all) runs while they start, and nothing is sent before all are known.
                # Once: a shard still missing after the wait does not stall every step.
                lead.comms.ready.wait(timeout=30)
            pr.stepped(tpb, P)
            if lead is not None:
                lead.send.count_step(tpb)
            self._after_step(ema_step or 0.0)
            if pr.step == first_step + 1 and loss_dev is not None and lead is not None:
                self.inner.ready(loss_dev)
                lead.report.record_first_step(self.inner.first_calls)
            now = time.perf_counter()
            dt = now - t_prev
            if pad > 0:
                self.stop.wait(dt * pad)
                now = time.perf_counter()
                dt = now - t_prev
            t_prev = now
            if pr.step == warm_step:
                warm_t = now
            if pr.step > first_step + STEP_TIME_SKIP:
                # The first steps after a (re)start hold compilation: a shard paces merges by
                # H times this, so they would hold every merge of a short run back.
                ema_step = dt if ema_step is None else 0.9 * ema_step + 0.1 * dt
                pr.ema_step = ema_step
            if pr.step % self.cfg.train.checkpoint_every == 0:
                self.checkpoint()
            if pr.step % 10 == 0 and loss_dev is not None:
                pr.loss = float(loss_dev)
                if pr.step > warm_step and warm_t > 0:
                    # Kept current for heartbeats: a killed incarnation reports it too.
                    pr.step_time_mean = (now - warm_t) / (pr.step - warm_step)
        if self.deterministic and not stopping():
            # The rounds sent in the last tau steps: the drain's decisions (what is left to
            # send) must not depend on whether their versions came before the last step.
            self._await_rounds(END)
        if loss_dev is not None:
            pr.loss = float(loss_dev)
        self.step_time = ema_step or 0.0
        if pr.step > warm_step and warm_t > 0:
            pr.step_time_mean = (time.perf_counter() - warm_t) / (pr.step - warm_step)

    def _await_rounds(self, next_step: int | None = None) -> float:
        """Before an inner step: adopt until no round holds it (:meth:`Gate.held`; never
        under Decoupled DiLoCo), giving up on a round after ``sync.blocking_timeout_s``
        with a warning; SIGTERM ends the wait. Records every released round as a
        ``round_wait`` event. Returns the seconds waited.

        Args:
            next_step: the step held (None: the learner's next one;
                :data:`ddiloco.workers.learner.blocking.END`: every round awaited, at the end
                of training).

        Raises:
            DeterminismBroken: under ``run.deterministic``, a round past the timeout.
        """
        lead = self.lead
        if lead is None:
            return 0.0  # never held: JOINING refuses sync.blocking for several processes
        nxt = self.progress.step + 1 if next_step is None else next_step
        t0 = time.perf_counter()
        while self.gate.held(nxt) and not self.stop.is_set():
            lead.comms.wait_inbox(0.05)
            self.adopt(nxt - 1)
            for r in self.gate.expire(nxt):
                a = r.awaited
                self.log.warning("fragment %d: no version newer than %d %.1f s after the send "
                                 "at step %d (sync.blocking_timeout_s); training on", a.fragment,
                                 a.base, r.waited_s, a.step)
        for r in self.gate.releases():
            lead.report.record_release(r)
        return time.perf_counter() - t0

    # ---------------------------------------------------------------- DRAINING
    def _drain_sends(self) -> None:
        """Send fragments with at least H/2 steps of unsent work; count the rest as
        ``discarded_drain`` (:meth:`ddiloco.workers.learner.send.Sender.drain`)."""
        if self.lead is not None:
            self.lead.send.drain(self.progress.step, self.step_time)

    def drain(self) -> None:
        """DRAINING: send substantial unsent work, wait for the queue (at most 3 s),
        checkpoint, leave.

        Only fragments with at least H/2 steps of unsent work are sent: every merge also
        applies the outer momentum, so a burst of tiny final deltas (one merge each) would
        move the global model by momentum alone. Smaller remainders are counted as
        ``discarded_drain`` tokens.

        Raises:
            StoreUnavailable: the store did not answer the leave.
            DeterminismBroken: under ``run.deterministic``, the drain's rounds did not merge
                within ``sync.blocking_timeout_s``.
        """
        pr = self.progress
        pr.transition(State.DRAINING, step=pr.step)
        lead = self.lead
        if lead is None:
            self.checkpoint()  # orbax: every process of the learner writes together
            self.ckpt.close()
            pr.transition(State.STOPPED, step=pr.step)
            return
        self._drain_sends()
        if self.deterministic and not self.stop.is_set():
            # The drain's rounds are the run's last merges: they must be in the final model
            # of every run of the seed, not left to a shard's flush at stop.
            self._await_rounds(END)
        # Whatever is still queued after the wait is lost with the process: bounded, since a
        # dead shard must not hold the learner's exit.
        poll_until(lambda: not lead.comms.pending(), timeout_s=DRAIN_WAIT_S, interval_s=0.02)
        self.checkpoint()
        self.ckpt.close()
        lead.report.stop()
        lead.comms.stop_flag.set()
        lead.comms.join(timeout=2)
        lead.report.leave(lead.send.eager_estimates)  # after the comms thread: final counts
        pr.transition(State.STOPPED, step=pr.step, tokens=pr.tokens_total)


def run(cls: type[Learner], store: ParameterStore, comms_store: ParameterStore,
        learner_id: str, run_dir: Path, max_steps: int | None = None,
        group: HostGroup | None = None, metrics_port: int | None = None,
        prepared: Prepared | None = None, handed_over: float | None = None) -> int:
    """Process body of one learner (or, in a multi-process learner, of this process's part):
    JOINING to STOPPED, with SIGTERM/SIGINT starting the drain.

    The learner's class (DiLoCo or a variant) is the caller's choice: :mod:`ddiloco.workers.roles`.

    Args:
        cls: the learner's class (its variant's hooks).
        store: parameter store of the run (heartbeats, events, SYNCING's reads).
        comms_store: the comms thread's own connection to the same store.
        learner_id: e.g. "learner-0"; its index (trailing int) picks its data shard.
        run_dir: where checkpoints and the compilation cache live.
        max_steps: stop after this many inner steps (None: ``train.steps``).
        group: the processes of a multi-process learner (:mod:`ddiloco.workers.learner.multihost`).
        metrics_port: serve Prometheus metrics there (:mod:`ddiloco.workers.run.metrics`; the
            leader only); None: none.
        prepared: what a standby built before its handover (SYNCING uses its task and warm
            inner step); None: a fresh process.
        handed_over: when the standby was handed this learner (``time.time()``): its
            start-up stages count from there, not from the process's start.

    Returns:
        The exit code.
    """
    leader = group is None or group.leader
    progress = Progress(setup_logging(learner_id if group is None or group.leader
                                      else f"{learner_id}.p{group.index}"))
    progress.stage("main")
    if handed_over is not None:
        progress.stages["process"] = handed_over
    else:
        started = process_start_time()
        if started is not None:  # else the stage is left out of the breakdown
            progress.stages["process"] = started
    if metrics_port is not None and leader:
        from ddiloco.workers.run.metrics import LearnerCollector, serve_metrics

        serve_metrics(LearnerCollector(learner_id, progress), metrics_port)
    stop = threading.Event()

    def _stop(signum: int, _frame: Any) -> None:
        stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    joined = join(cls.comms_class, store, comms_store, learner_id, group, progress)
    progress.stage("joined")
    synced = cls.sync(joined, store, run_dir, progress, stop, prepared)
    progress.stage("synced")
    learner = cls(joined, synced, progress, stop, max_steps)
    learner.train()
    learner.drain()
    return 0
