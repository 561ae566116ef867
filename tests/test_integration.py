"""Real processes, real sockets, a real Redis: 2 learners + 1 syncer shard + the evaluator.

learner-0 trains the built-in GPT's PyTorch twin and learner-1 the JAX model
(``run.torch_learners = 1``): every test below runs on one model trained by both frameworks.

One cluster is shared by the tests of this module (JAX start-up dominates their cost); they run
in file order: training progresses, a learner is killed with SIGKILL and rejoins, the shard is
killed with SIGKILL and resumes, the model is exported and sampled, a learner drains on
SIGTERM. Tests with runs of their own are in test_integration_runs.py, so that this module's
open-ended cluster is stopped before they start and does not compete with them for the cores.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddiloco.store import EmbeddedRedis, RedisStore
from ddiloco.store.embedded_s3 import EmbeddedS3
from ddiloco.workers.run.blobs import decode_blob, digest
from ddiloco.workers.run.launch import LocalCluster
from ddiloco.workers.run.manifest import manifest_layout
from tests._cluster import ROOT, check_rejoin, start_cluster, versions, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def cluster(redis_server: EmbeddedRedis, s3_server: EmbeddedS3,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, RedisStore]]:
    run_dir = tmp_path_factory.mktemp("run")
    # a long history so the versions a rejoining learner adopted are still there to compare;
    # the blobs on a real S3 server (Redis blobs run in the other integration suites)
    pytest.importorskip("torch", reason="the cluster's learner-0 is a PyTorch learner "
                        "(pip install 'ddiloco[torch]')")
    c, store = start_cluster(redis_server, run_dir, "it-diloco",
                             {"train.steps": 100000, "sync.history": 512,
                              # an open-ended run: a cadence of seconds, not of its budget
                              "run.eval_every_tokens": 0,
                              # momentum on, so a shard's resume of it is checked
                              "sync.outer_momentum": 0.5, "sync.outer_lr": 0.7,
                              "store.blobs": s3_server.url("it-diloco"),
                              # learner-0 in PyTorch, learner-1 in JAX
                              "run.torch_learners": 1, "train.checkpoint_every": 10},
                             standby=1)  # the killed learner is handed to it
    try:
        yield c, store
    finally:
        c.stop_all()
        store.flush_run()


def test_versions_increase_and_eval_loss_falls(cluster: tuple[LocalCluster, RedisStore]) -> None:
    c, store = cluster
    wait_for(lambda: min(versions(store)) >= 3, 150, "every fragment at version >= 3", c)
    evals = wait_for(lambda: (e := store.events(kinds={"eval"})) and len(e) >= 2
                     and e[-1][1]["loss"] < e[0][1]["loss"] - 0.3 and e,
                     120, "the evaluator's loss to fall by 0.3 nats/byte", c)
    first, last = evals[0][1], evals[-1][1]
    assert first["loss"] > 4.5  # about ln(256) = 5.55 at initialisation
    # every head points at objects on the S3 server, and Redis holds pointers alone
    assert store.blob_location.startswith("s3://")
    assert all(store.get_latest(p) is not None for p in range(4))
    assert any(x.startswith("it-diloco/f0/v") for x in store.object_paths())
    assert all(len(store.client.get(store.keys.value(p, v)) or b"") < 200
               for p, v in enumerate(versions(store)))
    assert last["tokens"] > first["tokens"]
    merges = store.events(kinds={"merge"})
    per_fragment: dict[int, list[int]] = {}
    for _, m in merges:
        per_fragment.setdefault(m["fragment"], []).append(m["version"])
    for vs in per_fragment.values():
        assert vs == sorted(set(vs))  # strictly increasing, never reused
    assert store.counters("wire")["up"] > 0


def test_learner_kill9_rejoins_with_store_versions(
        cluster: tuple[LocalCluster, RedisStore]) -> None:
    """The rejoin, through the cluster's standby learner (the fresh process's rejoin is
    test_integration_runs.py's); a new standby takes its place."""
    c, store = cluster
    adopted = check_rejoin(c, store)
    assert c.handovers == 1 and c.workers["standby-1"].alive
    # the process warmed up before it knew which learner it would be
    logs = c.run_dir / "logs"
    assert "waiting for a handover" in (logs / "standby-0.log").read_text()
    assert f'"incarnation": {adopted["incarnation"]}' in (logs / "learner-1.log").read_text()


def test_both_frameworks_deltas_are_merged_and_versions_adopted_bit_for_bit(
        cluster: tuple[LocalCluster, RedisStore]) -> None:
    c, store = cluster

    def engine(name: str) -> str:
        """The engine a learner's SYNCING log line names."""
        text = c.log_tail(name, 1_000_000)
        return "torch" if "(TorchInner)" in text else "jax" if "(InnerLoop)" in text else ""

    assert engine("learner-0") == "torch" and engine("learner-1") == "jax"
    wait_for(lambda: {x["learner"] for _, m in store.events(kinds={"merge"})
                      for x in m.get("contributions", [])} >= {"learner-0", "learner-1"},
             120, "a merged delta of each framework's learner", c)
    manifest = store.get_manifest()
    assert manifest is not None
    layout = manifest_layout(manifest)
    first = {}
    for _, e in store.events(kinds={"adopted"}):
        first.setdefault(e["learner"], e)
    for who in ("learner-0", "learner-1"):  # their join: versions read from the store
        for p, v in enumerate(first[who]["versions"]):
            blob = store.get_version(p, v)
            assert blob is not None
            assert digest(decode_blob(blob.value, layout.shapes(p))) == \
                first[who]["digests"][str(p)], who
    assert store.counters("drops") == {}


def test_a_pytorch_learner_kill9_rejoins_from_the_store_and_its_checkpoint(
        cluster: tuple[LocalCluster, RedisStore]) -> None:
    """learner-0 (PyTorch) restarts as a fresh process (standbys are warmed up on the JAX
    task) and restores its optimizer from its safetensors checkpoint."""
    c, store = cluster
    ckpt = c.run_dir / "learners" / "learner-0" / "ckpt"
    wait_for(lambda: any((d / "state.safetensors").exists() for d in ckpt.glob("[0-9]*")),
             120, "learner-0's first checkpoint", c)
    handovers = c.handovers
    adopted = check_rejoin(c, store, "learner-0")
    assert c.handovers == handovers  # not handed to the JAX standby
    assert adopted["incarnation"] >= 2
    assert "restored checkpoint at step" in c.log_tail("learner-0", 1_000_000)


def test_shard_kill9_resumes_versions_and_momentum(
        cluster: tuple[LocalCluster, RedisStore]) -> None:
    c, store = cluster
    before = versions(store)
    moment_before = store.get_latest(0)
    assert moment_before is not None and moment_before.momentum
    c.kill("shard-0")
    time.sleep(0.5)
    after_kill = versions(store)
    c.start("shard-0")
    start = wait_for(lambda: [e for _, e in store.events(kinds={"shard_start"})
                              if e["epoch"] > 1], 60, "shard-0 to restart", c)[-1]
    # it resumed at the stored versions (no reset to 0, no reuse)
    assert [start["versions"][str(p)] for p in range(4)] == after_kill
    assert all(a >= b for a, b in zip(after_kill, before, strict=True))
    wait_for(lambda: all(v > a for v, a in zip(versions(store), after_kill, strict=True)),
             90, "new versions after the restart", c)
    merges = store.events(kinds={"merge"})
    per_fragment: dict[int, list[int]] = {}
    for _, m in merges:
        per_fragment.setdefault(m["fragment"], []).append(m["version"])
    for vs in per_fragment.values():
        assert vs == sorted(set(vs))
    # momentum survived: the resumed shard loaded the stored, non-zero buffer
    blob = store.get_version(0, after_kill[0])
    assert blob is not None
    manifest = store.get_manifest()
    assert manifest is not None
    mom = decode_blob(blob.momentum, manifest_layout(manifest).shapes(0))
    assert any(float(abs(m).max()) > 0 for m in mom)


def test_sample_and_export_from_the_store(cluster: tuple[LocalCluster, RedisStore],
                                          redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    import subprocess
    import sys

    from safetensors.numpy import load_file

    _, store = cluster
    base = [sys.executable, "-m", "ddiloco.cli"]
    target = tmp_path / "model.safetensors"
    proc = subprocess.run([*base, "export", str(target), "--redis-url", redis_server.url,
                           "--run-id", store.run_id], capture_output=True, text=True,
                          cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    tensors = load_file(str(target))
    manifest = store.get_manifest()
    assert manifest is not None
    assert set(tensors) == {name for frag in manifest["layout"] for name, _ in frag}
    proc = subprocess.run([*base, "sample", "--redis-url", redis_server.url, "--run-id",
                           store.run_id, "--prompt", "the ", "-n", "40"], capture_output=True,
                          text=True, cwd=ROOT, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.startswith("the ") and len(proc.stdout) >= 40


def test_sigterm_drains_cleanly(cluster: tuple[LocalCluster, RedisStore]) -> None:
    c, store = cluster
    # a learner still importing has no SIGTERM handler yet (run alone, this test comes first)
    wait_for(lambda: [e for _, e in store.events(kinds={"first_step"})
                      if e["learner"] == "learner-0"], 180, "learner-0 to train", c)
    code = c.stop("learner-0", timeout_s=30)
    assert code == 0
    leave = [e for _, e in store.events(kinds={"leave"}) if e["learner"] == "learner-0"]
    assert leave and leave[-1]["tokens"] > 0
    assert "learner-0" not in store.live_learners()
