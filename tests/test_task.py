"""The task API: leaf paths, fragment plans, factories, manifests, data helpers, checkpoints."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import jax.numpy as jnp
import numpy as np
import optax
import pytest

import ddiloco
from ddiloco.pipeline.errors import ConfigError
from ddiloco.store import RedisStore
from ddiloco.workers.learner.checkpoint import CheckpointMismatch, LearnerCheckpoint
from ddiloco.workers.learner.programs import fsdp_axis
from ddiloco.workers.run.config import load_config
from ddiloco.workers.run.manifest import build_manifest, publish_initial, stored_initial
from ddiloco.workers.task.api import (
    DataShard,
    ParamTree,
    Task,
    TaskContext,
    TaskError,
    initial_values,
)
from ddiloco.workers.task.loader import build_task, load_factory

ROOT = Path(__file__).resolve().parent.parent


def tiny_params() -> dict[str, object]:
    return {"embed": jnp.zeros((10, 4)), "blocks": [{"w": jnp.ones((4, 4)), "b": jnp.zeros(4)},
                                                    {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}]}


def tiny_task(ctx: TaskContext) -> Task:
    """A task factory importable as tests.test_task:tiny_task."""
    def loss(p: dict[str, object], batch: object) -> object:
        return jnp.mean(p["embed"][batch]) + sum(jnp.sum(b["w"]) for b in p["blocks"])

    return Task(params=tiny_params(), loss=loss, optimizer=optax.sgd(0.1),
                batches=lambda s: iter(()), tokens_per_batch=7,
                embeddings=lambda path: path.startswith("embed"), name="tiny")


def test_leaf_paths_name_every_leaf_and_round_trip() -> None:
    tree = ParamTree.of(tiny_params())
    assert tree.names == ["blocks/0/b", "blocks/0/w", "blocks/1/b", "blocks/1/w", "embed"]
    assert tree.shapes["embed"] == (10, 4)
    assert tree.n_values() == 40 + 2 * (16 + 4)
    flat = tree.flatten(tiny_params())
    back = tree.unflatten(flat)
    assert back["blocks"][1]["w"].shape == (4, 4)
    assert set(tree.layout(2).fragment_of()) == set(tree.names)


def test_non_float_leaf_and_empty_tree_are_refused() -> None:
    with pytest.raises(TaskError, match="'step' has dtype int32"):
        ParamTree.of({"w": jnp.ones(3), "step": jnp.zeros((), jnp.int32)})
    with pytest.raises(TaskError, match="no leaves"):
        ParamTree.of({})


def test_embeddings_by_predicate_or_by_name() -> None:
    task = tiny_task(TaskContext(None, 0))
    assert task.embedding_paths() == ["embed"]
    task.embeddings = ["embed", "blocks/0/w"]
    assert task.embedding_paths() == ["blocks/0/w", "embed"]
    task.embeddings = ["emb"]
    with pytest.raises(TaskError, match=r"\['emb'\] are not parameter paths"):
        task.embedding_paths()


def test_load_factory_module_file_and_errors(tmp_path: Path) -> None:
    assert load_factory("tests.test_task:tiny_task") is tiny_task
    script = tmp_path / "mine.py"
    script.write_text("RAN_MAIN = False\ndef make(ctx):\n    return 42\n"
                      "if __name__ == '__main__':\n    RAN_MAIN = True\n")
    factory = load_factory(f"{script}:make")
    assert factory(None) == 42  # type: ignore[arg-type]
    assert sys.modules[factory.__module__].RAN_MAIN is False  # the main block did not run
    for ref, msg in [("nocolon", "expected"), (f"{tmp_path}/none.py:make", "no file"),
                     (f"{script}:missing", "no callable 'missing'"),
                     ("no_such_module_xyz:make", "cannot import")]:
        with pytest.raises(TaskError, match=msg):
            load_factory(ref)


def test_build_task_checks_the_factory_result(tmp_path: Path) -> None:
    script = tmp_path / "bad.py"
    script.write_text("def make(ctx):\n    return {'params': 1}\n")
    with pytest.raises(TaskError, match=r"returned dict, not ddiloco\.Task"):
        build_task(load_config(None, {"model.task": f"{script}:make"}))


def test_task_reference_of_functions() -> None:
    assert ddiloco.task_reference(tiny_task) == "tests.test_task:tiny_task"
    assert ddiloco.task_reference("a.py:f") == "a.py:f"
    with pytest.raises(ConfigError, match="top level"):
        ddiloco.task_reference(lambda ctx: None)  # type: ignore[arg-type,return-value]


def test_user_task_manifest_needs_no_model_code(store: RedisStore) -> None:
    cfg = load_config(None, {"model.task": "tests.test_task:tiny_task", "sync.fragments": 2,
                             "run.shards": 1})
    task = build_task(cfg)
    m = build_manifest(cfg, "user-task", task)
    assert m["task"] == {"name": "tiny", "ref": "tests.test_task:tiny_task", "params": 80,
                         "tokens_per_batch": 7}
    assert m["model"] is None and m["embedding"] == ["embed"]
    names = sorted(n for frag in m["layout"] for n, *_ in frag)
    assert names == sorted(task.tree().names)
    # the init step stores the initial values; a shard reads them back without the task
    from ddiloco.workers.run.manifest import manifest_layout

    store.put_manifest(m)
    publish_initial(store, m, task)
    assert store.put_initial(0, b"other") is False  # written once
    got = stored_initial(store, manifest_layout(m), [0, 1], timeout_s=1)
    want = initial_values(task)
    assert set(got) == set(want)
    for k in want:
        np.testing.assert_array_equal(got[k], want[k])


def test_dp_baseline_refuses_a_user_task() -> None:
    cfg = load_config(None, {"model.task": "tests.test_task:tiny_task", "run.mode": "dp",
                             "sync.fragments": 2})
    with pytest.raises(ConfigError, match="built-in model only"):
        build_manifest(cfg, "x")


def test_fsdp_axis_picks_the_largest_divisible_axis() -> None:
    assert fsdp_axis((384, 1536), 4) == 1
    assert fsdp_axis((1536, 384), 4) == 0
    assert fsdp_axis((6,), 4) is None
    assert fsdp_axis((3, 2), 4) is None
    assert fsdp_axis((8, 8), 1) is None


def test_windows_are_deterministic_disjoint_and_resumable() -> None:
    tokens = np.arange(1000, dtype=np.int32)
    a = ddiloco.windows(tokens, 4, 16, DataShard(0, 2, 0, 3))
    first = [next(a) for _ in range(5)]
    resumed = ddiloco.windows(tokens, 4, 16, DataShard(0, 2, 3, 3))
    np.testing.assert_array_equal(next(resumed), first[3])
    assert first[0].shape == (4, 17) and first[0].dtype == np.int32
    assert all(b.max() < 500 for b in first)  # learner 0 reads the first half only
    other = next(ddiloco.windows(tokens, 4, 16, DataShard(1, 2, 0, 3)))
    assert other.min() >= 500
    ev = ddiloco.eval_windows(tokens, 2, 16, 3)
    assert len(ev) == 3 and ev[0][0, 0] == 0 and ev[-1][-1, -1] == 999
    with pytest.raises(ConfigError, match="fewer than seq_len"):
        next(ddiloco.windows(tokens[:20], 1, 16, DataShard(1, 2, 0, 0)))


def test_checkpoint_restores_by_path_and_names_mismatches(tmp_path: Path) -> None:
    params = {"a": jnp.ones((4, 3)), "b": jnp.zeros(3)}
    state = optax.adamw(1e-3).init(params)
    state = optax.adamw(1e-3).update(params, state, params)[1]  # count = 1, mu != 0
    ck = LearnerCheckpoint(tmp_path / "ck")
    assert ck.restore(state) is None
    ck.save(5, state, {"step": 5, "position": 9})
    ck.close()
    got, meta = LearnerCheckpoint(tmp_path / "ck").restore(state)  # type: ignore[misc]
    assert meta == {"step": 5, "position": 9}
    np.testing.assert_array_equal(got[0].mu["a"], state[0].mu["a"])
    assert int(got[0].count) == 1
    with pytest.raises(CheckpointMismatch, match=r"missing paths \['0/trace/a'"):
        LearnerCheckpoint(tmp_path / "ck").restore(optax.sgd(0.1, momentum=0.9).init(params))


def test_a_step_torn_by_kill9_is_skipped(tmp_path: Path) -> None:
    """kill -9 while orbax deletes an old step leaves it without metadata: it is removed at
    start-up and the newest finalized step is restored."""
    params = {"a": jnp.ones(3)}
    state = optax.adam(1e-3).init(params)
    ck = LearnerCheckpoint(tmp_path / "ck")
    for step in (10, 20):
        ck.save(step, state, {"step": step})
    ck.close()
    (tmp_path / "ck" / "10" / "_CHECKPOINT_METADATA").unlink()
    (tmp_path / "ck" / "30").mkdir()  # a deletion torn before anything but the folder
    ck = LearnerCheckpoint(tmp_path / "ck")
    assert ck.removed == ["10", "30"]
    got = ck.restore(state)
    assert got is not None and got[1] == {"step": 20}


def test_default_platform_is_cpu_without_a_gpu() -> None:
    from ddiloco.workers.run.runtime import default_platform

    if Path("/dev/nvidia0").exists():
        pytest.skip("this machine has an NVIDIA GPU")
    assert default_platform() == "cpu"


@pytest.mark.timeout(300)
def test_four_devices_match_one_device_within_1e5() -> None:
    """The inner steps on a mesh of 4 host devices (data parallel and FSDP) and with gradient
    accumulation give the 1-device parameters within 1e-5 (bench/mesh.py)."""
    env = {**os.environ, "JAX_PLATFORMS": "cpu"}
    out = subprocess.run([sys.executable, str(ROOT / "bench" / "mesh.py"), "--devices", "4",
                          "--steps", "4"], capture_output=True, text=True, env=env,
                         timeout=280, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    import json

    rows = {r["layout"]: r for r in json.loads(out.stdout.strip().splitlines()[-1])["rows"]}
    for layout in ("4 devices, data parallel", "4 devices, fsdp", "1 device, accumulate 2"):
        assert rows[layout]["max_abs_diff"] <= 1e-5, (layout, rows[layout])
    # bf16 compute trains the same model, not the same bits
    assert 0 < rows["1 device, bf16 compute"]["max_abs_diff"] < 1e-2
