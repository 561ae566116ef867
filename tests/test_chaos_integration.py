"""Chaos runs against real processes, real signals, a real Redis, cgroups and nftables.

1. Every fault type once, in Decoupled DiLoCo runs: each fired (its event is in the stream)
   and the system recovered from it (the target took part in a merge again, or merges resumed),
   and the post-run audit holds. The kills and pauses need nothing; the CPU slowdown and the
   partition need root (cgroups, nftables) and are their own test, marked ``root``.
2. The object store that holds the blobs (``store.blobs = embedded-s3``) killed and restarted:
   the shards report the outage and its end, merges resume, and no head points at a missing
   object. Then Redis lost with its data and rebuilt from that object store: nothing
   acknowledged lost, merges resume.

The CLI's run of both modes under the CI storm, whose goodput the assertions judge, is
``tests/test_chaos_goodput.py`` (marker ``serial``: it runs alone).
"""

from __future__ import annotations

import json
import shutil
import subprocess
from pathlib import Path
from typing import Any

import pytest

from ddiloco.chaos.faults import _CG_V1, _CG_V2
from tests._cluster import make_corpus

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parent.parent

#: a small model stepping in tens of milliseconds: many rounds in a short run
SMALL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
         "model.seq_len=64", "train.batch_size=16", "train.warmup_steps=10",
         "train.checkpoint_every=20", "sync.H=24", "sync.fragments=4", "run.eval_every_s=5"]


def _overrides(tmp_path: Path, extra: list[str]) -> list[str]:
    corpus = make_corpus(tmp_path / "corpus")
    return [*SMALL, f"data.corpus={json.dumps([str(corpus)])}", "data.val_fraction=0.2",
            *extra]


def _run_script(tmp_path: Path, name: str, duration_s: int,
                faults: list[str], extra: tuple[str, ...] = ()) -> tuple[dict[str, Any], Path]:
    """One Decoupled DiLoCo chaos run (2 learners, 2 shards) of ``faults``; returns the
    DiLoCo block of the report (after the audit held) and the output folder. ``extra``: more
    configuration overrides."""
    from ddiloco.chaos.runner import run_chaos
    from ddiloco.workers.run.config import load_config

    script = tmp_path / f"{name}.yaml"
    script.write_text(f"name: {name}\nseed: 1\nduration_s: {duration_s}\nfaults:\n"
                      + "\n".join(faults) + "\n")
    cfg = load_config(None, _overrides(tmp_path, ["run.learners=2", "run.shards=2", *extra]))
    out = tmp_path / "out"
    report = run_chaos(cfg, script, out, live=False)  # raises if an invariant fails
    d = report["modes"]["diloco"]
    assert report["ok"] and d["invariants"]["ok"], d["invariants"]
    assert (out / "chaos.png").stat().st_size > 10_000
    return d, out


def test_every_fault_type_fires_and_recovers(tmp_path: Path) -> None:
    """The faults that need no privilege: kills and pauses of learners, shards and Redis."""
    d, _ = _run_script(tmp_path, "every-fault", 34, [
        "  - {at: 5s, kill: learner-0, down: 3s}",
        "  - {at: 10s, kill: shard-1, down: 1s}",
        "  - {at: 14s, pause: learner-1, for: 4s}",
        "  - {at: 20s, kill: redis, down: 2s}",
        "  - {at: 26s, pause: redis, for: 2s}",
    ])
    fired = {(f["kind"], f["target"]) for f in d["faults"]}
    assert fired == {("kill", "learner-0"), ("kill", "shard-1"), ("pause", "learner-1"),
                     ("kill", "redis"), ("pause", "redis")}
    assert d["faults_injected"] == {"kill:learner": 1, "kill:shard": 1, "pause:learner": 1,
                                    "kill:redis": 1, "pause:redis": 1}
    rec = {r["id"]: r for r in d["recoveries"]}
    assert len(rec) == 5
    for r in rec.values():
        assert r["recover_s"] is not None, f"no recovery from {r}"
    # A killed learner rejoined as a new incarnation, the killed shard resumed under a new
    # epoch, and both were noticed by the store (TTL / lease expiry).
    assert any(r["detect_s"] is not None for r in rec.values() if r["target"] == "learner-0")
    assert any(r["detect_s"] is not None for r in rec.values() if r["target"] == "shard-1")
    fate = d["token_fate"]
    assert fate["fragment_tokens"]["balance"] == 0 and fate["fragment_tokens"]["merged"] > 0
    # SIGKILL gives learner-0 no drain: the work of its fragments not yet sent is lost, and
    # with staggered fragments some fragment always has unsent steps.
    assert fate["fragment_tokens"]["lost"]["learner_killed"] > 0


def test_an_object_store_outage_and_a_lost_redis_are_ridden_out(tmp_path: Path) -> None:
    """The blobs' S3 server (SeaweedFS, started by the runner) killed -9 for 4 s, then started
    again on its data: the shards report the outage once and its end once, merges resume past
    the versions before it, and every head and kept version reads back from the objects.
    Later Redis is killed with its data deleted (``wipe``) and rebuilt from the object store:
    no acknowledged head is lost and merges go on past it."""
    from ddiloco.store.connect import connect
    from ddiloco.store.embedded import EmbeddedRedis
    from ddiloco.store.redis_store import RedisStore

    d, out = _run_script(tmp_path, "blobs-outage", 30, ["  - {at: 5s, kill: blobs, down: 4s}",
                                                        "  - {at: 16s, wipe: redis, down: 2s}"],
                         extra=("store.blobs=embedded-s3",))
    assert d["faults_injected"] == {"kill:blobs": 1, "wipe:redis": 1}
    rec = next(r for r in d["recoveries"] if r["target"] == "blobs")
    assert rec["recover_s"] is not None
    assert rec["detect_s"] is not None  # a shard's blobs_unavailable
    rebuilds = next(i for i in d["invariants"]["invariants"] if i["name"] == "rebuilds")
    assert rebuilds["ok"] and rebuilds["evidence"]["rebuilds"] == 1, rebuilds
    objects = next(i for i in d["invariants"]["invariants"] if i["name"] == "objects")
    assert objects["ok"] and objects["evidence"]["location"].startswith("s3://")
    assert objects["evidence"]["read"]["heads"] == 4 and objects["evidence"]["objects"] > 0
    report = json.loads((out / "chaos.json").read_text())
    assert report["config"]["store"]["blobs"] == "embedded-s3"
    assert report["blobs"].startswith("s3://")
    # The event stream, from the run's Redis (the runner stopped it; its AOF holds the run).
    with EmbeddedRedis(out / "redis", fsync="always") as server:
        store = RedisStore(connect(server.url), d["run_id"])
        events = sorted((e for _, e in store.events()), key=lambda e: e["t"])
    kill = next(e for e in events if e["kind"] == "fault" and e.get("phase") == "inject")
    (rebuilt,) = [e for e in events if e["kind"] == "rebuilt"]
    assert rebuilt["lost"] == [] and rebuilt["before"], rebuilt
    assert any(int(e["version"]) > int(rebuilt["after"][str(e["fragment"])])
               for e in events if e["kind"] == "merge" and e["t"] > rebuilt["t"]), \
        "no merge past the rebuilt heads"
    down = [e for e in events if e["kind"] == "blobs_unavailable"]
    back = [e for e in events if e["kind"] == "blobs_restored"]
    assert down and back, "the shards reported no outage of the object store"
    assert all(e["t"] >= kill["t"] for e in down + back)
    assert len(down) == len(back) <= 2  # once per shard that noticed, not per try
    assert all(e["outage_s"] > 0 and e["tries"] >= 1 for e in back)
    merges = [e for e in events if e["kind"] == "merge"]
    before = {int(e["fragment"]): int(e["version"]) for e in merges if e["t"] < kill["t"]}
    restored = max(e["t"] for e in back)
    after = [e for e in merges if e["t"] > restored]
    assert after, "no merge after the object store came back"
    assert any(int(e["version"]) > before.get(int(e["fragment"]), -1) for e in after)


@pytest.mark.root
def test_root_faults_fire_recover_and_leave_nothing(tmp_path: Path) -> None:
    """The faults that need root: a CPU slowdown (cgroup quota) and a partition (nftables).
    Off-root this test is skipped with the command that runs it; as root a missing cgroup
    controller or nft fails it."""
    cgroup = (_CG_V1 / "cpu.cfs_quota_us").exists() or (_CG_V2 / "cgroup.controllers").exists()
    assert cgroup, "no cgroup cpu controller: the slow fault cannot run"
    assert shutil.which("nft") is not None, "nft is not installed (apt-get install nftables)"
    d, _ = _run_script(tmp_path, "root-faults", 23, [
        "  - {at: 5s, slow: learner-0, factor: 3.0, for: 5s}",
        "  - {at: 11s, partition: learner-1, from: syncers, for: 5s}",
    ])
    fired = {(f["kind"], f["target"]) for f in d["faults"]}
    assert fired == {("slow", "learner-0"), ("partition", "learner-1")}
    part = next(r for r in d["recoveries"] if r["kind"] == "partition")
    assert part["recover_s"] is not None
    assert d["token_fate"]["fragment_tokens"]["balance"] == 0
    # Nothing is left behind: no cgroup, no nftables table.
    root = _CG_V1 if (_CG_V1 / "cpu.cfs_quota_us").exists() else _CG_V2
    assert not list(root.glob("ddiloco-*"))
    tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True)
    assert "ddiloco_" not in tables.stdout
