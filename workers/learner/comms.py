"""A learner's network side: the comms thread that sends deltas and rebuilds versions.

The training thread never waits on the network (DESIGN §2): it hands each due fragment's delta
to the comms thread (:meth:`Comms.submit`; an unsent delta of the same fragment folds into the
newer one, :func:`fold_outgoing`) and adopts the versions the comms thread has decoded
(:meth:`Comms.take_inbox`).

The comms thread is the Clone client of the zguide: it subscribes to every shard's broadcast
*before* the learner reads the snapshot from the store, keeps its own copy of the global value
of every fragment, applies exact quantized version differences to it, and on a version gap (or
a "resync" control) fetches the fragment from the store. Variants (:mod:`ddiloco.workers.dp`)
override
the hooks :meth:`Comms._header` and :meth:`Comms._on_other`.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ddiloco.pipeline import wire
from ddiloco.pipeline.errors import (
    ConfigError,
    DropError,
    InternalError,
    NonFinite,
    StoreUnavailable,
)
from ddiloco.pipeline.fragments import FragmentLayout, shard_of
from ddiloco.pipeline.security import ClientKeys, load_keys
from ddiloco.pipeline.transport import DeltaPush, Pacer, VersionSub, max_message_bytes
from ddiloco.pipeline.wire import Header, Kind
from ddiloco.store.base import FragmentBlob, ParameterStore
from ddiloco.workers.learner.adoption import fold_pending
from ddiloco.workers.run.blobs import decode_blob
from ddiloco.workers.run.manifest import manifest_config, manifest_layout
from ddiloco.workers.syncer.validate import check_broadcast

__all__ = ["DRAIN_LINGER_MS", "Comms", "Outgoing", "endpoint_refresh_s", "fold_outgoing"]

#: At exit, how long queued deltas may still go out to the shards, milliseconds.
DRAIN_LINGER_MS = 3000
#: the longest the comms thread sleeps with nothing to do, milliseconds: how soon it sees
#: the stop flag, a paced send coming due or a shard it could not reach yet
IDLE_WAKE_MS = 50
#: how often the comms thread reads the shards' endpoints, seconds: once it knows them all,
#: and at most while one is missing (:func:`endpoint_refresh_s`)
ENDPOINT_REFRESH_S = 1.0
ENDPOINT_FIRST_S = 0.05


def endpoint_refresh_s(last_s: float, all_known: bool) -> float:
    """Seconds until the comms thread reads the shards' endpoints again, after a read that
    came ``last_s`` seconds after the one before (0.0: the first read).

    Once every shard is known, :data:`ENDPOINT_REFRESH_S` (a shard that moves is seen within
    a second). While one is missing (a run's start, a shard restarting), soon again: the
    learner's first sends wait for every shard, so the wait starts at
    :data:`ENDPOINT_FIRST_S` and grows 1.5x a read up to :data:`ENDPOINT_REFRESH_S`, bounding
    what a learner reads from the store while a shard stays down.

    >>> [round(endpoint_refresh_s(s, False), 3) for s in (0.0, 0.05, 0.5, 0.9)]
    [0.05, 0.075, 0.75, 1.0]
    >>> endpoint_refresh_s(0.05, True)
    1.0
    """
    if all_known:
        return ENDPOINT_REFRESH_S
    return min(max(1.5 * last_s, ENDPOINT_FIRST_S), ENDPOINT_REFRESH_S)


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
    (:func:`ddiloco.workers.learner.adoption.fold_pending`; data-parallel gradients are never
    summed)."""
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
        log: the learner's logger.

    Raises:
        ConfigError: ``security.curve`` without ``security.keys_dir``.
    """

    def __init__(self, store: ParameterStore, manifest: dict[str, Any], learner: str,
                 incarnation: int, log: logging.Logger) -> None:
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
        sync = self.cfg.sync
        self.push = DeltaPush(self.ctx, max_message_bytes(biggest, [sync.codec_up, sync.codec_dp]),
                              curve)
        # Shards broadcast versions in codec_down and data-parallel averages in codec_dp: a
        # frame larger than either allows for the largest fragment is cut by libzmq.
        self.sub = VersionSub(self.ctx, max_message_bytes(biggest, [sync.codec_down,
                                                                    sync.codec_dp]), curve)
        self.lock = threading.Lock()
        self.outbox: dict[int, Outgoing] = {}
        self.inbox: dict[int, tuple[int, list[np.ndarray], dict[str, int]]] = {}
        #: set when a version enters the inbox (a waiting trainer wakes on it)
        self.inbox_filled = threading.Event()
        self.view: dict[int, tuple[int, list[np.ndarray]]] = {}
        self.resync: set[int] = set()
        # The trainer wakes the thread when it hands over a delta (:meth:`submit`), so the
        # thread sleeps in one poll of the broadcasts and this pipe instead of waking every
        # 2 ms to look (measured: 3.5 % of a core per learner, 7 % of its own CPU).
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._poller = zmq.Poller()
        self._poller.register(self.sub.sock, zmq.POLLIN)
        self._poller.register(self._wake_r, zmq.POLLIN)
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
        #: why the thread stopped on an error (None while it runs or after a clean stop)
        self.failure: str | None = None
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
        self.wake()

    def wake(self) -> None:
        """Wake the comms thread from its poll (there is something to send)."""
        try:
            os.write(self._wake_w, b"\0")
        except BlockingIOError:  # the pipe is full: the thread has wake-ups pending anyway
            pass

    def take_inbox(self) -> dict[int, tuple[int, list[np.ndarray], dict[str, int]]]:
        """Versions decoded since the last call (latest per fragment), each with the map
        learner -> step of the deltas merged into it."""
        with self.lock:
            got, self.inbox = self.inbox, {}
        return got

    def wait_inbox(self, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` seconds for a version to enter the inbox since the last
        call (``sync.blocking``); True if one did. The caller takes it with
        :meth:`take_inbox` afterwards, so one that arrives in between is not missed."""
        got = self.inbox_filled.wait(timeout_s)
        self.inbox_filled.clear()
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
        last_ep, every = 0.0, 0.0
        try:
            while not self.stop_flag.is_set():
                now = time.monotonic()
                try:
                    if now - last_ep > every:
                        last_ep = now
                        self._refresh_endpoints()
                        every = endpoint_refresh_s(every, self.ready.is_set())
                    self._send_pending()
                    self._sleep()
                    frames = self.sub.recv(0)
                    while frames is not None:
                        self._on_message(frames)
                        frames = self.sub.recv(0)
                    self._do_resync()
                except StoreUnavailable as exc:
                    # Sends and broadcasts go on without the store; resyncs wait for it.
                    self.log.warning("store unavailable: %s", exc)
                    self.stop_flag.wait(0.5)
        except Exception as exc:
            # The trainer checks this every step and exits non-zero with it (a learner that
            # can no longer send must not train on while looking alive).
            self.failure = f"{type(exc).__name__}: {exc}"
            self.log.error("comms thread stopped: %s", self.failure)
        finally:
            # Deltas handed to the socket are counted as sent: let them reach the shards
            # (a drain's last deltas, CURVE-encrypted on a busy machine, need more than the
            # moment LINGER 0 gives them), but never wait long for a dead shard.
            self.push.close(linger_ms=DRAIN_LINGER_MS)
            self.sub.close()
            self.ctx.term()
            os.close(self._wake_r)
            os.close(self._wake_w)

    def _sleep(self) -> None:
        """Wait until a broadcast arrives, the trainer submits a delta, or
        :data:`IDLE_WAKE_MS` pass (the stop flag, endpoint refreshes, paced sends)."""
        if dict(self._poller.poll(IDLE_WAKE_MS)).get(self._wake_r):
            try:
                while os.read(self._wake_r, 4096):
                    pass
            except BlockingIOError:
                pass

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
        """A broadcast of a kind only a variant takes (:mod:`ddiloco.workers.dp`); ignored here."""

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
        """Decode, validate (:func:`ddiloco.workers.syncer.validate.check_broadcast`) and apply one
        message
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
        self.inbox_filled.set()

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
            value = decode_blob(blob.value, self.layout.shapes(p), own=True)
            merged = {str(k): int(v) for k, v in blob.meta.get("merged", {}).items()}
            with self.lock:
                self.view[p] = (blob.version, value)
                self.inbox[p] = (blob.version, value, merged)
            self.inbox_filled.set()
            self.store.add_event("resync", {"learner": self.learner, "fragment": p,
                                            "version": blob.version})


