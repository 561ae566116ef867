"""Garbage collection of fragment objects (DESIGN §3, "blobs"): the value, momentum and record
objects of versions that left a fragment's kept window, deleted on a background thread.

A publish removes the old versions' pointers from Redis in its own script; the objects they
pointed at go after, here, in publish order. Orphans of publishes that crashed or were refused
go with them: a collection lists the fragment's objects and deletes every one whose version is
at or below the window's edge (:func:`~ddiloco.store.objects.object_version`).
"""

from __future__ import annotations

import logging
from concurrent.futures import Future, ThreadPoolExecutor

from ddiloco.pipeline.errors import StoreError
from ddiloco.store.objects import ObjectBlobs, ObjectStoreUnavailable, object_version

__all__ = ["Collector"]

log = logging.getLogger(__name__)


class Collector:
    """Deletes the objects of versions that left the kept window, one run's, in order.

    Args:
        run_id: the run whose objects it deletes (their paths start with it).
    """

    def __init__(self, run_id: str) -> None:
        self.run_id = run_id
        self._pool: ThreadPoolExecutor | None = None
        self._pending: list[Future[None]] = []

    def later(self, objs: ObjectBlobs, p: int, upto: int) -> None:
        """:meth:`collect` on a background thread, in publish order. Deleting a
        fragment-sized file takes tens of milliseconds (the file system frees its extents:
        0.04-0.05 s for 336 MB, a seventh of that publish), which neither the new version's
        readers nor its writer need to wait for. Pending collections finish before
        the store's ``object_paths``, ``flush_run`` and ``wait_collected`` return; one that a
        process exiting mid-collection leaves undone is done by the fragment's next publish,
        which collects every version ``<= upto``."""
        if upto < 0:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ddl-collect")
        self._pending = [f for f in self._pending if not f.done()]
        self._pending.append(self._pool.submit(self.collect, objs, p, upto))

    def wait(self) -> None:
        """Wait for the collections :meth:`later` started."""
        pending, self._pending = self._pending, []
        for future in pending:
            future.result()

    def collect(self, objs: ObjectBlobs, p: int, upto: int) -> None:
        """Delete fragment ``p``'s value and momentum objects of versions ``<= upto`` (left
        the kept window), orphans of crashed or refused publishes included. Best effort: an
        unavailable object store leaves them for the next publish."""
        if upto < 0:
            return
        try:
            old = [path for path in objs.list(f"{self.run_id}/f{p}")
                   if (v := object_version(path)) is not None and v <= upto]
            objs.delete(old)
        except (ObjectStoreUnavailable, StoreError) as exc:
            log.warning("fragment %d: garbage collection postponed: %s", p, exc)
