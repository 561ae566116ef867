"""How often a learner's comms thread reads the shards' endpoints (workers/learner/comms.py)."""

from __future__ import annotations

import pytest

from ddiloco.workers.learner.comms import (
    ENDPOINT_FIRST_S,
    ENDPOINT_REFRESH_S,
    endpoint_refresh_s,
)


def test_a_missing_shard_is_looked_for_soon_then_less_often() -> None:
    waits, every = [], 0.0  # the first read is at once
    for _ in range(9):
        every = endpoint_refresh_s(every, all_known=False)
        waits.append(round(every, 4))
    # 0.05 s growing 1.5x a read, capped at once a second
    assert waits == [ENDPOINT_FIRST_S, 0.075, 0.1125, 0.1688, 0.2531, 0.3797, 0.5695, 0.8543,
                     1.0]
    # reads at 0, 0.05, 0.125, 0.2375, 0.4063: five in the first 0.6 s, not the one a fixed
    # period of a second gave
    reads = [0.0, *(sum(waits[:i + 1]) for i in range(len(waits)))]
    assert sum(1 for t in reads if t < 0.6) == 5


@pytest.mark.parametrize("last_s", [ENDPOINT_FIRST_S, 0.3, ENDPOINT_REFRESH_S])
def test_once_every_shard_is_known_once_a_second(last_s: float) -> None:
    assert endpoint_refresh_s(last_s, all_known=True) == ENDPOINT_REFRESH_S
