"""The data-parallel baseline, as its own learner and syncer variant (DESIGN §2, baseline).

Every inner step each of the M learners sends its gradient of every fragment (``GRAD``, bf16 by
default); the owning shard waits for all M, averages them, applies the ``train`` section's AdamW
to its copy of the fragment and broadcasts the average (``GRAD_AVG``); every learner applies the
same average with the same optimizer, so all copies stay identical. There is no elasticity: a
learner that dies stalls the job, and the job resumes from its last checkpoint in the store (the
newest step every fragment stored, every ``run.dp_publish_every`` steps), the way a synchronous
data-parallel job restarts from its checkpoint.

The DiLoCo learner, comms thread and shard (:mod:`ddiloco.workers.learner.core`,
:mod:`ddiloco.workers.learner.comms`,
:mod:`ddiloco.workers.syncer.core`) know nothing of this mode: the variants here override their
hooks,
and
:mod:`ddiloco.workers.roles` picks them for a run whose ``run.mode`` is ``dp``.
"""

from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ddiloco.pipeline import codec, wire
from ddiloco.pipeline.errors import (
    DuplicateDelta,
    InvalidField,
    StoreError,
    StoreUnavailable,
    VersionConflict,
)
from ddiloco.pipeline.wire import Header, Kind
from ddiloco.store.base import FragmentBlob
from ddiloco.workers.learner.comms import Comms, Outgoing
from ddiloco.workers.learner.core import Learner, Resumed
from ddiloco.workers.learner.inner import InnerLoop
from ddiloco.workers.run.blobs import (
    decode_blob,
    dp_step_of,
    encode_blob,
    fragment_tensors,
    opt_state_bytes,
    opt_state_from_parts,
)
from ddiloco.workers.syncer.core import FragmentState, ShardCore
from ddiloco.workers.syncer.merge import OuterOptimizer, learner_order
from ddiloco.workers.syncer.validate import check_grad

if TYPE_CHECKING:
    from ddiloco.workers.learner.checkpoint import LearnerCheckpoint
    from ddiloco.workers.learner.torch_inner import TorchCheckpoint

DP_OPEN_STEPS = 4
"""Steps whose gradients a DP shard gathers at once. Learners step in lockstep (each waits for
the previous average), so two are ever open; more is a learner running ahead or a sender
spraying step numbers, which would otherwise grow the shard's memory without bound."""


# ------------------------------------------------------------------------------------------
# Syncer shard
# ------------------------------------------------------------------------------------------


@dataclass
class DPFragmentState(FragmentState):
    """A DP shard's fragment: the DiLoCo state plus the gradient buckets and AdamW state."""

    #: step -> learner -> gradient
    grads: dict[int, dict[str, list[np.ndarray]]] = field(default_factory=dict)
    opt_state: Any = None
    #: the AdamW state stored with the checkpoint this shard resumed from
    dp_checkpoint: bytes = b""
    #: the last step whose average was applied (-1: none yet)
    dp_done: int = -1
    #: a checkpoint publish with an unknown outcome: (token, expected version, DP step)
    dp_pending: tuple[str, int, int] | None = None


class DPShardCore(ShardCore):
    """A syncer shard of the data-parallel baseline (same constructor as
    :class:`ddiloco.workers.syncer.core.ShardCore`)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._dp_apply: Any = None
        self._dp_tx: Any = None

    @property
    def allowed_codecs(self) -> list[str]:
        """Gradients travel in ``sync.codec_dp``."""
        return [self.cfg.sync.codec_dp]

    def _new_state(self, version: int, value: list[np.ndarray],
                   momentum: list[np.ndarray]) -> FragmentState:
        return DPFragmentState(version=version, value=value, momentum=momentum)

    def _resume(self, p: int, blob: FragmentBlob) -> FragmentState:
        """Resume from the job's last common checkpoint (:meth:`_restore_point`), with the
        AdamW state stored there."""
        blob = self._restore_point(p, blob)
        value = decode_blob(blob.value, self.layout.shapes(p))
        st = DPFragmentState(version=blob.version, value=value,
                             momentum=OuterOptimizer.init_momentum(value))  # unused in DP
        if dp_step_of(blob.meta) >= 0:
            st.dp_checkpoint = blob.momentum
        return st

    def _restore_point(self, p: int, head: FragmentBlob) -> FragmentBlob:
        """No elasticity: the job resumes from its last checkpoint, the newest data-parallel
        step that *every* fragment has stored. A fragment stored at a later step (the job died
        while checkpointing) is rolled back by re-publishing its older version under a new
        version number (versions only increase).

        Raises:
            StoreError: the common checkpoint is no longer kept for fragment ``p``.
        """
        heads = self.store.get_latest_many(list(range(self.layout.n_fragments)))
        common = min(dp_step_of(b.meta) if b is not None else -1 for b in heads)
        if dp_step_of(head.meta) <= common:
            return head
        for v in range(head.version - 1, -1, -1):
            old = self.store.get_version(p, v)
            if old is None:
                break
            if dp_step_of(old.meta) == common:
                meta = {**old.meta, "restored_from": v}
                version = self.store.publish(p, expected_version=head.version, epoch=self.epoch,
                                             value=old.value, momentum=old.momentum,
                                             keep=self.cfg.sync.history, meta=meta)
                self.store.add_event("dp_rollback", {"shard": self.name, "fragment": p,
                                                     "dp_step": common, "version": version})
                restored = self.store.get_version(p, version)
                if restored is None:
                    raise StoreError(f"fragment {p}: version {version} is gone right after it "
                                     "was published (an evicting Redis?)")
                return restored
        raise StoreError(f"fragment {p}: the common DP checkpoint (step {common}) is no longer "
                         f"stored; raise sync.history")

    def _validate(self, h: Header, tensors: list[np.ndarray] | None) -> Any:
        if h.kind == Kind.GRAD:
            check_grad(h, tensors, self.frags.keys())
            return None
        if h.kind == Kind.DELTA:
            raise InvalidField("a dp shard does not take DELTA messages")
        return super()._validate(h, tensors)

    def _file_other(self, h: Header, tensors: list[np.ndarray]) -> list[list[bytes]]:
        """Gather step ``h.ver``'s gradients; when all M are in, average them, apply AdamW to
        the shard's copy and broadcast the average."""
        st = self.frags[h.frag]
        assert isinstance(st, DPFragmentState)
        step = h.ver
        if step <= st.dp_done:
            raise DuplicateDelta(f"fragment {h.frag}: DP step {step} was applied already")
        if step not in st.grads and len(st.grads) >= DP_OPEN_STEPS:
            raise InvalidField(f"fragment {h.frag}: DP step {step} would open more than "
                               f"{DP_OPEN_STEPS} steps at once")
        bucket = st.grads.setdefault(step, {})
        bucket[h.sender] = tensors
        need = int(self.manifest.get("learners_dp") or 1)
        if len(bucket) < need:
            return []
        del st.grads[step]
        st.dp_done = max(st.dp_done, step)
        # In learner order, not arrival order: the float sum depends on it (learner_order).
        avg = [np.mean(np.stack(col), axis=0, dtype=np.float32)
               for col in zip(*(bucket[k] for k in learner_order(bucket)), strict=True)]
        # Every learner decodes the same bf16 average; the shard applies exactly that.
        avg_q = codec.quantize_roundtrip(avg, self.cfg.sync.codec_dp)
        self._apply(h.frag, st, avg_q)
        self.seq += 1
        out = [wire.encode(
            Header(kind=Kind.GRAD_AVG, run=self.run_id, sender=self.name, inc=self.epoch,
                   seq=self.seq, frag=h.frag, ver=step, codec=self.cfg.sync.codec_dp),
            avg_q)]
        if (step + 1) % self.cfg.run.dp_publish_every == 0:
            try:
                self._publish(h.frag, st, step)
            except StoreUnavailable:
                pass  # a missed checkpoint: training goes on, a failure rolls back further
            except VersionConflict as exc:
                # A missed checkpoint too; the average is applied and goes out regardless.
                logging.getLogger("ddiloco.syncer").warning("fragment %d: %s", h.frag, exc)
                head = self.store.head(h.frag)
                st.version = st.version if head is None else head.version
        return out

    def _publish(self, p: int, st: DPFragmentState, step: int) -> None:
        """Publish fragment p's checkpoint at DP step ``step`` with a fresh token; one whose
        outcome an outage left unknown is settled first, by the head's token (commit, then
        apply: docs/RELIABILITY.md).

        Raises:
            StoreUnavailable: the outcome is unknown; settled at the next checkpoint.
        """
        if st.dp_pending is not None:
            self._settle_checkpoint(p, st)
        token = uuid.uuid4().hex
        st.dp_pending = (token, st.version, step)
        version = self.store.publish(p, expected_version=st.version, epoch=self.epoch,
                                     value=encode_blob(st.value),
                                     momentum=opt_state_bytes(st.opt_state),
                                     keep=self.cfg.sync.history, meta={"dp_step": step},
                                     token=token)
        st.dp_pending = None
        self._checkpointed(p, st, version, step)

    def tick(self) -> list[list[bytes]]:
        """Settle the checkpoints whose outcome an outage left unknown, as soon as the store
        answers (not only at the next checkpoint: the run's last one has none), then the base
        tick.

        Raises:
            StoreUnavailable: the store is still down; the checkpoints stay pending.
        """
        for p, st in self.frags.items():
            if isinstance(st, DPFragmentState) and st.dp_pending is not None:
                self._settle_checkpoint(p, st)
        return super().tick()

    def _settle_checkpoint(self, p: int, st: DPFragmentState) -> None:
        """A pending checkpoint is in when the head holds its token (then it is logged, as any
        checkpoint); otherwise it was missed. Either way it is pending no more.

        Raises:
            StoreUnavailable: the head cannot be read; the checkpoint stays pending.
        """
        assert st.dp_pending is not None
        token, expected, at = st.dp_pending
        head = self.store.head(p)
        if head is not None and head.version == expected + 1 and head.token == token:
            self._checkpointed(p, st, head.version, at)
        st.dp_pending = None

    def _checkpointed(self, p: int, st: DPFragmentState, version: int, step: int) -> None:
        st.version = version
        self.merges += 1
        self.records.event("merge", {"shard": self.name, "fragment": p, "version": version,
                                     "dp_step": step, "contributors": [], "tokens": 0})

    def _apply(self, p: int, st: DPFragmentState, grads: list[np.ndarray]) -> None:
        import jax

        from ddiloco.workers.task.model import optimizer_from_config

        if self._dp_apply is None:
            tx = optimizer_from_config(self.cfg.train, dp=True)
            self._dp_tx = tx

            def apply(params: Any, state: Any, g: Any) -> Any:
                import optax

                updates, state = tx.update(g, state, params)
                return optax.apply_updates(params, updates), state

            self._dp_apply = jax.jit(apply)
        names = self.layout.names(p)
        params = dict(zip(names, st.value, strict=True))
        if st.opt_state is None:
            st.opt_state = self._dp_tx.init(params)
            if st.dp_checkpoint:
                st.opt_state = opt_state_from_parts(st.opt_state, [st.dp_checkpoint])
        new_params, st.opt_state = self._dp_apply(params, st.opt_state,
                                                  dict(zip(names, grads, strict=True)))
        st.value = [np.asarray(new_params[n], np.float32) for n in names]



# ------------------------------------------------------------------------------------------
# Learner
# ------------------------------------------------------------------------------------------


class DPComms(Comms):
    """A DP learner's network side: sends gradients, collects the shards' averages."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.allowed_codecs = [self.cfg.sync.codec_dp]
        self.pacer = None  # the baseline's gradients are not rate-capped
        self.dp_inbox: dict[tuple[int, int], list[np.ndarray]] = {}
        self.dp_event = threading.Condition(self.lock)

    def send_grad(self, fragment: int, step: int, tensors: list[np.ndarray]) -> None:
        """Queue one fragment's gradient of ``step``."""
        self.submit(Outgoing(fragment, step, tensors, 1, 0, 0, step, 0.0, dp=True))

    def wait_grads(self, step: int, n_fragments: int, stop: threading.Event,
                   timeout_s: float = 0.2) -> dict[int, list[np.ndarray]] | None:
        """Block until every fragment's averaged gradient of ``step`` arrived (None: stop)."""
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

    def _header(self, item: Outgoing, fate: list[int]) -> Header:
        return Header(kind=Kind.GRAD, run=self.run_id, sender=self.learner,
                      inc=self.incarnation, seq=self.seq, frag=item.fragment, base=-1,
                      ver=item.step, c_steps=item.c_steps, c_tokens=item.c_tokens,
                      new_tokens=item.new_tokens, step=item.step, step_time=item.step_time,
                      codec=self.cfg.sync.codec_dp)

    def _on_other(self, h: Header, tensors: list[np.ndarray] | None) -> None:
        if h.kind == Kind.GRAD_AVG and tensors is not None:
            with self.dp_event:
                self.dp_inbox[(h.frag, h.ver)] = tensors
                self.dp_event.notify_all()


class DPLearner(Learner):
    """A learner of the data-parallel baseline: one batch per step, the averaged gradient of
    all M learners applied by every learner; resumes from the job's checkpoint in the store."""

    comms_class = DPComms
    reads_momentum = True  # the AdamW state of the last checkpoint
    # each step sends its gradient and waits for the shards' average of it
    shards_before_first_step = True

    @classmethod
    def _versions_ready(cls, blobs: Sequence[FragmentBlob | None]) -> bool:
        # Every fragment at the same checkpoint (shards roll back at start).
        return (super()._versions_ready(blobs)
                and len({dp_step_of(b.meta) for b in blobs if b is not None}) == 1)

    @classmethod
    def _resume(cls, blobs: Sequence[FragmentBlob | None],
                ckpt: LearnerCheckpoint | TorchCheckpoint, opt_state: Any,
                log: logging.Logger) -> Resumed:
        """The job resumes at its last checkpoint in the store (value and AdamW state); the
        data position is the step."""
        dp_step = dp_step_of(blobs[0].meta) if blobs[0] is not None else -1
        if dp_step >= 0:
            opt_state = opt_state_from_parts(opt_state,
                                             [b.momentum for b in blobs if b is not None])
        step = dp_step + 1
        log.info("data-parallel job resumes at step %d", step)
        return Resumed(opt_state, step=step, tokens_total=0, position=step)

    def _inner_step(self, micro: list[Any]) -> Any:
        lead = self.lead
        # One process (JOINING refuses a multi-process dp learner): always its own leader.
        assert lead is not None and isinstance(lead.comms, DPComms)
        comms = lead.comms
        step = self.progress.step
        P = self.layout.n_fragments
        inner = self.inner
        # The baseline's learners are JAX ones (learner.engines: run.torch_learners is DiLoCo's)
        assert isinstance(inner, InnerLoop)
        grads, loss = inner.grad(self.params, micro[0])
        for p in range(P):
            comms.send_grad(p, step, fragment_tensors(grads, self.layout, p))
        avg = comms.wait_grads(step, P, self.stop)
        if avg is None:
            return None
        merged = {n: a for p in range(P) for n, a in zip(self.layout.names(p), avg[p],
                                                          strict=True)}
        self.params, self.opt_state = inner.apply(self.params, self.opt_state,
                                                  inner.place_all(merged))
        return loss

    def _after_step(self, step_time: float) -> None:
        """No outer step: nothing to adopt or send."""

    def _drain_sends(self) -> None:
        """Nothing unsent: every step's gradient left with the step."""
