"""Prometheus metrics: the collectors' exposition, and a real Prometheus server scraping a
short local run, where every query of the shipped Grafana dashboard must return data."""

from __future__ import annotations

import json
import shutil
import socket
import subprocess
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry, generate_latest

from ddiloco.store import EmbeddedRedis, RedisStore
from ddiloco.store.connect import connect
from ddiloco.workers.run.config import load_config
from ddiloco.workers.run.launch import LocalCluster, metrics_port, with_run_keys
from ddiloco.workers.run.manifest import init_run
from ddiloco.workers.run.metrics import ShardCollector, drop_reasons
from tests._cluster import make_corpus, wait_for

ROOT = Path(__file__).resolve().parent.parent
DASHBOARD = ROOT / "configs" / "grafana" / "dashboards" / "ddiloco.json"


def dashboard_queries() -> list[tuple[str, str]]:
    dash = json.loads(DASHBOARD.read_text())
    return [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]


def test_metrics_ports_of_a_local_run() -> None:
    assert metrics_port(None, "learner-0") is None
    assert [metrics_port(9400, w) for w in ("shard-0", "shard-1", "evaluator", "learner-3")] \
        == [9400, 9401, 9450, 9503]


def test_shard_exposes_every_drop_reason_from_zero() -> None:
    class Core:
        def __init__(self) -> None:
            self.name, self.merges, self.merged_contributions = "shard-0", 3, 7
            self.merged_tokens, self.grace_wait_s = 900, 1.5
            self.drops = {"stale": 2}
            self.frags: dict[int, Any] = {}

    registry = CollectorRegistry()
    registry.register(ShardCollector(Core()))
    text = generate_latest(registry).decode()
    assert 'ddiloco_shard_merges_total{shard="shard-0"} 3.0' in text
    assert 'ddiloco_shard_drops_total{reason="stale",shard="shard-0"} 2.0' in text
    assert 'ddiloco_shard_drops_total{reason="spoofed_sender",shard="shard-0"} 0.0' in text
    assert {"corrupt", "stale", "merge_refused", "internal"} <= set(drop_reasons())


def _free_base(span: int = 102) -> int:
    """A base port with ``base .. base + span`` free on loopback."""
    for base in range(23000, 60000, 211):
        ok = True
        for port in (base, base + 1, base + 50, base + 100, base + 101):
            with socket.socket() as s:
                try:
                    s.bind(("127.0.0.1", port))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port range")


def _query(prom: str, expr: str) -> list[Any]:
    url = f"http://{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    with urllib.request.urlopen(url, timeout=5) as r:
        body = json.loads(r.read())
    assert body["status"] == "success", body
    return list(body["data"]["result"])


@pytest.mark.integration
@pytest.mark.timeout(300)
def test_every_dashboard_query_returns_data_from_a_real_prometheus(
        redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    binary = shutil.which("prometheus")
    if binary is None:
        pytest.skip("no prometheus binary (Debian package `prometheus`; .ci/run installs it)")
    base = _free_base()
    run_id = "it-metrics"
    cfg = with_run_keys(load_config(ROOT / "configs" / "ci-tiny.yaml", {
        "data.corpus": [str(make_corpus(tmp_path / "corpus"))], "data.val_fraction": 0.2,
        "train.steps": 100000, "run.metrics_port": base}), tmp_path)
    store = RedisStore(connect(redis_server.url), run_id)
    init_run(store, cfg, run_id)
    cluster = LocalCluster.for_run(cfg, redis_server.url, run_id, tmp_path)
    targets = cluster.metrics_targets()
    assert set(targets) == {"shard-0", "evaluator", "learner-0", "learner-1"}
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        prom = f"127.0.0.1:{s.getsockname()[1]}"
    (tmp_path / "prometheus.yml").write_text(json.dumps({
        "global": {"scrape_interval": "1s", "evaluation_interval": "1s"},
        "scrape_configs": [{"job_name": "ddiloco", "static_configs": [
            {"targets": [addr], "labels": {"worker": name}} for name, addr in targets.items()]}],
    }))
    log = (tmp_path / "prometheus.log").open("wb")
    proc = subprocess.Popen([binary, f"--config.file={tmp_path / 'prometheus.yml'}",
                             f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                             f"--web.listen-address={prom}"], stdout=log, stderr=log)
    cluster.start_all()
    try:
        wait_for(lambda: len(store.events(kinds={"merge"})) >= 6
                 and store.events(kinds={"eval"}), 120, "merges and an evaluation", cluster)
        wait_for(lambda: len(_query(prom, "up == 1")) == len(targets), 60,
                 "Prometheus to scrape every worker", cluster)
        time.sleep(5)  # a few more scrapes, so rates over [1m] have two points after merges
        empty = [(title, expr) for title, expr in dashboard_queries() if not _query(prom, expr)]
        assert not empty, f"dashboard queries without data: {empty}"
        loss = _query(prom, "ddiloco_eval_loss")
        assert 0 < float(loss[0]["value"][1]) < 6
    finally:
        cluster.stop_all()
        proc.terminate()
        proc.wait(10)
        store.flush_run()
