"""The inner step's programs as plain functions, built once per task, so that tracing them
before a fork serves every forked learner.

JAX traces a jitted function the first time it is called with given argument types and keeps
the trace, keyed by the function object (and the argument types and the trace-time
configuration). A learner's first step spent about 0.22 s of one quiet core tracing the model,
its gradient and the optimizer update (docs/SCALE.md, "Rejoin"): a quarter of a forked
rejoin. Tracing needs no device: the fork server (:mod:`ddiloco.workers.run.forkserver`)
builds the built-in task and traces its programs before its first fork
(:func:`pretrace`), and a learner forked from it that builds the same task gets the same
function objects (:func:`step_programs`), so its first call skips the trace and goes straight
to lowering and the (cached) compilation. A learner that is not forked, or whose task or
options differ, builds and traces its own: the same result, later.

Nothing here holds a device array or starts a backend; the programs are what
:class:`ddiloco.workers.learner.inner.InnerLoop` jits with its shardings.
"""

from __future__ import annotations

import os
import re
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from ddiloco.workers.task.api import Batch, Task, TaskError

Sharding = Literal["replicated", "fsdp"]


@dataclass(frozen=True)
class StepPrograms:
    """One task's inner-step programs, unjitted (flat params are ``{path: float32 array}``).

    Attributes:
        tx: the inner optimizer (``optax.MultiSteps`` around the task's when ``accumulate`` >
            1).
        train: ``train(flat, opt_state, batch) -> (flat, opt_state, loss)``: one
            micro-batch's gradient and optimizer update; loss a float32 scalar.
        grad: ``grad(flat, batch) -> (grads, loss)`` (the data-parallel baseline).
        apply: ``apply(flat, opt_state, grads) -> (flat, opt_state)`` (the baseline).
        init: ``init(flat) -> opt_state``.
    """

    tx: Any
    train: Callable[..., Any]
    grad: Callable[..., Any]
    apply: Callable[..., Any]
    init: Callable[..., Any]


#: (id(task), compute dtype, accumulate) -> (the task, its programs); the task is kept so its
#: id is not reused while the entry lives
_BUILT: dict[tuple[int, str, int], tuple[Task, StepPrograms]] = {}


def step_programs(task: Task, compute_dtype: str = "float32",
                  accumulate: int = 1) -> StepPrograms:
    """``task``'s programs for these options: the same objects on every call with the same
    task object (so a trace made earlier, in this process or before its fork, is reused).

    Args:
        task: the model, loss and inner optimizer.
        compute_dtype: ``float32`` or ``bfloat16``: the loss sees a copy of the params cast
            to it; params, optimizer state and gradients stay float32.
        accumulate: micro-batches per inner step (``optax.MultiSteps``), >= 1.

    Raises:
        TaskError: ``accumulate`` < 1.
    """
    if accumulate < 1:
        raise TaskError(f"train.accumulate must be >= 1, got {accumulate}")
    key = (id(task), compute_dtype, accumulate)
    hit = _BUILT.get(key)
    if hit is not None and hit[0] is task:
        return hit[1]
    programs = _build(task, compute_dtype, accumulate)
    _BUILT[key] = (task, programs)
    return programs


def _build(task: Task, compute_dtype: str, accumulate: int) -> StepPrograms:
    import jax
    import optax

    tree = task.tree()
    tx = (optax.MultiSteps(task.optimizer, every_k_schedule=accumulate)
          if accumulate > 1 else task.optimizer)
    cdtype = jax.numpy.dtype(compute_dtype)

    def loss_of(flat: dict[str, Any], batch: Batch) -> Any:
        params = tree.unflatten(flat)
        if cdtype != jax.numpy.float32:
            params = jax.tree_util.tree_map(lambda x: x.astype(cdtype), params)
        return jax.numpy.asarray(task.loss(params, batch), jax.numpy.float32)

    def train(flat: dict[str, Any], opt_state: Any, batch: Batch) -> Any:
        loss, grads = jax.value_and_grad(loss_of)(flat, batch)
        params = tree.unflatten(flat)
        updates, opt_state = tx.update(tree.unflatten(grads), opt_state, params)
        return tree.flatten(optax.apply_updates(params, updates)), opt_state, loss

    def grad(flat: dict[str, Any], batch: Batch) -> Any:
        loss, grads = jax.value_and_grad(loss_of)(flat, batch)
        return grads, loss

    def apply(flat: dict[str, Any], opt_state: Any, grads: dict[str, Any]) -> Any:
        params = tree.unflatten(flat)
        updates, opt_state = tx.update(tree.unflatten(grads), opt_state, params)
        return tree.flatten(optax.apply_updates(params, updates)), opt_state

    def init(flat: dict[str, Any]) -> Any:
        return tx.init(tree.unflatten(flat))

    return StepPrograms(tx=tx, train=train, grad=grad, apply=apply, init=init)


def fsdp_axis(shape: Sequence[int], n_devices: int) -> int | None:
    """The axis an FSDP layout splits: the largest one divisible by ``n_devices`` (ties: the
    first), or None (the leaf is replicated: too small or no divisible axis)."""
    if n_devices <= 1:
        return None
    best: int | None = None
    for i, d in enumerate(shape):
        if d % n_devices == 0 and d >= n_devices and (best is None or d > shape[best]):
            best = i
    return best


@dataclass(frozen=True)
class Layouts:
    """Where a learner's arrays live on its mesh (``jax.sharding.NamedSharding`` each).

    Attributes:
        params: by leaf path: replicated, or split along :func:`fsdp_axis` (``fsdp``).
        opt: the optimizer state's pytree: a leaf shaped like a parameter follows it (Adam's
            mu and nu), any other is replicated.
        batch: split along the leading (batch) axis over ``data``.
        replicated: on every device.
        opt_shapes: the optimizer state's shapes and dtypes (``jax.eval_shape`` of ``init``),
            which ``opt`` was read from.
    """

    params: dict[str, Any]
    opt: Any
    batch: Any
    replicated: Any
    opt_shapes: Any


def layouts(task: Task, programs: StepPrograms, mesh: Any,
            sharding: Sharding = "replicated") -> Layouts:
    """The layouts of ``task``'s arrays on ``mesh`` (a 1-D ``jax.sharding.Mesh`` with axis
    ``data``, or the ``AbstractMesh`` of one: the argument types, with no device). Explicit
    layouts in and out of every program keep the step compiled once: propagated layouts
    differ between init's output and a step's, and the second step would compile again."""
    import jax
    from jax.sharding import NamedSharding
    from jax.sharding import PartitionSpec as P

    tree = task.tree()
    n = int(mesh.shape["data"])
    params: dict[str, Any] = {}
    for name in tree.names:
        axis = fsdp_axis(tree.shapes[name], n) if sharding == "fsdp" else None
        spec: list[str | None] = [None] * len(tree.shapes[name])
        if axis is not None:
            spec[axis] = "data"
        params[name] = NamedSharding(mesh, P(*spec))
    replicated = NamedSharding(mesh, P())
    by_shape = {tree.shapes[n]: params[n] for n in tree.names}
    opt_shapes = jax.eval_shape(programs.init, _flat_spec(task))
    opt = jax.tree_util.tree_map(lambda leaf: by_shape.get(tuple(leaf.shape), replicated),
                                 opt_shapes)
    return Layouts(params=params, opt=opt, batch=NamedSharding(mesh, P("data")),
                   replicated=replicated, opt_shapes=opt_shapes)


def _flat_spec(task: Task, shardings: dict[str, Any] | None = None) -> dict[str, Any]:
    import jax

    tree = task.tree()
    return {n: jax.ShapeDtypeStruct(tree.shapes[n], jax.numpy.float32,
                                    sharding=None if shardings is None else shardings[n])
            for n in tree.names}


def cpu_mesh(n_devices: int) -> Any:
    """The ``AbstractMesh`` of a learner's mesh of ``n_devices`` CPU devices (what its
    arrays' types name), built without a backend."""
    from jax._src.mesh import AbstractDevice
    from jax.sharding import AbstractMesh

    return AbstractMesh((n_devices,), ("data",),
                        abstract_device=AbstractDevice(device_kind="cpu", num_cores=None,
                                                       platform="cpu"))


def host_device_count(xla_flags: str | None = None) -> int:
    """CPU devices a process of this environment sees: XLA's
    ``--xla_force_host_platform_device_count`` in ``XLA_FLAGS``, else 1."""
    flags = os.environ.get("XLA_FLAGS", "") if xla_flags is None else xla_flags
    found = re.findall(r"--xla_force_host_platform_device_count=(\d+)", flags)
    return int(found[-1]) if found else 1


def abstract_args(task: Task, programs: StepPrograms, batch: Batch,
                  lay: Layouts) -> tuple[Any, Any, Any]:
    """The argument types a learner calls ``programs.train`` with, as
    ``jax.ShapeDtypeStruct`` pytrees with ``lay``'s layouts: float32 params by path, the
    optimizer state, and ``batch``'s shapes with JAX's canonical dtypes (an int64 host batch
    is int32 on the device unless x64 is on). Starts no backend."""
    import jax
    import numpy as np

    flat = _flat_spec(task, lay.params)
    opt = jax.tree_util.tree_map(
        lambda leaf, sh: jax.ShapeDtypeStruct(leaf.shape, leaf.dtype, sharding=sh),
        lay.opt_shapes, lay.opt)

    def spec(x: Any) -> Any:
        arr = np.asarray(x)
        return jax.ShapeDtypeStruct(arr.shape, jax.dtypes.canonicalize_dtype(arr.dtype),
                                    sharding=lay.batch)

    return flat, opt, jax.tree_util.tree_map(spec, batch)


def pretrace(task: Task, batch: Batch, *, n_devices: int = 1,
             sharding: Sharding = "replicated", dp: bool = False,
             compute_dtype: str = "float32", accumulate: int = 1) -> dict[str, Any]:
    """Trace ``task``'s programs for the argument types of a CPU learner with
    ``n_devices`` devices (``batch``: one host batch, for its shapes and dtypes), without a
    device: what a fork server does before it forks. JAX keys a trace by the argument types,
    which name the mesh and its device kind: a learner on another platform or mesh traces
    its own.

    Args:
        task: the task the forked learners will build (the same object: see module doc).
        batch: one batch as the task's iterator yields it (host arrays).
        n_devices: the learners' mesh size (``run.devices``, else every CPU device).
        sharding: ``run.sharding``.
        dp: trace the data-parallel baseline's ``grad`` and ``apply`` instead of ``train``.
        compute_dtype, accumulate: the learners' (``train.compute_dtype``,
            ``train.accumulate``).

    Returns:
        ``{"traced": [program names], "trace_s": seconds}``.
    """
    import jax

    start = time.perf_counter()
    programs = step_programs(task, compute_dtype, accumulate)
    lay = layouts(task, programs, cpu_mesh(n_devices), sharding)
    flat, opt, batch_spec = abstract_args(task, programs, batch, lay)
    jax.jit(programs.init).trace(flat)
    if dp:
        jax.jit(programs.grad).trace(flat, batch_spec)
        jax.jit(programs.apply).trace(flat, opt, flat)
        names = ["init", "grad", "apply"]
    else:
        jax.jit(programs.train).trace(flat, opt, batch_spec)
        names = ["init", "train"]
    return {"traced": names, "trace_s": round(time.perf_counter() - start, 3)}
