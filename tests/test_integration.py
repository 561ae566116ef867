"""Real processes, real sockets, a real Redis: 2 learners + 1 syncer shard + the evaluator.

One cluster is shared by the tests of this module (JAX start-up dominates their cost); they run
in file order: training progresses, a learner is killed with SIGKILL and rejoins, the shard is
killed with SIGKILL and resumes. The data-parallel mode has its own small run.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ddiloco.store import EmbeddedRedis, RedisStore
from ddiloco.store.connect import connect
from ddiloco.store.embedded_s3 import EmbeddedS3
from ddiloco.workers.run.blobs import decode_blob, digest
from ddiloco.workers.run.config import load_config
from ddiloco.workers.run.launch import LocalCluster, with_run_keys
from ddiloco.workers.run.manifest import init_run

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the king doth wake tonight and all the court is merry with wine and song "
         "but hark what light through yonder window breaks it is the east ").split()


def make_corpus(path: Path) -> Path:
    """Six small plays of pseudo-English (the real corpus is exercised by test_data)."""
    path.mkdir(parents=True, exist_ok=True)
    for i in range(6):
        words = [WORDS[(i * 7 + j * j + j // 3) % len(WORDS)] for j in range(6000)]
        lines = [" ".join(words[k:k + 10]) for k in range(0, len(words), 10)]
        (path / f"play_{i}.txt").write_text(f"ACT {i}.\n\n" + "\n".join(lines) + "\n")
    return path


def wait_for(pred: Callable[[], Any], timeout_s: float, what: str,
             cluster: LocalCluster | None = None) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.25)
    logs = ""
    if cluster is not None:
        logs = "\n".join(f"--- {n}\n{cluster.log_tail(n, 1500)}" for n in cluster.workers)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n{logs}")


def start_cluster(server: EmbeddedRedis, run_dir: Path, run_id: str,
                  overrides: dict[str, Any]) -> tuple[LocalCluster, RedisStore]:
    corpus = make_corpus(run_dir / "corpus")
    cfg = load_config(ROOT / "configs" / "ci-tiny.yaml",
                      {**overrides, "data.corpus": [str(corpus)], "data.val_fraction": 0.2})
    cfg = with_run_keys(cfg, run_dir)
    store = RedisStore(connect(server.url), run_id)
    init_run(store, cfg, run_id)
    cluster = LocalCluster(server.url, run_id, run_dir)
    for s in range(cfg.run.shards):
        cluster.add_syncer(s)
    cluster.add_evaluator(cfg.run.eval_every_s)
    for m in range(cfg.run.learners):
        cluster.add_learner(m)
    cluster.start_all()
    return cluster, store


@pytest.fixture(scope="module")
def cluster(redis_server: EmbeddedRedis, s3_server: EmbeddedS3,
            tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[LocalCluster, RedisStore]]:
    run_dir = tmp_path_factory.mktemp("run")
    # a long history so the versions a rejoining learner adopted are still there to compare;
    # the blobs on a real S3 server (Redis blobs run in the other integration suites)
    c, store = start_cluster(redis_server, run_dir, "it-diloco",
                             {"train.steps": 100000, "sync.history": 512,
                              # an open-ended run: a cadence of seconds, not of its budget
                              "run.eval_every_tokens": 0,
                              # momentum on, so a shard's resume of it is checked
                              "sync.outer_momentum": 0.5, "sync.outer_lr": 0.7,
                              "store.blobs": s3_server.url("it-diloco")})
    try:
        yield c, store
    finally:
        c.stop_all()
        store.flush_run()


def versions(store: RedisStore) -> list[int]:
    return [h.version if h else -1 for h in store.heads(4)]


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


@pytest.fixture
def bpe_cluster(redis_server: EmbeddedRedis, tmp_path: Path,
                monkeypatch: pytest.MonkeyPatch) -> Iterator[tuple[LocalCluster, RedisStore]]:
    """A run of the user-model example examples/bpe_transformer.py (Flax NNX transformer,
    BPE tokens), through the task API: the same rejoin test must pass for it."""
    monkeypatch.setenv("DDILOCO_CACHE_DIR", str(tmp_path / "cache"))  # the tokenizer's cache
    c, store = start_cluster(redis_server, tmp_path, "it-user-task", {
        "train.steps": 100000, "sync.history": 512, "sync.merge_every": 0.0,
        "store.blobs": f"file://{tmp_path / 'blobs'}",
        "model.task": str(ROOT / "examples" / "bpe_transformer.py") + ":task"})
    try:
        yield c, store
    finally:
        c.stop_all()
        store.flush_run()


@pytest.mark.parametrize("model", ["builtin", "user-task"])
def test_learner_kill9_rejoins_with_store_versions(model: str,
                                                   request: pytest.FixtureRequest) -> None:
    c, store = request.getfixturevalue("cluster" if model == "builtin" else "bpe_cluster")
    wait_for(lambda: "learner-1" in store.live_learners()
             and store.live_learners()["learner-1"].get("step", 0) > 3, 120,
             "learner-1 training", c)
    c.kill("learner-1")
    assert not c.workers["learner-1"].alive
    wait_for(lambda: "learner-1" not in store.live_learners(), 20, "learner-1's TTL to expire", c)
    c.start("learner-1")
    adopted = wait_for(
        lambda: [e for _, e in store.events(kinds={"adopted"})
                 if e["learner"] == "learner-1" and e["incarnation"] >= 2],
        120, "learner-1 to rejoin", c)[-1]
    # every fragment it adopted is bit-identical to the store's version it names
    manifest = store.get_manifest()
    assert manifest is not None
    from ddiloco.workers.run.manifest import manifest_layout

    layout = manifest_layout(manifest)
    for p, v in enumerate(adopted["versions"]):
        blob = store.get_version(p, v)
        assert blob is not None, f"fragment {p} version {v} was garbage-collected too soon"
        assert digest(decode_blob(blob.value, layout.shapes(p))) == adopted["digests"][str(p)]
    # and it trains again, and its deltas are merged
    wait_for(lambda: store.live_learners().get("learner-1", {}).get("step", 0)
             > adopted["step"] + 5, 90, "learner-1 to train after rejoining", c)
    wait_for(lambda: any(x["learner"] == "learner-1" and x["inc"] >= 2
                         for _, m in store.events(kinds={"merge"})
                         for x in m.get("contributions", [])),
             90, "a merge of the rejoined learner-1's delta", c)
    if model == "user-task":
        assert manifest["task"]["name"] == "nnx-bpe4k" and manifest["model"] is None
        evals = wait_for(lambda: store.events(kinds={"eval"}), 60, "an evaluation", c)
        assert all(np.isfinite(e["loss"]) for _, e in evals)


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
    from ddiloco.workers.run.manifest import manifest_layout

    mom = decode_blob(blob.momentum, manifest_layout(manifest).shapes(0))
    assert any(float(abs(m).max()) > 0 for m in mom)


def test_sigterm_drains_cleanly(cluster: tuple[LocalCluster, RedisStore]) -> None:
    c, store = cluster
    code = c.stop("learner-0", timeout_s=30)
    assert code == 0
    leave = [e for _, e in store.events(kinds={"leave"}) if e["learner"] == "learner-0"]
    assert leave and leave[-1]["tokens"] > 0
    assert "learner-0" not in store.live_learners()


def test_data_parallel_mode_runs(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    c, store = start_cluster(redis_server, tmp_path, "it-dp",
                             {"run.mode": "dp", "train.steps": 30, "run.dp_publish_every": 5})
    try:
        assert c.wait(c.names("learner"), timeout_s=200), "DP learners did not finish"
        for n in c.names("learner"):
            assert c.workers[n].proc is not None and c.workers[n].proc.returncode == 0, \
                c.log_tail(n)
        assert min(versions(store)) >= 5  # 30 steps / publish every 5
        wire = store.counters("wire")
        assert int(wire["up"]) > 0 and int(wire["down"]) > 0
    finally:
        c.stop_all()
        store.flush_run()


def test_finish_ends_a_run_through_the_store(redis_server: EmbeddedRedis,
                                             tmp_path: Path) -> None:
    """`ddiloco finish` (compose's end of run): real learners reach their budget, then the
    shards and the evaluator, asked through the store and never signalled, stop on their own
    with code 0 after their final merges and evaluation, and the report is written."""
    from ddiloco.finish import finish_run

    c, store = start_cluster(redis_server, tmp_path, "it-finish", {"train.steps": 24})
    try:
        report = finish_run(store, tmp_path / "out", learners_timeout_s=240,
                            stop_timeout_s=90, say=lambda msg: None)
        for name in [*c.names("shard"), "evaluator"]:
            assert c.wait([name], timeout_s=30), f"{name} did not stop:\n{c.log_tail(name)}"
            proc = c.workers[name].proc
            assert proc is not None and proc.returncode == 0, c.log_tail(name)
        block = report["diloco"]
        assert set(block["per_learner"]) == {"learner-0", "learner-1"}
        assert all(r["tokens"] == 24 * 8 * 32 for r in block["per_learner"].values())
        assert block["merges"] > 0 and block["final_val_loss"] is not None
        assert (tmp_path / "out" / "report.json").exists()
        stops = [e for _, e in store.events(kinds={"shard_stop", "evaluator_stop"})]
        assert {e.get("shard", "evaluator") for e in stops} >= {"shard-0", "evaluator"}
    finally:
        c.stop_all()
        store.flush_run()


def test_upload_pacing_caps_each_learners_rate(redis_server: EmbeddedRedis,
                                               tmp_path: Path) -> None:
    """``sync.upload_bps``: a learner's delta uploads stay under the cap (one message of slack);
    deltas that may not go yet fold into newer ones, and training does not wait for them."""
    cap_bps = 40_000.0
    c, store = start_cluster(redis_server, tmp_path, "it-paced",
                             {"train.steps": 150, "sync.upload_bps": cap_bps})
    try:
        assert c.wait(c.names("learner"), timeout_s=200), "learners did not finish"
        events = [e for _, e in store.events(kinds={"join", "leave"})]
        for name in c.names("learner"):
            join = next(e for e in events if e["kind"] == "join" and e["learner"] == name)
            leave = next(e for e in events if e["kind"] == "leave" and e["learner"] == name)
            seconds = leave["t"] - join["t"]
            rate = leave["bytes_up"] * 8 / seconds
            print(f"{name}: {leave['bytes_up']:,} B up in {seconds:.1f} s = {rate:,.0f} bit/s "
                  f"(cap {cap_bps:,.0f}); {leave['deltas_sent']} sent, "
                  f"{leave['deltas_folded']} folded, {leave['step']} steps")
            biggest = 16 * 1024  # an int4 fragment of ci-tiny with its header, generously
            assert leave["bytes_up"] <= cap_bps / 8 * seconds + biggest
            assert leave["deltas_folded"] > 0 and leave["step"] == 150
        assert min(versions(store)) > 0
    finally:
        c.stop_all()
        store.flush_run()


def test_unreachable_redis_is_a_clear_error() -> None:
    from ddiloco.pipeline.errors import StoreUnavailable

    with pytest.raises(StoreUnavailable, match="cannot reach Redis"):
        connect("redis://127.0.0.1:1/0", attempts=2)




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
