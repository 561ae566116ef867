"""``sync.partial_merge``: the share of a partial round by hand, and a shard's merge of one of
two live learners' contributions under both rules."""

from __future__ import annotations

import numpy as np
import pytest

from ddiloco.pipeline.errors import ConfigError
from ddiloco.workers.run.blobs import decode_blob
from ddiloco.workers.run.config import load_config
from ddiloco.workers.syncer.merge import partial_share
from tests.test_syncer_core import TINY, delta_frames, rand_like, shard_core


def test_share_is_contributions_over_live_learners() -> None:
    assert partial_share(1, 4) == 0.25
    assert partial_share(3, 4) == 0.75
    assert partial_share(4, 4) == 1.0
    # more contributions than live learners (one died after sending): the whole merge
    assert partial_share(3, 2) == 1.0
    # no registry yet: the whole merge
    assert partial_share(2, 0) == 1.0
    with pytest.raises(ValueError, match="n >= 1"):
        partial_share(0, 4)
    with pytest.raises(ValueError, match="M >= 0"):
        partial_share(1, -1)


@pytest.mark.parametrize(("rule", "share"), [("full", 1.0), ("share", 0.5)])
def test_a_lone_contribution_of_two_live_learners(rule: str, share: float) -> None:
    with shard_core({**TINY, "sync.partial_merge": rule,
                     "sync.min_quorum": 1}) as (core, store, clock):
        p = 0
        before = [v.copy() for v in core.frags[p].value]
        d0 = rand_like(core, p, 1)
        core.handle(delta_frames(core, "learner-0", 1, p, 0, d0))
        clock.now += 10.0  # past the grace window: learner-1 is not waited for
        assert len(core.tick()) == 1
        stored = store.get_latest(p)
        assert stored is not None and stored.version == 1
        got = decode_blob(stored.value, core.layout.shapes(p))
        lr = core.cfg.sync.outer_lr
        # one contribution: the merge (average or RDA) is the contribution itself
        for b0, a, x in zip(before, got, d0, strict=True):
            np.testing.assert_allclose(a, b0 - lr * share * x.astype(np.float64),
                                       rtol=1e-5, atol=1e-7)
        assert stored.meta.get("share", 1.0) == share


def test_partial_merge_is_validated() -> None:
    assert load_config(None, {}).sync.partial_merge == "full"
    with pytest.raises(ConfigError, match=r"sync\.partial_merge: 'half' is not a valid "
                       r"choice; expected 'full' or 'share'"):
        load_config(None, {"sync.partial_merge": "half"})
