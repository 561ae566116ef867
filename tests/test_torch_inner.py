"""The PyTorch inner-step engine and its checkpoint, on a small module with hand-checked steps.

Covers what the learner core relies on: placing host values into the module's own
parameters (the optimizer keeps its state across adoptions), host copies, accumulated steps,
per-tensor clipping, the learning-rate schedule, and checkpoints of the optimizer state by
parameter name that restore to the same next step. The wire sees the same bytes from a
tensor's host view as from the numpy array it came from.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

torch = pytest.importorskip("torch", reason="PyTorch learners need torch "
                            "(pip install 'ddiloco[torch]')")

from ddiloco.pipeline import codec  # noqa: E402
from ddiloco.workers.learner.checkpoint import (  # noqa: E402
    CheckpointMismatch,
    CheckpointOfAnotherRun,
)
from ddiloco.workers.learner.torch_inner import TorchCheckpoint, TorchInner  # noqa: E402
from ddiloco.workers.task.api import DataShard, TaskError  # noqa: E402
from ddiloco.workers.task.torch_api import TorchTask, warmup_decay  # noqa: E402


class Tiny(torch.nn.Module):  # type: ignore[misc]
    """y = relu(x @ w1) @ w2 + b; loss: mean squared error against a target column."""

    def __init__(self) -> None:
        super().__init__()
        g = torch.Generator().manual_seed(0)
        self.w1 = torch.nn.Parameter(torch.randn(4, 8, generator=g) * 0.5)
        self.w2 = torch.nn.Parameter(torch.randn(8, 1, generator=g) * 0.5)
        self.b = torch.nn.Parameter(torch.zeros(1))


def tiny_loss(m: Tiny, batch: Any) -> Any:
    x, y = batch[:, :4], batch[:, 4:]
    return ((torch.relu(x @ m.w1) @ m.w2 + m.b - y) ** 2).mean()


def batches(shard: DataShard) -> Any:
    rng = np.random.default_rng(shard.index * 100 + shard.start)
    while True:
        yield rng.normal(size=(8, 5)).astype(np.float32)


def task(**kw: Any) -> TorchTask:
    base: dict[str, Any] = dict(
        model=Tiny, optimizer=lambda m: torch.optim.AdamW(m.parameters(), lr=1e-2,
                                                          weight_decay=0.1),
        loss=tiny_loss, batches=batches, tokens_per_batch=8, device="cpu", name="tiny")
    base.update(kw)
    return TorchTask(**base)


def test_tree_and_initial_values_follow_named_parameters() -> None:
    t = task()
    assert t.tree().names == ["w1", "w2", "b"]
    assert t.tree().shapes == {"w1": (4, 8), "w2": (8, 1), "b": (1,)}
    assert t.tree().n_values() == 32 + 8 + 1
    np.testing.assert_array_equal(t.initial_values()["w1"], Tiny().w1.detach().numpy())
    assert task(embeddings=["w1"]).embedding_paths() == ["w1"]
    with pytest.raises(TaskError, match="not parameter paths"):
        task(embeddings=["nope"]).embedding_paths()


def test_a_non_float_parameter_is_named() -> None:
    class Bad(torch.nn.Module):  # type: ignore[misc]
        def __init__(self) -> None:
            super().__init__()
            self.count = torch.nn.Parameter(torch.zeros(2, dtype=torch.int64),
                                            requires_grad=False)

    with pytest.raises(TaskError, match=r"'count' has dtype torch\.int64"):
        task(model=Bad).tree()


def test_options_of_the_jax_engine_are_refused() -> None:
    with pytest.raises(TaskError, match="one device in float32"):
        TorchInner(task(), devices=2)
    with pytest.raises(TaskError, match="one device in float32"):
        TorchInner(task(), compute_dtype="bfloat16")
    with pytest.raises(TaskError, match="accumulate"):
        TorchInner(task(), accumulate=0)


def test_place_writes_into_the_same_parameter_and_host_reads_it_back() -> None:
    inner = TorchInner(task(), threads=1)
    params = inner.place_all(task().initial_values())
    opt = inner.init_opt(params)
    b = next(batches(DataShard(0, 1, 0, 0)))
    inner.step(params, opt, [b])
    exp_avg = opt.optimizer.state[params["w1"]]["exp_avg"].clone()
    new = np.arange(32, dtype=np.float32).reshape(4, 8) / 7
    p = inner.place("w1", new)
    assert p is params["w1"] is inner.named["w1"]  # the optimizer's tensor: its state stays
    np.testing.assert_array_equal(inner.host(p), new)
    assert torch.equal(opt.optimizer.state[p]["exp_avg"], exp_avg)
    assert inner.host(p).dtype == np.float32


def test_an_accumulated_step_is_the_mean_gradient_and_clip_is_per_tensor() -> None:
    b1, b2 = (np.random.default_rng(i).normal(size=(8, 5)).astype(np.float32) for i in (1, 2))
    sgd = dict(optimizer=lambda m: torch.optim.SGD(m.parameters(), lr=0.1))
    inner = TorchInner(task(**sgd), accumulate=2, threads=1)
    params = inner.place_all(task().initial_values())
    opt = inner.init_opt(params)
    _, _, loss = inner.step(params, opt, [b1, b2])
    ref = Tiny()
    l1, l2 = tiny_loss(ref, torch.as_tensor(b1)), tiny_loss(ref, torch.as_tensor(b2))
    ((l1 + l2) / 2).backward()
    for name, q in ref.named_parameters():
        np.testing.assert_allclose(inner.host(params[name]),
                                   (q - 0.1 * q.grad).detach().numpy(), rtol=1e-6, atol=1e-7)
    assert float(loss) == pytest.approx(float(((l1 + l2) / 2).detach()), rel=1e-6)
    # clip 1e-3 per tensor: every parameter moves by lr * 1e-3 in L2 norm exactly
    clipped = TorchInner(task(clip=1e-3, **sgd), threads=1)
    cp = clipped.place_all(task().initial_values())
    copt = clipped.init_opt(cp)
    before = {n: clipped.host(v).copy() for n, v in cp.items()}
    clipped.step(cp, copt, [b1])
    for n in cp:
        moved = np.linalg.norm(clipped.host(cp[n]) - before[n])
        assert moved == pytest.approx(0.1 * 1e-3, rel=1e-4), n


def test_the_schedule_sets_each_steps_rate() -> None:
    sched = warmup_decay(1.0, 2, 10, 0.1, "cosine")
    assert [sched(s) for s in (0, 1, 2)] == [0.0, 0.5, 1.0]
    assert sched(10) == pytest.approx(0.1) and sched(50) == pytest.approx(0.1)
    assert sched(6) == pytest.approx(0.1 + 0.9 * 0.5)  # half way: cos(pi/2) = 0
    lin = warmup_decay(1.0, 0, 10, 0.1, "linear")
    assert lin(5) == pytest.approx(0.55)
    inner = TorchInner(task(schedule=sched), threads=1)
    params = inner.place_all(task().initial_values())
    opt = inner.init_opt(params)
    rates = []
    for _ in range(3):
        rates.append(opt.optimizer.param_groups[0]["lr"])
        inner.step(params, opt, [next(batches(DataShard(0, 1, 0, 0)))])
    assert rates == pytest.approx([0.0, 0.5e-2, 1e-2])
    with pytest.raises(TaskError, match="must exceed"):
        warmup_decay(1.0, 10, 10)


def _train(inner: TorchInner, params: dict[str, Any], opt: Any, steps: range) -> None:
    for s in steps:
        inner.step(params, opt, [next(batches(DataShard(0, 1, s, 0)))])


def test_checkpoint_restores_the_same_next_steps(tmp_path: Path) -> None:
    t = task(schedule=warmup_decay(1.0, 2, 20))
    a = TorchInner(t, threads=1)
    pa = a.place_all(t.initial_values())
    oa = a.init_opt(pa)
    _train(a, pa, oa, range(4))
    ck = a.checkpoint(tmp_path / "ck", run_id="run-a")
    ck.save(4, oa, {"step": 4, "position": 4})
    ck.save(4, oa, {"step": 4, "position": 4})  # a second save of a step is skipped
    ck.close()
    snapshot = {n: a.host(v).copy() for n, v in pa.items()}
    _train(a, pa, oa, range(4, 7))
    # a fresh engine, parameters from "the store", optimizer from the checkpoint
    b = TorchInner(t, threads=1)
    pb = b.place_all(snapshot)
    got = TorchCheckpoint(tmp_path / "ck", run_id="run-a").restore(b.init_opt(pb))
    assert got is not None
    ob, meta = got
    assert meta["step"] == 4 and meta["position"] == 4 and meta["run_id"] == "run-a"
    assert t.schedule is not None
    assert ob.steps == 4
    assert ob.optimizer.param_groups[0]["lr"] == pytest.approx(1e-2 * t.schedule(4))
    _train(b, pb, ob, range(4, 7))
    for n in pa:
        np.testing.assert_array_equal(b.host(pb[n]), a.host(pa[n]))
    # nothing pickled: a safetensors file and JSON
    assert sorted(p.name for p in (tmp_path / "ck" / "4").iterdir()) == [
        "meta.json", "state.safetensors"]
    json.loads((tmp_path / "ck" / "4" / "meta.json").read_text())


def test_checkpoint_keeps_the_newest_and_refuses_another_run_or_model(tmp_path: Path) -> None:
    t = task()
    a = TorchInner(t, threads=1)
    pa = a.place_all(t.initial_values())
    oa = a.init_opt(pa)
    ck = TorchCheckpoint(tmp_path / "ck", keep=2, run_id="run-a")
    for s in (1, 2, 3):
        _train(a, pa, oa, range(s - 1, s))
        ck.save(s, oa, {"step": s})
    ck.wait()
    assert ck.steps() == [2, 3]
    with pytest.raises(CheckpointOfAnotherRun, match="run-a"):
        TorchCheckpoint(tmp_path / "ck", run_id="run-b").restore(a.init_opt(pa))

    class Wider(Tiny):
        def __init__(self) -> None:
            super().__init__()
            self.extra = torch.nn.Parameter(torch.zeros(3))

    w = TorchInner(task(model=Wider), threads=1)
    with pytest.raises(CheckpointMismatch, match=r"unexpected|missing"):
        TorchCheckpoint(tmp_path / "ck").restore(w.init_opt(w.named))
    # a step directory a kill -9 tore (no meta.json) is removed at open
    (tmp_path / "ck" / "9").mkdir()
    again = TorchCheckpoint(tmp_path / "ck")
    assert again.removed == ["9"] and again.steps() == [2, 3]


def test_no_checkpoint_restores_nothing(tmp_path: Path) -> None:
    inner = TorchInner(task(), threads=1)
    assert TorchCheckpoint(tmp_path / "none").restore(inner.init_opt(inner.named)) is None


@settings(max_examples=30, deadline=None)
@given(arrays(np.float32, st.integers(1, 300),
              elements=st.floats(-1e3, 1e3, width=32, allow_subnormal=False)),
       st.sampled_from(codec.CODECS))
def test_a_tensor_host_view_encodes_to_the_same_bytes_as_its_array(
        values: np.ndarray, name: str) -> None:
    t = torch.from_numpy(values.copy())
    host = TorchInner.host(torch.nn.Parameter(t))
    assert codec.encode([host], name) == codec.encode([values], name)
    got = codec.decode(codec.encode([host], name), [values.shape], name)
    want = codec.decode(codec.encode([values], name), [values.shape], name)
    np.testing.assert_array_equal(got[0], want[0])
