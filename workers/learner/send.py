"""A learner's send path: each fragment's work since its last adoption, and how it leaves.

For every fragment p the learner keeps the version it adopted and its value (the anchor), and
counts the steps and tokens trained on it since (DESIGN §2, learner loop steps 1-2). Every H
steps, staggered over fragments (or earlier, to join a round a shard announced), p is due: its
outer gradient ``delta = anchor - theta`` is quantized with the uplink codec and handed to the
comms thread (:meth:`ddiloco.workers.learner.comms.Comms.submit`), which sends it without the
training
thread waiting. An adoption (the training loop's,
:meth:`ddiloco.workers.learner.core.Learner.adopt`)
re-anchors the fragment here (:meth:`Sender.adopted`); the drain sends what is worth sending
(:meth:`Sender.drain`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import numpy as np

from ddiloco.pipeline import codec
from ddiloco.pipeline.fragments import (
    FragmentLayout,
    due_fragments,
    fragment_offsets,
    initial_last_sends,
)
from ddiloco.workers.learner.adoption import eager_move
from ddiloco.workers.learner.blocking import Gate
from ddiloco.workers.learner.comms import Comms, Outgoing
from ddiloco.workers.learner.report import Progress, State
from ddiloco.workers.run.config import Config

__all__ = ["Sender"]


class Sender:
    """The per-fragment bookkeeping of a leader's unsent work and its sends.

    Every list is indexed by fragment. Only the training thread changes them; the comms thread
    reads ``last_send`` in :meth:`will_join` (a stale read costs at most a round joined one
    step late or early).

    Args:
        cfg: the run's configuration (``sync``: H, adoption policy, uplink codec, eager moves,
            round notices).
        layout: the run's fragment layout.
        comms: the comms thread the deltas go to.
        gate: the learner's round gate (told of every send).
        progress: the learner's progress (its step and state for :meth:`will_join`; token
            fate of discarded work).
        versions: the version of each fragment adopted at SYNCING.
        anchors: their values, float32 host copies (kept, not copied).
        host: fragment p's current parameters as float32 host copies (gathered from the
            learner's devices).
        place: put new values of fragment p on the learner's devices (eager moves).
    """

    def __init__(self, cfg: Config, layout: FragmentLayout, comms: Comms, gate: Gate,
                 progress: Progress, versions: Sequence[int],
                 anchors: Sequence[list[np.ndarray]],
                 host: Callable[[int], list[np.ndarray]],
                 place: Callable[[int, Sequence[np.ndarray]], None]) -> None:
        self.cfg = cfg
        self.layout = layout
        self.comms = comms
        self.gate = gate
        self.progress = progress
        self.host = host
        self.place = place
        P = layout.n_fragments
        #: the version each fragment's next delta is measured against (the last adopted)
        self.version: list[int] = list(versions)
        #: that version's value (float32 host copies)
        self.anchor: list[list[np.ndarray]] = list(anchors)
        #: where unsent work is measured from (carry adoption): anchor after an adoption,
        #: anchor - decoded delta after a send
        self.ref: list[list[np.ndarray]] = list(anchors)
        #: steps and tokens since the fragment's adoption (the token weight's counters)
        self.c_steps = [0] * P
        self.c_tokens = [0] * P
        #: steps and tokens that have not left the learner yet (token accounting)
        self.unsent_steps = [0] * P
        self.unsent_tokens = [0] * P
        #: sync.eager: each fragment's last outer step per version (previous version - anchor),
        #: None until the learner has adopted two versions of it (after a restart as well)
        self.last_step: list[list[np.ndarray] | None] = [None] * P
        #: sync.eager: the eager move made since the fragment's last adoption, if any
        self.jump: list[list[np.ndarray] | None] = [None] * P
        self.eager_estimates = 0
        #: the step of each fragment's last send; virtual at first, for the stagger
        self.last_send = initial_last_sends(fragment_offsets(P, cfg.sync.H), cfg.sync.H,
                                            progress.step)

    def count_step(self, tokens: int) -> None:
        """One inner step on ``tokens`` tokens is done: every fragment holds its work."""
        for p in range(self.layout.n_fragments):
            self.c_steps[p] += 1
            self.c_tokens[p] += tokens
            self.unsent_steps[p] += 1
            self.unsent_tokens[p] += tokens

    def due(self, step: int) -> list[int]:
        """Fragments to send after inner step ``step``: H steps after their last send, or now
        for an open round this learner decided to join (:meth:`will_join`)."""
        return due_fragments(step, self.last_send, self.cfg.sync.H,
                             self.comms.take_round_open())

    def will_join(self, p: int) -> bool:
        """Called by the comms thread on a round-open notice: join if at least
        (1 - early_fraction) * H steps have passed since this learner last sent p (only while
        TRAINING, and never under ``sync.blocking``:
        :attr:`ddiloco.workers.learner.blocking.Gate.joins_rounds_early`)."""
        s = self.cfg.sync
        if (self.progress.state is not State.TRAINING or not s.round_notice
                or not self.gate.joins_rounds_early):
            return False
        early = s.H * (1.0 - s.early_fraction)
        return self.progress.step - self.last_send[p] >= early

    def send(self, p: int, step: int, step_time: float) -> None:
        """Compute delta = anchor - theta for fragment p and hand it to the comms thread.

        The delta is quantized here with the uplink codec (what the shard will decode), and
        ``ref`` becomes anchor - decoded delta: under ``carry`` adoption the quantization
        error is then carried like unsent work and leaves with the next delta (error
        feedback). Nothing is sent when no step was made since the last adoption.

        Args:
            p: the fragment.
            step: the learner's inner step (the send's round).
            step_time: EMA of the inner step time, seconds (0.0: not measured yet); shards
                pace merges by it.
        """
        self.last_send[p] = step
        if self.c_steps[p] == 0:
            return
        theta = self.host(p)
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
                                   self.unsent_tokens[p], step, step_time))
        self.gate.sent(p, self.version[p], step)
        self.unsent_tokens[p] = self.unsent_steps[p] = 0

    def _eager(self, p: int, own: list[np.ndarray], sent: list[np.ndarray],
               exact: list[np.ndarray], last: list[np.ndarray]) -> None:
        """``sync.eager``: move fragment ``p`` to the estimate of its next version
        (:func:`ddiloco.workers.learner.adoption.eager_move`). ``ref`` moves with it, so that what
        carry adoption keeps is unchanged, and the move is remembered, so that a second send
        before the next adoption does not count it as this learner's work."""
        est, self.ref[p], self.jump[p] = eager_move(
            self.anchor[p], own, sent, exact, last, 1.0 / self.cfg.run.learners,
            self.cfg.sync.outer_lr)
        self.place(p, est)
        self.eager_estimates += 1

    def adopted(self, p: int, version: int, value: list[np.ndarray], step: int) -> None:
        """Re-anchor fragment p at a newly adopted ``version`` with global ``value`` (the
        caller computed the learner's new parameters against the old ``ref`` first).

        Under ``carry`` the counters restart at what theta - anchor still holds, the unsent
        steps and tokens; otherwise unsent work is gone (counted as ``discarded_overwritten``)
        and they restart at zero.

        Args:
            p: the fragment.
            version: the version adopted (newer than :attr:`version` ``[p]``).
            value: its value, float32 host copies (kept, not copied).
            step: the learner's inner step (``sync.phase_lock`` restarts p's period there).
        """
        if self.cfg.sync.adopt == "carry":
            self.c_steps[p], self.c_tokens[p] = self.unsent_steps[p], self.unsent_tokens[p]
        else:
            if self.unsent_tokens[p]:
                self.progress.discard(overwritten=self.unsent_tokens[p])
            self.c_steps[p] = self.c_tokens[p] = 0
            self.unsent_tokens[p] = self.unsent_steps[p] = 0
        if self.cfg.sync.eager:
            span = np.float32(version - self.version[p])
            self.last_step[p] = [(a - v) / span
                                 for a, v in zip(self.anchor[p], value, strict=True)]
        self.anchor[p] = value
        self.ref[p] = value
        self.version[p] = version
        self.jump[p] = None
        if self.cfg.sync.phase_lock:
            # Send p again H steps after adopting it: every learner adopts a version at
            # about the same time (one broadcast), so their next deltas of p arrive
            # together and meet in one round instead of splitting it.
            self.last_send[p] = step

    def drain(self, step: int, step_time: float) -> None:
        """DRAINING: send fragments with at least H/2 steps of unsent work; count the rest as
        ``discarded_drain``.

        Every merge also applies the outer momentum, so a burst of tiny final deltas (one
        merge each) would move the global model by momentum alone.

        Args:
            step: the learner's last inner step.
            step_time: EMA of the inner step time at the end of TRAINING, seconds.
        """
        for p in range(self.layout.n_fragments):
            if self.c_steps[p] >= self.cfg.sync.H / 2 and self.unsent_tokens[p] > 0:
                self.send(p, step, step_time)
            elif self.unsent_tokens[p] > 0:
                self.progress.discard(drain=self.unsent_tokens[p])
                self.unsent_tokens[p] = 0
