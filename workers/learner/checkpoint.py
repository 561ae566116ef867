"""A learner's checkpoint: inner optimizer state (by tree path), step, data position, counters
and the run id.

Written with orbax's ``CheckpointManager`` (atomic step directories, the newest two kept,
asynchronous writes so the inner loop does not wait on the disk). Restored *by tree path*
against the optimizer state the learner just built: a checkpoint whose tree differs (another
optimizer, another model) raises :class:`CheckpointMismatch` naming the paths that differ,
instead of loading leaves into the wrong places. The parameters themselves are not in it: a
learner rejoins from the global versions in the store (DESIGN §2). A checkpoint written for
another run (a learner started with another run's ``--run-dir``) is refused with both run ids
(:class:`CheckpointOfAnotherRun`) before any of it is loaded.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from ddiloco.pipeline.errors import DDilocoError


class CheckpointMismatch(DDilocoError):
    """The checkpoint's optimizer-state tree differs from the learner's (paths listed)."""


class CheckpointOfAnotherRun(CheckpointMismatch):
    """The checkpoint was written by a learner of another run (both run ids named)."""


def _paths(tree: Any) -> list[str]:
    import jax

    from ddiloco.workers.task.api import path_name

    return [path_name(p) for p, _ in jax.tree_util.tree_flatten_with_path(tree)[0]]


#: orbax writes this file last into a finalized step directory
_FINALIZED = "_CHECKPOINT_METADATA"


def remove_torn_steps(directory: Path) -> list[str]:
    """Delete step directories a ``kill -9`` tore: orbax finalizes a step by renaming a
    temporary directory (atomic) but deletes old steps file by file, so a learner killed while
    dropping an old step leaves ``<step>/`` without its metadata, which orbax would then take
    for a checkpoint. Returns the names removed.

    Only call this while no save is in flight (at start-up).
    """
    import shutil

    removed = []
    if directory.is_dir():
        for child in directory.iterdir():
            if child.name.isdigit() and child.is_dir() and not (child / _FINALIZED).exists():
                shutil.rmtree(child, ignore_errors=True)
                removed.append(child.name)
    return sorted(removed)


class LearnerCheckpoint:
    """Save and restore one learner's state under ``directory``.

    Args:
        directory: e.g. ``<run_dir>/learners/learner-0/ckpt``; created when needed.
        keep: how many checkpoints to keep (the newest).
        run_id: the run this learner trains: written into every checkpoint, and a checkpoint
            of another run is refused on restore (None: neither).
    """

    def __init__(self, directory: Path, keep: int = 2, run_id: str | None = None) -> None:
        import logging

        import orbax.checkpoint as ocp

        # orbax logs every save step at INFO: a learner saving every 100 steps would drown
        # its own log.
        logging.getLogger("absl").setLevel(logging.WARNING)
        self._ocp = ocp
        self.directory = Path(directory).resolve()
        self.run_id = run_id
        self.removed = remove_torn_steps(self.directory)
        self.manager = ocp.CheckpointManager(
            self.directory,
            options=ocp.CheckpointManagerOptions(max_to_keep=keep,
                                                 enable_async_checkpointing=True, create=True,
                                                 cleanup_tmp_directories=True),
            item_handlers={"state": ocp.StandardCheckpointHandler(),
                           "meta": ocp.JsonCheckpointHandler()})

    def save(self, step: int, opt_state: Any, meta: dict[str, Any]) -> None:
        """Start writing the checkpoint of ``step`` (returns before the disk write ends;
        :meth:`wait` waits). ``meta``: JSON-able counters (data position, tokens, versions).
        A second save at the same step is skipped. The run id is added to ``meta``."""
        ocp = self._ocp
        if self.manager.latest_step() == step:
            return
        if self.run_id is not None:
            meta = {**meta, "run_id": self.run_id}
        self.manager.save(step, args=ocp.args.Composite(
            state=ocp.args.StandardSave(opt_state), meta=ocp.args.JsonSave(meta)))

    def wait(self) -> None:
        """Block until pending writes are on disk."""
        self.manager.wait_until_finished()

    def restore(self, template: Any) -> tuple[Any, dict[str, Any]] | None:
        """The newest checkpoint's optimizer state (shaped, placed and typed like
        ``template``) and meta, or None if there is none.

        Raises:
            CheckpointOfAnotherRun: the checkpoint carries another run id than this one's.
            CheckpointMismatch: the stored tree's paths differ from ``template``'s.
        """
        import jax

        ocp = self._ocp
        step = self.manager.latest_step()
        if step is None:
            return None
        if self.run_id is not None:
            # The meta alone first: nothing of another run's state is loaded.
            meta = self.manager.restore(step, args=ocp.args.Composite(
                meta=ocp.args.JsonRestore()))["meta"]
            theirs = meta.get("run_id")
            # A checkpoint without a run id predates them: it is taken as this run's.
            if theirs is not None and theirs != self.run_id:
                raise CheckpointOfAnotherRun(
                    f"checkpoint {self.directory}/{step} belongs to run {theirs!r}, not to "
                    f"this learner's run {self.run_id!r}: give the learner the --run-dir of "
                    f"run {self.run_id!r}, or move the directory away to start it fresh")
        stored = self.manager.item_metadata(step)["state"]
        have, want = _paths(stored), _paths(template)
        if have != want:
            missing = sorted(set(want) - set(have))[:5]
            extra = sorted(set(have) - set(want))[:5]
            raise CheckpointMismatch(
                f"checkpoint {self.directory}/{step}: its optimizer state does not match this "
                f"learner's (another model or optimizer?); missing paths {missing}, unexpected "
                f"paths {extra}. Move the directory away to start this learner fresh.")
        abstract = jax.tree_util.tree_map(ocp.utils.to_shape_dtype_struct, template)
        try:
            got = self.manager.restore(step, args=ocp.args.Composite(
                state=ocp.args.StandardRestore(abstract), meta=ocp.args.JsonRestore()))
        except ValueError as exc:
            raise CheckpointMismatch(f"checkpoint {self.directory}/{step}: {exc}") from exc
        return got["state"], dict(got["meta"])

    def close(self) -> None:
        """Finish pending writes and release the manager."""
        self.manager.wait_until_finished()
        self.manager.close()
