"""Process set-up of a worker: logging, the JAX platform, XLA threads, malloc and CPU affinity.

Everything here changes process-wide state and runs before the first JAX computation (a worker's
command line calls :func:`setup_jax` first). What a worker knows of its *run* (the manifest,
the init step) is in :mod:`ddiloco.workers.run.manifest`; store blobs are in
:mod:`ddiloco.workers.run.blobs`.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

__all__ = [
    "JAX_CACHE_SETTINGS",
    "LOG_LEVELS",
    "LOG_LEVEL_ENV",
    "SINGLE_THREAD_XLA_FLAGS",
    "configure_cpu_runtime",
    "default_platform",
    "log_level",
    "setup_jax",
    "setup_logging",
]

SINGLE_THREAD_XLA_FLAGS = "--xla_cpu_multi_thread_eigen=false"
"""XLA:CPU flag making GEMMs single-threaded (jax 0.10). ``intra_op_parallelism_threads`` is a
TensorFlow session option, not an XLA flag: XLA_FLAGS silently ignores it."""

#: The persistent compilation cache's thresholds (every entry is kept: a worker's programs are
#: few, and a restarted one should skip each compilation); :func:`setup_jax` adds the directory.
JAX_CACHE_SETTINGS: dict[str, str | float | int] = {
    "jax_persistent_cache_min_compile_time_secs": 0.0,
    "jax_persistent_cache_min_entry_size_bytes": 0,
}

# glibc mallopt parameters (malloc.h).
_M_TRIM_THRESHOLD, _M_MMAP_MAX, _M_ARENA_MAX = -1, -4, -8


#: The environment variable that carries a worker's log level (set by
#: :class:`ddiloco.workers.run.launch.LocalCluster` from ``tracking.log_level``, and by a worker
#: command's ``--log-level``).
LOG_LEVEL_ENV = "DDILOCO_LOG_LEVEL"

#: The levels ``--log-level`` and ``DDILOCO_LOG_LEVEL`` accept, lower case.
LOG_LEVELS = ("debug", "info", "warning", "error")


def log_level(level: str | None = None) -> int:
    """The :mod:`logging` level of ``level``, else of ``$DDILOCO_LOG_LEVEL``, else INFO.

    Raises:
        ConfigError: a level that is not one of :data:`LOG_LEVELS` (case-insensitive).
    """
    from ddiloco.pipeline.errors import ConfigError

    raw = level if level is not None else os.environ.get(LOG_LEVEL_ENV) or "info"
    if raw.lower() not in LOG_LEVELS:
        source = "--log-level" if level is not None else LOG_LEVEL_ENV
        raise ConfigError(f"{source} {raw!r}: not a log level; use one of "
                          f"{', '.join(LOG_LEVELS)}")
    return int(getattr(logging, raw.upper()))


def setup_logging(name: str, level: str | None = None) -> logging.Logger:
    """Plain, timestamped logging to stderr for one worker process at ``level`` (default:
    ``$DDILOCO_LOG_LEVEL``, else info; :func:`log_level`); returns the logger
    ``ddiloco.<name>``.

    Raises:
        ConfigError: an unknown level.
    """
    lvl = log_level(level)
    logging.basicConfig(level=lvl, format=f"%(asctime)s {name} %(levelname)s %(message)s")
    # basicConfig does nothing when the root logger has handlers already (a library imported
    # earlier, a test's log capture): the level is set either way.
    logging.getLogger().setLevel(lvl)
    return logging.getLogger(f"ddiloco.{name}")


def default_platform() -> str:
    """``cuda`` when this machine has an NVIDIA GPU (``/dev/nvidia0``) and jax's CUDA plugin
    is installed (``pip install 'ddiloco[cuda]'``), else ``cpu``: the JAX_PLATFORMS workers
    get unless ``run.platform`` or the environment says otherwise."""
    import importlib.util

    if not Path("/dev/nvidia0").exists():
        return "cpu"
    for mod in ("jax_plugins.xla_cuda12", "jax_cuda12_plugin", "jax_plugins.xla_cuda13",
                "jax_cuda13_plugin"):
        try:
            if importlib.util.find_spec(mod) is not None:
                return "cuda"
        except ModuleNotFoundError:
            continue
    return "cpu"


def pin_core(learner_id: str, pin: bool) -> int | None:
    """Core for learner ``name-<i>``: i mod usable cores (None when not pinning)."""
    if not pin or not hasattr(os, "sched_getaffinity"):
        return None
    cores = sorted(os.sched_getaffinity(0))
    tail = learner_id.rsplit("-", 1)[-1]
    return cores[int(tail) % len(cores)] if tail.isdigit() else None


def pins_itself(xla_threads: int, platform: str | None) -> bool:
    """Whether a learner pins itself to its core (:func:`setup_jax`): one XLA thread on the
    CPU. Elsewhere its threads are XLA's to place."""
    return xla_threads == 1 and platform == "cpu"


def pin_plan(current: Mapping[int, int | None], cores: Sequence[int]) -> dict[int, int]:
    """Cores for the learners still running, balanced with the fewest moves.

    Args:
        current: learner index -> the one core of ``cores`` it is pinned to, or None (not
            pinned to one of them: a process still starting, say).
        cores: the cores to spread over.

    Returns:
        learner index -> core: every core holds ``len(current) // len(cores)`` learners or
        one more; a learner stays where it is unless its core holds more than its share.
        With every learner of a run pinned by :func:`pin_core` (learner i on core i mod
        cores) nothing moves; once some have exited, the rest spread over every core again,
        instead of sharing the cores they started on while others idle (a run's uneven
        finish).

    >>> pin_plan({0: 0, 1: 1, 2: 0, 3: 1}, [0, 1])
    {0: 0, 2: 0, 1: 1, 3: 1}
    >>> pin_plan({1: 1, 3: 1}, [0, 1])  # learners 0 and 2 (core 0) are done
    {1: 1, 3: 0}
    >>> pin_plan({1: 1, 2: 0, 3: 1}, [0, 1])  # three on two cores: already balanced
    {2: 0, 1: 1, 3: 1}
    """
    if not cores:
        return {}
    base, extra = divmod(len(current), len(cores))
    on = {k: [i for i in sorted(current) if current[i] == k] for k in cores}
    # the fullest cores keep the extra learners: fewer moves
    by_load = sorted(cores, key=lambda k: (-len(on[k]), k))
    share = {k: base + (1 if j < extra else 0) for j, k in enumerate(by_load)}
    plan: dict[int, int] = {}
    moving = [i for i in sorted(current) if current[i] not in on]
    for k in cores:
        plan.update({i: k for i in on[k][:share[k]]})
        moving += on[k][share[k]:]
    free = [k for k in by_load for _ in range(share[k] - len(on[k][:share[k]]))]
    plan.update(zip(sorted(moving), free, strict=True))
    return plan


def repin(pid: int, cpu: int) -> bool:
    """Move every thread of process ``pid`` to core ``cpu`` (``sched_setaffinity`` per
    thread: a process's affinity is its threads'). False when the process is gone or the
    call is refused (nothing is raised: the process then stays where it ran)."""
    if not hasattr(os, "sched_setaffinity"):
        return False
    try:
        tids = [int(t) for t in os.listdir(f"/proc/{pid}/task")]
    except OSError:
        return False
    moved = False
    for tid in tids:
        try:
            os.sched_setaffinity(tid, {cpu})
            moved = True
        except OSError:  # a thread that ended meanwhile
            continue
    return moved


def setup_jax(cache_dir: Path | None, xla_threads: int = 1, cpu: int | None = None) -> None:
    """Prepare this process for JAX; call before the first JAX computation. The platform is
    ``JAX_PLATFORMS`` if set, else :func:`default_platform`.

    ``xla_threads == 1`` makes XLA single-threaded and keeps freed memory in the heap
    (:func:`configure_cpu_runtime`): several learners share few cores, and oversubscribed
    thread pools and per-step page faults both cost more than one thread each. ``cpu`` pins
    the process to that core. The persistent compilation cache in ``cache_dir`` makes a
    restarted worker skip compilation.

    JAX is not imported here: the settings go into the environment variables JAX reads when it
    is imported (:data:`JAX_CACHE_SETTINGS`), so a process that never uses JAX (a PyTorch
    learner) does not pay its import (about 1.1 s of CPU on a quiet core). In a process that
    has imported JAX already they are set through ``jax.config``.
    """
    os.environ.setdefault("JAX_PLATFORMS", default_platform())
    if pins_itself(xla_threads, os.environ["JAX_PLATFORMS"]):
        configure_cpu_runtime(cpu=cpu, single_thread=True, keep_freed_memory=True)
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        settings = {**JAX_CACHE_SETTINGS, "jax_compilation_cache_dir": str(cache_dir)}
        if "jax" in sys.modules:
            import jax

            for key, value in settings.items():
                jax.config.update(key, value)
        else:
            for key, value in settings.items():
                os.environ[key.upper()] = str(value)


def configure_cpu_runtime(
    cpu: int | None = None, single_thread: bool = True, keep_freed_memory: bool = True
) -> dict[str, Any]:
    """Set up a learner process for CPU training; call before the first JAX computation.

    Several learners share a few cores, so each should run one XLA thread:

    * ``single_thread``: append :data:`SINGLE_THREAD_XLA_FLAGS` to ``XLA_FLAGS`` (read when
      the CPU backend starts, i.e. at the first JAX computation).
    * ``cpu``: pin the process to that core (``os.sched_setaffinity``). The PjRt CPU client
      sizes its thread pool from the affinity mask, so this is what makes it one thread.
    * ``keep_freed_memory``: XLA:CPU allocates each step's temporaries (activations, tens of
      MiB) with malloc and frees them at the end of the step. glibc serves blocks above its
      mmap threshold (dynamic, at most 32 MiB) with fresh ``mmap`` pages, so every step page-
      faults its whole working set back in: measured 8.5k faults and about 15 ms of system time
      per step at B=4, L=128, 37k faults and 60 ms at B=16, L=128. ``mallopt(M_MMAP_MAX, 0)``,
      a huge ``M_TRIM_THRESHOLD`` and one arena make freed memory stay in the heap for reuse.
      glibc only; skipped elsewhere.

    Args:
        cpu: core to pin to; None leaves the affinity alone.
        single_thread: add the single-thread XLA flag.
        keep_freed_memory: tune glibc malloc as above.

    Returns:
        What was applied (for logging): ``xla_flags``, ``cpu``, ``malloc_tuned``, and
        ``backend_already_started`` (True means XLA_FLAGS came too late to matter).

    Raises:
        OSError: ``cpu`` is not a core this process may run on (``sched_setaffinity``).
    """
    started = False
    if "jax" in sys.modules:  # importing JAX only to ask would cost its import
        try:
            from jax._src import xla_bridge  # private, only to warn about a late call

            started = bool(xla_bridge.backends_are_initialized())
        except (ImportError, AttributeError):
            pass
    if single_thread:
        flags = os.environ.get("XLA_FLAGS", "")
        if SINGLE_THREAD_XLA_FLAGS not in flags:
            os.environ["XLA_FLAGS"] = f"{flags} {SINGLE_THREAD_XLA_FLAGS}".strip()
    if cpu is not None:
        os.sched_setaffinity(0, {cpu})
    tuned = False
    if keep_freed_memory:
        libc_name = ctypes.util.find_library("c")
        libc = ctypes.CDLL(libc_name) if libc_name else None
        if libc is not None and hasattr(libc, "mallopt") and hasattr(libc, "gnu_get_libc_version"):
            tuned = bool(
                libc.mallopt(_M_MMAP_MAX, 0)
                and libc.mallopt(_M_TRIM_THRESHOLD, 2**31 - 1)
                and libc.mallopt(_M_ARENA_MAX, 1)
            )
    return {
        "xla_flags": os.environ.get("XLA_FLAGS", ""),
        "cpu": cpu,
        "malloc_tuned": tuned,
        "backend_already_started": started,
    }
