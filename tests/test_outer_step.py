"""A round's merge returns the fragment's next state and never writes the committed one
(:func:`ddiloco.workers.syncer.outer_step.merge_and_step`), accepted or refused, on the fused int
downlink and on the reference path."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

from ddiloco.pipeline.accumulate import Packed, pack_raw
from ddiloco.pipeline.errors import MergeRefused
from ddiloco.workers.run.config import SyncSection
from ddiloco.workers.syncer.fragment_state import FragmentState
from ddiloco.workers.syncer.fused import MergeEngine
from ddiloco.workers.syncer.merge import OuterConfig, OuterOptimizer
from ddiloco.workers.syncer.outer_step import FragmentSpec, MergeResult, RoundTerms, merge_and_step

SHAPES: list[tuple[int, ...]] = [(8, 4), (16,)]
SPEC = FragmentSpec(SHAPES, [False, False])


def fp32_term(tensors: list[np.ndarray]) -> Packed:
    flat = np.concatenate([t.reshape(-1) for t in tensors]).astype(np.float32)
    return pack_raw(flat.view(np.uint8), SHAPES, "fp32")


def committed_state(momentum: bool) -> FragmentState:
    rng = np.random.default_rng(0)
    value = [rng.standard_normal(sh).astype(np.float32) for sh in SHAPES]
    moment = [np.full(sh, 0.5, np.float32) for sh in SHAPES] if momentum else []
    st = FragmentState(version=3, value=value, momentum=moment)
    st.history[3] = None
    return st


def snapshot(st: FragmentState) -> dict[str, Any]:
    return {"value": st.flat_value.copy(), "momentum": st.flat_momentum.copy(),
            "residual": None if st.flat_residual is None else st.flat_residual.copy(),
            "version": st.version, "history": dict(st.history),
            "corrected": dict(st.corrected), "norms": list(st.recent_norms)}


def assert_unchanged(st: FragmentState, before: dict[str, Any]) -> None:
    after = snapshot(st)
    arrays = ("value", "momentum", "residual")
    for key in arrays:
        np.testing.assert_array_equal(after[key], before[key])
    assert {k: v for k, v in after.items() if k not in arrays} \
        == {k: v for k, v in before.items() if k not in arrays}


def step(s: SyncSection, st: FragmentState, tensors: list[np.ndarray]) -> MergeResult:
    outer = OuterOptimizer(OuterConfig(lr=s.outer_lr, momentum=s.outer_momentum))
    rnd = RoundTerms([[fp32_term(tensors)]], [1.0], lr_mass=1.0)
    return merge_and_step(s, MergeEngine(threads=1), outer, st, rnd, SPEC)


@pytest.mark.parametrize(("down", "momentum"), [("int4", 0.0), ("int8", 0.9), ("fp32", 0.0),
                                                ("fp32", 0.9)])
def test_the_next_state_is_new_and_the_committed_one_is_unchanged(down: str,
                                                                   momentum: float) -> None:
    s = SyncSection(codec_up="fp32", codec_down=down, outer_momentum=momentum)
    st = committed_state(momentum != 0)
    before = snapshot(st)
    grad = [np.full(sh, 0.1, np.float32) for sh in SHAPES]
    got = step(s, st, grad)
    assert_unchanged(st, before)
    assert got.state is not st and got.state.flat_value is not st.flat_value
    # The update moved the value by what the broadcast's difference says (the applied diff).
    applied = np.concatenate([t.reshape(-1) for t in got.diff.tensors()])
    np.testing.assert_allclose(got.state.flat_value, st.flat_value + applied, atol=1e-6)
    assert np.abs(applied).max() > 0 and got.payload and got.norm > 0
    assert got.norms == [] and got.delayed is None


@pytest.mark.parametrize("down", ["int4", "fp32"])
def test_a_refused_merge_leaves_the_committed_state_unchanged(down: str) -> None:
    s = SyncSection(codec_up="fp32", codec_down=down)
    big = np.finfo(np.float32).max
    st = FragmentState(version=3, value=[np.full(sh, big / 2, np.float32) for sh in SHAPES],
                       momentum=[])
    st.history[3] = None
    before = snapshot(st)
    # Theta - outer gradient overflows float32: the new version would not be finite.
    with pytest.raises(MergeRefused):
        step(s, st, [np.full(sh, -big, np.float32) for sh in SHAPES])
    assert_unchanged(st, before)
