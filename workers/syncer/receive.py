"""A syncer shard's receive path: every incoming message is decoded, checked and filed into its
fragment's open round, or dropped with a named reason before it changes anything (DESIGN §2.5
step 1, §2.7, §4.4, §6.3).

:class:`Receiver` is the half of :class:`ddiloco.workers.syncer.core.ShardCore` that messages enter
by: it owns what the shard knows of each sender (registered learners, the last sequence number
of each incarnation, the messages held while the registry cannot be asked) and the drop
counts. The other half, the merge path, empties the rounds it fills; the two share the
fragments' states, the timing estimates, the records and the broadcast sequence, so the receive
half is a base class of the core rather than an object beside it. A variant overrides the hooks
:attr:`Receiver.allowed_codecs`, :meth:`Receiver._validate` and :meth:`Receiver._file_other`
(the data-parallel baseline's gradients, :mod:`ddiloco.workers.dp`).
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from typing import Any

import numpy as np

from ddiloco.pipeline import codec, wire
from ddiloco.pipeline.accumulate import Packed, unpack
from ddiloco.pipeline.errors import ChecksumMismatch as _ChecksumMismatch
from ddiloco.pipeline.errors import (
    DropError,
    DuplicateDelta,
    InternalError,
    InvalidField,
    OutOfOrder,
    OversizedFrame,
    SchemaMismatch,
    SpoofedSender,
    StaleDelta,
    StoreDown,
    StoreUnavailable,
    TruncatedFrame,
    UnknownSender,
    WrongRun,
)
from ddiloco.pipeline.fragments import FragmentLayout
from ddiloco.pipeline.wire import Header, Kind
from ddiloco.store.base import ParameterStore
from ddiloco.workers.run.config import Config
from ddiloco.workers.syncer.fragment_state import Contribution, FragmentState
from ddiloco.workers.syncer.lateness import Pace
from ddiloco.workers.syncer.merge import GraceConfig, Timing
from ddiloco.workers.syncer.records import ShardRecords
from ddiloco.workers.syncer.validate import (
    ClaimLimits,
    DeltaClaim,
    check_delta,
    check_shard_control,
)

__all__ = ["HELD_LIMIT", "Receiver"]

#: Messages a shard holds while the learner registry cannot be asked about their sender;
#: beyond this they are dropped as ``store_unavailable``.
HELD_LIMIT = 256


class Receiver:
    """Decode, check and file a shard's incoming messages (the receive half of a shard core).

    The shard core sets the attributes annotated below (shared with its merge path) before it
    takes a message; this half owns the per-sender state it sets up itself.

    Args:
        claim_limits: bounds on a delta's token counters (:func:`check_delta`).

    Attributes:
        known: learners the registry confirmed (or the liveness registry lists).
        last_seq: the last sequence number taken from each ``(learner, incarnation)``.
        held: ``(frames, peer)`` of messages not judged yet, in arrival order
            (:meth:`retry_held`).
        drops: dropped messages and contributions, by reason.
        paces: each learner's newest delta at this shard (``sync.round_wait = "live"``).
        last_sent: the step of each ``(fragment, learner)``'s newest delta.
    """

    run_id: str
    name: str
    epoch: int
    mode: str
    cfg: Config
    layout: FragmentLayout
    store: ParameterStore
    clock: Callable[[], float]
    timing: Timing
    grace_cfg: GraceConfig
    records: ShardRecords
    frags: dict[int, FragmentState]
    #: sequence number of the shard's last broadcast (controls, versions, heartbeats)
    seq: int

    def __init__(self, claim_limits: ClaimLimits) -> None:
        self.claim_limits = claim_limits
        self.known: set[str] = set()
        self.last_seq: dict[tuple[str, int], int] = {}
        self.held: list[tuple[list[bytes], str | None]] = []
        self.drops: dict[str, int] = {}
        self.paces: dict[str, Pace] = {}
        self.last_sent: dict[tuple[int, str], int] = {}

    # -------------------------------------------------------------------- hooks
    def expected_shapes(self, h: Header) -> list[tuple[int, ...]] | None:
        """Manifest shapes of an owned fragment; None for a fragment this shard doesn't own."""
        if h.frag not in self.frags:
            return None
        return self.layout.shapes(h.frag)

    @property
    def allowed_codecs(self) -> list[str]:
        """The payload codec the manifest fixes for what this shard receives."""
        return [self.cfg.sync.codec_up]

    def _validate(self, h: Header, tensors: list[np.ndarray] | None) -> DeltaClaim | None:
        """Every check on a message that needs no state change; the DELTA's counters.

        Raises:
            DropError: the named reason (:mod:`ddiloco.workers.syncer.validate`).
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

    def _file_other(self, h: Header, tensors: list[np.ndarray]) -> list[list[bytes]]:
        """File a validated message of a kind only a variant takes (the DP baseline's
        gradients, :mod:`ddiloco.workers.dp`); a DiLoCo shard's :meth:`_validate` lets none
        through.

        Raises:
            InvalidField: always, here.
        """
        raise InvalidField(f"a {self.mode} shard does not take {h.kind.name} messages")

    # -------------------------------------------------------------------- entry points
    def handle(self, frames: list[bytes], peer: str | None = None) -> list[list[bytes]]:
        """Decode, validate and file one incoming message; returns frames to broadcast.

        Every check (:mod:`ddiloco.workers.syncer.validate`) runs before the shard records
        anything; a
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

    # -------------------------------------------------------------------- decode
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
        """A DELTA's payload checked against its header and the manifest (``wire.decode``'s
        checks) and kept quantized, as the round holds it.

        Raises:
            DropError: the named reason (wrong run, truncated or oversized payload, checksum,
                codec or shapes not the manifest's).
        """
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

    # -------------------------------------------------------------------- judge
    def _handle(self, frames: list[bytes], peer: str | None) -> list[list[bytes]]:
        """:meth:`handle` without its last-resort catch: decode, judge, then file or hold.

        Raises:
            DropError: only from the decode, before a sender is known (:meth:`handle`
                records it).
        """
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

    def _awaits_commit(self, h: Header) -> bool:
        """Whether delta ``h`` is anchored at the version this shard is still committing (its
        sender read it from the store, where the publish took effect): it is filed once the
        commit is settled (held, judged again by :meth:`retry_held`)."""
        pc = self.frags[h.frag].pending if h.kind == Kind.DELTA else None
        return pc is not None and h.base == pc.expected + 1 and len(self.held) < HELD_LIMIT

    def _check_sender(self, h: Header) -> None:
        """Take ``h``'s sequence number: its sender must be a registered learner, and each
        incarnation's numbers only grow (DESIGN §2.7).

        Raises:
            StoreDown: the learner registry cannot be asked (the message is held).
            UnknownSender, DuplicateDelta, OutOfOrder: the named reason.
        """
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

    # -------------------------------------------------------------------- file
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

    def _file_delta(self, h: Header, packed: Packed, nbytes: int,
                    claim: DeltaClaim) -> bool:
        """File a validated delta in its fragment's round; True when it opened the round.

        Raises:
            StaleDelta: its base is newer than the fragment's version or older than the kept
                history.
        """
        st = self.frags[h.frag]
        if h.base > st.version:
            raise StaleDelta(f"fragment {h.frag}: base {h.base} is newer than {st.version}")
        if h.base not in st.history:
            raise StaleDelta(f"fragment {h.frag}: base {h.base} is older than the kept history "
                             f"({min(st.history)}..{st.version})")
        now = self.clock()
        if h.step_time > 0:
            self.timing.observe("step_time", h.step_time, self.grace_cfg.ema)
        self._note_pace(h, now)
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

    def _note_pace(self, h: Header, now: float) -> None:
        """Record the learner's step, step time and this fragment's send step, from which
        ``sync.round_wait = "live"`` predicts its next delta (:mod:`.lateness`). A new
        incarnation restarts its send schedule, so its old send steps are forgotten."""
        old = self.paces.get(h.sender)
        if old is not None and old.inc != h.inc:
            for key in [k for k in self.last_sent if k[1] == h.sender]:
                del self.last_sent[key]
        self.paces[h.sender] = Pace(now, h.step, h.step_time, h.inc)
        self.last_sent[(h.frag, h.sender)] = h.step

    # -------------------------------------------------------------------- drops and answers
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
        """Drop an accepted contribution (all its folded deltas) with a reason: a restarted
        learner's older one here, a round the merge path refuses or abandons there."""
        self.drops[reason] = self.drops.get(reason, 0) + 1
        self.records.counter("drops", reason)
        self.records.event("drop", {"shard": self.name, "reason": reason,
                                      "detail": detail[:200], "learner": c.learner,
                                      "inc": c.inc, "seqs": c.seqs, "fragment": p,
                                      "base": c.base, "tokens": c.new_tokens})

    def _control(self, learner: str, action: str, fragment: int) -> list[bytes]:
        """A CONTROL to ``learner`` (``"*"``: every learner) about ``fragment``: ``resync``
        after a stale delta, ``round_open`` when a delta opened a round."""
        self.seq += 1
        return wire.encode(Header(kind=Kind.CONTROL, run=self.run_id, sender=self.name,
                                  inc=self.epoch, seq=self.seq, frag=fragment,
                                  extra={"to": learner, "action": action}))
