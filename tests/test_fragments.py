"""Fragmentation, the staggered schedule and shard routing."""

from __future__ import annotations

import pytest

from ddiloco.pipeline.errors import ConfigError
from ddiloco.pipeline.fragments import (
    FragmentLayout,
    balanced_fragments,
    due_fragments,
    fragment_offsets,
    fragments_of_shard,
    initial_last_sends,
    shard_of,
)


def test_balanced_greedy_by_size() -> None:
    # sizes: a=100, b=60, c=50, d=40, e=10 into 2 fragments:
    # a->0 (100), b->1 (60), c->1 (110), d->0 (140), e->1 (120)
    shapes = {"a": (10, 10), "b": (60,), "c": (5, 10), "d": (40,), "e": (10,)}
    layout = balanced_fragments(shapes, 2)
    assert layout.names(0) == ["a", "d"]
    assert layout.names(1) == ["b", "c", "e"]
    assert [layout.n_values(p) for p in range(2)] == [140, 120]
    assert layout.fragment_of() == {"a": 0, "d": 0, "b": 1, "c": 1, "e": 1}


def test_every_tensor_exactly_once_and_deterministic() -> None:
    shapes = {f"t{i}": (i + 1, 3) for i in range(17)}
    a = balanced_fragments(shapes, 5)
    b = balanced_fragments(dict(reversed(list(shapes.items()))), 5)
    assert a == b
    names = [n for p in range(5) for n in a.names(p)]
    assert sorted(names) == sorted(shapes)
    assert a.digest() == b.digest()


def test_layout_json_round_trip() -> None:
    layout = balanced_fragments({"x": (2, 3), "y": (4,), "z": ()}, 2)
    assert FragmentLayout.from_json(layout.to_json()) == layout
    with pytest.raises(ConfigError):
        FragmentLayout.from_json([[["x"]]])


@pytest.mark.parametrize("p", [0, 4])
def test_bad_fragment_counts(p: int) -> None:
    with pytest.raises(ConfigError, match="fragments"):
        balanced_fragments({"a": (1,), "b": (2,), "c": (3,)}, p)


def test_offsets_streaming_diloco() -> None:
    # o_p = floor(H/P*(p+1)) mod H with H=24, P=4 -> 6, 12, 18, 0
    assert fragment_offsets(4, 24) == [6, 12, 18, 0]
    # P = H: one fragment every step
    offs = fragment_offsets(24, 24)
    assert sorted(offs) == list(range(24))
    with pytest.raises(ConfigError, match="H"):
        fragment_offsets(4, 0)


def test_due_schedule_each_fragment_once_per_period() -> None:
    H, P = 12, 3
    offs = fragment_offsets(P, H)
    assert offs == [4, 8, 0]
    last = initial_last_sends(offs, H)
    assert last == [-8, -4, 0]
    counts = [0] * P
    first_due: dict[int, int] = {}
    for step in range(1, 3 * H + 1):
        for p in due_fragments(step, last, H):
            counts[p] += 1
            first_due.setdefault(p, step)
            last[p] = step
    assert counts == [3, 3, 3]
    assert first_due == {0: 4, 1: 8, 2: 12}


def test_joining_a_round_shifts_the_phase() -> None:
    last = [0, 0]
    # joining fragment 1 at step 5 makes it due now; its next regular due is 5 + H
    assert due_fragments(5, last, 12, joining={1}) == [1]
    last[1] = 5
    assert due_fragments(12, last, 12) == [0]
    assert due_fragments(17, last, 12) == [0, 1]


def test_routing() -> None:
    assert [shard_of(p, 2) for p in range(5)] == [0, 1, 0, 1, 0]
    assert fragments_of_shard(1, 5, 2) == [1, 3]
