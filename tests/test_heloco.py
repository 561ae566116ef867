"""HeLoCo's correction of incoming outer gradients (``sync.correction = "heloco"``): each case
of the rule by hand, the reference, and a shard whose round holds an anti-aligned learner,
before and after the shard restarts from the store."""

from __future__ import annotations

import math

import numpy as np
import pytest

from ddiloco.pipeline import codec
from ddiloco.pipeline.accumulate import pack_raw, unpack
from ddiloco.pipeline.errors import ConfigError
from ddiloco.workers.run.blobs import decode_blob
from ddiloco.workers.run.config import load_config
from ddiloco.workers.syncer.core import ShardCore
from ddiloco.workers.syncer.heloco import (
    KEPT,
    SHRUNK,
    TURNED,
    HeLoCoConfig,
    correct_contribution,
    correct_tensor,
    reference,
)
from tests.test_syncer_core import TINY, Clock, delta_frames, rand_like, shard_core

F32 = np.float32
CFG = HeLoCoConfig()  # keep 0.2, shrink 1, shrink_max 0.5, reorient 0.5, kappa 1


def test_an_aligned_tensor_passes_unchanged() -> None:
    x = np.array([3.0, 4.0], F32)
    out, what = correct_tensor(x, np.array([1.0, 0.0], F32), CFG)  # cosine 0.6 >= 0.2
    assert what == KEPT and out is x


def test_an_anti_aligned_tensor_loses_part_of_its_component_along_the_reference() -> None:
    # x = (-3, 4): ||x|| = 5, cosine with (1, 0) is -0.6; conf = 5 / (5 + 1) = 5/6;
    # beta = min(1 * 0.6 * 5/6, 0.5) = 0.5; x - beta c ||x|| v = (-3 + 0.5 * 0.6 * 5, 4)
    out, what = correct_tensor(np.array([-3.0, 4.0], F32), np.array([1.0, 0.0], F32), CFG)
    assert what == SHRUNK
    np.testing.assert_allclose(out, [-1.5, 4.0], rtol=1e-6)
    # kappa 3: conf = 5 / 8, beta = 0.6 * 0.625 = 0.375: (-3 + 0.375 * 3, 4)
    out, _ = correct_tensor(np.array([-3.0, 4.0], F32), np.array([1.0, 0.0], F32),
                            HeLoCoConfig(kappa=3.0))
    np.testing.assert_allclose(out, [-1.875, 4.0], rtol=1e-6)


def test_a_weakly_aligned_tensor_is_turned_towards_the_reference_at_its_length() -> None:
    # x = (1, 7): ||x|| = sqrt(50), cosine with r = (2, 0) is 1 / sqrt(50) = 0.141421 < 0.2;
    # conf = sqrt(50) / (sqrt(50) + 1 * 2) = 0.779519; lam = 0.5 * (0.2 - 0.141421) * conf
    # = 0.022832; u~ = (1 - lam) u + lam v = (0.161024, 0.967347), ||u~|| = 0.980658;
    # out = sqrt(50) u~ / ||u~|| = (1.161070, 6.975092)
    out, what = correct_tensor(np.array([1.0, 7.0], F32), np.array([2.0, 0.0], F32), CFG)
    assert what == TURNED
    np.testing.assert_allclose(out, [1.161070, 6.975092], rtol=2e-5)
    assert float(np.linalg.norm(out)) == pytest.approx(math.sqrt(50.0), rel=1e-6)


@pytest.mark.parametrize("x, r", [([0.0, 0.0], [1.0, 0.0]), ([1.0, 0.0], [0.0, 0.0]),
                                  ([float("nan"), 1.0], [1.0, 0.0]),
                                  ([-1.0, 0.0], [float("inf"), 0.0])])
def test_zero_and_non_finite_tensors_are_left_to_the_guard(x: list[float],
                                                          r: list[float]) -> None:
    xa = np.array(x, F32)
    out, what = correct_tensor(xa, np.array(r, F32), CFG)
    assert what == KEPT and out is xa


def test_the_reference_is_the_momentum_or_minus_the_kept_differences() -> None:
    shapes = [(3,)]
    d1 = pack_raw(np.array([1.0, 0.0, -2.0], F32).view(np.uint8), shapes, "fp32")
    d2 = unpack(codec.encode([np.array([0.5, 1.0, 0.0], F32)], "int8"), shapes, "int8")
    history = {0: None, 1: d1, 2: d2}
    ref = reference(3, history)
    assert ref is not None
    np.testing.assert_allclose(ref, [-1.5, -1.0, 2.0], atol=1e-2)  # int8 rounding of d2
    m = np.array([0.1, 0.2, 0.3], F32)
    assert reference(3, history, m) is m
    np.testing.assert_allclose(reference(3, history, np.zeros(3, F32)),  # type: ignore[arg-type]
                               ref)
    assert reference(3, {0: None}) is None
    assert reference(3, {}, np.zeros(0, F32)) is None


def test_a_contribution_is_summed_then_corrected_tensor_by_tensor() -> None:
    shapes = [(2,), (2,)]
    a = pack_raw(np.array([-2.0, 4.0, 1.0, 0.0], F32).view(np.uint8), shapes, "fp32")
    b = pack_raw(np.array([-1.0, 0.0, 0.0, 1.0], F32).view(np.uint8), shapes, "fp32")
    ref = np.array([1.0, 0.0, 1.0, 1.0], F32)
    fixed, counts = correct_contribution([a, b], ref, shapes, CFG)
    # tensor 0: (-3, 4) against (1, 0) as above; tensor 1: (1, 1) against (1, 1), cosine 1
    np.testing.assert_allclose(fixed.tensors()[0], [-1.5, 4.0], rtol=1e-6)
    np.testing.assert_allclose(fixed.tensors()[1], [1.0, 1.0], rtol=1e-6)
    assert counts == {KEPT: 1, SHRUNK: 1, TURNED: 0}


def test_a_shard_shrinks_the_anti_aligned_learner_and_a_restart_keeps_its_reference() -> None:
    with shard_core({**TINY, "sync.correction": "heloco",
                     "sync.merge": "average"}) as (core, store, _):
        p = 0
        shapes = core.layout.shapes(p)
        d0 = rand_like(core, p, 1)
        # round 1: no reference yet (version 0 only), merged as sent
        for i, lid in enumerate(("learner-0", "learner-1")):
            core.handle(delta_frames(core, lid, 1 + i, p, 0, d0))
        assert len(core.tick()) == 1
        assert core.frags[p].corrected == {}
        v1 = [v.copy() for v in core.frags[p].value]
        # round 2: learner-0 sends -d0, learner-1 d0. The reference is d0 (lr 1: Theta_1 -
        # Theta_0 = -d0): learner-0's cosine is -1, conf = 1 / (1 + 1), beta = min(0.5, 0.5):
        # -d0 becomes -d0 - 0.5 * (-1) * ||d0|| * d0 / ||d0|| = -0.5 d0. Average with d0:
        # 0.25 d0 (0 uncorrected).
        core.handle(delta_frames(core, "learner-0", 3, p, 1, [-x for x in d0]))
        core.handle(delta_frames(core, "learner-1", 4, p, 1, d0))
        assert len(core.tick()) == 1
        stored = store.get_latest(p)
        assert stored is not None and stored.version == 2
        got = decode_blob(stored.value, shapes)
        for a, b, x in zip(got, v1, d0, strict=True):
            np.testing.assert_allclose(a, b - 0.25 * x, rtol=1e-4, atol=1e-7)
        n = len(shapes)
        assert core.frags[p].corrected == {KEPT: n, SHRUNK: n, TURNED: 0}
        merges = [e for _, e in store.events(kinds={"merge"}) if e["fragment"] == p]
        assert "corrected" not in merges[0] and merges[-1]["corrected"] == {KEPT: n, SHRUNK: n,
                                                                            TURNED: 0}
        before = reference(core.frags[p].flat_value.size, core.frags[p].history)
        # a new owner of the fragment rebuilds the reference from the stored versions
        store.release_lease(0, "owner")
        epoch = store.acquire_lease(0, "owner-2", 5000)
        assert epoch is not None
        again = ShardCore(core.manifest, 0, store, epoch, clock=Clock())
        again.load(lambda: pytest.fail("must resume, not re-initialise"))  # type: ignore[arg-type,return-value]
        after = reference(again.frags[p].flat_value.size, again.frags[p].history)
        assert before is not None and after is not None
        np.testing.assert_allclose(after, before, rtol=1e-5, atol=1e-8)


def test_heloco_settings_are_validated() -> None:
    cfg = load_config(None, {"sync.correction": "heloco", "sync.heloco_keep": "0.3"}).sync
    assert (cfg.correction, cfg.heloco_keep) == ("heloco", 0.3)
    with pytest.raises(ConfigError, match=r"sync\.correction: 'scaffold' is not a valid "
                       r"choice; expected 'none' or 'heloco'"):
        load_config(None, {"sync.correction": "scaffold"})
    with pytest.raises(ConfigError, match=r"sync\.heloco_shrink_max: .* \[0, 1\]"):
        load_config(None, {"sync.heloco_shrink_max": "1.5"})
    with pytest.raises(ConfigError, match=r"sync\.heloco_keep: must be in \[0, 1\], got -0\.1"):
        HeLoCoConfig(keep=-0.1)
