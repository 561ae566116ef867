"""The documented low-level API (docs/API.md, "Your own loop"): the example runs as written and
its numbers match a hand computation."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np
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
    scope: dict[str, object] = {}
    exec(compile(_example(), str(DOC), "exec"), scope)  # the doc's own code, as a user runs it
    delta = np.array([-0.5, 0.25, -1.0, 0.0], np.float32)
    d0 = scope["d0"][0]  # type: ignore[index]
    # int8: per block s = max|x| / 127, error at most s / 2
    assert np.max(np.abs(d0 - delta)) <= (1.0 / 127) / 2 + 1e-7
    # token weights 4096^2 / 8 and 2048^2 / 8: 4 to 1
    assert scope["weights"] == [2_097_152.0, 524_288.0]
    merged = 0.8 * d0 + 0.2 * 0.1
    np.testing.assert_allclose(scope["outer_grad"][0], merged, rtol=1e-6)  # type: ignore[index]
    # Nesterov from zero momentum: b = g; update = -lr (g + mu b) = -0.7 * 1.9 * g
    np.testing.assert_allclose(scope["new_value"][0], -1.33 * merged, rtol=1e-5)  # type: ignore[index]
    np.testing.assert_allclose(scope["momentum"][0], merged, rtol=1e-6)  # type: ignore[index]
    # carry with nothing unsent: theta becomes the new value
    np.testing.assert_array_equal(scope["theta"][0], scope["new_value"][0])  # type: ignore[index]


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
