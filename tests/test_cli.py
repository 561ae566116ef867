"""The command line: clear one-line errors (no tracebacks), manifest refusal, status."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddiloco.store import EmbeddedRedis, RedisStore
from ddiloco.store.connect import connect
from ddiloco.workers.run.config import load_config
from ddiloco.workers.run.manifest import build_manifest

ROOT = Path(__file__).resolve().parent.parent
pytestmark = pytest.mark.timeout(120)


def ddiloco(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ddiloco.cli", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=100)


def test_unreachable_redis_is_one_clear_line() -> None:
    proc = ddiloco("learner", "--redis-url", "redis://:hunter2@127.0.0.1:1/0", "--run-id", "r",
                   "--id", "learner-0")
    assert proc.returncode == 2
    assert "cannot reach Redis" in proc.stderr
    assert "Traceback" not in proc.stderr and "hunter2" not in proc.stderr


def test_bad_config_names_the_field() -> None:
    proc = ddiloco("run", "--set", "sync.H=0", "--no-live", "--out", "/tmp/never")
    assert proc.returncode == 2
    assert "sync.H" in proc.stderr and "Traceback" not in proc.stderr


def test_worker_with_other_manifest_is_refused(redis_server: EmbeddedRedis) -> None:
    store = RedisStore(connect(redis_server.url), "cli-manifest")
    store.put_manifest(build_manifest(load_config(), "cli-manifest"))
    try:
        proc = ddiloco("syncer", "--redis-url", redis_server.url, "--run-id", "cli-manifest",
                       "--shard", "0", "--set", "sync.H=12")
        assert proc.returncode == 2
        assert "schema" in proc.stderr.lower() and "Traceback" not in proc.stderr
    finally:
        store.flush_run()


def test_status_json(redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    store = RedisStore(connect(redis_server.url), "cli-status")
    store.set_blob_location(f"file://{tmp_path}")
    store.put_manifest(build_manifest(load_config(), "cli-status"))
    args = ("status", "--redis-url", redis_server.url, "--run-id", "cli-status")
    try:
        proc = ddiloco(*args, "--json")
        assert proc.returncode == 0, proc.stderr
        st = json.loads(proc.stdout)
        assert st["run_id"] == "cli-status" and st["mode"] == "diloco"
        assert st["versions"] == [None] * 12 and st["learners"] == {}
        assert st["blobs"] == f"file://{tmp_path}" and st["blob_outage"] == {}
        # An outage seen by shard 1 (shard 0's ended) shows until that shard reports it over.
        store.add_event("blobs_unavailable", {"shard": "s0", "error": "refused"})
        store.add_event("blobs_unavailable", {"shard": "s1", "error": "[503] refused"})
        store.add_event("blobs_restored", {"shard": "s0", "outage_s": 2.0, "tries": 2})
        st = json.loads(ddiloco(*args, "--json").stdout)
        assert list(st["blob_outage"]) == ["s1"]
        assert st["blob_outage"]["s1"]["error"] == "[503] refused"
        shown = ddiloco(*args).stdout
        assert "object store unreachable from shard s1" in shown and "[503] refused" in shown
    finally:
        store.flush_run()


def test_resume_needs_a_run_directory(tmp_path: Path) -> None:
    proc = ddiloco("run", "--resume", str(tmp_path), "--no-live")
    assert proc.returncode == 2
    assert "no run.json" in proc.stderr and "Traceback" not in proc.stderr
