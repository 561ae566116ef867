"""One compilation per program: processes that share a persistent compilation cache take
turns at their first compile, so the first one compiles and the rest load its executable.

The M learners of a local run start together and trace the same inner step. Compiling it costs
each of them seconds of CPU (about 2 s of one core for the tiny preset), and with every process
compiling at once on a few cores a fresh run spent its first seconds compiling M copies of one
program (docs/SCALE.md, "Where a run's wall clock goes"). JAX's persistent cache
(``jax_compilation_cache_dir``) only helps those that start compiling after an entry is
written, and it writes entries without a lock, so a process may read another's half-written
file.

:func:`compile_turn` wraps a first call that compiles: the first process to arrive holds an
exclusive ``flock`` on ``<cache dir>/.ddiloco-compile.lock`` while it compiles (JAX writes the
cache entry before the call returns); the others wait on the lock without using CPU, then
compile too, now from the cache. A holder that dies releases the lock with its descriptor
(the kernel's), and a waiter gives up waiting after ``timeout_s`` and compiles on its own, so a
wedged process costs the others that long at most, never the run.

Cost: one open and two ``flock`` calls per first call when nobody else compiles; a waiter
waits at most one compilation (the holder's). Processes that compile different programs into
one cache (two runs sharing it) also take turns: each waits for at most the other's compile.
"""

from __future__ import annotations

import fcntl
import logging
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

#: the lock file in the cache directory
LOCK_NAME = ".ddiloco-compile.lock"
#: how long a waiter waits for the holder, seconds (a compile of the tiny preset takes about 2 s)
DEFAULT_TIMEOUT_S = 120.0
#: how often a waiter looks whether the holder is done, seconds
POLL_S = 0.02

log = logging.getLogger(__name__)


#: JAX's monitoring events for a persistent-cache lookup that found an entry, and one that
#: did not (the program is then compiled and written)
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
CACHE_MISS_EVENT = "/jax/compilation_cache/cache_misses"
_lookups = {"hits": 0, "misses": 0}
_listening = False


def _count_lookup(event: str, **_: Any) -> None:
    if event == CACHE_HIT_EVENT:
        _lookups["hits"] += 1
    elif event == CACHE_MISS_EVENT:
        _lookups["misses"] += 1


def cache_lookups() -> tuple[int, int]:
    """This process's persistent-cache lookups so far: (entries found, entries missed and
    compiled), counted from JAX's monitoring events once the first call has registered the
    counter (before it: none are counted). What tells a first call that loaded another
    process's executable from one that compiled: the lock's turn does not (a process that
    arrives after the holder is done gets the free lock and loads)."""
    global _listening
    if not _listening:
        import jax.monitoring

        jax.monitoring.register_event_listener(_count_lookup)
        _listening = True
    return _lookups["hits"], _lookups["misses"]


def cache_dir() -> Path | None:
    """This process's JAX persistent compilation cache directory (None: no cache, or JAX not
    imported yet: a process that has not set JAX up compiles nothing worth sharing)."""
    jax = sys.modules.get("jax")
    if jax is None:
        return None
    path = jax.config.jax_compilation_cache_dir
    return Path(path) if path else None


@contextmanager
def compile_turn(directory: Path | None, timeout_s: float = DEFAULT_TIMEOUT_S, *,
                 monotonic: Callable[[], float] = time.monotonic,
                 sleep: Callable[[float], None] = time.sleep) -> Iterator[str]:
    """Run the block (a first call that compiles) in turn with the other processes that share
    the compilation cache in ``directory``.

    Args:
        directory: the persistent compilation cache (:func:`cache_dir`); None runs the block
            at once.
        timeout_s: the longest wait for another process's compile, seconds.
        monotonic, sleep: the wait's clock and sleep, seconds (injectable for tests).

    Yields:
        How this process got its turn: ``"first"`` (it holds the lock: it compiles and writes
        the cache entry), ``"after"`` (another process compiled first), ``"timeout"`` (the
        holder took longer than ``timeout_s``), ``"unshared"`` (no cache directory, or its lock
        file cannot be opened).
    """
    if directory is None:
        yield "unshared"
        return
    try:
        fd = os.open(directory / LOCK_NAME, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as exc:
        log.debug("compilation cache lock unavailable (%s): compiling at once", exc)
        yield "unshared"
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            pass
        else:
            try:
                yield "first"
            finally:
                fcntl.flock(fd, fcntl.LOCK_UN)
            return
        how = _wait_turn(fd, timeout_s, monotonic, sleep)
        yield how
    finally:
        os.close(fd)


def _wait_turn(fd: int, timeout_s: float, monotonic: Callable[[], float],
               sleep: Callable[[float], None]) -> str:
    """Wait until no process holds the lock exclusively (``"after"``) or ``timeout_s`` passed
    (``"timeout"``). A shared lock taken and dropped at once: waiters never hold it, so they
    do not keep each other out."""
    deadline = monotonic() + timeout_s
    while True:
        try:
            fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
        except BlockingIOError:
            if monotonic() >= deadline:
                log.warning("another process has compiled for %.0f s: compiling without its "
                            "cache entry", timeout_s)
                return "timeout"
            sleep(POLL_S)
            continue
        fcntl.flock(fd, fcntl.LOCK_UN)
        return "after"
