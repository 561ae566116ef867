"""The documented low-level API (docs/API.md, "Your own loop"): the example runs as written and
its numbers match a hand computation."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

import numpy as np
import optax
import pytest

import ddiloco
from ddiloco import core

DOC = Path(__file__).resolve().parent.parent / "docs" / "API.md"


def _example() -> str:
    text = DOC.read_text()
    section = text[text.index("## Your own loop"):]
    match = re.search(r"```python\n(.*?)```", section, re.S)
    assert match is not None, "the section has no python example"
    return match.group(1)


def test_the_documented_example_runs_and_matches_the_hand_computation() -> None:
    scope: dict[str, Any] = {}
    exec(compile(_example(), str(DOC), "exec"), scope)  # the doc's own code, as a user runs it
    # One fragment of both leaves, in name order: b (2,), then w (4,).
    assert scope["names"] == ["b", "w"] and scope["shapes"] == [(2,), (4,)]
    t = [np.array([0.5, 0.5], np.float32), np.array([1.0, -0.5, 2.0, 0.0], np.float32)]
    # Each step halves the distance to the target: 0.75 t after H = 2 steps, 0.875 t after 3.
    delta = [-0.75 * x for x in t]
    # int8, one block of 6 values: s = max|x| / 127 = 1.5 / 127, error at most s / 2; the
    # shard decodes exactly what encode_and_reconstruct said it would.
    s = 1.5 / 127
    for got, want, sent in zip(scope["d0"], delta, scope["sent"], strict=True):
        assert np.max(np.abs(got - want)) <= s / 2 + 1e-7
        np.testing.assert_array_equal(got, sent)
    # token weights 4096^2 / 2 and 2048^2 / 2: 4 to 1
    assert scope["weights"] == [8_388_608.0, 2_097_152.0]
    merged = [0.8 * d + 0.2 * 0.1 for d in scope["d0"]]
    for got, want in zip(scope["outer_grad"], merged, strict=True):
        np.testing.assert_allclose(got, want, rtol=1e-6)
    # Nesterov from zero momentum at anchor 0: b = g; Theta = -lr (g + mu b) = -0.7 * 1.9 * g
    for value, mom, g in zip(scope["value"], scope["momentum"], merged, strict=True):
        np.testing.assert_allclose(value, -1.33 * g, rtol=1e-5)
        np.testing.assert_allclose(mom, g, rtol=1e-6)
    # The broadcast (int8 of value - 0) decodes within its own s / 2.
    s_down = max(float(np.max(np.abs(v))) for v in scope["value"]) / 127
    for got, want in zip(scope["new_value"], scope["value"], strict=True):
        assert np.max(np.abs(got - want)) <= s_down / 2 + 1e-7
    # carry: theta = new value + (theta - ref), ref = anchor - sent = -sent, theta = 0.875 t:
    # the step taken after the send (0.125 t) and the codec's error on the send stay local.
    params = scope["params"]
    for name, new, sent, x in zip(["b", "w"], scope["new_value"], scope["sent"], t,
                                  strict=True):
        np.testing.assert_allclose(params[name], new + 0.875 * x + sent, atol=1e-6)
        assert np.max(np.abs(params[name] - (new + 0.125 * x))) <= s / 2 + 1e-6
    for anchor, new in zip(scope["anchor"], scope["new_value"], strict=True):
        np.testing.assert_array_equal(anchor, new)


def test_outer_optimizer_is_the_shards_nesterov_step() -> None:
    g1, g2 = np.array([1.0, 2.0], np.float32), np.array([0.5, -1.0], np.float32)
    tx = core.outer_optimizer(core.OuterConfig(lr=0.7, momentum=0.9))
    params = {"x": np.zeros(2, np.float32)}
    state = tx.init(params)
    for g in (g1, g2):
        updates, state = tx.update({"x": g}, state)
        params = optax.apply_updates(params, updates)
    # b1 = g1; x1 = -0.7 (g1 + 0.9 b1). b2 = 0.9 b1 + g2; x2 = x1 - 0.7 (g2 + 0.9 b2).
    b2 = 0.9 * g1 + g2
    x2 = -0.7 * 1.9 * g1 - 0.7 * (g2 + 0.9 * b2)
    np.testing.assert_allclose(params["x"], x2, rtol=1e-6)
    opt = core.OuterOptimizer(core.OuterConfig(lr=0.7, momentum=0.9))
    x, b = [np.zeros(2, np.float32)], opt.init_momentum([g1])
    for g in (g1, g2):
        x, b = opt.step(x, [g], b)
    np.testing.assert_allclose(x[0], x2, rtol=1e-6)
    np.testing.assert_allclose(b[0], b2, rtol=1e-6)


def test_the_schedule_staggers_the_fragments() -> None:
    offsets = core.fragment_offsets(4, 8)
    assert offsets == [2, 4, 6, 0]
    last = core.initial_last_sends(offsets, 8)
    sends = []
    for step in range(1, 17):
        for frag in core.due_fragments(step, last, 8):
            last[frag] = step
            sends.append((step, frag))
    # One fragment every H / P = 2 steps, each once per H = 8 steps.
    assert sends == [(2, 0), (4, 1), (6, 2), (8, 3), (10, 0), (12, 1), (14, 2), (16, 3)]


def test_carry_keeps_the_unsent_work() -> None:
    theta = [np.array([1.0, 2.0], np.float32)]
    ref = [np.array([0.5, 2.5], np.float32)]     # unsent work: +0.5, -0.5
    value = [np.array([10.0, 20.0], np.float32)]
    out = core.adopt_fragment("carry", theta, value, ref=ref)
    np.testing.assert_array_equal(out[0], [10.5, 19.5])
    np.testing.assert_array_equal(core.adopt_fragment("overwrite", theta, value)[0], value[0])
    np.testing.assert_allclose(core.adopt_fragment("mix", theta, value, alpha=0.25)[0],
                               [7.75, 15.5])
    with pytest.raises(ValueError, match="needs ref"):
        core.adopt_fragment("carry", theta, value)


def test_rda_keeps_the_mean_length_of_orthogonal_updates() -> None:
    a, b = np.array([3.0, 0.0], np.float32), np.array([0.0, 3.0], np.float32)
    out = core.rda([a, b], [1.0, 1.0])
    # mean length 3 along the mean direction (1, 1) / sqrt 2; plain averaging gives 3 / sqrt 2
    np.testing.assert_allclose(out, [3 / np.sqrt(2)] * 2, rtol=1e-6)
    np.testing.assert_allclose(core.weighted_average([a, b], [1.0, 1.0]), [1.5, 1.5])


def test_the_public_names_resolve() -> None:
    for name in ddiloco.__all__:
        assert getattr(ddiloco, name) is not None, name
    for name in core.__all__:
        assert getattr(core, name) is not None, name
    assert issubclass(ddiloco.CheckpointMismatch, Exception)
    with pytest.raises(AttributeError):
        ddiloco.not_a_name  # noqa: B018
