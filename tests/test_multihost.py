"""A learner made of two ``jax.distributed`` processes joins a real run (one shard, Redis):
process 0 talks to the shard and the store, process 1 computes on its own device, and the
learner's outer gradients are merged."""

from __future__ import annotations

import socket
import subprocess
import sys
from pathlib import Path

import pytest

from ddiloco.store import EmbeddedRedis, RedisStore
from ddiloco.store.connect import connect
from ddiloco.workers.run.config import load_config
from ddiloco.workers.run.launch import LocalCluster, with_run_keys
from ddiloco.workers.run.manifest import init_run
from tests._cluster import make_corpus, wait_for

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parent.parent


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_two_process_learner_joins_and_is_merged(redis_server: EmbeddedRedis,
                                                 tmp_path: Path) -> None:
    run_id = "it-multihost"
    cfg = with_run_keys(load_config(ROOT / "configs" / "ci-tiny.yaml", {
        "run.learners": 1, "data.corpus": [str(make_corpus(tmp_path / "corpus"))],
        "data.val_fraction": 0.2, "sync.merge_every": 0.0}), tmp_path)
    store = RedisStore(connect(redis_server.url), run_id)
    init_run(store, cfg, run_id)
    cluster = LocalCluster(redis_server.url, run_id, tmp_path)
    cluster.add_syncer(0)
    cluster.start_all()
    env = {**cluster._env(), "XLA_FLAGS": "--xla_force_host_platform_device_count=1"}
    coord = f"127.0.0.1:{free_port()}"
    procs = []
    logs = [tmp_path / f"p{i}.log" for i in range(2)]
    try:
        for i in range(2):
            procs.append(subprocess.Popen(
                [sys.executable, "-m", "ddiloco.cli", "learner", "--redis-url",
                 redis_server.url, "--run-id", run_id, "--id", "learner-0", "--run-dir",
                 str(tmp_path), "--steps", "40", "--coordinator", coord, "--num-processes", "2",
                 "--process-id", str(i)], stdout=logs[i].open("wb"), stderr=subprocess.STDOUT,
                env=env, cwd=ROOT))
        for p, log in zip(procs, logs, strict=True):
            rc = p.wait(timeout=240)
            assert rc == 0, log.read_text()[-3000:]
        leader, follower = (log.read_text() for log in logs)
        # the follower computed the same 40 steps on its own device and never registered
        assert "learner-0.p1" in follower and '"step": 40' in follower
        assert "on 2 cpu device(s)" in leader and "on 2 cpu device(s)" in follower
        joins = [e for _, e in store.events(kinds={"join"}) if e["learner"] == "learner-0"]
        assert len(joins) == 1
        merged = wait_for(lambda: [m for _, m in store.events(kinds={"merge"})
                                   if "learner-0" in m.get("contributors", [])],
                          60, "a merge of the two-process learner's delta", cluster)
        assert merged
        assert store.counters("tokens").get("learner-0") == 40 * 8 * 32
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
        cluster.stop_all()
        store.flush_run()
