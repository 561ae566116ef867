"""The training task a learner runs: the user's model, loss, inner optimizer and data.

This is the library API's core (re-exported as :class:`ddiloco.Task`): a :class:`Task` bundles
an initial parameter pytree, a loss function, an optax inner optimizer and a batch iterator
factory. ddiloco runs the learner around it (fragment schedule, outer gradients, adoption,
checkpoints, rejoin); the syncer only ever sees the manifest the task produces (leaf paths,
shapes, the fragment plan and the initial values), never the model code.

Parameters are addressed by **leaf path**: ``jax.tree_util.keystr(path, simple=True,
separator="/")``, e.g. ``blocks/0/attn/kernel/value`` for a Flax NNX state or ``embed`` for a
flat dict. Fragments are whole leaves (balanced fragmentation, paper §2); embeddings, merged
by token-weighted averaging instead of RDA, are named by path or picked by a predicate.

A task is named in a run's configuration by a reference ``model.task = "pkg.mod:factory"`` or
``"path/to/file.py:factory"``; every learner (and the evaluator) process calls
``factory(TaskContext)`` to build it (:func:`ddiloco.workers.task.loader.build_task`). No reference:
the built-in byte-level GPT (:func:`ddiloco.workers.task.gpt.gpt_task`), which is just one user of
this
API.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ddiloco.pipeline.errors import ConfigError
from ddiloco.pipeline.fragments import FragmentLayout, balanced_fragments

Params = Any
"""A pytree whose leaves are float32 arrays (the fp32 master weights)."""
Batch = Any
"""A pytree of arrays; every leaf's leading axis is the batch axis (split over devices)."""
DEFAULT_LOSS_UNIT = "nats/token"
"""A task's loss unit when it names none: a mean cross-entropy over tokens."""


class TaskError(ConfigError):
    """A task is malformed: bad reference, non-float leaves, duplicate paths, bad batches."""


@dataclass(frozen=True)
class DataShard:
    """Which part of the data a learner reads, and from where.

    Attributes:
        index: this learner's index m in [0, count) (``learner-<m>``).
        count: M, the number of learners of the run (the data is split M ways).
        start: batches this learner already consumed (0 on a fresh start; a rejoining
            learner's checkpointed position): the iterator must resume there.
        seed: the run's seed (``train.seed``).
    """

    index: int
    count: int
    start: int
    seed: int


@dataclass(frozen=True)
class TaskContext:
    """What a task factory is called with.

    Attributes:
        config: the run's :class:`ddiloco.workers.run.config.Config` (read your own hyper-parameters
        from
            it or ignore it).
        seed: ``train.seed``; use it for the initial parameters so every process agrees.
    """

    config: Any
    seed: int


@dataclass
class Task:
    """A model, its loss, its inner optimizer and its data, as a learner trains them.

    Attributes:
        params: initial parameters, a pytree of float arrays (stored as float32 master
            weights; the initial values every learner and the syncer start from).
        loss: ``loss(params, batch) -> scalar`` (float, mean over the batch); traced by
            ``jax.jit`` and differentiated with respect to ``params``.
        optimizer: the optax inner optimizer (AdamW in the paper, §2); its state is
            checkpointed by tree path.
        batches: ``batches(DataShard) -> iterator of batches``; called once per learner start
            with the learner's shard and resume position. Each batch is a pytree of arrays whose
            leading axis is the per-learner batch size.
        tokens_per_batch: tokens in one batch (token weights and goodput count these).
        embeddings: leaf paths merged by token-weighted averaging rather than RDA (paper §2),
            or a predicate on the path.
        eval_batches: optional ``() -> iterable of batches`` for the evaluator's validation
            loss of the global model (``loss`` is reused); none: the run has no evaluation.
        name: shown in logs and the manifest.
        loss_unit: the unit of ``loss``, printed next to every loss (report, summary, live
            view, status): ``"nats/token"`` for a mean cross-entropy over tokens, ``"nats/byte"``
            where a token is a byte (the built-in GPT), or anything else your loss measures.
    """

    params: Params
    loss: Callable[[Params, Batch], Any]
    optimizer: Any
    batches: Callable[[DataShard], Iterator[Batch]]
    tokens_per_batch: int
    embeddings: Sequence[str] | Callable[[str], bool] = ()
    eval_batches: Callable[[], Iterable[Batch]] | None = None
    name: str = "task"
    loss_unit: str = DEFAULT_LOSS_UNIT
    #: filled by :func:`param_tree`
    _tree: ParamTree | None = field(default=None, init=False, repr=False)

    def tree(self) -> ParamTree:
        """The parameter tree's path codec (:class:`ParamTree`), built once.

        Raises:
            TaskError: a non-float leaf, a duplicate path, or no leaves at all.
        """
        if self._tree is None:
            self._tree = ParamTree.of(self.params)
        return self._tree

    def initial_values(self) -> dict[str, np.ndarray]:
        """The initial parameters, flat by path, as float32 host arrays
        (:func:`initial_values`)."""
        return initial_values(self)

    def embedding_paths(self) -> list[str]:
        """The leaf paths merged as embeddings (sorted).

        Raises:
            TaskError: a named embedding path that is not a leaf of ``params``.
        """
        return pick_embeddings(self.tree().names, self.embeddings, self.name)


def pick_embeddings(names: Sequence[str], embeddings: Sequence[str] | Callable[[str], bool],
                    task_name: str) -> list[str]:
    """The parameter names ``embeddings`` picks (a list of names or a predicate), sorted: a
    task's embeddings, JAX or PyTorch.

    Raises:
        TaskError: a named embedding that is not one of ``names``.
    """
    if callable(embeddings):
        return sorted(n for n in names if embeddings(n))
    unknown = sorted(set(embeddings) - set(names))
    if unknown:
        raise TaskError(f"task {task_name!r}: embeddings {unknown} are not parameter "
                        f"paths (paths look like {list(names[:3])})")
    return sorted(embeddings)


def path_name(path: Sequence[Any]) -> str:
    """A leaf's path as a string: ``jax.tree_util.keystr(path, simple=True, separator="/")``."""
    import jax

    return jax.tree_util.keystr(tuple(path), simple=True, separator="/")


@dataclass(frozen=True)
class ParamTree:
    """Maps a parameter pytree to and from a flat ``{path: array}`` dict (the layout's names).

    Learners keep parameters flat by path, the unit of fragments, deltas and the store, and
    rebuild the user's tree inside the jitted step (free: a pytree re-labelling).
    """

    names: list[str]
    shapes: dict[str, tuple[int, ...]]
    treedef: Any

    @classmethod
    def of(cls, params: Params) -> ParamTree:
        """The codec of ``params``.

        Raises:
            TaskError: a non-float leaf, a duplicate path, or no leaves.
        """
        import jax

        flat, treedef = jax.tree_util.tree_flatten_with_path(params)
        if not flat:
            raise TaskError("task params: the pytree has no leaves")
        names: list[str] = []
        shapes: dict[str, tuple[int, ...]] = {}
        for path, leaf in flat:
            name = path_name(path) or "param"
            dtype = np.dtype(getattr(leaf, "dtype", np.asarray(leaf).dtype))
            # jax's issubdtype knows ml_dtypes' bfloat16 and float8 types as floating (numpy's
            # does not)
            if not jax.dtypes.issubdtype(dtype, np.floating):
                raise TaskError(f"task params: leaf {name!r} has dtype {dtype}; parameters "
                                "must be floating point (keep integer state out of params)")
            if name in shapes:
                raise TaskError(f"task params: two leaves share the path {name!r}")
            names.append(name)
            shapes[name] = tuple(int(d) for d in np.shape(leaf))
        return cls(names, shapes, treedef)

    def flatten(self, params: Params) -> dict[str, Any]:
        """``{path: leaf}`` of a tree with this structure (leaves untouched)."""
        import jax

        return dict(zip(self.names, jax.tree_util.tree_leaves(params), strict=True))

    def unflatten(self, flat: dict[str, Any]) -> Params:
        """The user's tree from ``{path: leaf}``.

        Raises:
            KeyError: a path is missing from ``flat``.
        """
        import jax

        return jax.tree_util.tree_unflatten(self.treedef, [flat[n] for n in self.names])

    def layout(self, n_fragments: int) -> FragmentLayout:
        """Balanced fragmentation over the leaves (paper §2, :func:`balanced_fragments`).

        Raises:
            ConfigError: more fragments than leaves.
        """
        return balanced_fragments(self.shapes, n_fragments)

    def n_values(self) -> int:
        """Total number of scalar parameters."""
        return sum(math.prod(s) for s in self.shapes.values())


def initial_values(task: Task) -> dict[str, np.ndarray]:
    """The task's initial parameters, flat by path, as float32 host arrays."""
    flat = task.tree().flatten(task.params)
    return {n: np.asarray(v, dtype=np.float32) for n, v in flat.items()}


def manifest_loss_unit(manifest: Mapping[str, Any]) -> str:
    """The loss unit of a run's task, from its manifest (``loss_unit``, written by
    :func:`ddiloco.workers.run.manifest.build_manifest`). A manifest written before runs recorded
    it: ``"nats/byte"`` for the built-in GPT (``model`` set), else ``"nats/token"``."""
    unit = manifest.get("loss_unit")
    if isinstance(unit, str) and unit:
        return unit
    return "nats/byte" if manifest.get("model") is not None else DEFAULT_LOSS_UNIT
