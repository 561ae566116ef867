"""JAX and PyTorch learners train one model: real worker processes on a real Redis.

``run.torch_learners = 2`` of M = 4: learner-0 and learner-1 train the built-in GPT's PyTorch
twin, learner-2 and learner-3 the JAX model, through the same shards. Both kinds' outer
gradients are merged, both adopt the shards' versions bit for bit, and a PyTorch learner
killed with SIGKILL rejoins from the store and its own safetensors checkpoint.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

pytest.importorskip("torch", reason="PyTorch learners need torch (pip install 'ddiloco[torch]')")

from ddiloco.store import EmbeddedRedis, RedisStore
from ddiloco.workers.run.blobs import decode_blob, digest
from ddiloco.workers.run.launch import LocalCluster
from ddiloco.workers.run.manifest import manifest_layout
from tests._cluster import check_rejoin, start_cluster, wait_for

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def mixed(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[LocalCluster, RedisStore, Path]]:
    run_dir = tmp_path_factory.mktemp("mixed")
    c, store = start_cluster(redis_server, run_dir, "it-mixed",
                             {"run.learners": 4, "run.torch_learners": 2,
                              "train.steps": 1_000_000, "train.checkpoint_every": 10,
                              "run.eval_every_tokens": 0,  # every run.eval_every_s
                              "sync.history": 64})  # the rejoin check reads its versions
    try:
        yield c, store, run_dir
    finally:
        c.stop_all()
        store.flush_run()


def test_both_frameworks_deltas_are_merged_and_versions_adopted_bit_for_bit(
        mixed: tuple[LocalCluster, RedisStore, Path]) -> None:
    c, store, _ = mixed

    def engines() -> dict[str, tuple[bool, bool]]:
        """Each learner's engine, as its SYNCING log line names it: (PyTorch, JAX)."""
        return {n: ("(TorchInner)" in c.log_tail(n, 100_000),
                    "(InnerLoop)" in c.log_tail(n, 100_000)) for n in c.names("learner")}

    wait_for(lambda: all(any(e) for e in engines().values()), 120,
             "every learner's engine in its log", c)
    assert engines() == {"learner-0": (True, False), "learner-1": (True, False),
                         "learner-2": (False, True), "learner-3": (False, True)}

    def merged_from() -> set[str]:
        return {x["learner"] for _, m in store.events(kinds={"merge"})
                for x in m.get("contributions", [])}

    wait_for(lambda: merged_from() >= {"learner-0", "learner-1", "learner-2", "learner-3"},
             180, "a merged delta of every learner, PyTorch and JAX", c)
    manifest = store.get_manifest()
    assert manifest is not None
    layout = manifest_layout(manifest)
    adopted = {e["learner"]: e for _, e in store.events(kinds={"adopted"})}
    assert set(adopted) >= {"learner-0", "learner-3"}
    for who in ("learner-0", "learner-3"):  # one of each framework
        e = adopted[who]
        for p, v in enumerate(e["versions"]):
            blob = store.get_version(p, v)
            assert blob is not None
            assert digest(decode_blob(blob.value, layout.shapes(p))) == e["digests"][str(p)], who
    assert store.counters("drops") == {}


def test_a_pytorch_learner_kill9_rejoins_from_the_store_and_its_checkpoint(
        mixed: tuple[LocalCluster, RedisStore, Path]) -> None:
    c, store, run_dir = mixed
    ckpt = run_dir / "learners" / "learner-1" / "ckpt"
    wait_for(lambda: any((d / "state.safetensors").exists() for d in ckpt.glob("[0-9]*")),
             120, "learner-1's first checkpoint", c)
    adopted = check_rejoin(c, store)  # learner-1 is a PyTorch learner
    assert adopted["incarnation"] >= 2
    assert "restored checkpoint at step" in c.log_tail("learner-1", 100_000)
    evals = wait_for(lambda: store.events(kinds={"eval"}), 60, "an evaluation", c)
    assert all(e["loss"] < 5.545 for _, e in evals[-1:])  # below a uniform byte model
