"""Inner steps over a device mesh: the compute engine a learner drives.

A learner's parameters live as a flat ``{path: jax.Array}`` dict (:class:`ddiloco.workers.task.api.
ParamTree`) placed on a 1-D ``jax.sharding.Mesh`` with axis ``"data"`` over its devices:

* ``replicated`` (default): data parallel; every device holds all parameters, each batch is
  split along its leading axis, XLA all-reduces the gradients inside the jitted step.
* ``fsdp``: each parameter is also split along its largest axis divisible by the device
  count (ZeRO-3 / FSDP style); XLA gathers it where the step needs it.

A fragment is gathered to the host only when it is due (:meth:`InnerLoop.host`) and an adopted
version is scattered back with :meth:`InnerLoop.place`. Compute may run in bfloat16
(``compute_dtype``): parameters, optimizer state and outer state stay float32 (master
weights), the loss casts a bf16 copy inside the step. ``accumulate`` > 1 wraps the inner
optimizer in ``optax.MultiSteps``: one inner step is that many micro-batches.

With ``jax.distributed`` initialised the mesh spans every process's devices
(:func:`jax.devices`), and each process feeds its own slice of the batch
(``jax.make_array_from_process_local_data``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np

from ddiloco.workers.learner.programs import Sharding, layouts, step_programs
from ddiloco.workers.run.first_compile import cache_dir, cache_lookups, compile_turn
from ddiloco.workers.task.api import Batch, Task, TaskError


class InnerLoop:
    """Jitted inner steps of ``task`` on a mesh of devices.

    Args:
        task: the model, loss and inner optimizer.
        devices: how many devices form the mesh (None: all of :func:`jax.devices`).
        sharding: ``replicated`` (data parallel) or ``fsdp`` (parameters split too).
        compute_dtype: ``float32`` or ``bfloat16`` (the loss sees a cast copy of the params).
        accumulate: micro-batches per inner step (``optax.MultiSteps``); >= 1.
        donate: donate params and optimizer state to the step (in-place update).

    Raises:
        TaskError: more devices asked for than exist, or a bad ``accumulate``.
    """

    def __init__(self, task: Task, devices: int | None = None, sharding: Sharding = "replicated",
                 compute_dtype: str = "float32", accumulate: int = 1,
                 donate: bool = True) -> None:
        import jax
        from jax.sharding import Mesh

        available = jax.devices()
        n = len(available) if devices is None else devices
        if jax.process_count() > 1 and ((devices is not None and devices != len(available))
                                        or sharding != "replicated"):
            raise TaskError("a multi-process learner uses every process's devices with "
                            "replicated parameters (run.devices unset, run.sharding = "
                            "replicated)")
        if not 1 <= n <= len(available):
            raise TaskError(f"run.devices = {devices}: this process sees {len(available)} "
                            f"device(s) ({available[0].platform})")
        # The programs come from the task object: a fork server that traced them before its
        # fork has already done this learner's trace (ddiloco.workers.learner.programs).
        programs = step_programs(task, compute_dtype, accumulate)
        self.task = task
        self.tree = task.tree()
        self.n_devices = n
        self.mesh = Mesh(np.array(available[:n]), ("data",))
        self.accumulate = accumulate
        self.tx = programs.tx
        lay = layouts(task, programs, self.mesh, sharding)
        self.replicated, self.batch_sharding = lay.replicated, lay.batch
        self.shardings: dict[str, Any] = lay.params
        self.opt_shardings = lay.opt
        params_sh, opt_sh, rep = self.shardings, self.opt_shardings, self.replicated
        donated = (0, 1) if donate else ()
        self._train = jax.jit(programs.train, donate_argnums=donated,
                              in_shardings=(params_sh, opt_sh, self.batch_sharding),
                              out_shardings=(params_sh, opt_sh, rep))
        self._grad = jax.jit(programs.grad, in_shardings=(params_sh, self.batch_sharding),
                             out_shardings=(params_sh, rep))
        self._apply = jax.jit(programs.apply, donate_argnums=donated,
                              in_shardings=(params_sh, opt_sh, params_sh),
                              out_shardings=(params_sh, opt_sh))
        self._init = jax.jit(programs.init, in_shardings=(params_sh,), out_shardings=opt_sh)
        # The learners of a run compile the same programs: their first calls take turns at
        # the shared persistent cache (first_compile). A learner of several processes does
        # not: its processes compile together, collectives and all.
        self._cache = cache_dir() if jax.process_count() == 1 else None
        self._warm: set[str] = set()
        #: program name -> what its first call did: "compiled" (a miss in the persistent
        #: cache), "loaded" (a hit: another process compiled it), else its turn at the cache
        #: (:func:`ddiloco.workers.run.first_compile.compile_turn`: "unshared", ...)
        self.first_calls: dict[str, str] = {}

    def _call(self, name: str, fn: Any, *args: Any) -> Any:
        """``fn(*args)``, a jitted function; its first call (the one that compiles) in turn
        with the other processes that compile into this process's persistent cache
        (:func:`ddiloco.workers.run.first_compile.compile_turn`)."""
        if name in self._warm:
            return fn(*args)
        hits, misses = cache_lookups()
        with compile_turn(self._cache) as how:
            out = fn(*args)
        self._warm.add(name)
        hits_after, misses_after = cache_lookups()
        self.first_calls[name] = ("compiled" if misses_after > misses else
                                  "loaded" if hits_after > hits else how)
        return out

    # ------------------------------------------------------------------ placement
    def place(self, name: str, value: Any) -> Any:
        """Scatter a host value of parameter ``name`` onto the mesh (float32)."""
        import jax

        host = np.asarray(value, dtype=np.float32)
        return jax.make_array_from_callback(host.shape, self.shardings[name],
                                            lambda idx: host[idx])

    def place_all(self, flat: dict[str, Any]) -> dict[str, Any]:
        """:meth:`place` every parameter of ``flat``."""
        return {n: self.place(n, v) for n, v in flat.items()}

    @staticmethod
    def host(x: Any) -> np.ndarray:
        """A parameter as a float32 host array (gathered from every device that holds part
        of it; across processes with ``jax.distributed``, every process must call this)."""
        if getattr(x, "is_fully_addressable", True):
            return np.asarray(x, dtype=np.float32)
        if x.sharding.is_fully_replicated:  # every process holds all of it: no collective
            return np.asarray(x.addressable_data(0), dtype=np.float32)
        from jax.experimental import multihost_utils

        return np.asarray(multihost_utils.process_allgather(x, tiled=True), dtype=np.float32)

    def batch(self, batch: Batch) -> Batch:
        """A learner batch laid out along the mesh's data axis. With several processes each
        gives the same batch and contributes its own slice of the leading axis.

        Raises:
            TaskError: a leaf's leading axis does not split over the devices.
        """
        import jax

        n, i = jax.process_count(), jax.process_index()

        def put(x: Any) -> Any:
            x = np.asarray(x)
            if x.ndim == 0 or x.shape[0] % self.n_devices:
                raise TaskError(f"batch leaf of shape {x.shape}: the leading (batch) axis must "
                                f"be divisible by the learner's {self.n_devices} device(s)")
            if n > 1:
                part = x.shape[0] // n
                x = x[i * part:(i + 1) * part]
            return jax.make_array_from_process_local_data(self.batch_sharding, x)

        return jax.tree_util.tree_map(put, batch)

    def ready(self, loss: Any) -> None:
        """Block until ``loss`` (and the step that made it) is computed."""
        loss.block_until_ready()

    def describe(self) -> str:
        """The mesh, for logs."""
        return f"{self.n_devices} {self.mesh.devices.flat[0].platform} device(s)"

    # ------------------------------------------------------------------ steps
    def init_opt(self, params: dict[str, Any]) -> Any:
        """The inner optimizer's initial state for ``params`` (on the mesh)."""
        return self._call("init", self._init, params)

    def step(self, params: dict[str, Any], opt_state: Any,
             micro_batches: Sequence[Batch]) -> tuple[dict[str, Any], Any, Any]:
        """One inner step: ``accumulate`` micro-batches (host pytrees). Returns the new
        params, optimizer state and the mean loss (a device scalar: no host sync).
        ``params`` and ``opt_state`` are donated: do not reuse them."""
        if len(micro_batches) != self.accumulate:
            raise TaskError(f"an inner step takes {self.accumulate} micro-batches, "
                            f"got {len(micro_batches)}")
        losses = []
        for b in micro_batches:
            params, opt_state, loss = self._call("train", self._train, params, opt_state,
                                                 self.batch(b))
            losses.append(loss)
        return params, opt_state, (losses[0] if len(losses) == 1 else sum(losses) / len(losses))

    def grad(self, params: dict[str, Any], batch: Batch) -> tuple[dict[str, Any], Any]:
        """Gradients ``{path: array}`` and the loss of one batch (data-parallel baseline)."""
        return self._call("grad", self._grad, params, self.batch(batch))  # type: ignore[no-any-return]

    def apply(self, params: dict[str, Any], opt_state: Any,
              grads: dict[str, Any]) -> tuple[dict[str, Any], Any]:
        """Apply averaged gradients with the inner optimizer (data-parallel baseline)."""
        return self._call("apply", self._apply, params, opt_state, grads)  # type: ignore[no-any-return]

    @staticmethod
    def set_lr_scale(opt_state: Any, scale: float) -> None:
        """``train.lr_clock = global``: set the update's scale in ``opt_state``, in place
        (:func:`ddiloco.workers.learner.lr_clock.set_lr_scale`).

        Raises:
            ConfigError: the optimizer has no injected scale.
        """
        from ddiloco.workers.learner.lr_clock import set_lr_scale

        set_lr_scale(opt_state, scale)

    @staticmethod
    def checkpoint(directory: Any, run_id: str | None = None) -> Any:
        """This engine's checkpoint under ``directory`` (orbax:
        :class:`ddiloco.workers.learner.checkpoint.LearnerCheckpoint`)."""
        from ddiloco.workers.learner.checkpoint import LearnerCheckpoint

        return LearnerCheckpoint(directory, run_id=run_id)
