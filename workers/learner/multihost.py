"""Learners that span several processes (hosts) with ``jax.distributed``.

One learner = N processes = one global ``jax.sharding.Mesh`` over all their devices. Process 0,
the **leader**, is the learner the run sees: it registers, talks to the shards and the store,
decides adoptions and sends outer gradients. The others, **followers**, only compute: they run
the same jitted inner steps on their devices and follow the leader's decisions, exchanged once
per inner step in lockstep (:meth:`HostGroup.share`): a small header (stop flag, which
fragments changed), then the new values of those fragments. Every process calls the same
collectives in the same order; checkpoints are written by all of them together (orbax).

Parameters are replicated across processes (``run.sharding = replicated``), so the leader
gathers a due fragment from its own devices without a collective.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from ddiloco.pipeline.errors import ConfigError
from ddiloco.pipeline.fragments import FragmentLayout


@dataclass(frozen=True)
class Distributed:
    """How to join a multi-process learner (``jax.distributed.initialize`` arguments).

    Attributes:
        coordinator: ``host:port`` of process 0's coordination service.
        num_processes: N, the processes of this learner.
        process_id: this process, in [0, N).
    """

    coordinator: str
    num_processes: int
    process_id: int

    def __post_init__(self) -> None:
        if self.num_processes < 1 or not 0 <= self.process_id < self.num_processes:
            raise ConfigError(f"--process-id {self.process_id} of --num-processes "
                              f"{self.num_processes}: need 0 <= id < N")
        host, sep, port = self.coordinator.rpartition(":")
        if not sep or not host or not port.isdigit():
            raise ConfigError(f"--coordinator {self.coordinator!r}: expected host:port")


def initialize(d: Distributed) -> None:
    """Join the learner's process group; call before the first JAX computation. On CPU the
    cross-process collectives use gloo."""
    import os

    import jax

    if os.environ.get("JAX_PLATFORMS", "cpu") == "cpu":
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(d.coordinator, num_processes=d.num_processes,
                               process_id=d.process_id)


class HostGroup:
    """The lockstep exchange between a multi-process learner's leader and followers.

    Args:
        layout: the run's fragment layout (followers allocate receive buffers from it); may
            be set later, once the manifest is read, but before :meth:`share`.
    """

    def __init__(self, layout: FragmentLayout | None = None) -> None:
        import jax

        self.layout: FragmentLayout = layout  # type: ignore[assignment]
        self.index = jax.process_index()
        self.count = jax.process_count()

    @property
    def leader(self) -> bool:
        """True in process 0."""
        return self.index == 0

    def share(self, stop: bool, fragments: Mapping[int, Sequence[np.ndarray]]
              ) -> tuple[bool, dict[int, list[np.ndarray]]]:
        """The leader's stop flag and new fragment values, on every process.

        Args:
            stop: the leader's; ignored on followers.
            fragments: fragment -> float32 tensors (payload order); the leader's, ignored on
                followers.

        Returns:
            (stop, fragments) as the leader gave them.
        """
        from jax.experimental.multihost_utils import broadcast_one_to_all

        P = self.layout.n_fragments
        header = np.zeros(P + 1, np.int32)
        if self.leader:
            header[0] = int(stop)
            for p in fragments:
                header[1 + p] = 1
        header = np.asarray(broadcast_one_to_all(header))
        out: dict[int, list[np.ndarray]] = {}
        for p in np.flatnonzero(header[1:]).tolist():
            mine: Any = ([np.asarray(t, np.float32) for t in fragments[p]] if self.leader
                         else [np.zeros(s, np.float32) for s in self.layout.shapes(p)])
            out[p] = [np.asarray(t, np.float32) for t in broadcast_one_to_all(mine)]
        return bool(header[0]), out

    def share_ints(self, values: Sequence[int]) -> list[int]:
        """The leader's integers (e.g. step and data position) on every process."""
        from jax.experimental.multihost_utils import broadcast_one_to_all

        got = broadcast_one_to_all(np.asarray(values, np.int32))
        return [int(v) for v in np.asarray(got)]
