"""The training task of a PyTorch learner: an ``nn.Module``, its optimizer, loss and data.

The PyTorch twin of :class:`ddiloco.workers.task.api.Task` (re-exported as
:class:`ddiloco.TorchTask`). ddiloco runs the same learner around it (fragment schedule, outer
gradients, adoption, checkpoints, rejoin) with a PyTorch inner-step engine
(:mod:`ddiloco.workers.learner.torch_inner`); shards, the store and the wire never see the
framework, only the manifest: leaf paths, shapes and initial values.

Parameters are addressed by their ``named_parameters()`` names (``blocks.0.attn.wqkv``): the
leaf paths of the manifest. A module whose names, shapes and initial values equal a JAX task's
trains the same run as that task: learners of the two frameworks exchange outer gradients
through one set of shards (:mod:`ddiloco.workers.task.torch_gpt` is the built-in GPT so written).

Nothing here imports torch: the module is read by processes that never build the model
(shards, the CLI), and ``torch`` is an optional extra (``pip install 'ddiloco[torch]'``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from ddiloco.workers.task.api import (
    DEFAULT_LOSS_UNIT,
    DataShard,
    ParamTree,
    TaskError,
    pick_embeddings,
)

if TYPE_CHECKING:
    import torch

__all__ = ["TORCH_EXTRA", "TorchTask", "import_torch"]

#: how a user installs PyTorch learners' dependencies
TORCH_EXTRA = "pip install 'ddiloco[torch]'"


def import_torch() -> Any:
    """``import torch``, or a :class:`TaskError` naming the extra to install.

    Raises:
        TaskError: torch is not installed.
    """
    try:
        import torch
    except ImportError as exc:
        raise TaskError(f"PyTorch learners need torch: {TORCH_EXTRA} ({exc})") from None
    return torch


@dataclass
class TorchTask:
    """A PyTorch model, its loss, its inner optimizer and its data, as a learner trains them.

    Attributes:
        model: ``model() -> torch.nn.Module`` with its initial parameters; every process
            calls it and must get the same values (seed it), as they are the run's version 0.
            Its parameters are float tensors (float32 master weights are stored); buffers are
            not merged (they stay each learner's own, e.g. a causal mask).
        optimizer: ``optimizer(module) -> torch.optim.Optimizer`` over ``module.parameters()``
            (AdamW in the paper, §2); its state is checkpointed by parameter name
            (safetensors and JSON).
        loss: ``loss(module, batch) -> scalar tensor`` (mean over the batch), differentiated
            by autograd.
        batches: ``batches(DataShard) -> iterator of batches``; as for a JAX task. A batch is
            a numpy array or tensor, or a tuple/dict of them (moved to the model's device).
        tokens_per_batch: tokens in one batch (token weights and goodput count these).
        schedule: ``schedule(step) -> factor`` of the optimizer's learning rates at inner step
            ``step`` (``torch.optim.lr_scheduler.LambdaLR``); None: constant.
        clip: per-tensor L2 bound on each gradient before the step (decomposes over
            fragments, like the built-in optimizer's ``train.clip``); None: no clipping.
        embeddings: parameter names merged by token-weighted averaging rather than RDA
            (paper §2), or a predicate on the name.
        eval_batches: optional ``() -> iterable of batches`` for the evaluator's loss.
        name: shown in logs and the manifest.
        loss_unit: the unit of ``loss`` (as :class:`ddiloco.workers.task.api.Task`).
        device: where the module trains: ``"cpu"``, ``"cuda"``, ``"cuda:1"``; None: CUDA when
            available, else the CPU.
    """

    model: Callable[[], torch.nn.Module]
    optimizer: Callable[[torch.nn.Module], torch.optim.Optimizer]
    loss: Callable[[torch.nn.Module, Any], torch.Tensor]
    batches: Callable[[DataShard], Iterator[Any]]
    tokens_per_batch: int
    schedule: Callable[[int], float] | None = None
    clip: float | None = None
    embeddings: Sequence[str] | Callable[[str], bool] = ()
    eval_batches: Callable[[], Iterable[Any]] | None = None
    name: str = "torch-task"
    loss_unit: str = DEFAULT_LOSS_UNIT
    device: str | None = None
    #: filled by :meth:`tree`
    _tree: ParamTree | None = field(default=None, init=False, repr=False)
    _initial: dict[str, np.ndarray] | None = field(default=None, init=False, repr=False)

    def initial_values(self) -> dict[str, np.ndarray]:
        """The module's initial parameters by name, float32 host arrays (built once).

        Raises:
            TaskError: a non-float parameter, or a module without parameters.
        """
        if self._initial is None:
            import_torch()
            module = self.model()
            out: dict[str, np.ndarray] = {}
            for name, p in module.named_parameters():
                if not p.dtype.is_floating_point:
                    raise TaskError(f"task {self.name!r}: parameter {name!r} has dtype "
                                    f"{p.dtype}; parameters must be floating point (keep "
                                    "integer state in buffers)")
                out[name] = p.detach().to("cpu", dtype=p.dtype).float().numpy().copy()
            if not out:
                raise TaskError(f"task {self.name!r}: the module has no parameters")
            self._initial = out
        return self._initial

    def tree(self) -> ParamTree:
        """The parameters' names and shapes (:class:`ParamTree` without a pytree structure:
        a PyTorch task is flat by name already).

        Raises:
            TaskError: as :meth:`initial_values`.
        """
        if self._tree is None:
            values = self.initial_values()
            self._tree = ParamTree(list(values), {n: tuple(v.shape) for n, v in values.items()},
                                   treedef=None)
        return self._tree

    def embedding_paths(self) -> list[str]:
        """The parameter names merged as embeddings (sorted).

        Raises:
            TaskError: a named embedding that is not a parameter.
        """
        return pick_embeddings(self.tree().names, self.embeddings, self.name)


def warmup_decay(lr: float, warmup_steps: int, total_steps: int | None,
                 final_fraction: float = 0.1, kind: str = "cosine") -> Callable[[int], float]:
    """A learning-rate factor for :attr:`TorchTask.schedule`: the built-in schedule
    (:func:`ddiloco.workers.task.model.lr_schedule`: linear warm-up from 0, then cosine,
    linear or constant down to ``final_fraction``), as a share of ``lr`` at each step.

    Raises:
        TaskError: a decaying schedule whose ``total_steps`` does not exceed the warm-up.
    """
    if total_steps is not None and kind != "constant" and total_steps <= warmup_steps:
        raise TaskError(f"total_steps ({total_steps}) must exceed warmup_steps "
                        f"({warmup_steps})")
    del lr  # the factor is a share of the optimizer's own rate

    def factor(step: int) -> float:
        if warmup_steps > 0 and step < warmup_steps:
            return step / warmup_steps
        if total_steps is None or kind == "constant":
            return 1.0
        frac = min(max((step - warmup_steps) / (total_steps - warmup_steps), 0.0), 1.0)
        if kind == "cosine":
            return final_fraction + (1 - final_fraction) * 0.5 * (1 + math.cos(math.pi * frac))
        return 1.0 - (1.0 - final_fraction) * frac

    return factor
