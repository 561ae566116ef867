"""bench/scale.py end to end at its smallest size: real shards, Redis and file blobs, synthetic
learners, one JSON object out."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.integration, pytest.mark.timeout(120)]

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "scale.py"

KEYS = {
    "params", "backend", "periods_completed", "versions", "merge_s_per_fragment",
    "merge_s_per_period", "merge_fp32_gbps_per_core", "publish_s", "publish_bytes",
    "publish_gbps", "redis_used_memory_bytes", "object_store_bytes", "rejoin_s",
    "shard_peak_rss_bytes", "learner_peak_rss_bytes", "shard_peak_rss_ratio",
    "disk_fdatasync_gbps", "disk_fdatasync_burst_gbps", "publish_total_bytes",
}


def test_tiny_run_on_files(tmp_path: Path) -> None:
    out = tmp_path / "scale.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--size", "tiny", "--backend", "file", "--periods", "1",
         "--learners", "2", "--shards", "2", "--timeout-s", "45", "--fdatasync-mib", "64",
         "--workdir", str(tmp_path / "work"), "--json", str(out)],
        capture_output=True, text=True, timeout=110, cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert KEYS <= set(res), sorted(KEYS - set(res))
    assert "error" not in res, res["error"]
    assert res["backend"] == "file"
    assert res["params"] > 500_000
    assert res["periods_completed"] >= 1
    assert min(res["versions"]) >= 1
    assert res["full_rounds"] == res["merges"]  # K = M: every merge holds every learner
    # a fragment's value blob, not a count of its parts (a publish may pass it as parts)
    assert res["publish_bytes"] > 1000
    assert res["object_store_bytes"] > 0
    assert res["rejoin_versions"] == res["versions"]
    assert set(res["shard_peak_rss_bytes"]) == {"shard-0", "shard-1"}
    assert not any((tmp_path / "work").iterdir())  # the run's directory went without --keep


def test_the_disk_measurement_splits_burst_from_sustained(tmp_path: Path) -> None:
    import importlib.util

    spec = importlib.util.spec_from_file_location("bench_scale", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    rates = mod.fdatasync_gbps(tmp_path, total=4 << 20, chunk=1 << 20, burst=2 << 20)
    assert set(rates) == {"all", "burst", "sustained"} and min(rates.values()) > 0
    assert not list(tmp_path.iterdir())  # its file is gone
    # nothing after the burst: no sustained figure
    assert set(mod.fdatasync_gbps(tmp_path, total=2 << 20, chunk=1 << 20,
                                  burst=2 << 20)) == {"all", "burst"}


PUBLISH_KEYS = {
    "params", "fragments", "file_publish_gbps", "file_publish_gbps_reps", "s3_publish_gbps",
    "s3_publish_gbps_reps", "s3_over_file", "s3_over_file_reps", "s3_server_cpu_s_per_gb",
    "s3_plain_put_gbps_reps", "s3_multipart_put_gbps_reps", "rejoin_s3_s_reps",
    "rejoin_file_s_reps", "rejoin_bytes", "publish_bytes_per_rep",
}


def test_publish_only_compares_s3_with_files_in_one_run(tmp_path: Path) -> None:
    out = tmp_path / "publish.json"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--backend", "s3", "--publish-only", "--sizes", "tiny",
         "--reps", "1", "--workdir", str(tmp_path / "work"), "--json", str(out)],
        capture_output=True, text=True, timeout=110, cwd=ROOT,
        env={**os.environ, "PYTHONUNBUFFERED": "1"})
    assert proc.returncode == 0, proc.stderr[-3000:]
    res = json.loads(out.read_text())
    assert "error" not in res, res["error"]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == res  # the JSON line
    tiny = res["sizes"]["tiny"]
    assert PUBLISH_KEYS <= set(tiny), sorted(PUBLISH_KEYS - set(tiny))
    assert tiny["s3_over_file"] == pytest.approx(
        tiny["s3_publish_gbps"] / tiny["file_publish_gbps"], rel=0.02)
    assert tiny["rejoin_bytes"] == tiny["publish_bytes_per_rep"]  # every fragment's latest
    assert not any((tmp_path / "work").iterdir())


def test_publish_only_needs_the_s3_backend() -> None:
    proc = subprocess.run([sys.executable, str(SCRIPT), "--backend", "file", "--publish-only"],
                          capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert proc.returncode == 2 and "--publish-only compares --backend s3" in proc.stderr
