"""A syncer shard's core: merges the outer gradients of the fragments it owns (DESIGN §2, §3).

:class:`ShardCore` holds the logic and no sockets: it takes decoded messages and a clock
reading, validates and files them in rounds (the receive path), decides rounds with
:mod:`ddiloco.workers.merge`, publishes versions to the store (fenced compare-and-set; the merge
path)
and returns the frames to broadcast. :func:`ddiloco.workers.shard_server.serve` is the thin process
around it: lease, sockets, polling, heartbeats. Variants (the data-parallel baseline,
:mod:`ddiloco.workers.dp`) override its hooks; :mod:`ddiloco.workers.roles` picks the class of a
run.

Restart safety: versions and momentum live in the store, so a restarted shard continues at the
stored version with the stored momentum; its epoch (from the lease) fences out a previous
owner that is still alive.

Memory. With ``F`` the float32 bytes of the fragments a shard owns and ``F_max`` those of
the largest, a shard holds:

* the value of each fragment, ``F``, and its outer momentum, ``F``, when
  ``sync.outer_momentum`` is not 0 (at 0 the momentum would only hold the last outer gradient:
  it is neither kept nor published);
* the downlink error-feedback residual (``sync.error_feedback`` with a lossy ``codec_down``):
  ``F``;
* one accumulator for the merges (:class:`ddiloco.workers.fused.MergeEngine`): ``F_max``;
* the open rounds' deltas as received, quantized (``codec_up``; int4: ``0.14 F`` each, so
  ``M * 0.14 F`` with M learners per round; :class:`ddiloco.pipeline.accumulate.Packed`);
* the version history as quantized differences between consecutive versions
  (``sync.history - 1`` of them; int4/int8 ``codec_down``: ``0.14 F`` or ``0.27 F`` each,
  also after a restart; other codecs: float32, ``F`` each);
* during a merge, the store blobs of one fragment's new value and momentum (``F_max`` each, the
  store's input) and the broadcast payload.

No float32 copy of a contribution is made: a merge decodes each delta straight into the
accumulator (:mod:`ddiloco.workers.fused`).
"""

from __future__ import annotations

import logging
import math
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from ddiloco.pipeline import codec, wire
from ddiloco.pipeline.accumulate import Packed, pack_raw, unpack
from ddiloco.pipeline.errors import (
    AlreadyMerged,
    DropError,
    DuplicateDelta,
    FencedOut,
    InternalError,
    InvalidField,
    MergeRefused,
    OutOfOrder,
    OversizedFrame,
    SchemaMismatch,
    SpoofedSender,
    StaleDelta,
    StoreDown,
    StoreUnavailable,
    TruncatedFrame,
    UnknownSender,
    VersionConflict,
    WrongRun,
)
from ddiloco.pipeline.errors import ChecksumMismatch as _ChecksumMismatch
from ddiloco.pipeline.fragments import FragmentLayout, fragments_of_shard
from ddiloco.pipeline.quantize import quantize
from ddiloco.pipeline.wire import Header, Kind
from ddiloco.store.base import FragmentBlob, ParameterStore
from ddiloco.workers.blobs import blob_parts, decode_blob, encode_blob
from ddiloco.workers.fragment_state import Contribution, FragmentState, PendingCommit
from ddiloco.workers.fused import FUSED_DOWN, MergeEngine
from ddiloco.workers.manifest import manifest_config, manifest_layout, tokens_per_batch
from ddiloco.workers.merge import (
    GUARD_WARMUP_MERGES,
    UPDATE_NORM_EMA,
    GraceConfig,
    OuterConfig,
    OuterOptimizer,
    Round,
    Timing,
    grace_window,
    lr_mass,
    lr_prefix,
    merge_interval,
    partial_share,
    should_merge,
    token_weight,
)
from ddiloco.workers.outer_step import merge_and_step
from ddiloco.workers.shard_records import ShardRecords
from ddiloco.workers.validate import (
    ClaimLimits,
    DeltaClaim,
    check_delta,
    check_shard_control,
)

__all__ = ["Clock", "Contribution", "FragmentState", "ShardCore"]

Clock = Callable[[], float]

#: Messages a shard holds while the learner registry cannot be asked about their sender;
#: beyond this they are dropped as ``store_unavailable``.
HELD_LIMIT = 256


class ShardCore:
    """Rounds, merges, outer steps and versions of one shard's fragments.

    Args:
        manifest: the run manifest.
        shard: this shard's id.
        store: the run's parameter store.
        epoch: fencing epoch from this shard's lease.
        clock: monotonic seconds (injectable for tests).
        threads: merge threads (None: ``run.merge_threads`` of the manifest's config).
    """

    def __init__(self, manifest: dict[str, Any], shard: int, store: ParameterStore,
                 epoch: int, clock: Clock = time.monotonic, name: str | None = None,
                 threads: int | None = None) -> None:
        self.manifest = manifest
        self.cfg = manifest_config(manifest)
        self.layout: FragmentLayout = manifest_layout(manifest)
        self.run_id: str = manifest["run_id"]
        self.shard = shard
        self.name = name or f"shard-{shard}"
        self.store = store
        self.epoch = epoch
        self.clock = clock
        s = self.cfg.sync
        self.mode: str = manifest["mode"]
        self.grace_cfg = GraceConfig(s.min_quorum, s.tau, s.gamma, s.grace_cap_s,
                                     enabled=s.grace, floor_steps=s.grace_steps,
                                     period_steps=s.H)
        self._outer: OuterOptimizer | None = None
        #: the outer momentum is state only when it is on (FragmentState)
        self.keep_momentum = s.outer_momentum != 0 and s.outer_delay == 1
        #: delayed Nesterov: momentum and buffer are kept beside the value instead
        self.delayed = s.outer_delay > 1
        self.engine = MergeEngine(threads or self.cfg.run.merge_threads)
        self.timing = Timing()
        embedding = set(manifest["embedding"])
        self.owned = fragments_of_shard(shard, self.layout.n_fragments, self.cfg.run.shards)
        self.embedding_mask = {p: [n in embedding for n in self.layout.names(p)]
                               for p in self.owned}
        self.frags: dict[int, FragmentState] = {}
        self.last_seq: dict[tuple[str, int], int] = {}
        #: events, counters and received totals, queued while the store is down
        self.records = ShardRecords(store, self.name)
        #: broadcasts a store failure kept from being returned (:meth:`take_unsent`)
        self.unsent: list[list[bytes]] = []
        #: messages of senders the registry could not be asked about (:meth:`retry_held`)
        self.held: list[tuple[list[bytes], str | None]] = []
        self.known: set[str] = set()
        self.live: set[str] = set()
        self.drops: dict[str, int] = {}
        self.merges = 0
        #: merged learner contributions, fragment-tokens and quorum-to-merge seconds, summed
        #: over this shard's merges (metrics: participation, goodput, grace wait)
        self.merged_contributions = 0
        self.merged_tokens = 0
        self.grace_wait_s = 0.0
        self.seq = 0
        self._lr_cum: np.ndarray | None = None
        self.claim_limits = ClaimLimits(
            tokens_per_batch=tokens_per_batch(manifest),
            max_c_steps=4 * s.H)

    # -------------------------------------------------------------------- start-up / resume
    def load(self, init_params: Callable[[], dict[str, np.ndarray]]) -> None:
        """Claim the owned fragments and resume them from the store (or write version 0).

        Raises:
            FencedOut: a newer owner holds one of the fragments.
        """
        initial: dict[str, np.ndarray] | None = None
        for p in self.owned:
            self.store.claim_fragment(p, self.epoch)
            blob = self.store.get_latest(p)
            if blob is None:
                if initial is None:
                    initial = init_params()
                value = [np.asarray(initial[n], np.float32) for n in self.layout.names(p)]
                momentum = OuterOptimizer.init_momentum(value) if self.keep_momentum else []
                self.store.publish(p, expected_version=-1, epoch=self.epoch,
                                   value=encode_blob(value), momentum=self._momentum_blob(
                                       momentum),
                                   keep=self.cfg.sync.history, meta={"init": True})
                st = self._new_state(0, value, momentum)
                if self.delayed:
                    st.restore_delayed(b"")
            else:
                st = self._resume(p, blob)
            st.history[st.version] = None
            self._load_history(p, st)
            self.frags[p] = st

    def _new_state(self, version: int, value: list[np.ndarray],
                   momentum: list[np.ndarray]) -> FragmentState:
        """A fragment's state at ``version`` (variants add their own fields)."""
        return FragmentState(version=version, value=value, momentum=momentum)

    def _resume(self, p: int, blob: FragmentBlob) -> FragmentState:
        """Fragment ``p``'s state from its stored head: value and outer momentum."""
        shapes = self.layout.shapes(p)
        value = decode_blob(blob.value, shapes)
        momentum: list[np.ndarray] = []
        if self.keep_momentum:
            momentum = (decode_blob(blob.momentum, shapes) if blob.momentum
                        else OuterOptimizer.init_momentum(value))
        st = self._new_state(blob.version, value, momentum)
        if self.delayed:
            st.restore_delayed(blob.momentum)
        return st

    def outer(self) -> OuterOptimizer:
        """The reference outer optimizer (optax), built at its first use: only downlink
        codecs without a fused outer step use it."""
        if self._outer is None:
            s = self.cfg.sync
            self._outer = OuterOptimizer(OuterConfig(lr=s.outer_lr, momentum=s.outer_momentum))
        return self._outer

    def _momentum_blob(self, momentum: list[np.ndarray]) -> bytes | list[memoryview]:
        """The store blob of a fragment's outer momentum, as its parts: empty when none is
        kept (a reader takes an empty blob as zeros)."""
        return blob_parts(momentum) if self.keep_momentum else b""

    def _load_history(self, p: int, st: FragmentState) -> None:
        """The kept versions' differences, from the stored values.

        With an int downlink they are held in its codec, as the shard's own merges hold them:
        each stored difference is the dequantized update the merge applied, which quantizes
        back to itself up to float32 rounding (``0.14 F`` a version for int4 instead of ``F``,
        so a restarted shard fits the memory of a running one). Other downlinks: float32.
        """
        shapes = self.layout.shapes(p)
        down = self.cfg.sync.codec_down
        keep = down if down in FUSED_DOWN else "fp32"
        newer = st.flat_value
        for v in range(st.version - 1, max(-1, st.version - self.cfg.sync.history), -1):
            blob = self.store.get_version(p, v)
            if blob is None:
                break
            older = np.concatenate([t.reshape(-1) for t in decode_blob(blob.value, shapes)])
            diff = np.subtract(newer, older)
            raw = diff.view(np.uint8) if keep == "fp32" else quantize([diff], keep)
            st.history[v + 1] = pack_raw(raw, shapes, keep)
            st.history[v] = None
            newer = older

    def _reload(self, p: int) -> None:
        """Fragment p's value, momentum and history again from the store's head (after a
        failed publish); the open round and the guard's state are kept."""
        old = self.frags[p]
        blob = self.store.get_latest(p)
        if blob is None:
            return
        st = self._resume(p, blob)
        st.history[st.version] = None
        self._load_history(p, st)
        st.round, st.contributions = old.round, old.contributions
        st.last_merge_at, st.update_norm = old.last_merge_at, old.update_norm
        st.norm_count = old.norm_count
        self.frags[p] = st

    # -------------------------------------------------------------------- membership
    def set_live(self, live: set[str], known: set[str] | None = None) -> None:
        """Update the live learners (from the store's TTL registry)."""
        self.live = set(live)
        if known is not None:
            self.known |= known
        self.known |= self.live

    def _drop(self, reason: str, header: Header | None, detail: str,
              accepted: bool = True) -> None:
        """Count and record a dropped message. ``accepted`` False: it failed validation, so
        its header is not trusted: it names no incarnation and carries no tokens in the
        token-fate ledger (the sender's tokens stay "in flight")."""
        self.drops[reason] = self.drops.get(reason, 0) + 1
        self.records.counter("drops", reason)
        fields: dict[str, Any] = {"shard": self.name, "reason": reason, "detail": detail[:200]}
        if header is not None and accepted:
            fields.update(learner=header.sender, inc=header.inc, seq=header.seq,
                          fragment=header.frag, base=header.base, tokens=header.new_tokens)
        elif header is not None:
            fields.update(claimed_sender=header.sender[:64], fragment=header.frag)
        self.records.event("drop", fields)

    def _drop_contribution(self, reason: str, p: int, c: Contribution, detail: str) -> None:
        """Drop an accepted contribution (all its folded deltas) with a reason."""
        self.drops[reason] = self.drops.get(reason, 0) + 1
        self.records.counter("drops", reason)
        self.records.event("drop", {"shard": self.name, "reason": reason,
                                      "detail": detail[:200], "learner": c.learner,
                                      "inc": c.inc, "seqs": c.seqs, "fragment": p,
                                      "base": c.base, "tokens": c.new_tokens})

    def flush(self) -> list[list[bytes]]:
        """Merge every round holding at least K contributions now, past pacing and the grace
        window (a clean stop: the learners have drained, nobody else is coming); returns the
        broadcasts. A refused merge drops its contributions with the reason; what is left
        for :meth:`drop_pending` is only rounds below the quorum."""
        out: list[list[bytes]] = []
        for p in list(self.frags):
            st = self.frags[p]
            if st.pending is None and len(st.contributions) < self.grace_cfg.min_quorum:
                continue
            try:
                frames = self._merge_guarded(p)
                if frames is None and self.frags[p].pending is None \
                        and len(self.frags[p].contributions) >= self.grace_cfg.min_quorum:
                    frames = self._merge_guarded(p)  # settled a pending commit; now the round
            except (FencedOut, VersionConflict):
                continue  # merge() dropped them as "fenced"
            except StoreUnavailable:
                self.unsent.extend(out)
                raise
            if frames is not None:
                out.append(frames)
        return out

    def drop_pending(self, reason: str) -> int:
        """Drop every contribution still waiting in a round (e.g. on a clean stop); returns
        how many. Their tokens are then discarded with ``reason``, not lost. A commit still
        pending (the store went down during its publish) is left alone: the head's token
        decides whether its round is in, and the version's meta names its contributions."""
        n = 0
        for p, st in self.frags.items():
            for c in st.contributions.values():
                self._drop_contribution(reason, p, c, "round still open")
                n += 1
            self._reset_round(st)
        return n

    # -------------------------------------------------------------------- receive
    def expected_shapes(self, h: Header) -> list[tuple[int, ...]] | None:
        """Manifest shapes of an owned fragment; None for a fragment this shard doesn't own."""
        if h.frag not in self.frags:
            return None
        return self.layout.shapes(h.frag)

    def handle(self, frames: list[bytes], peer: str | None = None) -> list[list[bytes]]:
        """Decode, validate and file one incoming message; returns frames to broadcast.

        Every check (:mod:`ddiloco.workers.validate`) runs before the shard records anything; a
        failure is a named drop, counted, and the message changes no state. Nothing a message
        holds can raise out of here: an unexpected error is dropped as ``internal`` and logged.

        Args:
            frames: the ZeroMQ frames.
            peer: the learner id the connection authenticated as (CURVE); when given, the
                header's sender must match it (:class:`SpoofedSender`).
        """
        try:
            return self._handle(frames, peer)
        except DropError as exc:  # raised before the message was attributed to a sender
            self._drop(exc.reason, None, str(exc))
            return []
        except Exception as exc:
            log = logging.getLogger("ddiloco.syncer")
            log.exception("unexpected error on a message: dropped")
            self._drop(InternalError.reason, None, f"{type(exc).__name__}: {exc}")
            return []

    def _awaits_commit(self, h: Header) -> bool:
        """Whether delta ``h`` is anchored at the version this shard is still committing (its
        sender read it from the store, where the publish took effect): it is filed once the
        commit is settled (held, judged again by :meth:`retry_held`)."""
        pc = self.frags[h.frag].pending if h.kind == Kind.DELTA else None
        return pc is not None and h.base == pc.expected + 1 and len(self.held) < HELD_LIMIT

    def retry_held(self) -> list[list[bytes]]:
        """Handle again, in arrival order, the messages held while the learner registry was
        down; returns the frames to broadcast. One still not judgeable is held again, with
        every message after it (their order is kept)."""
        held, self.held = self.held, []
        out: list[list[bytes]] = []
        for i, (frames, peer) in enumerate(held):
            out += self.handle(frames, peer)
            if self.held:  # still down: keep the rest, in order, untried
                self.held += held[i + 1:]
                break
        return out

    def _receive(self, frames: list[bytes]) -> tuple[Header, list[np.ndarray] | None,
                                                      Packed | None]:
        """:func:`ddiloco.pipeline.wire.decode`, with a DELTA's payload validated but kept
        quantized: ``(header, tensors, None)`` or, for a DELTA, ``(header, [], packed)``.

        The same checks, in the same order, with the same exceptions as ``wire.decode``.
        """
        if len(frames) == 2:
            try:
                h = wire.decode_header(bytes(frames[0]))
            except DropError:
                h = None
            if h is not None and h.kind == Kind.DELTA and h.len > 0:
                return h, [], self._unpack_delta(h, frames[1])
        msg = wire.decode(frames, run_id=self.run_id, expected_shapes=self.expected_shapes,
                          allowed_codecs=self.allowed_codecs)
        return msg.header, msg.tensors, None

    def _unpack_delta(self, h: Header, frame: bytes) -> Packed:
        if h.run != self.run_id:
            raise WrongRun(f"message of run {h.run!r}, this is run {self.run_id!r}")
        # A view of the received frame: the payload is read once, by the decompressor.
        payload = memoryview(frame).cast("B")
        if payload.nbytes < h.len:
            raise TruncatedFrame(f"payload has {payload.nbytes} bytes, header declares {h.len}")
        if payload.nbytes > h.len:
            raise OversizedFrame(f"payload has {payload.nbytes} bytes, header declares {h.len}")
        if wire.payload_crc(payload) != h.crc:
            raise _ChecksumMismatch("payload CRC-32C mismatch")
        allowed = self.allowed_codecs
        if h.codec not in allowed:
            raise SchemaMismatch(f"codec {h.codec!r} not allowed (manifest: {list(allowed)})")
        want = self.expected_shapes(h)
        if want is None:
            raise SchemaMismatch(f"fragment {h.frag} is not in the manifest")
        want_t = tuple(tuple(s) for s in want)
        if h.shapes != want_t:
            raise SchemaMismatch(f"fragment {h.frag}: shapes {h.shapes} != manifest {want_t}")
        limit = codec.max_payload_size(sum(math.prod(s) for s in want_t), h.codec)
        if h.len > limit:
            raise OversizedFrame(f"payload of {h.len} bytes exceeds the bound {limit}")
        return unpack(payload, want_t, h.codec)

    def _handle(self, frames: list[bytes], peer: str | None) -> list[list[bytes]]:
        nbytes = wire.message_nbytes(frames)
        try:
            h, tensors, packed = self._receive(frames)
        except DropError as exc:
            self._drop(exc.reason, None, str(exc))
            return []
        try:
            if peer is not None and h.sender != peer:
                raise SpoofedSender(f"header sender {h.sender!r} on a connection "
                                    f"authenticated as {peer!r}")
            claim = self._validate(h, tensors)
            if self._awaits_commit(h):
                self.held.append((frames, peer))
                return []
            self._check_sender(h)
        except StoreDown as exc:
            if len(self.held) < HELD_LIMIT:
                # Not judged yet: the registry is down. Judged again when it is back.
                self.held.append((frames, peer))
                return []
            self._drop(exc.reason, h, str(exc), accepted=False)
            return []
        except DropError as exc:
            # Not accepted: its tokens stay "in flight" in the token-fate ledger.
            self._drop(exc.reason, h, str(exc), accepted=False)
            return []
        # Receive, then record: the delta is filed first; its tokens are recorded after,
        # queued while the store is down (docs/RELIABILITY.md).
        try:
            return self._file(h, tensors, packed, nbytes, claim)
        except StaleDelta as exc:
            self._drop(exc.reason, h, str(exc))
            return [self._control(h.sender, "resync", h.frag)]
        except DropError as exc:
            self._drop(exc.reason, h, str(exc))
            return []
        finally:
            if claim is not None:
                self.records.add_received(h.sender, h.inc, h.new_tokens, claim.fate)

    def _file(self, h: Header, tensors: list[np.ndarray] | None, packed: Packed | None,
              nbytes: int, claim: DeltaClaim | None) -> list[list[bytes]]:
        """File an accepted message by kind; returns frames to broadcast.

        Raises:
            DropError: the named reason (a stale base: :class:`StaleDelta`).
        """
        if h.kind == Kind.DELTA:
            assert claim is not None and packed is not None
            opened = self._file_delta(h, packed, nbytes, claim)
            if opened and self.cfg.sync.round_notice:
                return [self._control("*", "round_open", h.frag)]
            return []
        if h.kind == Kind.CONTROL:
            rnd = self.frags[h.frag].round
            if rnd.started_at is not None:
                rnd.joining.add(h.sender)
            return []
        assert tensors is not None
        return self._file_other(h, tensors)

    @property
    def allowed_codecs(self) -> list[str]:
        """The payload codec the manifest fixes for what this shard receives."""
        return [self.cfg.sync.codec_up]

    def _validate(self, h: Header, tensors: list[np.ndarray] | None) -> DeltaClaim | None:
        """Every check on a message that needs no state change; the DELTA's counters.

        Raises:
            DropError: the named reason (:mod:`ddiloco.workers.validate`).
        """
        if h.kind == Kind.DELTA:
            claim = check_delta(h, tensors, self.frags.keys(), self.claim_limits)
            if claim.clamped:
                self.records.counter("claims", "clamped")
            return claim
        if h.kind == Kind.CONTROL:
            check_shard_control(h, self.frags.keys())
            return None
        raise InvalidField(f"a {self.mode} shard does not take {h.kind.name} messages")

    def _check_sender(self, h: Header) -> None:
        if h.sender not in self.known:
            try:
                known = self.store.known_learner(h.sender)
            except StoreUnavailable as exc:
                raise StoreDown(f"cannot check {h.sender!r} in the learner registry: "
                                f"{exc}") from exc
            if known:
                self.known.add(h.sender)
            else:
                raise UnknownSender(f"{h.sender!r} is not a registered learner of this run")
        key = (h.sender, h.inc)
        last = self.last_seq.get(key)
        if last is not None and h.seq == last:
            raise DuplicateDelta(f"{h.sender} inc {h.inc} seq {h.seq} seen before")
        if last is not None and h.seq < last:
            raise OutOfOrder(f"{h.sender} inc {h.inc} seq {h.seq} < {last}")
        if last is None:
            self._evict_incarnations(h.sender, h.inc)
        self.last_seq[key] = h.seq

    def _evict_incarnations(self, learner: str, inc: int) -> None:
        """Keep per-sender state for a learner's two newest incarnations only: an older one's
        deltas can still be in flight after a restart, none older than that (bounded memory
        under restarts)."""
        incs = sorted({i for (who, i) in self.last_seq if who == learner} | {inc})
        for old in incs[:-2]:
            self.last_seq.pop((learner, old), None)
            self.records.forget(learner, old)

    def _file_delta(self, h: Header, packed: Packed, nbytes: int,
                    claim: DeltaClaim) -> bool:
        """File a validated delta in its fragment's round; True when it opened the round."""
        st = self.frags[h.frag]
        if h.base > st.version:
            raise StaleDelta(f"fragment {h.frag}: base {h.base} is newer than {st.version}")
        if h.base not in st.history:
            raise StaleDelta(f"fragment {h.frag}: base {h.base} is older than the kept history "
                             f"({min(st.history)}..{st.version})")
        now = self.clock()
        if h.step_time > 0:
            self.timing.observe("step_time", h.step_time, self.grace_cfg.ema)
        prev = st.contributions.get(h.sender)
        if prev is not None and prev.inc != h.inc:
            # A restarted learner's delta does not contain its previous life's work.
            self._drop_contribution("superseded", h.frag, prev,
                                    f"incarnation {prev.inc} replaced by {h.inc}")
            prev = None
        new_tokens = h.new_tokens + (prev.new_tokens if prev is not None else 0)
        c_steps, c_tokens = claim.c_steps, claim.c_tokens
        parts = [packed]
        if prev is not None and h.base > prev.base:
            # fold_pending: a newer base holds only the work since that adoption, so the
            # older delta is added (kept as received, summed by the merge).
            parts += prev.parts
            c_steps += prev.c_steps
            c_tokens += prev.c_tokens
        st.contributions[h.sender] = Contribution(
            learner=h.sender, base=h.base, parts=parts, c_steps=c_steps,
            c_tokens=c_tokens, new_tokens=new_tokens,
            nbytes=nbytes + (prev.nbytes if prev is not None else 0), step=h.step, inc=h.inc,
            seqs=[*(prev.seqs if prev is not None else []), h.seq])
        had_quorum = st.round.quorum_at is not None
        opened = st.round.started_at is None
        st.round.add(h.sender, now, self.grace_cfg.min_quorum)
        if not had_quorum and st.round.quorum_at is not None and st.round.started_at is not None:
            self.timing.observe("quorum_time", st.round.quorum_at - st.round.started_at,
                                self.grace_cfg.ema)
        return opened

    # -------------------------------------------------------------------- merge
    def tick(self) -> list[list[bytes]]:
        """Settle pending commits and merge every round that is ready now; returns the
        version broadcasts.

        Raises:
            StoreUnavailable: the store failed; the broadcasts of versions committed before
                it did are kept for :meth:`take_unsent`, not lost.
        """
        out: list[list[bytes]] = []
        now = self.clock()
        grace = grace_window(self.timing, self.grace_cfg)
        pace = merge_interval(self.timing, self.cfg.sync.H, self.cfg.sync.merge_every)
        try:
            for p in list(self.frags):
                st = self.frags[p]
                not_before = (st.last_merge_at + pace
                              if pace > 0 and st.last_merge_at is not None else None)
                if st.pending is not None or (
                        st.contributions and should_merge(st.round, now, self.live, grace,
                                                          self.grace_cfg.min_quorum,
                                                          self.grace_cfg.cap_s, not_before)):
                    frames = self._merge_guarded(p)
                    if frames is not None:
                        out.append(frames)
        except StoreUnavailable:
            self.unsent.extend(out)
            raise
        return out

    def take_unsent(self) -> list[list[bytes]]:
        """Broadcasts of committed versions that a later store failure kept from being
        returned (:meth:`tick`, :meth:`flush`); the caller publishes them."""
        out, self.unsent = self.unsent, []
        return out

    def _merge_guarded(self, p: int) -> list[bytes] | None:
        """:meth:`merge`, with a refused merge's contributions dropped as ``merge_refused`` and
        its round reset (None then); the refused step ran in a scratch copy, so the
        fragment's committed state is unchanged."""
        try:
            return self.merge(p)
        except MergeRefused as exc:
            st = self.frags[p]
            for c in st.contributions.values():
                self._drop_contribution(exc.reason, p, c, str(exc))
            self._reset_round(st)
            return None

    def merge(self, p: int) -> list[bytes] | None:
        """Merge fragment p's round, commit it to the store, then apply it; returns the
        broadcast (commit, then apply: docs/RELIABILITY.md).

        The round's next state is computed in a copy of the fragment
        (:meth:`FragmentState.scratch`); the round closes (new deltas file into the next one)
        and its :class:`PendingCommit` is published with the round's token and merge ledger.
        Only a confirmed publish swaps the new state in. When the outcome is unknown (the
        store failed during the publish), ``StoreUnavailable`` is raised and the commit stays
        pending: the next call settles it first (:meth:`_settle`), by the head's token.

        Returns None when the publish was refused (fenced out, version conflict, or the
        ledger shows the round merged already); the contributions are then dropped with a
        reason and the fragment read back from the store.

        Raises:
            MergeRefused: the update is not finite or its norm is far outside the fragment's
                recent range (:func:`ddiloco.workers.merge.guard_update`); nothing changed.
            StoreUnavailable: the publish's outcome is unknown; the commit stays pending.
            FencedOut, VersionConflict: another writer holds the fragment.
        """
        if self.frags[p].pending is not None:
            return self._settle(p)
        t0 = self.clock()
        if self.frags[p].stale:
            self._reload(p)
        st = self.frags[p]
        contribs = list(st.contributions.values())
        weights = [token_weight(c.c_tokens, c.c_steps) for c in contribs]
        if sum(weights) <= 0:
            for c in contribs:
                self._drop_contribution("zero_weight", p, c, f"{c.learner} fragment {p}")
            self._reset_round(st)
            return None
        # Re-anchoring (anchor_delta): Theta_c - Theta_b is the sum of the kept differences.
        terms = [c.parts + [d for v in range(c.base + 1, st.version + 1)
                            if (d := st.history[v]) is not None]
                 for c in contribs]
        shapes = self.layout.shapes(p)
        lr_mass = sum(w * self._lr_mass(c) for w, c in zip(weights, contribs, strict=True)) \
            / sum(weights)
        recent = st.update_norm if st.norm_count >= GUARD_WARMUP_MERGES else None
        share = (partial_share(len(contribs), len(self.live))
                 if self.cfg.sync.partial_merge == "share" else 1.0)
        new = st.scratch()
        norm, diff_raw, payload, norms, delayed = merge_and_step(
            self.cfg.sync, self.engine, None if self.delayed or self.cfg.sync.codec_down
            in FUSED_DOWN else self.outer(), new, terms, weights, shapes,
            self.embedding_mask[p], recent, lr_mass, share, [len(c.parts) for c in contribs])
        meta = {"contributors": [c.learner for c in contribs], "weights": weights,
                "bases": [c.base for c in contribs],
                "merged": {c.learner: c.step for c in contribs},
                "contributions": [{"learner": c.learner, "inc": c.inc, "seqs": c.seqs,
                                   "tokens": c.new_tokens} for c in contribs],
                **({"share": share} if share != 1.0 else {})}
        st.pending = PendingCommit(
            token=uuid.uuid4().hex, expected=st.version, state=new, contribs=contribs,
            weights=weights, meta=meta, diff=diff_raw, payload=payload, norm=norm,
            norms=norms, delayed=delayed, started_at=st.round.started_at,
            quorum_at=st.round.quorum_at, t0=t0)
        self._reset_round(st)  # closed: deltas arriving from now on form the next round
        return self._publish_pending(p)

    def _publish_pending(self, p: int) -> list[bytes] | None:
        """Publish fragment p's pending commit (again, with the same token, after an outage:
        the store answers a repeat of a publish that took effect as a success)."""
        st = self.frags[p]
        pc = st.pending
        assert pc is not None
        pc.tries += 1
        new = pc.state
        ledger = [(f"{c.learner}:{c.inc}", min(c.seqs), max(c.seqs))
                  for c in pc.contribs if c.seqs]
        try:
            version = self.store.publish(
                p, expected_version=pc.expected, epoch=self.epoch,
                value=blob_parts([new.flat_value]),
                momentum=(blob_parts(list(pc.delayed)) if pc.delayed is not None
                          else self._momentum_blob([new.flat_momentum])),
                keep=self.cfg.sync.history, meta=pc.meta, token=pc.token, ledger=ledger)
        except (FencedOut, VersionConflict) as exc:
            self._abandon(p, "fenced", str(exc))
            raise
        except AlreadyMerged as exc:
            # The ledger holds these deltas: they are in an earlier version, so merging them
            # again would count them twice. The head is the truth: read it back.
            self._abandon(p, AlreadyMerged.__name__, str(exc), reason="already_merged")
            return None
        return self._commit(p, version)

    def _settle(self, p: int) -> list[bytes] | None:
        """Settle fragment p's pending commit after an unknown outcome, by the head's token:
        the round is in the head (apply it), or the head is still the version it was built
        on (publish again), or another writer moved the head (drop it, read the head back).

        Raises:
            StoreUnavailable: the store is still down; the commit stays pending.
        """
        st = self.frags[p]
        pc = st.pending
        assert pc is not None
        head = self.store.head(p)
        if head is not None and head.version == pc.expected + 1 and head.token == pc.token:
            logging.getLogger("ddiloco.syncer").info(
                "fragment %d: version %d was published before the outage; applying it",
                p, head.version)
            return self._commit(p, head.version)
        current = -1 if head is None else head.version
        if current == pc.expected:
            return self._publish_pending(p)
        self._abandon(p, "fenced", f"head moved to version {current} during an outage")
        return None

    def _abandon(self, p: int, why: str, detail: str, reason: str = "fenced") -> None:
        """Drop the pending commit's contributions with ``reason`` and read the head back."""
        st = self.frags[p]
        pc = st.pending
        assert pc is not None
        for c in pc.contribs:
            self._drop_contribution(reason, p, c, f"{c.learner} fragment {p}: {why}: "
                                                  f"{detail}")
        st.pending = None
        st.stale = True  # read back now, or before the next merge if the store is down
        self._reload(p)

    def _commit(self, p: int, version: int) -> list[bytes]:
        """The store confirmed fragment p's pending commit as ``version``: swap its state in,
        record it (queued if the store is down again) and return the broadcast."""
        st = self.frags[p]
        pc = st.pending
        assert pc is not None
        st.take(pc.state)  # the round that opened meanwhile stays open
        st.pending = None
        if pc.delayed is not None:
            st.delayed_m, st.delayed_buf = pc.delayed
        st.update_norm = pc.norm if st.update_norm is None else (
            (1 - UPDATE_NORM_EMA) * st.update_norm + UPDATE_NORM_EMA * pc.norm)
        st.norm_count += 1
        st.recent_norms.extend(pc.norms)
        st.version = version
        st.history[version] = pc.diff
        for v in [v for v in st.history if v <= version - self.cfg.sync.history]:
            del st.history[v]
        st.history[min(st.history)] = None
        now = self.clock()
        sync_time = now - pc.t0
        st.last_merge_at = now
        self.timing.observe("sync_time", sync_time, self.grace_cfg.ema)
        contribs = pc.contribs
        self.merges += 1
        self.merged_contributions += len(contribs)
        self.merged_tokens += sum(c.new_tokens for c in contribs)
        if pc.quorum_at is not None:
            self.grace_wait_s += max(0.0, now - pc.quorum_at)
        meta = pc.meta
        self.records.event("merge", {
            "shard": self.name, "fragment": p, "version": version,
            "contributors": meta["contributors"], "weights": pc.weights,
            "bases": meta["bases"], "tokens": sum(c.new_tokens for c in contribs),
            "per_learner_tokens": {c.learner: c.new_tokens for c in contribs},
            "contributions": meta["contributions"],
            "bytes": sum(c.nbytes for c in contribs),
            "round_s": now - (pc.started_at or pc.t0),
            "sync_s": sync_time, **({"corrected": dict(st.corrected)} if st.corrected else {}),
            **({"publish_tries": pc.tries} if pc.tries > 1 else {}),
        })
        self.seq += 1
        return self._broadcast(Header(
            kind=Kind.VERSION, run=self.run_id, sender=self.name, inc=self.epoch, seq=self.seq,
            frag=p, base=pc.expected, ver=version, codec=self.cfg.sync.codec_down, enc="diff",
            extra={"merged": meta["merged"]}), pc.payload, self.layout.shapes(p))

    @staticmethod
    def _broadcast(h: Header, payload: bytes, shapes: list[tuple[int, ...]]) -> list[bytes]:
        """The frames of a VERSION carrying an encoded payload, as :func:`wire.encode` makes
        them."""
        full = replace(h, len=len(payload), crc=wire.payload_crc(payload),
                       shapes=tuple(tuple(int(d) for d in sh) for sh in shapes),
                       t=time.time())
        return [wire._pack(full), payload]

    def _lr_mass(self, c: Contribution) -> float:
        """Sum of the inner learning rates over the steps ``c`` holds, (step - c_steps, step]
        (the run's schedule, constant at its last value after ``train.steps``;
        :func:`ddiloco.workers.merge.guard_update`). O(1): a prefix sum computed once. A user task's
        optimizer has a schedule the shard cannot know: its mass is the step count."""
        if (self.manifest.get("task") or {}).get("ref") is not None:
            return float(c.c_steps)
        if self._lr_cum is None:
            self._lr_cum = lr_prefix(self.cfg.train)
        return lr_mass(self._lr_cum, c.step, c.c_steps)

    @staticmethod
    def _reset_round(st: FragmentState) -> None:
        st.contributions.clear()
        st.round = Round()

    def _control(self, learner: str, action: str, fragment: int) -> list[bytes]:
        self.seq += 1
        return wire.encode(Header(kind=Kind.CONTROL, run=self.run_id, sender=self.name,
                                  inc=self.epoch, seq=self.seq, frag=fragment,
                                  extra={"to": learner, "action": action}))

    def heartbeat(self) -> list[bytes]:
        """An idle heartbeat broadcast carrying the owned fragments' versions."""
        self.seq += 1
        return wire.encode(Header(
            kind=Kind.HEARTBEAT, run=self.run_id, sender=self.name, inc=self.epoch,
            seq=self.seq,
            extra={"versions": {str(p): st.version for p, st in self.frags.items()}}))

    def _file_other(self, h: Header, tensors: list[np.ndarray]) -> list[list[bytes]]:
        """File a validated message of a kind only a variant takes (the DP baseline's
        gradients, :mod:`ddiloco.workers.dp`); a DiLoCo shard's :meth:`_validate` lets none through.

        Raises:
            InvalidField: always, here.
        """
        raise InvalidField(f"a {self.mode} shard does not take {h.kind.name} messages")
