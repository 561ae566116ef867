"""Folding unsent deltas in a learner's outbox (workers.learner.comms.fold_outgoing)."""

from __future__ import annotations

import numpy as np

from ddiloco.workers.learner.comms import Outgoing, fold_outgoing


def out(base: int, value: float, steps: int, tokens: int, new: int, dp: bool = False) -> Outgoing:
    return Outgoing(0, base, [np.full(3, value, np.float32)], steps, tokens, new, 0, 0.0, dp=dp)


def test_same_base_newer_contains_the_older() -> None:
    older, newer = out(4, 1.0, 6, 600, 600), out(4, 1.5, 10, 1000, 400)
    fold_outgoing(older, newer)
    np.testing.assert_array_equal(newer.tensors[0], 1.5)
    assert (newer.c_steps, newer.c_tokens, newer.new_tokens) == (10, 1000, 1000)


def test_newer_base_adds_the_older_work() -> None:
    older, newer = out(4, 1.0, 6, 600, 600), out(5, 0.25, 2, 200, 200)
    fold_outgoing(older, newer)
    np.testing.assert_array_equal(newer.tensors[0], 1.25)
    assert (newer.c_steps, newer.c_tokens, newer.new_tokens) == (8, 800, 800)


def test_dp_gradients_are_never_summed() -> None:
    older, newer = out(4, 1.0, 1, 0, 0, dp=True), out(5, 2.0, 1, 0, 0, dp=True)
    fold_outgoing(older, newer)
    np.testing.assert_array_equal(newer.tensors[0], 2.0)
