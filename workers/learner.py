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

from pipeline import codec, wire
from pipeline.errors import (
    ConfigError,
    DDilocoError,
    DropError,
    InternalError,
    NonFinite,
    StoreUnavailable,
)
from pipeline.fragments import (
    FragmentLayout,
    due_fragments,
    fragment_offsets,
    initial_last_sends,
    shard_of,
)
from pipeline.security import ClientKeys, load_keys
from pipeline.transport import DeltaPush, Pacer, VersionSub, max_message_bytes
from pipeline.wire import Header, Kind
from workers.merge import adopt_fragment, fold_pending
from workers.runtime import (
    Ticker,
    decode_blob,
    digest,
    dp_step_of,
    fragment_tensors,
    heartbeat_ttl_s,
    manifest_config,
    manifest_layout,
    opt_state_from_parts,
    setup_logging,
)
from workers.validate import check_broadcast

if TYPE_CHECKING:
    from store.base import FragmentBlob


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
        #: the payload codecs the manifest fixes for broadcasts: versions and DP averages
        self.allowed_codecs = [self.cfg.sync.codec_dp if manifest["mode"] == "dp"
                               else self.cfg.sync.codec_down]
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
        self.dp_inbox: dict[tuple[int, int], list[np.ndarray]] = {}
        self.dp_event = threading.Condition(self.lock)
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
        self.pacer = Pacer(up_bps) if up_bps is not None and manifest["mode"] != "dp" else None

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

    def send_grad(self, fragment: int, step: int, tensors: list[np.ndarray]) -> None:
        """DP baseline: queue one fragment's gradient of ``step``."""
        self.submit(Outgoing(fragment, step, tensors, 1, 0, 0, step, 0.0, dp=True))

    def wait_grads(self, step: int, n_fragments: int, stop: threading.Event,
                   timeout_s: float = 0.2) -> dict[int, list[np.ndarray]] | None:
        """DP baseline: block until every fragment's averaged gradient of ``step`` arrived."""
        with self.dp_event:
            while True:
                got = {p: self.dp_inbox[(p, step)] for p in range(n_fragments)
                       if (p, step) in self.dp_inbox}
                if len(got) == n_fragments:
                    for p in range(n_fragments):
                        del self.dp_inbox[(p, step)]
                    return got
                if stop.is_set():
                    return None
                self.dp_event.wait(timeout_s)

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
        dp = self.manifest["mode"] == "dp"
        processed, overwritten, drain = self.fate_source()
        fate = [processed, self.sent_tokens + item.new_tokens, overwritten, drain]
        header = Header(
            kind=Kind.GRAD if dp else Kind.DELTA, run=self.run_id, sender=self.learner,
            inc=self.incarnation, seq=self.seq, frag=item.fragment,
            base=-1 if dp else item.base, ver=item.step if dp else -1,
            c_steps=item.c_steps, c_tokens=item.c_tokens, new_tokens=item.new_tokens,
            step=item.step, step_time=item.step_time,
            codec=self.cfg.sync.codec_dp if dp else self.cfg.sync.codec_up,
            extra={} if dp else {"fate": fate})
        frames = wire.encode(header, item.tensors)
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
        elif h.kind == Kind.GRAD_AVG and msg.tensors is not None:
            with self.dp_event:
                self.dp_inbox[(h.frag, h.ver)] = msg.tensors
                self.dp_event.notify_all()
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
    """One learner process's training side.

    Args:
        store: parameter store of the run.
        learner_id: e.g. "learner-0"; its index (trailing int) picks its data shard.
        run_dir: where checkpoints and the compilation cache live.
    """

    def __init__(self, store: Any, comms_store: Any, learner_id: str, run_dir: Path,
                 max_steps: int | None = None) -> None:
        self.store = store
        self.comms_store = comms_store
        self.id = learner_id
        self.run_dir = run_dir
        self.log = setup_logging(learner_id)
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
        from workers.runtime import wait_for_manifest

        self.manifest = wait_for_manifest(self.store)
        self.cfg = manifest_config(self.manifest)
        self.layout = manifest_layout(self.manifest)
        self.incarnation = self.store.register_learner(self.id)
        self.comms = Comms(self.comms_store, self.manifest, self.id, self.incarnation, self.log)
        self.comms.fate_source = lambda: self.fate
        self.comms.start()
        self.ticker = Ticker(self.cfg.run.heartbeat_s, self._heartbeat,
                             f"{self.id}-heartbeat").start()
        self.store.add_event("join", {"learner": self.id, "incarnation": self.incarnation})

    def sync(self) -> None:
        """SYNCING: build the model, adopt the store's latest versions, restore the checkpoint."""
        import jax

        from workers.data import BatchStream, load_documents, shard_documents, split_documents
        from workers.model import optimizer_from_config

        self.transition(State.SYNCING, incarnation=self.incarnation)
        cfg = self.cfg
        self.model_cfg = cfg.model_config_obj()
        docs = load_documents([Path(p) for p in cfg.data.corpus] or None)
        train_docs, _ = split_documents(docs, cfg.data.val_fraction, seed=cfg.train.seed)
        index = int(self.id.rsplit("-", 1)[-1]) if self.id.rsplit("-", 1)[-1].isdigit() else 0
        n_shards = max(cfg.run.learners, index + 1)
        shards = shard_documents(train_docs, n_shards, iid=cfg.data.iid, seed=cfg.train.seed)
        self.data = shards[index % len(shards)]
        dp = self.manifest["mode"] == "dp"
        t = cfg.train
        self.tx = optimizer_from_config(t, dp=dp)
        # Wait until every fragment has a version (shards write version 0 at first start);
        # DP: until every fragment is at the same checkpoint (shards roll back at start).
        deadline = time.monotonic() + 120
        while True:
            blobs = self.store.get_latest_many(list(range(self.layout.n_fragments)))
            self.comms.count_store_read(blobs)
            ready = all(b is not None for b in blobs)
            if ready and dp:
                ready = len({dp_step_of(b.meta) for b in blobs if b is not None}) == 1
            if ready or self.stop.is_set():
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
        self.params = {k: jax.numpy.asarray(v) for k, v in params.items()}
        self.opt_state = self.tx.init(self.params)
        P = self.layout.n_fragments
        self.c_steps = [0] * P
        self.c_tokens = [0] * P
        self.unsent_tokens = [0] * P
        self.unsent_steps = [0] * P
        #: where unsent work is measured from (carry adoption): anchor after an adoption,
        #: anchor - decoded delta after a send
        self.ref: list[list[np.ndarray]] = list(self.anchor)
        if dp:
            # Data-parallel without elasticity: every learner resumes from the job's last
            # checkpoint in the store (value and AdamW state), one batch per step.
            dp_step = dp_step_of(blobs[0].meta) if blobs[0] is not None else -1
            if dp_step >= 0:
                self.opt_state = opt_state_from_parts(
                    self.opt_state, [b.momentum for b in blobs if b is not None])
            self.step = position = dp_step + 1
            self.log.info("data-parallel job resumes at step %d", self.step)
        else:
            position = self._restore()
        self.stream = BatchStream(self.data, t.batch_size, self.model_cfg.seq_len,
                                  seed=t.seed * 1000 + index, position=position)
        self.offsets = fragment_offsets(P, cfg.sync.H)
        self.last_send = initial_last_sends(self.offsets, cfg.sync.H, self.step)

    # ---------------------------------------------------------------- checkpoints
    @property
    def ckpt_dir(self) -> Path:
        """This learner's checkpoint directory."""
        return self.run_dir / "learners" / self.id

    def checkpoint(self) -> None:
        """Write inner optimizer state, data position and counters atomically (npz + json)."""
        import jax

        self.ckpt_dir.mkdir(parents=True, exist_ok=True)
        leaves = jax.tree_util.tree_leaves(self.opt_state)
        tmp = self.ckpt_dir / "opt.tmp.npz"
        np.savez(tmp, *[np.asarray(x) for x in leaves])
        os.replace(tmp, self.ckpt_dir / "opt.npz")
        meta = {"step": self.step, "position": self.stream.position,
                "tokens_total": self.tokens_total, "versions": self.version,
                "incarnation": self.incarnation, "time": time.time()}
        tmpj = self.ckpt_dir / "meta.tmp.json"
        tmpj.write_text(json.dumps(meta))
        os.replace(tmpj, self.ckpt_dir / "meta.json")

    def _restore(self) -> int:
        import jax

        meta_path = self.ckpt_dir / "meta.json"
        opt_path = self.ckpt_dir / "opt.npz"
        if not (meta_path.exists() and opt_path.exists()):
            return 0
        meta = json.loads(meta_path.read_text())
        with np.load(opt_path, allow_pickle=False) as z:
            leaves = [z[f"arr_{i}"] for i in range(len(z.files))]
        treedef = jax.tree_util.tree_structure(self.opt_state)
        if treedef.num_leaves != len(leaves):  # type: ignore[attr-defined]
            self.log.warning("checkpoint does not match the optimizer: starting fresh")
            return 0
        self.opt_state = jax.tree_util.tree_unflatten(
            treedef, [jax.numpy.asarray(x) for x in leaves])
        self.step = int(meta["step"])
        self.tokens_total = self.tokens_reported = int(meta["tokens_total"])
        self.log.info("restored checkpoint at step %d (data position %d)", self.step,
                      meta["position"])
        return int(meta["position"])

    # ---------------------------------------------------------------- adoption and sends
    def adopt(self) -> int:
        """Adopt every newer version the comms thread has (DESIGN §2 step 3).

        ``carry`` (default, ours): theta = Theta + (theta - ref): the local work that has not
        left yet (steps since the last send, plus the codec's error on that send) is kept and
        leaves in the next delta, so no processed token is thrown away. ``overwrite`` (paper):
        theta = Theta; unsent work is discarded (counted as ``discarded_overwritten``).
        ``mix`` (Streaming DiLoCo): theta = a*theta + (1-a)*Theta, unsent work discarded.
        Either way the anchor becomes Theta. The fragment's counters restart at what theta -
        anchor holds: the unsent steps and tokens under ``carry``, zero otherwise.
        """
        import jax.numpy as jnp

        got = self.comms.take_inbox()
        policy = self.cfg.sync.adopt
        n = 0
        for p, (ver, value, _merged) in got.items():
            if ver <= self.version[p]:
                continue
            theta = (fragment_tensors(self.params, self.layout, p)
                     if policy != "overwrite" else value)
            new = adopt_fragment(policy, theta, value, alpha=self.cfg.sync.alpha,
                                 ref=self.ref[p])
            for name, t in zip(self.layout.names(p), new, strict=True):
                self.params[name] = jnp.asarray(t)
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
            n += 1
        return n

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
        theta = fragment_tensors(self.params, self.layout, p)
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
    def train(self) -> None:
        """TRAINING until the step budget, or SIGTERM, then DRAINING."""
        from workers.model import make_apply_step, make_grad_step, make_train_step

        dp = self.manifest["mode"] == "dp"
        budget = self.max_steps if self.max_steps is not None else self.cfg.train.steps
        if dp:
            grad_step = make_grad_step(self.model_cfg)
            apply_step = make_apply_step(self.tx)
        else:
            train_step = make_train_step(self.model_cfg, self.tx)
        self.comms.ready.wait(timeout=30)
        self.comms.will_join = self.will_join
        self.transition(State.TRAINING, step=self.step, versions=self.version)
        self._record_rejoin()
        ema_step: float | None = None
        t_prev = time.perf_counter()
        loss_dev = None
        tpb = self.stream.tokens_per_batch
        P = self.layout.n_fragments
        first_step = self.start_step = self.step
        # Steady-state timing starts after warm-up (compilation, first adoptions).
        warm_step, warm_t = first_step + 20, 0.0
        # Heterogeneous learners: a speed factor s < 1 stretches every step to 1/s of its time.
        pad = 1.0 / self.cfg.train.speed.get(self.id, 1.0) - 1.0
        while self.step < budget and not self.stop.is_set():
            batch = self.stream.next()
            if dp:
                grads, loss_dev = grad_step(self.params, batch)
                for p in range(P):
                    self.comms.send_grad(p, self.step, fragment_tensors(grads, self.layout, p))
                avg = self.comms.wait_grads(self.step, P, self.stop)
                if avg is None:
                    break
                merged = {n: a for p in range(P)
                          for n, a in zip(self.layout.names(p), avg[p], strict=True)}
                self.params, self.opt_state = apply_step(self.params, self.opt_state, merged)
            else:
                self.params, self.opt_state, loss_dev = train_step(
                    self.params, self.opt_state, batch)
            self.step += 1
            self.tokens_total += tpb
            processed, overwritten, drain = self.fate
            self.fate = (processed + tpb * P, overwritten, drain)
            for p in range(P):
                self.c_steps[p] += 1
                self.c_tokens[p] += tpb
                self.unsent_steps[p] += 1
                self.unsent_tokens[p] += tpb
            if not dp:
                self.adopt()
                for p in self.due():
                    self.send_delta(p, ema_step or 0.0)
            if self.step == first_step + 1 and loss_dev is not None:
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

    def _event(self, kind: str, fields: dict[str, Any]) -> None:
        """Record an event; a store outage must not stop training (the event is lost)."""
        try:
            self.store.add_event(kind, fields)
        except StoreUnavailable as exc:
            self.log.warning("event %s not recorded: %s", kind, exc)

    def _record_rejoin(self) -> None:
        """Record, for audits, exactly what this incarnation adopted from the store."""
        digests = {str(p): digest(fragment_tensors(self.params, self.layout, p))
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
        if self.manifest["mode"] == "diloco":
            for p in range(self.layout.n_fragments):
                if self.c_steps[p] >= self.cfg.sync.H / 2 and self.unsent_tokens[p] > 0:
                    self.send_delta(p, getattr(self, "step_time", 0.0))
                elif self.unsent_tokens[p] > 0:
                    processed, overwritten, drain = self.fate
                    self.fate = (processed, overwritten, drain + self.unsent_tokens[p])
                    self.unsent_tokens[p] = 0
        deadline = time.monotonic() + 3.0
        while self.comms.pending() and time.monotonic() < deadline:
            time.sleep(0.02)
        self.checkpoint()
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
                max_steps: int | None = None) -> int:
    """Process entry: run one learner to completion or SIGTERM. Returns the exit code."""
    learner = Learner(store, comms_store, learner_id, run_dir, max_steps)

    def _stop(signum: int, _frame: Any) -> None:
        learner.stop.set()

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    learner.join()
    learner.sync()
    learner.train()
    learner.drain()
    return 0
