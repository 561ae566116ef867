"""The PyTorch GPT (workers.task.torch_gpt) is the JAX model's twin: the same parameter names,
shapes and initial values, the same loss and gradients, the same AdamW trajectory (schedule,
decay mask, per-tensor clipping), and its task the same data as the JAX task.

Tolerances are float32 rounding: the two frameworks sum in different orders (fused attention
against the written-out softmax, an embedding gather against a one-hot matmul), so values agree
to a few ulps of their scale, not bit for bit. Measured on a CPU (torch 2.13, three batches):
loss within 2e-7 relative, each gradient within 1.2e-6 of its tensor's largest entry (2e-8
absolute), parameters after five AdamW steps at lr 1e-2 within 4e-7; the bounds below leave
more than 10x room, so a real difference (a missed scale, mask or decay: errors of 1e-3 and
more) still fails.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="PyTorch learners need the torch extra")
jax = pytest.importorskip("jax", reason="the twin is compared with the JAX model")

from ddiloco.workers.run.config import Config, load_config  # noqa: E402
from ddiloco.workers.task import model as M  # noqa: E402
from ddiloco.workers.task.api import DataShard, ParamTree, TaskContext, TaskError  # noqa: E402
from ddiloco.workers.task.gpt import gpt_task  # noqa: E402
from ddiloco.workers.task.gpt_params import model_config_of  # noqa: E402
from ddiloco.workers.task.torch_api import warmup_decay  # noqa: E402
from ddiloco.workers.task.torch_gpt import (  # noqa: E402
    TorchGPT,
    gpt_torch_task,
    loss,
    torch_optimizer,
)
from tests._cluster import make_corpus  # noqa: E402

SMALL = {"model.d_model": 32, "model.n_layers": 2, "model.n_heads": 2, "model.d_ff": 64,
         "model.seq_len": 16}
SMALL_CFG = M.ModelConfig(d_model=32, n_layers=2, n_heads=2, d_ff=64, seq_len=16)
CONFIGS = {"small": SMALL_CFG, "tiny": M.PRESETS["tiny"]}
B = 4

#: loss: relative, float32 (measured <= 2e-7)
LOSS_RTOL = 1e-5
#: gradients: absolute, as a share of the tensor's largest |entry| (measured <= 1.2e-6)
GRAD_ATOL_SHARE = 2e-5
#: parameters after the AdamW steps: absolute (measured <= 4e-7 at lr 1e-2)
PARAM_ATOL = 2e-5


def _batch(cfg: M.ModelConfig, seed: int = 0, batch: int = B) -> np.ndarray:
    return np.random.default_rng(seed).integers(0, cfg.vocab, (batch, cfg.seq_len + 1),
                                                dtype=np.int32)


#: jitted once per (config, batch shape): the tests share it to compile as little as possible
_jax_value_and_grad = jax.jit(jax.value_and_grad(M.loss_fn), static_argnums=2)


def _torch_value_and_grad(model: Any, batch: np.ndarray) -> tuple[float, dict[str, np.ndarray]]:
    model.zero_grad()
    value = loss(model, batch)
    value.backward()
    return float(value.detach()), {n: p.grad.numpy().copy() for n, p in model.named_parameters()}


@pytest.mark.parametrize("preset", list(CONFIGS))
def test_names_shapes_and_initial_values_are_the_jax_models(preset: str) -> None:
    cfg = CONFIGS[preset]
    model = TorchGPT(cfg, seed=3)
    named = dict(model.named_parameters())
    assert list(named) == list(M.param_shapes(cfg))  # the same order too
    assert {n: tuple(p.shape) for n, p in named.items()} == M.param_shapes(cfg)
    want = M.init_params(cfg, 3)
    for name, p in named.items():
        assert p.dtype == torch.float32 and p.requires_grad
        got = p.detach().numpy()
        assert got.tobytes() == want[name].tobytes(), name  # bit for bit
    assert list(model.buffers()) == []


@pytest.mark.parametrize("preset", list(CONFIGS))
def test_loss_and_gradients_equal_the_jax_models(preset: str) -> None:
    cfg = CONFIGS[preset]
    params = M.init_params(cfg, 1)
    batch = _batch(cfg, seed=2)
    jax_loss, jax_grads = _jax_value_and_grad(params, batch, cfg)
    torch_loss, torch_grads = _torch_value_and_grad(TorchGPT(cfg, seed=1), batch)
    assert 5.0 < torch_loss < 6.0  # about ln(256) = 5.545 at initialisation
    assert torch_loss == pytest.approx(float(jax_loss), rel=LOSS_RTOL)
    assert list(torch_grads) == list(M.param_shapes(cfg))
    for name, got in torch_grads.items():
        want = np.asarray(jax_grads[name])
        scale = float(np.max(np.abs(want)))
        assert scale > 0, name
        np.testing.assert_allclose(got, want, rtol=0, atol=GRAD_ATOL_SHARE * scale,
                                   err_msg=name)


def test_a_shorter_sequence_and_causality() -> None:
    cfg = SMALL_CFG
    model = TorchGPT(cfg, seed=0)
    tokens = torch.as_tensor(_batch(cfg)[:, :-1]).long()
    with torch.no_grad():
        full = model(tokens)
        short = model(tokens[:, :8])
        changed = tokens.clone()
        changed[:, 5] = (changed[:, 5] + 1) % cfg.vocab
        after = model(changed)
    assert full.shape == (B, cfg.seq_len, cfg.vocab) and full.dtype == torch.float32
    # a prefix sees the first positions only (pos_embed[:8]), so its logits are the full
    # window's first ones (the full window's are the JAX model's, tested above)
    assert short.shape == (B, 8, cfg.vocab)
    torch.testing.assert_close(short, full[:, :8], rtol=0, atol=1e-5)
    assert torch.equal(after[:, :5], full[:, :5])  # the past does not see the future
    assert not torch.equal(after[:, 5:], full[:, 5:])
    with pytest.raises(TaskError, match="seq_len"):
        model(torch.zeros((1, cfg.seq_len + 1), dtype=torch.long))


def _train_cfg(**overrides: Any) -> Config:
    return load_config(None, {**SMALL, "train.lr": 1e-2, "train.warmup_steps": 2,
                              "train.steps": 8, "train.weight_decay": 0.1,
                              "train.clip": 0.05, "train.b2": 0.99, **overrides})


def test_adamw_steps_equal_the_optax_optimizer() -> None:
    cfg = _train_cfg()
    mcfg = model_config_of(cfg.model)
    params = {n: jax.numpy.asarray(v) for n, v in M.init_params(mcfg, 0).items()}
    tx = M.optimizer_from_config(cfg.train)
    state = tx.init(params)
    update = jax.jit(tx.update)

    make_opt, schedule_fn, clip = torch_optimizer(cfg.train)
    assert clip is not None and clip == 0.05
    model = TorchGPT(mcfg, seed=0)
    opt = make_opt(model)
    lr_sched = torch.optim.lr_scheduler.LambdaLR(opt, schedule_fn)
    clipped = set()
    for step in range(5):
        batch = _batch(mcfg, seed=10 + step)
        _, grads = _jax_value_and_grad(params, batch, mcfg)  # compiled by the test above
        updates, state = update(grads, state, params)
        params = jax.tree_util.tree_map(lambda p, u: p + u, params, updates)

        opt.zero_grad()
        loss(model, batch).backward()
        with torch.no_grad():
            for name, p in model.named_parameters():  # clip_by_tensor_norm's formula
                grad = p.grad
                assert grad is not None
                norm = float(torch.linalg.vector_norm(grad))
                if norm > clip:
                    clipped.add(name)
                grad.mul_(clip / max(norm, clip))
        opt.step()
        lr_sched.step()
    # the bound binds on some tensors and not on others: both branches are compared
    assert clipped and clipped != set(M.param_shapes(mcfg))
    for name, p in model.named_parameters():
        np.testing.assert_allclose(p.detach().numpy(), np.asarray(params[name]), rtol=0,
                                   atol=PARAM_ATOL, err_msg=name)
    # decay reached the matrices but not the norm scales, which moved by Adam alone
    assert opt.param_groups[0]["weight_decay"] == 0.1 and opt.param_groups[1]["weight_decay"] == 0
    assert all(p.ndim >= 2 for p in opt.param_groups[0]["params"])
    assert all(p.ndim == 1 for p in opt.param_groups[1]["params"])


def test_dp_uses_dp_lr() -> None:
    cfg = _train_cfg(**{"train.dp_lr": 2e-2})
    model = TorchGPT(model_config_of(cfg.model), seed=0)
    assert torch_optimizer(cfg.train)[0](model).param_groups[0]["lr"] == 1e-2
    assert torch_optimizer(cfg.train, dp=True)[0](model).param_groups[0]["lr"] == 2e-2


@pytest.mark.parametrize("kind", ["cosine", "linear", "constant"])
@pytest.mark.parametrize("warmup", [0, 3])
@pytest.mark.parametrize("total", [20, None])
def test_warmup_decay_is_the_jax_schedule(kind: str, warmup: int, total: int | None) -> None:
    lr, floor = 3e-3, 0.1
    factor = warmup_decay(lr, warmup, total, floor, kind)
    sched = M.lr_schedule(lr, warmup, total, floor, kind)
    for step in [*range(0, 25), 100]:
        assert lr * factor(step) == pytest.approx(float(sched(step)), rel=1e-6, abs=1e-12), step


def test_warmup_decay_by_hand() -> None:
    f = warmup_decay(1.0, 10, 110, 0.1, "cosine")
    assert f(0) == 0.0 and f(5) == 0.5 and f(10) == 1.0
    assert f(60) == pytest.approx(0.55)  # half-way down the cosine: (1 + 0.1) / 2
    assert f(110) == pytest.approx(0.1) and f(500) == pytest.approx(0.1)
    g = warmup_decay(1.0, 0, 100, 0.2, "linear")
    assert g(0) == 1.0 and g(50) == pytest.approx(0.6) and g(100) == pytest.approx(0.2)
    h = warmup_decay(1.0, 4, 100, 0.1, "constant")
    assert [h(s) for s in (0, 2, 4, 99, 1000)] == [0.0, 0.5, 1.0, 1.0, 1.0]
    assert warmup_decay(1.0, 0, None)(7) == 1.0
    assert math.isclose(warmup_decay(1.0, 10, 110)(110), 0.1)


@pytest.mark.parametrize(("override", "field"), [
    ({"train.optimizer": "muon"}, "train.optimizer"),
    ({"train.lr_clock": "global"}, "train.lr_clock"),
])
def test_torch_optimizer_refuses_what_pytorch_learners_lack(override: dict[str, str],
                                                            field: str) -> None:
    cfg = _train_cfg(**override)
    with pytest.raises(TaskError, match=field) as err:
        torch_optimizer(cfg.train)
    assert "adamw" in str(err.value) and "lr_clock=own" in str(err.value)


def test_the_task_is_the_jax_tasks_twin(tmp_path: Path) -> None:
    corpus = make_corpus(tmp_path / "corpus")
    cfg = load_config(None, {**SMALL, "data.corpus": [str(corpus)], "data.val_fraction": 0.2,
                             "data.eval_batches": 2, "train.batch_size": B,
                             "train.seed": 5})
    ctx = TaskContext(config=cfg, seed=5)
    task, twin = gpt_task(ctx), gpt_torch_task(ctx)
    jax_tree, torch_tree = task.tree(), twin.tree()
    # JAX flattens a dict by sorted key; the names and shapes, hence fragments, are the same
    assert sorted(torch_tree.names) == sorted(jax_tree.names) == sorted(M.param_shapes(
        cfg.model_config_obj()))
    assert torch_tree.shapes == jax_tree.shapes
    assert torch_tree.layout(3) == ParamTree.of(task.params).layout(3)
    values = twin.initial_values()
    assert all(values[n].tobytes() == np.asarray(v).tobytes() for n, v in task.params.items())
    assert twin.embedding_paths() == task.embedding_paths() == ["embed", "pos_embed"]
    assert (twin.name, twin.loss_unit, twin.tokens_per_batch, twin.clip, twin.device) == (
        task.name, task.loss_unit, task.tokens_per_batch, cfg.train.clip, None)
    for shard in (DataShard(0, 2, 0, 5), DataShard(1, 2, 3, 5)):
        got, want = next(twin.batches(shard)), next(task.batches(shard))
        assert got.shape == (B, 17) and np.array_equal(got, want)
    assert twin.eval_batches is not None and task.eval_batches is not None
    got_eval, want_eval = list(twin.eval_batches()), list(task.eval_batches())
    assert len(got_eval) == len(want_eval) == 2
    assert all(np.array_equal(a, b) for a, b in zip(got_eval, want_eval, strict=True))
    assert twin.schedule is not None and twin.schedule(0) == 0.0
    model = twin.model()
    with torch.no_grad():
        got_loss = float(loss(model, got))
    want_loss, _ = _jax_value_and_grad(task.params, got, cfg.model_config_obj())
    assert got_loss == pytest.approx(float(want_loss), rel=LOSS_RTOL)
