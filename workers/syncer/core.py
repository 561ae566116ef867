"""A syncer shard's core: merges the outer gradients of the fragments it owns (DESIGN §2, §3).

:class:`ShardCore` holds the logic and no sockets. Its receive path
(:class:`ddiloco.workers.syncer.receive.Receiver`, its base class) takes the incoming messages and
files them in rounds; this module holds the rest: it loads the owned fragments, decides rounds
with :mod:`ddiloco.workers.syncer.merge`, merges them
(:func:`ddiloco.workers.syncer.outer_step.merge_and_step`),
publishes versions to the store (fenced compare-and-set; commit, then apply) and returns the
frames to broadcast. :func:`ddiloco.workers.syncer.server.serve` is the thin process around it:
lease, sockets, polling, heartbeats. Variants (the data-parallel baseline,
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
* one accumulator for the merges (:class:`ddiloco.workers.syncer.fused.MergeEngine`): ``F_max``;
* the open rounds' deltas as received, quantized (``codec_up``; int4: ``0.14 F`` each, so
  ``M * 0.14 F`` with M learners per round; :class:`ddiloco.pipeline.accumulate.Packed`);
* the version history as quantized differences between consecutive versions
  (``sync.history - 1`` of them; int4/int8 ``codec_down``: ``0.14 F`` or ``0.27 F`` each,
  also after a restart; other codecs: float32, ``F`` each);
* during a merge, the fragment's next state (its value, and its momentum and residual where
  kept: ``F_max`` each), held until its publish is settled (in a store outage, one for each
  fragment whose publish has an unknown outcome), the store blobs of its new value and momentum
  (``F_max`` each, the store's input) and the broadcast payload.

No float32 copy of a contribution is made: a merge decodes each delta straight into the
accumulator (:mod:`ddiloco.workers.syncer.fused`).
"""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from dataclasses import replace
from typing import Any

import numpy as np

from ddiloco.pipeline import wire
from ddiloco.pipeline.accumulate import pack_raw
from ddiloco.pipeline.errors import (
    AlreadyMerged,
    FencedOut,
    MergeRefused,
    StoreUnavailable,
    VersionConflict,
)
from ddiloco.pipeline.fragments import fragments_of_shard
from ddiloco.pipeline.quantize import quantize
from ddiloco.pipeline.wire import Header, Kind
from ddiloco.store.base import FragmentBlob, ParameterStore
from ddiloco.workers.run.blobs import blob_parts, decode_blob, encode_blob
from ddiloco.workers.run.manifest import manifest_config, manifest_layout, tokens_per_batch
from ddiloco.workers.syncer.fragment_state import Contribution, FragmentState, PendingCommit
from ddiloco.workers.syncer.fused import FUSED_DOWN, MergeEngine
from ddiloco.workers.syncer.lateness import expected_arrival, live_round_ready, live_wait_s
from ddiloco.workers.syncer.merge import (
    UPDATE_NORM_EMA,
    GraceConfig,
    OuterConfig,
    OuterOptimizer,
    Round,
    Timing,
    grace_window,
    learner_order,
    lr_mass,
    lr_prefix,
    merge_interval,
    partial_share,
    should_merge,
    token_weight,
)
from ddiloco.workers.syncer.outer_step import FragmentSpec, RoundTerms, merge_and_step
from ddiloco.workers.syncer.receive import Receiver
from ddiloco.workers.syncer.records import ShardRecords
from ddiloco.workers.syncer.validate import ClaimLimits

__all__ = ["Clock", "Contribution", "FragmentState", "ShardCore"]

Clock = Callable[[], float]


class ShardCore(Receiver):
    """Rounds, merges, outer steps and versions of one shard's fragments; messages enter by
    the receive path it inherits (:meth:`handle`, :meth:`retry_held`).

    Args:
        manifest: the run manifest.
        shard: this shard's id.
        store: the run's parameter store.
        epoch: fencing epoch from this shard's lease.
        clock: monotonic seconds (injectable for tests).
        name: the shard's name in events and metrics (None: ``shard-<shard>``).
        threads: merge threads (None: ``run.merge_threads`` of the manifest's config).
    """

    def __init__(self, manifest: dict[str, Any], shard: int, store: ParameterStore,
                 epoch: int, clock: Clock = time.monotonic, name: str | None = None,
                 threads: int | None = None) -> None:
        self.manifest = manifest
        self.cfg = manifest_config(manifest)
        s = self.cfg.sync
        super().__init__(ClaimLimits(tokens_per_batch=tokens_per_batch(manifest),
                                     max_c_steps=4 * s.H))
        self.layout = manifest_layout(manifest)
        self.run_id = manifest["run_id"]
        self.shard = shard
        self.name = name or f"shard-{shard}"
        self.store = store
        self.epoch = epoch
        self.clock = clock
        self.mode = manifest["mode"]
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
        self.frags = {}
        #: events, counters and received totals, queued while the store is down
        self.records = ShardRecords(store, self.name)
        #: broadcasts a store failure kept from being returned (:meth:`take_unsent`)
        self.unsent: list[list[bytes]] = []
        self.live: set[str] = set()
        self.merges = 0
        #: merged learner contributions, fragment-tokens and quorum-to-merge seconds, summed
        #: over this shard's merges (metrics: participation, goodput, grace wait)
        self.merged_contributions = 0
        self.merged_tokens = 0
        self.grace_wait_s = 0.0
        self.seq = 0
        self._lr_cum: np.ndarray | None = None

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

    # -------------------------------------------------------------------- merge
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
                        st.contributions and self._round_ready(p, now, grace, not_before)):
                    frames = self._merge_guarded(p)
                    if frames is not None:
                        out.append(frames)
        except StoreUnavailable:
            self.unsent.extend(out)
            raise
        return out

    def _round_ready(self, p: int, now: float, grace: float,
                     not_before: float | None) -> bool:
        """Whether fragment p's round merges now: the grace window (the paper's rule,
        :func:`should_merge`) or, with ``sync.round_wait = "live"``, every live learner not
        really late (:func:`live_round_ready`)."""
        s, rnd = self.cfg.sync, self.frags[p].round
        if s.round_wait == "grace":
            return should_merge(rnd, now, self.live, grace, self.grace_cfg.min_quorum,
                                self.grace_cfg.cap_s, not_before)
        expected = {name: expected_arrival(self.paces.get(name),
                                           self.last_sent.get((p, name)), s.H,
                                           self.timing.step_time, self.cfg.train.steps)
                    for name in self.live - rnd.contributors.keys()}
        wait_s = live_wait_s(s.H, self.timing.step_time, s.late_fraction, s.grace_cap_s)
        return live_round_ready(rnd, now, self.live, expected, wait_s,
                                self.grace_cfg.min_quorum, not_before)

    def take_unsent(self) -> list[list[bytes]]:
        """Broadcasts of committed versions that a later store failure kept from being
        returned (:meth:`tick`, :meth:`flush`); the caller publishes them."""
        out, self.unsent = self.unsent, []
        return out

    def _merge_guarded(self, p: int) -> list[bytes] | None:
        """:meth:`merge`, with a refused merge's contributions dropped as ``merge_refused`` and
        its round reset (None then); the refused step ran in a copy
        (:func:`ddiloco.workers.syncer.outer_step.merge_and_step`), so the fragment's committed
        state
        is unchanged."""
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

        The round's next state is computed from the committed one, which it leaves unchanged
        (:func:`ddiloco.workers.syncer.outer_step.merge_and_step`); the round closes (new deltas
        file
        into the next one) and its :class:`PendingCommit` is published with the round's token
        and merge ledger. Only a confirmed publish swaps the new state in. When the outcome is
        unknown (the store failed during the publish), ``StoreUnavailable`` is raised and the
        commit stays pending: the next call settles it first (:meth:`_settle`), by the head's
        token.

        Returns None when the publish was refused (fenced out, version conflict, or the
        ledger shows the round merged already); the contributions are then dropped with a
        reason and the fragment read back from the store.

        Raises:
            MergeRefused: the update is not finite or its norm is far outside the fragment's
                recent range (:func:`ddiloco.workers.syncer.merge.guard_update`); nothing changed.
            StoreUnavailable: the publish's outcome is unknown; the commit stays pending.
            FencedOut, VersionConflict: another writer holds the fragment.
        """
        if self.frags[p].pending is not None:
            return self._settle(p)
        t0 = self.clock()
        if self.frags[p].stale:
            self._reload(p)
        st = self.frags[p]
        # In learner order, not arrival order: float sums depend on it (learner_order).
        contribs = [st.contributions[k] for k in learner_order(st.contributions)]
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
        lr_mass = sum(w * self._lr_mass(c) for w, c in zip(weights, contribs, strict=True)) \
            / sum(weights)
        share = (partial_share(len(contribs), len(self.live))
                 if self.cfg.sync.partial_merge == "share" else 1.0)
        outer = None if self.delayed or self.cfg.sync.codec_down in FUSED_DOWN else self.outer()
        result = merge_and_step(
            self.cfg.sync, self.engine, outer, st,
            RoundTerms(terms, weights, lr_mass, own=[len(c.parts) for c in contribs],
                       share=share),
            FragmentSpec(self.layout.shapes(p), self.embedding_mask[p]))
        meta = {"contributors": [c.learner for c in contribs], "weights": weights,
                "bases": [c.base for c in contribs],
                "merged": {c.learner: c.step for c in contribs},
                "contributions": [{"learner": c.learner, "inc": c.inc, "seqs": c.seqs,
                                   "tokens": c.new_tokens} for c in contribs],
                **({"share": share} if share != 1.0 else {})}
        st.pending = PendingCommit(
            token=uuid.uuid4().hex, expected=st.version, state=result.state, contribs=contribs,
            weights=weights, meta=meta, diff=result.diff, payload=result.payload,
            norm=result.norm, norms=result.norms, delayed=result.delayed,
            started_at=st.round.started_at, quorum_at=st.round.quorum_at, t0=t0)
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
        :func:`ddiloco.workers.syncer.merge.guard_update`). O(1): a prefix sum computed once. A
        user task's
        optimizer has a schedule the shard cannot know: its mass is the step count."""
        if (self.manifest.get("task") or {}).get("ref") is not None:
            return float(c.c_steps)
        if self._lr_cum is None:
            self._lr_cum = lr_prefix(self.cfg.train)
        return lr_mass(self._lr_cum, c.step, c.c_steps)

    @staticmethod
    def _reset_round(st: FragmentState) -> None:
        """Empty ``st``'s round: the next delta filed opens a new one."""
        st.contributions.clear()
        st.round = Round()

    def heartbeat(self) -> list[bytes]:
        """An idle heartbeat broadcast carrying the owned fragments' versions."""
        self.seq += 1
        return wire.encode(Header(
            kind=Kind.HEARTBEAT, run=self.run_id, sender=self.name, inc=self.epoch,
            seq=self.seq,
            extra={"versions": {str(p): st.version for p, st in self.frags.items()}}))
