"""The run manifest: written once by the init step, read by every worker of the run.

The manifest is written once per run (SET NX) by the first worker that has a configuration;
every later worker compares its schema hash and is refused on a mismatch
(:class:`ddiloco.pipeline.errors.ManifestMismatch`). A learner started with only a Redis URL and its
id reads everything it needs from it (DESIGN §3): the fragment layout over the task's leaf
paths, the hyper-parameters and the full configuration. The init step also stores the task's
initial values per fragment, so shards write version 0 without running model code.
"""

from __future__ import annotations

import functools
import math
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict
from typing import Any

import numpy as np

from ddiloco.pipeline.errors import ConfigError, StoreError, StoreUnavailable
from ddiloco.pipeline.fragments import FragmentLayout
from ddiloco.pipeline.waiting import poll_until
from ddiloco.pipeline.wire import FORMAT_VERSION
from ddiloco.store.base import ParameterStore
from ddiloco.workers.run.blobs import decode_blob, encode_blob
from ddiloco.workers.run.config import EMBEDDED_S3, Config, config_from_dict, schema_hash
from ddiloco.workers.task.api import Task
from ddiloco.workers.task.loader import build_task
from ddiloco.workers.task.torch_api import TorchTask

__all__ = [
    "TRAIN_OUTSIDE_SCHEMA",
    "amend_manifest",
    "build_manifest",
    "check_blob_location",
    "init_run",
    "manifest_config",
    "manifest_layout",
    "publish_initial",
    "stored_initial",
    "tokens_per_batch",
    "wait_for_manifest",
]


#: train fields left out of the schema hash: a resume may change them
#: (:mod:`ddiloco.workers.run.resume`)
TRAIN_OUTSIDE_SCHEMA = frozenset({"steps", "checkpoint_every"})


def build_manifest(cfg: Config, run_id: str,
                   task: Task | TorchTask | None = None) -> dict[str, Any]:
    """The run manifest: fragment layout over the task's leaf paths, hyper-parameters and
    schema hash. The syncer needs nothing else (and the initial values,
    :func:`publish_initial`) to serve the task's fragments.

    Args:
        cfg: the run configuration.
        run_id: the run.
        task: the run's task (None: :func:`ddiloco.workers.task.loader.build_task` of ``cfg``).

    Raises:
        ConfigError: the layout is impossible for the model (e.g. more fragments than tensors),
            or the task cannot be built (``TaskError``).
    """
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
        "train": cfg.train.model_dump(exclude=set(TRAIN_OUTSIDE_SCHEMA)),
        "learners_dp": cfg.run.learners if cfg.run.mode == "dp" else None,
    }
    return {
        **core,
        "run_id": run_id,
        # the unit of the task's loss (report, live view, status); outside the schema hash:
        # it labels numbers, workers need not agree on it
        "loss_unit": task.loss_unit,
        "config": cfg.model_dump(mode="json"),
        "schema_hash": schema_hash(core),
        "created_at": time.time(),
    }


def publish_initial(store: ParameterStore, manifest: dict[str, Any], task: Task | TorchTask,
                    fragments: Sequence[int] | None = None) -> None:
    """Store the task's initial values per fragment, once (the init step: shards write them
    as version 0 without running model code). A fragment that has them already keeps them.

    Raises:
        ConfigError: the task's tree does not match the manifest's layout.
    """
    layout = manifest_layout(manifest)
    values = task.initial_values()
    for p in range(layout.n_fragments) if fragments is None else fragments:
        try:
            tensors = [values[n] for n in layout.names(p)]
        except KeyError as exc:
            raise ConfigError(f"the task has no parameter {exc} of the run's manifest: "
                              "the stored run was made with another model") from exc
        store.put_initial(p, encode_blob(tensors))


def init_run(store: ParameterStore, cfg: Config, run_id: str,
             fragments: Sequence[int] | None = None) -> dict[str, Any]:
    """The init step of a run: build the task, store the manifest (once) and the initial
    values of ``fragments`` (default all). Returns the stored manifest.

    Raises:
        ConfigError: a bad task or layout; ``ManifestMismatch`` if the run exists with another
            configuration.
    """
    task = build_task(cfg)
    built = build_manifest(cfg, run_id, task)
    check_blob_location(cfg, built)
    store.set_blob_location(cfg.store.blobs)
    manifest = store.put_manifest(built)
    publish_initial(store, manifest, task, fragments)
    return dict(manifest)


def amend_manifest(store: ParameterStore, updates: Mapping[str, Any]) -> dict[str, Any] | None:
    """Set configuration fields of the stored manifest (a resume's safe changes,
    :func:`ddiloco.workers.run.resume.check_resume`), so every worker that reads the manifest
    later, also one restarted by hand, sees them. Returns the new manifest, or None when the
    run has none yet (its init step writes the new values).

    The write is a compare-and-set on the stored manifest
    (:meth:`~ddiloco.store.base.VersionStore.update_manifest`): a manifest changed in between
    is read again.

    Args:
        updates: dotted field -> new value, e.g. ``{"train.steps": 1000}``.

    Raises:
        ConfigError: the amended configuration is invalid, or it would change the schema hash
            (an unsafe field).
        StoreUnavailable: Redis did not answer.
    """
    import json

    from ddiloco.workers.run.resume import resume_rule

    # The schema hash covers the stored top-level fields, which this leaves alone: a field
    # inside it must never change under the same hash.
    unsafe = [path for path in updates if not resume_rule(path)[0]]
    if unsafe:
        raise ConfigError(f"run {store.run_id!r}: {', '.join(unsafe)} cannot change in a "
                          "stored run: start a new run")

    def change(manifest: dict[str, Any]) -> dict[str, Any]:
        tree = json.loads(json.dumps(manifest["config"]))
        for path, value in updates.items():
            section, _, name = path.partition(".")
            tree.setdefault(section, {})[name] = value
        cfg = config_from_dict(tree, stored=True)
        return {**manifest, "config": cfg.model_dump(mode="json")}

    return store.update_manifest(change)


def check_blob_location(cfg: Config, manifest: Mapping[str, Any]) -> None:
    """Refuse a run whose fragments are too large for Redis strings when its blobs would be
    kept there (``store.blobs = "redis"``), before anything is written.

    Raises:
        ConfigError: ``store.blobs`` is ``embedded-s3`` outside a local run, or the largest
            fragment holds more than ``store.redis_max_fragment_mb`` MB of float32; the
            message names the settings that fix it.
    """
    from ddiloco.store.objects import REDIS

    if cfg.store.blobs == EMBEDDED_S3:
        raise ConfigError(f"store.blobs = {EMBEDDED_S3!r} is for `ddiloco run`, which starts "
                          "the server; elsewhere give the server's s3://bucket/prefix")
    if cfg.store.blobs != REDIS:
        return
    layout = FragmentLayout.from_json(manifest["layout"])
    sizes = [4 * sum(math.prod(s) for s in layout.shapes(p)) for p in range(layout.n_fragments)]
    largest = max(sizes, default=0)
    limit = cfg.store.redis_max_fragment_mb << 20
    if largest > limit:
        p = sizes.index(largest)
        raise ConfigError(
            f"store.blobs = 'redis': fragment {p} holds {largest / 2**20:.0f} MB of float32, "
            f"above store.redis_max_fragment_mb = {cfg.store.redis_max_fragment_mb} (the model "
            f"has {sum(sizes) / 2**30:.2f} GiB in {layout.n_fragments} fragments; Redis would "
            "hold about 16x that). Keep the blobs in an object store: store.blobs = "
            "'file:///path/to/dir' or 's3://bucket/prefix' (pip install 'ddiloco[objects]')"
        )


def stored_initial(store: ParameterStore, layout: FragmentLayout, fragments: Sequence[int],
                   timeout_s: float = 60.0) -> dict[str, np.ndarray]:
    """The initial values of ``fragments`` from the store, ``{path: float32 array}``; waits
    for the init step (:func:`init_run`) up to ``timeout_s`` seconds in all.

    Raises:
        StoreError: no initial values after ``timeout_s`` seconds.
    """
    deadline = time.monotonic() + timeout_s
    out: dict[str, np.ndarray] = {}
    for p in fragments:
        blob = poll_until(functools.partial(store.get_initial, p),
                          timeout_s=deadline - time.monotonic(), interval_s=0.2)
        if blob is None:
            raise StoreError(f"fragment {p} has no initial value after {timeout_s:.0f} s: "
                             "run the init step (`ddiloco run`, or `ddiloco syncer "
                             "--config`) first")
        out.update(zip(layout.names(p), decode_blob(blob, layout.shapes(p)), strict=True))
    return out


def tokens_per_batch(manifest: dict[str, Any]) -> int:
    """Tokens of one learner batch (one inner step) of the run."""
    return int(manifest["task"]["tokens_per_batch"])


def manifest_config(manifest: dict[str, Any]) -> Config:
    """The full configuration stored with a manifest."""
    return config_from_dict(manifest["config"], stored=True)


def manifest_layout(manifest: dict[str, Any]) -> FragmentLayout:
    """The fragment layout stored with a manifest."""
    return FragmentLayout.from_json(manifest["layout"])


def wait_for_manifest(store: ParameterStore, timeout_s: float = 60.0) -> dict[str, Any]:
    """Poll the store every 0.2 s until the run manifest exists; return it.

    Raises:
        StoreUnavailable: no manifest after ``timeout_s`` seconds (or the store did not
            answer).
    """
    manifest = poll_until(store.get_manifest, timeout_s=timeout_s, interval_s=0.2)
    if manifest is None:
        raise StoreUnavailable(
            f"run {store.run_id!r} has no manifest after {timeout_s:.0f} s: start a syncer "
            "(or `ddiloco run`) with a configuration first"
        )
    return dict(manifest)
