"""What every worker process shares: the run manifest, store blobs, JAX set-up, logging.

The manifest is written once per run (SET NX) by the first worker that has a configuration;
every later worker compares its schema hash and is refused on a mismatch
(:class:`pipeline.errors.ManifestMismatch`). A learner started with only a Redis URL and its
id reads everything it needs from it.
"""

from __future__ import annotations

import hashlib
import logging
import os
import time
from collections.abc import Sequence
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np

from ddiloco.pipeline import codec
from ddiloco.pipeline.errors import ConfigError, StoreUnavailable
from ddiloco.pipeline.fragments import FragmentLayout
from ddiloco.pipeline.wire import FORMAT_VERSION
from ddiloco.workers.config import Config, config_from_dict, schema_hash

log = logging.getLogger("ddiloco")

#: Codec of value and momentum blobs in the store: exact.
BLOB_CODEC = "fp32"


def setup_logging(name: str, level: str = "INFO") -> logging.Logger:
    """Plain, timestamped logging to stderr for one worker process."""
    logging.basicConfig(
        level=getattr(logging, level.upper(), logging.INFO),
        format=f"%(asctime)s {name} %(levelname)s %(message)s",
    )
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


def setup_jax(cache_dir: Path | None, xla_threads: int = 1, cpu: int | None = None) -> None:
    """Prepare this process for JAX; call before the first JAX computation. The platform is
    ``JAX_PLATFORMS`` if set, else :func:`default_platform`.

    ``xla_threads == 1`` makes XLA single-threaded and keeps freed memory in the heap
    (:func:`workers.model.configure_cpu_runtime`): several learners share few cores, and
    oversubscribed thread pools and per-step page faults both cost more than one thread each.
    ``cpu`` pins the process to that core. The persistent compilation cache in ``cache_dir``
    makes a restarted worker skip compilation.
    """
    os.environ.setdefault("JAX_PLATFORMS", default_platform())
    import jax

    from ddiloco.workers.model import configure_cpu_runtime

    if xla_threads == 1 and os.environ["JAX_PLATFORMS"] == "cpu":
        configure_cpu_runtime(cpu=cpu, single_thread=True, keep_freed_memory=True)
    if cache_dir is not None:
        cache_dir.mkdir(parents=True, exist_ok=True)
        jax.config.update("jax_compilation_cache_dir", str(cache_dir))
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)


def build_manifest(cfg: Config, run_id: str, task: Any = None) -> dict[str, Any]:
    """The run manifest: fragment layout over the task's leaf paths, hyper-parameters and
    schema hash. The syncer needs nothing else (and the initial values,
    :func:`publish_initial`) to serve the task's fragments.

    Args:
        cfg: the run configuration.
        run_id: the run.
        task: the :class:`workers.task.Task` (None: :func:`workers.task.build_task` of ``cfg``).

    Raises:
        ConfigError: the layout is impossible for the model (e.g. more fragments than tensors),
            or the task cannot be built (``TaskError``).
    """
    from ddiloco.workers.task import build_task

    if task is None:
        task = build_task(cfg)
    tree = task.tree()
    layout = tree.layout(cfg.sync.fragments)
    if cfg.run.mode == "dp" and cfg.model.task is not None:
        raise ConfigError("run.mode = dp: the data-parallel baseline's shards apply the "
                          "built-in AdamW of the train section, so it trains the built-in "
                          "model only (model.task unset)")
    core = {
        "format_version": FORMAT_VERSION,
        "mode": cfg.run.mode,
        "task": {"name": task.name, "ref": cfg.model.task, "params": tree.n_values(),
                 "tokens_per_batch": int(task.tokens_per_batch)},
        "model": asdict(cfg.model_config_obj()) if cfg.model.task is None else None,
        "layout": layout.to_json(),
        "embedding": task.embedding_paths(),
        "sync": cfg.sync.model_dump(),
        "train": cfg.train.model_dump(exclude={"steps", "checkpoint_every"}),
        "learners_dp": cfg.run.learners if cfg.run.mode == "dp" else None,
    }
    return {
        **core,
        "run_id": run_id,
        "config": cfg.model_dump(mode="json"),
        "schema_hash": schema_hash(core),
        "created_at": time.time(),
    }


def publish_initial(store: Any, manifest: dict[str, Any], task: Any,
                    fragments: Sequence[int] | None = None) -> None:
    """Store the task's initial values per fragment, once (the init step: shards write them
    as version 0 without running model code). A fragment that has them already keeps them.

    Raises:
        ConfigError: the task's tree does not match the manifest's layout.
    """
    from ddiloco.workers.task import initial_values

    layout = manifest_layout(manifest)
    values = initial_values(task)
    for p in range(layout.n_fragments) if fragments is None else fragments:
        try:
            tensors = [values[n] for n in layout.names(p)]
        except KeyError as exc:
            raise ConfigError(f"the task has no parameter {exc} of the run's manifest: "
                              "the stored run was made with another model") from exc
        store.put_initial(p, encode_blob(tensors))


def init_run(store: Any, cfg: Config, run_id: str,
             fragments: Sequence[int] | None = None) -> dict[str, Any]:
    """The init step of a run: build the task, store the manifest (once) and the initial
    values of ``fragments`` (default all). Returns the stored manifest.

    Raises:
        ConfigError: a bad task or layout; ``ManifestMismatch`` if the run exists with another
            configuration.
    """
    from ddiloco.workers.task import build_task

    task = build_task(cfg)
    manifest = store.put_manifest(build_manifest(cfg, run_id, task))
    publish_initial(store, manifest, task, fragments)
    return dict(manifest)


def stored_initial(store: Any, layout: FragmentLayout, fragments: Sequence[int],
                   timeout_s: float = 60.0) -> dict[str, np.ndarray]:
    """The initial values of ``fragments`` from the store, ``{path: float32 array}``; waits
    for the init step (:func:`init_run`) up to ``timeout_s``.

    Raises:
        StoreError: no initial values after ``timeout_s`` seconds.
    """
    from ddiloco.pipeline.errors import StoreError

    deadline = time.monotonic() + timeout_s
    out: dict[str, np.ndarray] = {}
    for p in fragments:
        while (blob := store.get_initial(p)) is None:
            if time.monotonic() > deadline:
                raise StoreError(f"fragment {p} has no initial value after {timeout_s:.0f} s: "
                                 "run the init step (`ddiloco run`, or `ddiloco syncer "
                                 "--config`) first")
            time.sleep(0.2)
        out.update(zip(layout.names(p), decode_blob(blob, layout.shapes(p)), strict=True))
    return out


def tokens_per_batch(manifest: dict[str, Any]) -> int:
    """Tokens of one learner batch (one inner step) of the run."""
    return int(manifest["task"]["tokens_per_batch"])


def manifest_config(manifest: dict[str, Any]) -> Config:
    """The full configuration stored with a manifest."""
    return config_from_dict(manifest["config"])


def manifest_layout(manifest: dict[str, Any]) -> FragmentLayout:
    """The fragment layout stored with a manifest."""
    return FragmentLayout.from_json(manifest["layout"])


def wait_for_manifest(store: Any, timeout_s: float = 60.0) -> dict[str, Any]:
    """Poll the store until the run manifest exists.

    Raises:
        StoreUnavailable: no manifest after ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        m = store.get_manifest()
        if m is not None:
            return dict(m)
        if time.monotonic() > deadline:
            raise StoreUnavailable(
                f"run {store.run_id!r} has no manifest after {timeout_s:.0f} s: start a syncer "
                "(or `ddiloco run`) with a configuration first"
            )
        time.sleep(0.2)


def encode_blob(tensors: Sequence[np.ndarray]) -> bytes:
    """Store blob of a fragment's tensors (fp32, zstd, checksummed)."""
    return codec.encode(tensors, BLOB_CODEC)


def decode_blob(blob: bytes, shapes: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
    """Inverse of :func:`encode_blob`, bounded by the layout's shapes."""
    return codec.decode(blob, shapes, BLOB_CODEC)


def digest(tensors: Sequence[np.ndarray]) -> str:
    """Short content hash of float32 tensors (to prove two copies are bit-identical)."""
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        h.update(np.ascontiguousarray(t, dtype=np.float32).tobytes())
    return h.hexdigest()


def fragment_tensors(params: dict[str, Any], layout: FragmentLayout, p: int) -> list[np.ndarray]:
    """Host copies (float32, owned) of fragment ``p``'s tensors in payload order."""
    return [np.array(params[n], dtype=np.float32, copy=True) for n in layout.names(p)]


def heartbeat_ttl_s(base_ttl_s: float, period_s: float, recent_tick_s: Sequence[float]) -> float:
    """TTL for a learner's heartbeat entry that a slow control path cannot make lapse.

    A heartbeat tick is one round trip to the store (the entry is written on the way there);
    the next tick starts ``period_s`` after this one's reply. Two writes therefore arrive at
    most ``d_k + period_s + d_{k+1}`` apart, where ``d`` is a tick's duration. On a congested
    link ``d`` grows with the queue (seconds on a saturated 10 Mbit/s link with deep buffers),
    so the TTL is ``max(base_ttl_s, period_s + 3 * max(recent_tick_s))``: twice the worst
    recent tick, plus half again for a queue that is still growing. A dead learner writes no
    more, so its entry still lapses within one such TTL.

    Args:
        base_ttl_s: configured TTL (``run.learner_ttl_s``), seconds: the floor.
        period_s: heartbeat period (``run.heartbeat_s``), seconds.
        recent_tick_s: durations of the last ticks, seconds (any length, may be empty).

    Returns:
        The TTL, seconds.
    """
    worst = max(recent_tick_s, default=0.0)
    return max(base_ttl_s, period_s + 3.0 * worst)


class Ticker:
    """Calls ``fn`` every ``period_s`` seconds on a daemon thread until :meth:`stop`.

    Liveness (learner TTL heartbeats, shard lease renewal) must not depend on the main loop:
    a JIT compilation or a slow step can block it for longer than a TTL.
    Exceptions of ``fn`` are logged and the ticker goes on (a transient Redis error must not
    end liveness for good).
    """

    def __init__(self, period_s: float, fn: Any, name: str) -> None:
        import threading

        self.period_s = period_s
        self.fn = fn
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    def start(self) -> Ticker:
        """Start ticking (the first call happens at once)."""
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.fn()
            except Exception as exc:  # logged; liveness must keep trying
                log.warning("%s: %s", self._thread.name, exc)
            self._stop.wait(self.period_s)

    def stop(self) -> None:
        """Stop and join the thread."""
        self._stop.set()
        if self._thread.is_alive():
            self._thread.join(timeout=5)


def opt_state_bytes(state: Any) -> bytes:
    """Serialise an optax state (safetensors; keys are the leaves' tree paths).

    The data-parallel baseline stores each fragment's AdamW state with its checkpointed value, so
    a restarted job resumes bit-exactly (DESIGN §2, baseline). Nothing is pickled.
    """
    import jax
    from safetensors.numpy import save

    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    return save({jax.tree_util.keystr(path): np.ascontiguousarray(np.asarray(leaf))
                 for path, leaf in flat})


def opt_state_from_parts(template: Any, parts: Sequence[bytes]) -> Any:
    """Build an optax state shaped like ``template`` from the :func:`opt_state_bytes` of
    several fragments (their leaves are keyed by parameter name; shared counters by path).

    Raises:
        DDilocoError: a leaf of ``template`` is in none of ``parts``, or has another shape.
    """
    import jax
    from safetensors.numpy import load

    from ddiloco.pipeline.errors import DDilocoError

    found: dict[str, np.ndarray] = {}
    for part in parts:
        found.update(load(part))
    flat, treedef = jax.tree_util.tree_flatten_with_path(template)
    leaves = []
    for path, leaf in flat:
        key = jax.tree_util.keystr(path)
        # safetensors stores a 0-d array as shape (1,): compare sizes, then restore the shape.
        if key not in found or found[key].size != np.size(leaf):
            raise DDilocoError(f"optimizer state leaf {key} missing or of another shape")
        leaves.append(jax.numpy.asarray(found[key].reshape(np.shape(leaf))))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def dp_step_of(meta: dict[str, Any]) -> int:
    """The data-parallel step a stored version is the state after (-1: initial value)."""
    return int(meta.get("dp_step", -1))
