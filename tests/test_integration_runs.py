"""Integration tests that start runs of their own (real processes, sockets and Redis): a user
task's learner killed and rejoined, the data-parallel mode, `ddiloco finish`, upload pacing.
They are apart from test_integration.py so that its shared, open-ended cluster has stopped
before they start.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from ddiloco.store import EmbeddedRedis, RedisStore
from ddiloco.store.connect import connect
from ddiloco.workers.run.launch import LocalCluster
from tests._cluster import ROOT, check_rejoin, start_cluster, versions, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]


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


def test_a_user_tasks_learner_kill9_rejoins_with_store_versions(
        bpe_cluster: tuple[LocalCluster, RedisStore]) -> None:
    """The rejoin of test_integration.py, for a user model through the task API."""
    c, store = bpe_cluster
    check_rejoin(c, store)
    manifest = store.get_manifest()
    assert manifest is not None
    assert manifest["task"]["name"] == "nnx-bpe4k" and manifest["model"] is None
    evals = wait_for(lambda: store.events(kinds={"eval"}), 60, "an evaluation", c)
    assert all(np.isfinite(e["loss"]) for _, e in evals)


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
