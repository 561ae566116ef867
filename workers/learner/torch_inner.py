"""Inner steps of a PyTorch module: the learner's second inner-step engine.

:class:`TorchInner` has the interface of :class:`ddiloco.workers.learner.inner.InnerLoop`
(``place``, ``host``, ``init_opt``, ``step``, ``ready``, ``checkpoint``), so one learner core
drives either framework: it gathers a due fragment to the host, subtracts the anchor, quantizes
and sends (the same codecs, on numpy views of the tensors), and places adopted versions back.

The learner's ``params`` dict holds the module's own ``nn.Parameter`` objects: placing a value
copies it into the parameter in place, so the optimizer, which holds the same objects, keeps
its state across adoptions (as the JAX engine keeps ``opt_state``). The optimizer state is the
:class:`TorchOptState` record (optimizer, learning-rate schedule), checkpointed by parameter
name as safetensors and JSON (:class:`TorchCheckpoint`; nothing is pickled).

One device per learner process (``TorchTask.device``); data parallelism inside a learner,
bfloat16 compute and several processes per learner are the JAX engine's (refused here with a
named error).
"""

from __future__ import annotations

import json
import os
import shutil
import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ddiloco.pipeline.errors import ConfigError
from ddiloco.workers.learner.checkpoint import CheckpointMismatch, CheckpointOfAnotherRun
from ddiloco.workers.task.api import TaskError
from ddiloco.workers.task.torch_api import TorchTask, import_torch

__all__ = ["TorchCheckpoint", "TorchInner", "TorchOptState", "torch_losses"]


@dataclass
class TorchOptState:
    """A PyTorch learner's inner optimizer state.

    Attributes:
        optimizer: the task's ``torch.optim.Optimizer`` over the module's parameters.
        scheduler: its ``LambdaLR`` (``TorchTask.schedule``), or None.
        steps: inner steps taken (the schedule's position; checkpointed).
        names: parameter name of each of the optimizer's parameters, in its groups' order.
    """

    optimizer: Any
    scheduler: Any
    steps: int
    names: list[str]


def _to_device(batch: Any, device: Any) -> Any:
    """A batch (array, tensor, or tuple/list/dict of them) as tensors on ``device``."""
    torch = import_torch()
    if isinstance(batch, dict):
        return {k: _to_device(v, device) for k, v in batch.items()}
    if isinstance(batch, tuple | list):
        return type(batch)(_to_device(v, device) for v in batch)
    if isinstance(batch, torch.Tensor):
        return batch.to(device, non_blocking=True)
    return torch.as_tensor(np.asarray(batch), device=device)


class TorchInner:
    """Inner steps of ``task`` on one device (module docstring).

    Args:
        task: the PyTorch task.
        accumulate: micro-batches per inner step (gradients averaged, then one optimizer
            step); >= 1.
        threads: CPU threads for torch's intra-op pool (None: the cores this process may
            run on, as the JAX engine's XLA pool).
        devices, sharding, compute_dtype: the JAX engine's options; only their defaults
            (one device, replicated, float32) are accepted.

    Raises:
        TaskError: a bad ``accumulate``, or an option the PyTorch engine does not have.
    """

    def __init__(self, task: TorchTask, accumulate: int = 1, threads: int | None = None,
                 devices: int | None = None, sharding: str = "replicated",
                 compute_dtype: str = "float32") -> None:
        #: what each program's first call did (the JAX engine's ``first_calls``): always
        #: empty, since eager PyTorch compiles nothing through a persistent cache
        self.first_calls: dict[str, str] = {}
        torch = import_torch()
        if accumulate < 1:
            raise TaskError(f"train.accumulate must be >= 1, got {accumulate}")
        if devices not in (None, 1) or sharding != "replicated" or compute_dtype != "float32":
            raise TaskError("a PyTorch learner trains on one device in float32: leave "
                            "run.devices unset, run.sharding = replicated and "
                            f"train.compute_dtype = float32 (got {devices}, {sharding}, "
                            f"{compute_dtype})")
        if threads is None and hasattr(os, "sched_getaffinity"):
            threads = len(os.sched_getaffinity(0))
        if threads:
            torch.set_num_threads(threads)
        self.torch = torch
        self.task = task
        self.tree = task.tree()
        self.accumulate = accumulate
        self.n_devices = 1
        self.device = torch.device(task.device or ("cuda" if torch.cuda.is_available()
                                                   else "cpu"))
        #: the device kind, for logs ("cpu", "cuda")
        self.platform = self.device.type
        self.module = task.model().to(self.device)
        self.module.train()
        self.named: dict[str, Any] = dict(self.module.named_parameters())
        if list(self.named) != self.tree.names:
            raise TaskError(f"task {task.name!r}: model() built different parameters on a "
                            "second call; it must build the same module every time")

    # ------------------------------------------------------------------ placement
    def place(self, name: str, value: Any) -> Any:
        """Copy a host value into parameter ``name`` (in place); returns the parameter."""
        p = self.named[name]
        host = np.ascontiguousarray(value, dtype=np.float32)
        with self.torch.no_grad():
            p.copy_(self.torch.from_numpy(host).to(p.device, p.dtype).reshape(p.shape))
        return p

    def place_all(self, flat: dict[str, Any]) -> dict[str, Any]:
        """:meth:`place` every parameter of ``flat``."""
        return {n: self.place(n, v) for n, v in flat.items()}

    @staticmethod
    def host(x: Any) -> np.ndarray:
        """A parameter as a float32 host array (a view of a CPU parameter: copy it before
        the next step if it must not change)."""
        t = x.detach()
        if t.device.type != "cpu":
            t = t.cpu()
        if t.is_floating_point() and t.element_size() == 4:
            return t.numpy()  # type: ignore[no-any-return]
        return t.float().numpy()  # type: ignore[no-any-return]

    def ready(self, loss: Any) -> None:
        """Block until ``loss`` (and the step that made it) is computed."""
        if self.device.type == "cuda":
            self.torch.cuda.synchronize(self.device)

    def describe(self) -> str:
        """The device, for logs."""
        return f"1 {self.platform} device ({self.torch.get_num_threads()} threads)"

    # ------------------------------------------------------------------ steps
    def init_opt(self, params: dict[str, Any]) -> TorchOptState:
        """A fresh optimizer (and schedule) over the module's parameters."""
        opt = self.task.optimizer(self.module)
        by_id = {id(p): n for n, p in self.named.items()}
        names = []
        for group in opt.param_groups:
            for p in group["params"]:
                if id(p) not in by_id:
                    raise TaskError(f"task {self.task.name!r}: its optimizer holds a tensor "
                                    "that is not a parameter of the module")
                names.append(by_id[id(p)])
        sched = None
        if self.task.schedule is not None:
            sched = self.torch.optim.lr_scheduler.LambdaLR(opt, self.task.schedule)
        return TorchOptState(opt, sched, 0, names)

    def step(self, params: dict[str, Any], opt_state: TorchOptState,
             micro_batches: Sequence[Any]) -> tuple[dict[str, Any], TorchOptState, Any]:
        """One inner step on ``accumulate`` micro-batches: mean gradient, per-tensor clip
        (``TorchTask.clip``), optimizer and schedule step. Returns the (same) params, the
        state and the mean loss (a detached scalar tensor)."""
        if len(micro_batches) != self.accumulate:
            raise TaskError(f"an inner step takes {self.accumulate} micro-batches, "
                            f"got {len(micro_batches)}")
        torch, opt = self.torch, opt_state.optimizer
        opt.zero_grad(set_to_none=True)
        total = None
        for b in micro_batches:
            loss = self.task.loss(self.module, _to_device(b, self.device))
            (loss / self.accumulate).backward()
            total = loss.detach() if total is None else total + loss.detach()
        clip = self.task.clip
        if clip is not None:
            with torch.no_grad():
                for p in self.named.values():
                    if p.grad is not None:  # per tensor: decomposes over fragments
                        # g * clip / max(|g|, clip): the JAX optimizer's factor, exactly 1
                        # below the bound (clip_by_tensor_norm)
                        p.grad.mul_(clip / torch.clamp(torch.linalg.vector_norm(p.grad),
                                                       min=clip))
        opt.step()
        if opt_state.scheduler is not None:
            opt_state.scheduler.step()
        opt_state.steps += 1
        assert total is not None
        return params, opt_state, total / self.accumulate

    def set_lr_scale(self, opt_state: TorchOptState, scale: float) -> None:
        """``train.lr_clock = global`` has no PyTorch form yet.

        Raises:
            ConfigError: always.
        """
        raise ConfigError("train.lr_clock=global: PyTorch learners follow their own step "
                          "count; use train.lr_clock=own")

    def checkpoint(self, directory: Path, run_id: str | None = None) -> TorchCheckpoint:
        """This engine's checkpoint under ``directory`` (:class:`TorchCheckpoint`)."""
        return TorchCheckpoint(directory, run_id=run_id)


def torch_losses(task: TorchTask, values: dict[str, np.ndarray],
                 batches: Iterable[Any], module: Any = None) -> tuple[list[float], Any]:
    """The loss of each batch for the model with parameters ``values`` (the evaluator's
    validation loss of a PyTorch task; no gradients). Returns the losses and the module
    (pass it back to reuse it).
    """
    torch = import_torch()
    if module is None:
        device = torch.device(task.device or ("cuda" if torch.cuda.is_available() else "cpu"))
        module = task.model().to(device)
        module.eval()
    named = dict(module.named_parameters())
    device = next(iter(named.values())).device
    out = []
    with torch.no_grad():
        for n, v in values.items():
            named[n].copy_(torch.from_numpy(np.ascontiguousarray(v, np.float32)).to(device))
        for b in batches:
            out.append(float(task.loss(module, _to_device(b, device))))
    return out, module


# ---------------------------------------------------------------------- checkpoints
#: written last into a step directory before it is renamed into place
_META = "meta.json"
_STATE = "state.safetensors"


class TorchCheckpoint:
    """Save and restore a PyTorch learner's optimizer state, step, data position and counters
    under ``directory``: one ``<step>/`` directory per checkpoint (``state.safetensors``:
    tensors named ``<parameter>/<state key>``; ``meta.json``: the rest), written in a
    temporary directory by a background thread and renamed into place (atomic), the newest
    ``keep`` kept. The interface of :class:`ddiloco.workers.learner.checkpoint.
    LearnerCheckpoint`.

    Args:
        directory: e.g. ``<run_dir>/learners/learner-0/ckpt``; created when needed.
        keep: how many checkpoints to keep.
        run_id: written into every checkpoint; another run's is refused on restore.
    """

    def __init__(self, directory: Path, keep: int = 2, run_id: str | None = None) -> None:
        self.directory = Path(directory).resolve()
        self.keep = keep
        self.run_id = run_id
        self.removed: list[str] = []
        if self.directory.is_dir():
            for child in self.directory.iterdir():
                torn = child.name.isdigit() and not (child / _META).exists()
                if torn or child.name.startswith(".tmp-"):
                    shutil.rmtree(child, ignore_errors=True)
                    self.removed.append(child.name)
        self.removed.sort()
        self._writer: threading.Thread | None = None
        self._error: BaseException | None = None

    def steps(self) -> list[int]:
        """The complete checkpoints' steps, oldest first."""
        if not self.directory.is_dir():
            return []
        return sorted(int(c.name) for c in self.directory.iterdir()
                      if c.name.isdigit() and (c / _META).exists())

    def save(self, step: int, opt_state: TorchOptState, meta: dict[str, Any]) -> None:
        """Start writing the checkpoint of ``step`` (copies the state now, writes it in a
        thread; :meth:`wait` waits). A second save at the same step is skipped."""
        self.wait()
        if step in self.steps():
            return
        opt = opt_state.optimizer
        tensors: dict[str, Any] = {}
        scalars: dict[str, dict[str, Any]] = {}
        i = 0
        for group in opt.param_groups:
            for p in group["params"]:
                name = opt_state.names[i]
                i += 1
                for key, value in opt.state.get(p, {}).items():
                    if hasattr(value, "detach"):
                        tensors[f"{name}/{key}"] = value.detach().to("cpu", copy=True)
                    else:
                        scalars.setdefault(name, {})[key] = value
        groups = [{k: v for k, v in g.items() if k != "params"} for g in opt.param_groups]
        full = {**meta, "optimizer": {"names": opt_state.names, "groups": groups,
                                      "scalars": scalars, "steps": opt_state.steps}}
        if self.run_id is not None:
            full["run_id"] = self.run_id
        self._writer = threading.Thread(target=self._write, args=(step, tensors, full),
                                        name="checkpoint", daemon=True)
        self._writer.start()

    def _write(self, step: int, tensors: dict[str, Any], meta: dict[str, Any]) -> None:
        from safetensors.torch import save_file

        try:
            self.directory.mkdir(parents=True, exist_ok=True)
            tmp = self.directory / f".tmp-{step}-{os.getpid()}"
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir()
            save_file(tensors, str(tmp / _STATE))
            (tmp / _META).write_text(json.dumps(meta, default=_jsonable))
            os.rename(tmp, self.directory / str(step))
            for old in self.steps()[:-self.keep]:
                shutil.rmtree(self.directory / str(old), ignore_errors=True)
        except BaseException as exc:  # reported by wait(): a lost checkpoint is not silent
            self._error = exc

    def wait(self) -> None:
        """Block until the pending write is on disk.

        Raises:
            OSError: the last write failed.
        """
        if self._writer is not None:
            self._writer.join()
            self._writer = None
        if self._error is not None:
            err, self._error = self._error, None
            raise OSError(f"checkpoint write under {self.directory} failed: {err}") from err

    def restore(self, template: TorchOptState) -> tuple[TorchOptState, dict[str, Any]] | None:
        """Load the newest checkpoint into ``template`` (a fresh :meth:`TorchInner.init_opt`
        state) and return it with the meta, or None if there is none.

        Raises:
            CheckpointOfAnotherRun: the checkpoint carries another run id than this one's.
            CheckpointMismatch: its parameter names or tensor shapes differ from the
                template's optimizer.
        """
        from safetensors.torch import load_file

        self.wait()
        steps = self.steps()
        if not steps:
            return None
        where = self.directory / str(steps[-1])
        meta = json.loads((where / _META).read_text())
        theirs = meta.get("run_id")
        if self.run_id is not None and theirs is not None and theirs != self.run_id:
            raise CheckpointOfAnotherRun(
                f"checkpoint {where} belongs to run {theirs!r}, not to this learner's run "
                f"{self.run_id!r}: give the learner the --run-dir of run {self.run_id!r}, or "
                "move the directory away to start it fresh")
        saved = meta.pop("optimizer")
        if saved["names"] != template.names:
            missing = sorted(set(template.names) - set(saved["names"]))[:5]
            extra = sorted(set(saved["names"]) - set(template.names))[:5]
            raise CheckpointMismatch(
                f"checkpoint {where}: its optimizer state does not match this learner's "
                f"(another model or optimizer?); missing parameters {missing}, unexpected "
                f"{extra}. Move the directory away to start this learner fresh.")
        tensors = load_file(str(where / _STATE))
        opt = template.optimizer
        params = [p for g in opt.param_groups for p in g["params"]]
        state: dict[int, dict[str, Any]] = {}
        for i, name in enumerate(saved["names"]):
            entry: dict[str, Any] = dict(saved["scalars"].get(name, {}))
            for key, value in tensors.items():
                pname, _, skey = key.rpartition("/")
                if pname == name:
                    if value.dim() == params[i].dim() > 0 and value.shape != params[i].shape:
                        raise CheckpointMismatch(
                            f"checkpoint {where}: {key} has shape {tuple(value.shape)}, the "
                            f"parameter {tuple(params[i].shape)}")
                    entry[skey] = value
            if entry:
                state[i] = entry
        groups = saved["groups"]
        if len(groups) != len(opt.param_groups):
            raise CheckpointMismatch(f"checkpoint {where}: {len(groups)} parameter groups, "
                                     f"the optimizer has {len(opt.param_groups)}")
        start = 0
        for g, cur in zip(groups, opt.param_groups, strict=True):
            g["params"] = list(range(start, start + len(cur["params"])))
            start += len(cur["params"])
        try:
            opt.load_state_dict({"state": state, "param_groups": groups})
        except (ValueError, KeyError) as exc:
            raise CheckpointMismatch(f"checkpoint {where}: {exc}") from exc
        template.steps = int(saved["steps"])
        if template.scheduler is not None:
            sched = template.scheduler
            sched.last_epoch = template.steps
            for group, base, fn in zip(opt.param_groups, sched.base_lrs, sched.lr_lambdas,
                                       strict=True):
                group["lr"] = base * fn(template.steps)
            sched._last_lr = [g["lr"] for g in opt.param_groups]
        return template, meta

    def close(self) -> None:
        """Finish the pending write."""
        self.wait()


def _jsonable(value: Any) -> Any:
    """JSON for optimizer hyper-parameters that are tensors or tuples (e.g. Adam's betas)."""
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON-able: {type(value).__name__}")
