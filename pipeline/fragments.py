"""Fragments: balanced tensor fragmentation, the staggered sync schedule and shard routing.

Source: Decoupled DiLoCo (arXiv 2604.21428), "balanced tensor fragmentation"; offsets follow
Streaming DiLoCo (arXiv 2501.18512), o_p = floor(H / P * (p + 1)) mod H. DESIGN §2.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from ddiloco.pipeline.errors import ConfigError


@dataclass(frozen=True)
class TensorInfo:
    """One parameter tensor: its name and shape (float32 elements)."""

    name: str
    shape: tuple[int, ...]

    @property
    def size(self) -> int:
        """Number of float32 elements."""
        n = 1
        for d in self.shape:
            n *= d
        return n


@dataclass(frozen=True)
class FragmentLayout:
    """Which tensors form each fragment, in a fixed order.

    ``fragments[p]`` lists the tensors of fragment ``p``; the order inside a fragment is the
    order of the tensors in every wire payload and store blob of that fragment.
    """

    fragments: tuple[tuple[TensorInfo, ...], ...]

    @property
    def n_fragments(self) -> int:
        """P, the number of fragments."""
        return len(self.fragments)

    def names(self, p: int) -> list[str]:
        """Tensor names of fragment ``p`` in payload order."""
        return [t.name for t in self.fragments[p]]

    def shapes(self, p: int) -> list[tuple[int, ...]]:
        """Tensor shapes of fragment ``p`` in payload order."""
        return [t.shape for t in self.fragments[p]]

    def n_values(self, p: int) -> int:
        """Number of float32 values in fragment ``p``."""
        return sum(t.size for t in self.fragments[p])

    def fragment_of(self) -> dict[str, int]:
        """Map tensor name -> fragment id."""
        return {t.name: p for p, frag in enumerate(self.fragments) for t in frag}

    def to_json(self) -> list[list[list[object]]]:
        """JSON form stored in the run manifest: ``[[[name, [dims...]], ...], ...]``."""
        return [[[t.name, list(t.shape)] for t in frag] for frag in self.fragments]

    @classmethod
    def from_json(cls, data: Sequence[Sequence[Sequence[object]]]) -> FragmentLayout:
        """Inverse of :meth:`to_json`.

        Raises:
            ConfigError: the data is not a list of fragments of ``[name, shape]`` pairs.
        """
        try:
            frags = tuple(
                tuple(TensorInfo(str(name), tuple(int(d) for d in shape))  # type: ignore[attr-defined]
                      for name, shape in frag)
                for frag in data
            )
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"fragment layout: malformed ({exc})") from exc
        return cls(frags)

    def digest(self) -> str:
        """Stable hash of the layout (part of the manifest's schema hash)."""
        blob = json.dumps(self.to_json(), separators=(",", ":")).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def balanced_fragments(shapes: Mapping[str, Sequence[int]], n_fragments: int) -> FragmentLayout:
    """Split whole tensors into ``n_fragments`` groups of nearly equal size.

    Greedy: tensors sorted by size (largest first, ties by name so every process agrees), each
    put into the currently lightest fragment (ties: lowest id). Inside a fragment tensors keep
    name order. Source: paper, balanced tensor fragmentation.

    Args:
        shapes: tensor name -> shape.
        n_fragments: P >= 1, at most the number of tensors (no empty fragment).

    Raises:
        ConfigError: P < 1 or P > number of tensors.
    """
    if n_fragments < 1:
        raise ConfigError(f"fragments: must be >= 1, got {n_fragments}")
    if n_fragments > len(shapes):
        raise ConfigError(
            f"fragments: {n_fragments} exceeds the number of parameter tensors ({len(shapes)})"
        )
    infos = [TensorInfo(name, tuple(int(d) for d in shape)) for name, shape in shapes.items()]
    infos.sort(key=lambda t: (-t.size, t.name))
    loads = [0] * n_fragments
    groups: list[list[TensorInfo]] = [[] for _ in range(n_fragments)]
    for t in infos:
        p = min(range(n_fragments), key=lambda i: (loads[i], i))
        groups[p].append(t)
        loads[p] += t.size
    return FragmentLayout(tuple(tuple(sorted(g, key=lambda t: t.name)) for g in groups))


def fragment_offsets(n_fragments: int, sync_period: int) -> list[int]:
    """Staggered offsets o_p = floor(H / P * (p + 1)) mod H (Streaming DiLoCo).

    With P = H exactly one fragment is due every inner step, which keeps traffic smooth.

    Raises:
        ConfigError: H < 1 or P < 1.
    """
    if sync_period < 1:
        raise ConfigError(f"H (sync_period): must be >= 1, got {sync_period}")
    if n_fragments < 1:
        raise ConfigError(f"fragments: must be >= 1, got {n_fragments}")
    return [int(sync_period / n_fragments * (p + 1)) % sync_period for p in range(n_fragments)]


def initial_last_sends(offsets: Sequence[int], sync_period: int, step: int = 0) -> list[int]:
    """Virtual "last send" steps that make fragment p first due at ``step + o_p``
    (``step + H`` when o_p = 0), i.e. the Streaming DiLoCo stagger."""
    return [step + (o - sync_period if o > 0 else 0) for o in offsets]


def due_fragments(step: int, last_send: Sequence[int], sync_period: int,
                  joining: Collection[int] = ()) -> list[int]:
    """Fragments to send after inner step ``step`` (1-based count of completed steps).

    Fragment p is due H steps after its last send; fragments in ``joining`` (an open round
    this learner decided to join, see docs/ARCHITECTURE.md) are due now. Counting from the
    last send rather than from a fixed phase lets a learner that joined a round early stay in
    phase with that round.
    """
    return [p for p, last in enumerate(last_send)
            if step - last >= sync_period or p in joining]


def shard_of(fragment: int, n_shards: int) -> int:
    """Owning syncer shard of a fragment: round robin, p mod S."""
    return fragment % n_shards


def fragments_of_shard(shard: int, n_fragments: int, n_shards: int) -> list[int]:
    """Fragments owned by ``shard``."""
    return [p for p in range(n_fragments) if shard_of(p, n_shards) == shard]
