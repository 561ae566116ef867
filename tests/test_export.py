"""``ddiloco export`` and :func:`ddiloco.load_params`: the global model of a run written as
safetensors, npz or msgpack and read back into the task's own parameter tree (same structure
and dtypes as ``like``), with a named error on any leaf that does not fit."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import redis
from typer.testing import CliRunner

import ddiloco
from ddiloco.cli import app
from ddiloco.export import (
    ExportFormatError,
    ParamsMismatch,
    export_format,
    export_run,
    load_params,
    read_export,
    write_export,
)
from ddiloco.store import RedisStore
from ddiloco.store.embedded import EmbeddedRedis
from ddiloco.workers.run.blobs import encode_blob
from ddiloco.workers.run.config import load_config
from ddiloco.workers.run.manifest import build_manifest, manifest_layout
from ddiloco.workers.task.api import ParamTree
from ddiloco.workers.task.loader import build_task
from ddiloco.workers.task.model import init_params

FORMATS = ["safetensors", "npz", "msgpack"]
SUFFIX = {"safetensors": ".safetensors", "npz": ".npz", "msgpack": ".msgpack"}


def _needs(fmt: str) -> None:
    if fmt == "msgpack":
        pytest.importorskip("flax")


def nested_params() -> dict[str, Any]:
    """A custom task's tree: nested dicts and a list, jax and numpy leaves, a bf16 leaf."""
    return {"embed": jnp.zeros((10, 4)),
            "blocks": [{"w": jnp.ones((4, 4), jnp.bfloat16), "b": np.zeros(4, np.float32)},
                       {"w": jnp.ones((4, 4)), "b": jnp.zeros(4)}],
            "scale": jnp.float32(1.0)}


def _trained(like: Any, seed: int = 0) -> dict[str, np.ndarray]:
    """Flat values by leaf path, as a run's store holds them (float32)."""
    tree = ParamTree.of(like)
    rng = np.random.default_rng(seed)
    return {n: rng.normal(size=tree.shapes[n]).astype(np.float32) for n in tree.names}


def _publish(store: RedisStore, flat: dict[str, np.ndarray], manifest: dict[str, Any]) -> None:
    """Version 0 of every fragment holding ``flat``'s values (what a shard writes)."""
    store.put_manifest(manifest)
    layout = manifest_layout(manifest)
    for p in range(layout.n_fragments):
        value = encode_blob([flat[n] for n in layout.names(p)])
        store.publish(p, expected_version=-1, epoch=1, value=value, momentum=b"", keep=2)


def _gpt() -> tuple[Any, dict[str, Any]]:
    cfg = load_config(None, {"model.preset": "tiny", "sync.fragments": 4, "run.shards": 1})
    return cfg, build_manifest(cfg, "export-run", build_task(cfg))


@pytest.mark.parametrize("fmt", FORMATS)
def test_the_built_in_gpt_round_trips(tmp_path: Path, fmt: str, fake_redis: redis.Redis
                                      ) -> None:
    _needs(fmt)
    cfg, manifest = _gpt()
    like = init_params(cfg.model_config_obj(), 0)
    flat = _trained(like)
    store = RedisStore(fake_redis, "export-run")
    _publish(store, flat, manifest)
    path = tmp_path / f"model{SUFFIX[fmt]}"
    done = export_run(store, path)
    assert done["format"] == fmt and done["tensors"] == len(flat)
    assert done["versions"] == [0] * 4
    back = load_params(path, like=like)
    assert isinstance(back, dict) and set(back) == set(like)
    for name, value in like.items():
        assert isinstance(back[name], np.ndarray) and back[name].dtype == value.dtype
        np.testing.assert_array_equal(back[name], flat[name])
    _, meta = read_export(path)
    assert meta["format"] == "ddiloco" and meta["loss_unit"] == "nats/byte"
    assert json.loads(meta["versions"]) == [0] * 4 and meta["run_id"] == "export-run"
    assert json.loads(meta["model"])["d_model"] == cfg.model_config_obj().d_model


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_nested_custom_tree_round_trips_with_its_structure_and_dtypes(tmp_path: Path,
                                                                         fmt: str) -> None:
    _needs(fmt)
    like = nested_params()
    flat = _trained(like, seed=1)
    path = tmp_path / "custom.bin"  # no known suffix: the format comes from --format
    assert write_export(path, flat, {"k": "v"}, fmt) == fmt
    back = load_params(path, like=like, format=fmt)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(like)
    for (kp, got), want in zip(jax.tree_util.tree_leaves_with_path(back),
                               jax.tree_util.tree_leaves(like), strict=True):
        assert got.dtype == want.dtype and got.shape == np.shape(want)
        assert isinstance(got, np.ndarray) == isinstance(want, np.ndarray)
        name = jax.tree_util.keystr(kp, simple=True, separator="/")
        np.testing.assert_allclose(np.asarray(got, np.float32), flat[name],
                                   rtol=1e-2 if want.dtype == jnp.bfloat16 else 0)
    assert read_export(path, fmt)[1] == {"k": "v"}


def test_a_flax_nnx_state_round_trips(tmp_path: Path) -> None:
    nnx = pytest.importorskip("flax.nnx")

    class Tiny(nnx.Module):
        def __init__(self, rngs: Any) -> None:
            self.lin = nnx.Linear(3, 2, rngs=rngs)
            self.layers = nnx.List([nnx.Linear(2, 2, rngs=rngs) for _ in range(2)])

    _, like = nnx.split(Tiny(nnx.Rngs(0)), nnx.Param)
    flat = _trained(like, seed=2)
    path = tmp_path / "nnx.safetensors"
    write_export(path, flat)
    back = load_params(path, like=like)
    assert type(back) is type(like)
    assert jax.tree_util.tree_structure(back) == jax.tree_util.tree_structure(like)
    (kernel,) = jax.tree_util.tree_leaves(back["lin"]["kernel"])
    np.testing.assert_array_equal(np.asarray(kernel), flat["lin/kernel/value"])


def test_a_mismatched_like_names_the_leaf(tmp_path: Path) -> None:
    path = tmp_path / "m.safetensors"
    write_export(path, _trained(nested_params()))
    wrong_shape = nested_params()
    wrong_shape["blocks"][1]["w"] = jnp.ones((4, 5))
    with pytest.raises(ParamsMismatch, match=r"leaf 'blocks/1/w' has shape \(4, 4\) in the "
                       r"file and \(4, 5\) in `like`"):
        load_params(path, like=wrong_shape)
    more = {**nested_params(), "head": jnp.zeros(3)}
    with pytest.raises(ParamsMismatch, match="leaf 'head' of `like` is not in the file"):
        load_params(path, like=more)
    fewer = nested_params()
    del fewer["embed"]
    with pytest.raises(ParamsMismatch, match="leaf 'embed' of the file is not in `like`"):
        load_params(path, like=fewer)
    assert ddiloco.load_params is load_params and ddiloco.ParamsMismatch is ParamsMismatch


def test_formats_by_suffix_and_bad_files(tmp_path: Path) -> None:
    assert export_format("a.npz") == "npz" and export_format("a.MSGPACK") == "msgpack"
    assert export_format("a.pt") == "safetensors" and export_format("a.npz", "npz") == "npz"
    with pytest.raises(ExportFormatError, match="use one of safetensors, npz, msgpack"):
        export_format("a", "zip")
    junk = tmp_path / "junk.npz"
    junk.write_bytes(b"not a zip")
    with pytest.raises(ExportFormatError, match=r"junk\.npz: not a npz export"):
        load_params(junk, like=nested_params())
    with pytest.raises(FileNotFoundError):
        load_params(tmp_path / "missing.safetensors", like=nested_params())
    # no half-written file under the final name, no temporary left behind
    write_export(tmp_path / "ok.npz", _trained(nested_params()))
    assert sorted(p.name for p in tmp_path.iterdir()) == ["junk.npz", "ok.npz"]


def test_the_cli_refuses_an_unknown_format(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["export", str(tmp_path / "m.bin"), "--format", "zip",
                                   "--redis-url", "redis://localhost:1", "--run-id", "r"])
    assert res.exit_code == 2 and "zip" in res.output
    assert not (tmp_path / "m.bin").exists()


@pytest.mark.integration
@pytest.mark.timeout(60)
def test_the_cli_exports_a_run_from_its_store(tmp_path: Path, redis_server: EmbeddedRedis
                                              ) -> None:
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    try:
        cfg, manifest = _gpt()
        like = init_params(cfg.model_config_obj(), 0)
        flat = _trained(like, seed=3)
        _publish(RedisStore(client, "export-run"), flat, manifest)
        path = tmp_path / "sub" / "model.npz"
        res = CliRunner().invoke(app, ["export", str(path), "--redis-url", redis_server.url,
                                       "--run-id", "export-run"])
        assert res.exit_code == 0, res.output
        assert f"wrote {path} (npz, {len(flat)} tensors, versions [0, 0, 0, 0])" in res.output
        back = load_params(path, like=like)
        for name in like:
            np.testing.assert_array_equal(back[name], flat[name])
    finally:
        client.flushdb()
        client.close()
