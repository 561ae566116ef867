"""A learner: inner AdamW steps on its own shard, staggered fragment sync that never blocks.

One state machine, ``JOINING -> SYNCING -> TRAINING -> DRAINING -> STOPPED`` (DESIGN §2):

* JOINING: register (new incarnation), read the run manifest, start the comms thread, which
  subscribes to every shard's broadcast *before* the snapshot is read (zguide Clone pattern).
* SYNCING: read the latest version of every fragment from the store, adopt them, restore the
  inner optimizer state and data position from this learner's own checkpoint if it has one.
* TRAINING: the loop. Sends and receives happen on the comms thread; the training thread only
  copies the due fragment to the host, subtracts and hands it over (folding into a pending
  unsent delta for the same fragment), and adopts versions the comms thread has decoded.
* DRAINING (SIGTERM): send a final delta of every fragment with unsent work, wait briefly for
  the queue to empty, checkpoint, deregister.

The comms thread is the Clone client: it keeps its own copy of the global value of every
fragment, applies exact quantized version differences to it, and on a version gap (or a
"resync" control) fetches the fragment from the store.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import socket
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import redis

from ddiloco.pipeline import codec, wire
from ddiloco.pipeline.errors import (
    ConfigError,
    DDilocoError,
    DropError,
    InternalError,
    NonFinite,
    StoreUnavailable,
)
from ddiloco.pipeline.fragments import (
    FragmentLayout,
    due_fragments,
    fragment_offsets,
    initial_last_sends,
    shard_of,
)
from ddiloco.pipeline.security import ClientKeys, load_keys
from ddiloco.pipeline.transport import DeltaPush, Pacer, VersionSub, max_message_bytes
from ddiloco.pipeline.wire import Header, Kind
from ddiloco.workers.merge import adopt_fragment, fold_pending
from ddiloco.workers.runtime import (
    Ticker,
    decode_blob,
    digest,
    heartbeat_ttl_s,
    manifest_config,
    manifest_layout,
    setup_logging,
)
from ddiloco.workers.validate import check_broadcast

if TYPE_CHECKING:
    from ddiloco.workers.multihost import HostGroup

if TYPE_CHECKING:
    from ddiloco.store.base import FragmentBlob


#: At exit, how long queued deltas may still go out to the shards, milliseconds.
DRAIN_LINGER_MS = 3000
#: Inner steps after a (re)start left out of the reported step time (they hold compilation).
STEP_TIME_SKIP = 3


class State(Enum):
    """Learner states (STYLE: one state machine, transitions in one place)."""

    JOINING = "joining"
    SYNCING = "syncing"
    TRAINING = "training"
    DRAINING = "draining"
    STOPPED = "stopped"


@dataclass
class Outgoing:
    """A delta waiting for the comms thread; a newer one of the same fragment absorbs it
    (:func:`fold_outgoing`)."""

    fragment: int
    base: int
    tensors: list[np.ndarray]
    c_steps: int
    c_tokens: int
    new_tokens: int
    step: int
    step_time: float
    #: a data-parallel gradient (``base`` is its step): never summed with another step's
    dp: bool = False


def fold_outgoing(older: Outgoing, newer: Outgoing) -> None:
    """Fold an unsent older delta of a fragment into a newer one, in place
    (:func:`workers.merge.fold_pending`; data-parallel gradients are never summed)."""
    if not newer.dp:
        newer.tensors, added = fold_pending(older.base, older.tensors, newer.base,
                                            newer.tensors)
        if added:
            newer.c_steps += older.c_steps
            newer.c_tokens += older.c_tokens
    newer.new_tokens += older.new_tokens


class Comms(threading.Thread):
    """Network side of a learner: sends deltas, receives and reconstructs versions.

    Args:
        store: a parameter store (its own connection: redis-py clients are thread safe, but a
            separate one keeps slow reads off the heartbeat path).
        manifest: the run manifest.
        learner: this learner's id; ``incarnation`` its current incarnation.
    """

    def __init__(self, store: Any, manifest: dict[str, Any], learner: str, incarnation: int,
                 log: Any) -> None:
        super().__init__(name=f"{learner}-comms", daemon=True)
        import zmq

        self.store = store
        self.manifest = manifest
        self.cfg = manifest_config(manifest)
        self.layout: FragmentLayout = manifest_layout(manifest)
        self.learner = learner
        self.incarnation = incarnation
        self.log = log
        self.run_id: str = manifest["run_id"]
        #: the payload codecs the manifest fixes for broadcasts (versions)
        self.allowed_codecs = [self.cfg.sync.codec_down]
        self.ctx = zmq.Context()
        biggest = max(self.layout.n_values(p) for p in range(self.layout.n_fragments))
        curve = None
        if self.cfg.security.curve:
            keys_dir = self.cfg.security.keys_dir
            if keys_dir is None:
                raise ConfigError("security.curve needs security.keys_dir (docs/SECURITY.md)")
            curve = ClientKeys(load_keys(keys_dir, learner), Path(keys_dir))
        self.push = DeltaPush(self.ctx, max_message_bytes(biggest), curve)
        self.sub = VersionSub(self.ctx, max_message_bytes(biggest), curve)
        self.lock = threading.Lock()
        self.outbox: dict[int, Outgoing] = {}
        self.inbox: dict[int, tuple[int, list[np.ndarray], dict[str, int]]] = {}
        self.view: dict[int, tuple[int, list[np.ndarray]]] = {}
        self.resync: set[int] = set()
        self.round_open: set[int] = set()
        #: set by the trainer: would it join an open round of fragment p now?
        self.will_join: Callable[[int], bool] | None = None
        self.stop_flag = threading.Event()
        self.seq = 0
        self.bytes_up = 0
        self.bytes_down = 0
        #: application bytes per directed pair of workers, ``"src>dst"`` (this learner,
        #: ``shard-<s>``, ``redis``), compared per link with interface counters when the run
        #: is spread over regions (docs/REGIONS.md); ``?`` for an undecodable message's sender
        self.peer_bytes: dict[str, int] = {}
        self._peer_lock = threading.Lock()
        self.sent = 0
        #: fragment-tokens handed to a socket (DESIGN §5 token fate)
        self.sent_tokens = 0
        #: returns the trainer's (processed, overwritten, drain) fragment-tokens, read atomically
        self.fate_source: Callable[[], tuple[int, int, int]] = lambda: (0, 0, 0)
        self.folded = 0
        self.in_flight = 0
        self.drops: dict[str, int] = {}
        self.last_shard_msg = time.monotonic()
        self.ready = threading.Event()
        up_bps = self.cfg.sync.upload_bps
        self.pacer = Pacer(up_bps) if up_bps is not None else None

    def count_bytes(self, src: str, dst: str, nbytes: int) -> None:
        """Add ``nbytes`` (application bytes: ZeroMQ frames, or fragment blobs read from the
        store) to the pair ``src -> dst`` of :attr:`peer_bytes`."""
        key = f"{src}>{dst}"
        with self._peer_lock:
            self.peer_bytes[key] = self.peer_bytes.get(key, 0) + nbytes

    def count_store_read(self, blobs: Sequence[FragmentBlob | None]) -> None:
        """Count the value and momentum bytes of fragment blobs read from the store."""
        n = sum(len(b.value) + len(b.momentum) for b in blobs if b is not None)
        if n:
            self.count_bytes("redis", self.learner, n)

    def peer_bytes_snapshot(self) -> dict[str, int]:
        """A copy of :attr:`peer_bytes` (cumulative for this incarnation)."""
        with self._peer_lock:
            return dict(self.peer_bytes)

    # ---------------------------------------------------------------- called by the trainer
    def submit(self, item: Outgoing) -> None:
        """Hand a delta over without blocking; replaces an unsent one of the same fragment."""
        with self.lock:
            prev = self.outbox.get(item.fragment)
            if prev is not None:
                self.folded += 1
                fold_outgoing(prev, item)
            self.outbox[item.fragment] = item

    def take_inbox(self) -> dict[int, tuple[int, list[np.ndarray], dict[str, int]]]:
        """Versions decoded since the last call (latest per fragment), each with the map
        learner -> step of the deltas merged into it."""
        with self.lock:
            got, self.inbox = self.inbox, {}
        return got

    def take_round_open(self) -> set[int]:
        """Fragments whose shard announced an open round since the last call."""
        with self.lock:
            got, self.round_open = self.round_open, set()
        return got

    def seed(self, fragment: int, version: int, tensors: list[np.ndarray]) -> None:
        """Set the comms view of a fragment from a store read (SYNCING)."""
        with self.lock:
            cur = self.view.get(fragment)
            if cur is None or version > cur[0]:
                self.view[fragment] = (version, [t.copy() for t in tensors])

    def pending(self) -> int:
        """Deltas not yet handed to a socket."""
        with self.lock:
            return len(self.outbox) + self.in_flight

    # ---------------------------------------------------------------- thread body
    def run(self) -> None:
        last_ep = 0.0
        try:
            while not self.stop_flag.is_set():
                now = time.monotonic()
                try:
                    if now - last_ep > 1.0:
                        last_ep = now
                        self._refresh_endpoints()
                    self._send_pending()
                    frames = self.sub.recv(2)
                    while frames is not None:
                        self._on_message(frames)
                        frames = self.sub.recv(0)
                    self._do_resync()
                except StoreUnavailable as exc:
                    # Sends and broadcasts go on without the store; resyncs wait for it.
                    self.log.warning("store unavailable: %s", exc)
                    self.stop_flag.wait(0.5)
        except DDilocoError as exc:  # pragma: no cover - logged, trainer notices via state
            self.log.error("comms thread stopped: %s", exc)
        finally:
            # Deltas handed to the socket are counted as sent: let them reach the shards
            # (a drain's last deltas, CURVE-encrypted on a busy machine, need more than the
            # moment LINGER 0 gives them), but never wait long for a dead shard.
            self.push.close(linger_ms=DRAIN_LINGER_MS)
            self.sub.close()
            self.ctx.term()

    def _refresh_endpoints(self) -> None:
        shards = self.store.shards()
        self.push.update({int(s): e["pull"] for s, e in shards.items() if "pull" in e})
        if self.sub.update({int(s): e["pub"] for s, e in shards.items() if "pub" in e}):
            self.log.info("connected to shards %s", sorted(shards))
        if len(shards) >= self.cfg.run.shards:
            self.ready.set()

    def _send_pending(self) -> None:
        with self.lock:
            items = list(self.outbox.values())
        for item in items:
            if self.pacer is not None and not self.pacer.ready():
                return  # the rest waits in the outbox (and folds into newer deltas)
            shard = shard_of(item.fragment, self.cfg.run.shards)
            if not self.push.has(shard):
                continue
            with self.lock:
                # Take it out before sending: a delta folded into a newer one meanwhile must
                # not be both sent and folded (its tokens would count twice).
                if self.outbox.get(item.fragment) is not item:
                    continue
                del self.outbox[item.fragment]
                self.in_flight += 1
            try:
                sent = self._send_item(shard, item)
            finally:
                with self.lock:
                    self.in_flight -= 1
            if not sent:
                with self.lock:
                    newer = self.outbox.get(item.fragment)
                    if newer is None:
                        self.outbox[item.fragment] = item
                    else:
                        fold_outgoing(item, newer)

    def _send_item(self, shard: int, item: Outgoing) -> bool:
        """Encode and push one delta (or DP gradient); False when the socket refused it."""
        self.seq += 1
        processed, overwritten, drain = self.fate_source()
        fate = [processed, self.sent_tokens + item.new_tokens, overwritten, drain]
        frames = wire.encode(self._header(item, fate), item.tensors)
        if not self.push.send(shard, frames):
            return False
        nbytes = wire.message_nbytes(frames)
        if self.pacer is not None:
            self.pacer.sent(nbytes)
        self.bytes_up += nbytes
        self.count_bytes(self.learner, f"shard-{shard}", nbytes)
        self.sent += 1
        self.sent_tokens += item.new_tokens
        return True

    def _header(self, item: Outgoing, fate: list[int]) -> Header:
        """The DELTA header of ``item``; ``fate``: this incarnation's token-fate counters."""
        return Header(
            kind=Kind.DELTA, run=self.run_id, sender=self.learner, inc=self.incarnation,
            seq=self.seq, frag=item.fragment, base=item.base, ver=-1, c_steps=item.c_steps,
            c_tokens=item.c_tokens, new_tokens=item.new_tokens, step=item.step,
            step_time=item.step_time, codec=self.cfg.sync.codec_up, extra={"fate": fate})

    def _on_other(self, h: Header, tensors: list[np.ndarray] | None) -> None:
        """A broadcast of a kind only a variant takes (:mod:`workers.dp`); ignored here."""

    def _send_join(self, fragment: int) -> None:
        shard = shard_of(fragment, self.cfg.run.shards)
        self.seq += 1
        frames = wire.encode(Header(kind=Kind.CONTROL, run=self.run_id, sender=self.learner,
                                    inc=self.incarnation, seq=self.seq, frag=fragment,
                                    extra={"action": "join"}))
        if self.push.send(shard, frames):
            nbytes = wire.message_nbytes(frames)
            self.bytes_up += nbytes
            self.count_bytes(self.learner, f"shard-{shard}", nbytes)

    def _shapes(self, h: Header) -> list[tuple[int, ...]] | None:
        if 0 <= h.frag < self.layout.n_fragments:
            return self.layout.shapes(h.frag)
        return None

    def _on_message(self, frames: list[bytes]) -> None:
        """Decode, validate (:func:`workers.validate.check_broadcast`) and apply one message
        from a shard. A bad one is dropped and counted by reason; nothing a message holds
        raises out of here (the comms thread must not die on input)."""
        nbytes = wire.message_nbytes(frames)
        self.bytes_down += nbytes
        self.last_shard_msg = time.monotonic()
        try:
            self._handle_broadcast(frames, nbytes)
        except DropError as exc:
            self.drops[exc.reason] = self.drops.get(exc.reason, 0) + 1
        except Exception:
            logging.getLogger("ddiloco.learner").exception(
                "unexpected error on a shard message: dropped")
            self.drops[InternalError.reason] = self.drops.get(InternalError.reason, 0) + 1

    def _handle_broadcast(self, frames: list[bytes], nbytes: int) -> None:
        try:
            msg = wire.decode(frames, run_id=self.run_id, expected_shapes=self._shapes,
                              allowed_codecs=self.allowed_codecs)
            h = msg.header
            versions = check_broadcast(h, msg.tensors, self.layout.n_fragments)
        except DropError:
            self.count_bytes("?", self.learner, nbytes)
            raise
        self.count_bytes(h.sender, self.learner, nbytes)
        if h.kind == Kind.VERSION and msg.tensors is not None:
            self._on_version(h, msg.tensors)
        elif h.kind == Kind.CONTROL and h.extra.get("action") == "round_open":
            if self.will_join is not None and self.will_join(h.frag):
                # Tell the shard at once (the trainer may be mid-step) so it waits for us.
                self._send_join(h.frag)
                with self.lock:
                    self.round_open.add(h.frag)
        elif h.kind == Kind.CONTROL and h.extra.get("to") == self.learner:
            if h.extra.get("action") == "resync":
                self.resync.add(h.frag)
        elif h.kind == Kind.HEARTBEAT and versions is not None:
            for p, ver in versions.items():
                cur = self.view.get(p)
                if cur is not None and ver > cur[0]:
                    self.resync.add(p)  # a broadcast was missed: fetch from the store
        else:
            self._on_other(h, msg.tensors)

    def _on_version(self, h: Header, tensors: list[np.ndarray]) -> None:
        with self.lock:
            cur = self.view.get(h.frag)
        if cur is None or h.ver <= cur[0]:
            return  # already have it (or newer), e.g. read from the store after subscribing
        if h.enc == "diff":
            if cur[0] != h.base:
                self.resync.add(h.frag)  # version gap: the store has the exact value
                return
            with np.errstate(over="ignore", invalid="ignore"):
                value = [v + d for v, d in zip(cur[1], tensors, strict=True)]
            if not all(np.isfinite(v).all() for v in value):
                # No shard publishes such a version (its merge guard refuses it): the
                # broadcast is not the stored version; the store holds the exact value.
                self.drops[NonFinite.reason] = self.drops.get(NonFinite.reason, 0) + 1
                self.resync.add(h.frag)
                return
        else:
            value = tensors
        merged = {str(k): int(v) for k, v in h.extra.get("merged", {}).items()}
        with self.lock:
            self.view[h.frag] = (h.ver, value)
            self.inbox[h.frag] = (h.ver, value, merged)

    def _do_resync(self) -> None:
        while self.resync:
            p = self.resync.pop()
            try:
                blob = self.store.get_latest(p)
            except StoreUnavailable:
                self.resync.add(p)
                raise
            self.count_store_read([blob])
            if blob is None:
                continue
            with self.lock:
                cur = self.view.get(p)
            if cur is not None and blob.version <= cur[0]:
                continue  # the view is current; the trainer adopts it from the inbox
            value = decode_blob(blob.value, self.layout.shapes(p))
            merged = {str(k): int(v) for k, v in blob.meta.get("merged", {}).items()}
            with self.lock:
                self.view[p] = (blob.version, value)
                self.inbox[p] = (blob.version, value, merged)
            self.store.add_event("resync", {"learner": self.learner, "fragment": p,
                                            "version": blob.version})


class Learner:
    """One learner process's training side (Decoupled DiLoCo; the data-parallel baseline is
    the :class:`workers.dp.DPLearner` variant).

    Args:
        store: parameter store of the run.
        learner_id: e.g. "learner-0"; its index (trailing int) picks its data shard.
        run_dir: where checkpoints and the compilation cache live.
    """

    #: the network side (a variant's learner brings its own)
    comms_class: type[Comms] = Comms

    def __init__(self, store: Any, comms_store: Any, learner_id: str, run_dir: Path,
                 max_steps: int | None = None, group: HostGroup | None = None) -> None:
        #: the processes of a multi-process learner (:mod:`workers.multihost`); None: one
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

    def transition(self, new: State, **detail: Any) -> None:
        """Move to ``new``; every transition is logged and recorded with its versions."""
        self.log.info("%s -> %s %s", self.state.value, new.value,
                      json.dumps(detail, default=str) if detail else "")
        self.state = new

    # ---------------------------------------------------------------- set-up
    def join(self) -> None:
        """JOINING: register, read the manifest, subscribe."""
        from ddiloco.workers.runtime import wait_for_manifest

        self.manifest = wait_for_manifest(self.store)
        self.cfg = manifest_config(self.manifest)
        self.layout = manifest_layout(self.manifest)
        if self.group is not None:
            if self.manifest["mode"] != "diloco":
                raise DDilocoError("multi-process learners train DiLoCo runs only (run.mode "
                                   "= diloco)")
            self.group.layout = self.layout
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
        from ddiloco.workers.task import DataShard, TaskError, build_task

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
            self.ckpt = LearnerCheckpoint(self.ckpt_dir / "ckpt")
            self._restore()
            self.step, self.position = self.group.share_ints([0, 0])
            self.batches = self.task.batches(DataShard(index, n_shards, self.position, t.seed))
            return
        # Wait until every fragment has a version (shards write version 0 at first start);
        # DP: until every fragment is at the same checkpoint (shards roll back at start).
        deadline = time.monotonic() + 120
        while True:
            blobs = self.store.get_latest_many(list(range(self.layout.n_fragments)))
            self.comms.count_store_read(blobs)
            if self._versions_ready(blobs) or self.stop.is_set():
                break
            if time.monotonic() > deadline:
                raise DDilocoError("fragments have no version after 120 s: is a syncer up?")
            time.sleep(0.1)
        params: dict[str, Any] = {}
        self.version: list[int] = []
        self.anchor: list[list[np.ndarray]] = []
        for p, blob in enumerate(blobs):
            assert blob is not None
            value = decode_blob(blob.value, self.layout.shapes(p))
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
        self.ckpt = LearnerCheckpoint(self.ckpt_dir / "ckpt")
        position = self._resume(blobs)
        if self.group is not None:
            self.group.share_ints([self.step, position])
        #: batches consumed from this learner's data shard (the resume position)
        self.position = position
        self.batches = self.task.batches(DataShard(index, n_shards, position, t.seed))
        self.offsets = fragment_offsets(P, cfg.sync.H)
        self.last_send = initial_last_sends(self.offsets, cfg.sync.H, self.step)

    def _versions_ready(self, blobs: list[Any]) -> bool:
        """Every fragment has a version (shards write version 0 at first start)."""
        return all(b is not None for b in blobs)

    def _resume(self, blobs: list[Any]) -> int:
        """Restore this learner's own checkpoint; returns the data position to resume at."""
        return self._restore()

    # ---------------------------------------------------------------- checkpoints
    @property
    def ckpt_dir(self) -> Path:
        """This learner's checkpoint directory."""
        return self.run_dir / "learners" / self.id

    def checkpoint(self) -> None:
        """Checkpoint the inner optimizer state (by tree path), data position and counters
        (orbax, atomic; :mod:`workers.checkpoint`)."""
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
        for p, (ver, value, _merged) in got.items():
            if ver <= self.version[p]:
                continue
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
            self.anchor[p] = value
            self.ref[p] = value
            self.version[p] = ver
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
        (1 - early_fraction) * H steps have passed since this learner last sent p."""
        if self.state is not State.TRAINING or not self.cfg.sync.round_notice:
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
        delta = [a - t for a, t in zip(self.anchor[p], theta, strict=True)]
        if self.cfg.sync.adopt == "carry":
            delta = codec.quantize_roundtrip(delta, self.cfg.sync.codec_up)
            self.ref[p] = [a - d for a, d in zip(self.anchor[p], delta, strict=True)]
        self.comms.submit(Outgoing(p, self.version[p], delta, self.c_steps[p], self.c_tokens[p],
                                   self.unsent_tokens[p], self.step, step_time))
        self.unsent_tokens[p] = self.unsent_steps[p] = 0

    # ---------------------------------------------------------------- liveness
    def _heartbeat(self) -> None:
        """One round trip to the store: the TTL entry, the fate record and the counters in one
        pipeline, so a slow link costs one queueing delay per tick, not one per write. The
        entry's TTL covers the worst recent tick (:func:`workers.runtime.heartbeat_ttl_s`)."""
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
        try:
            pipe.execute()
        except (redis.ConnectionError, redis.TimeoutError) as exc:
            raise StoreUnavailable(f"heartbeat: {exc}") from exc
        # Only now: a failed tick must not count its increments as reported.
        self.tokens_reported = max(self.tokens_reported, total)
        if up > prev_up or down > prev_down:
            self._bytes_reported = (up, down)
        tick = time.monotonic() - t0
        self.heartbeat_ticks.append(tick)
        self.heartbeat_tick_max = max(self.heartbeat_tick_max, tick)

    def _write_fate(self, ended: str, pipe: Any = None) -> None:
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
        deadline = time.monotonic() + 3.0
        while self.comms.pending() and time.monotonic() < deadline:
            time.sleep(0.02)
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
                                       "bytes_up": self.comms.bytes_up,
                                       "bytes_down": self.comms.bytes_down,
                                       "heartbeat_tick_max_s": self.heartbeat_tick_max})
        self.transition(State.STOPPED, step=self.step, tokens=self.tokens_total)


def run_learner(store: Any, comms_store: Any, learner_id: str, run_dir: Path,
                max_steps: int | None = None, multiprocess: bool = False,
                metrics_port: int | None = None) -> int:
    """Process entry: run one learner (or, with ``multiprocess``, this process's part of a
    ``jax.distributed`` learner: :mod:`workers.multihost`) to completion or SIGTERM. Returns
    the exit code."""
    group = None
    if multiprocess:
        from ddiloco.workers.multihost import HostGroup

        group = HostGroup()
    from ddiloco.workers.runtime import wait_for_manifest

    cls: type[Learner] = Learner
    if wait_for_manifest(store)["mode"] == "dp":
        from ddiloco.workers.dp import DPLearner

        cls = DPLearner
    learner = cls(store, comms_store, learner_id, run_dir, max_steps, group=group)
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
