"""The worker roles of a run, with the classes of its mode: the one place that chooses them.

A run's manifest says its mode (``run.mode``): ``diloco`` (Decoupled DiLoCo, DESIGN §2) or
``dp`` (the data-parallel baseline). The DiLoCo learner and shard
(:mod:`ddiloco.workers.learner.core`,
:mod:`ddiloco.workers.syncer.core`) know nothing of the baseline, and the baseline's variants
(:mod:`ddiloco.workers.dp`) only override their hooks; this module, above both, picks the class and
starts the role's process. ``python -m ddiloco.workers learner|syncer`` (:mod:`ddiloco.workers.cli`)
comes here.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING, Any

from ddiloco.store.base import ParameterStore
from ddiloco.workers.run.manifest import wait_for_manifest

if TYPE_CHECKING:
    from ddiloco.workers.learner.core import Learner
    from ddiloco.workers.learner.standby import Prepared
    from ddiloco.workers.syncer.core import ShardCore

__all__ = ["learner_class", "make_shard_core", "run_learner", "serve", "shard_class"]


def learner_class(manifest: dict[str, Any]) -> type[Learner]:
    """The learner of the manifest's mode: :class:`ddiloco.workers.dp.DPLearner` for ``dp``,
    :class:`ddiloco.workers.learner.core.Learner` otherwise.

    Imported here, not at the top: a DiLoCo learner's process never loads the shard's merge
    code (numba and its JIT set-up), which a rejoin would otherwise wait for."""
    if manifest["mode"] == "dp":
        from ddiloco.workers.dp import DPLearner

        return DPLearner
    from ddiloco.workers.learner.core import Learner

    return Learner


def shard_class(manifest: dict[str, Any]) -> type[ShardCore]:
    """The shard core of the manifest's mode: :class:`ddiloco.workers.dp.DPShardCore` for ``dp``,
    :class:`ddiloco.workers.syncer.core.ShardCore` otherwise."""
    if manifest["mode"] == "dp":
        from ddiloco.workers.dp import DPShardCore

        return DPShardCore
    from ddiloco.workers.syncer.core import ShardCore

    return ShardCore


def make_shard_core(manifest: dict[str, Any], shard: int, store: ParameterStore,
                    epoch: int, **kwargs: Any) -> ShardCore:
    """The shard core of the manifest's mode (:func:`shard_class`) for shard ``shard`` at
    fencing epoch ``epoch``; ``kwargs`` go to its constructor (``clock``, ``name``)."""
    return shard_class(manifest)(manifest, shard, store, epoch, **kwargs)


def run_learner(store: ParameterStore, comms_store: ParameterStore, learner_id: str,
                run_dir: Path, max_steps: int | None = None, multiprocess: bool = False,
                metrics_port: int | None = None, prepared: Prepared | None = None,
                handed_over: float | None = None) -> int:
    """Process entry: run one learner of the run's mode (or, with ``multiprocess``, this
    process's part of a ``jax.distributed`` learner: :mod:`ddiloco.workers.learner.multihost`) to
    completion or
    SIGTERM (:func:`ddiloco.workers.learner.core.run`). ``prepared`` and ``handed_over``: a
    standby's warm task and the time of its handover
    (:mod:`ddiloco.workers.learner.standby`). Returns the exit code.

    Raises:
        StoreUnavailable: the run has no manifest after 60 s.
    """
    group = None
    if multiprocess:
        from ddiloco.workers.learner.multihost import HostGroup

        group = HostGroup()
    from ddiloco.workers.learner import core as learner_process

    cls = learner_class(wait_for_manifest(store))
    return learner_process.run(cls, store, comms_store, learner_id, run_dir, max_steps,
                               group=group, metrics_port=metrics_port, prepared=prepared,
                               handed_over=handed_over)


def serve(store: ParameterStore, shard: int, *, bind_host: str = "127.0.0.1",
          advertise_host: str | None = None, pull_port: int = 0, pub_port: int = 0,
          metrics_port: int | None = None) -> int:
    """Process entry: run syncer shard ``shard`` with the core of the run's mode until
    SIGTERM/SIGINT (:func:`ddiloco.workers.syncer.server.serve`, which documents the arguments and
    errors). Returns the exit code."""
    from ddiloco.workers.syncer import server as shard_server

    return shard_server.serve(store, shard, make_core=make_shard_core, bind_host=bind_host,
                              advertise_host=advertise_host, pull_port=pull_port,
                              pub_port=pub_port, metrics_port=metrics_port)
