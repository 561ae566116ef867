"""Chaos runs against real processes, real signals, a real Redis, cgroups and nftables.

1. Every fault type once, in one Decoupled DiLoCo run: each fired (its event is in the stream)
   and the system recovered from it (the target took part in a merge again, or merges resumed),
   and the post-run audit holds.
2. ``ddiloco chaos run --baseline dp`` end to end through the CLI: both modes under the same
   short kill storm, every invariant holds, and Decoupled DiLoCo keeps more goodput than
   data-parallel (which restarts the whole job after each kill).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ddiloco.chaos.faults import _CG_V1, _CG_V2
from tests.test_integration import make_corpus

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

ROOT = Path(__file__).resolve().parent.parent

#: a small model stepping in tens of milliseconds: many rounds in a short run
SMALL = ["model.d_model=32", "model.n_layers=2", "model.n_heads=2", "model.d_ff=64",
         "model.seq_len=64", "train.batch_size=16", "train.warmup_steps=10",
         "train.checkpoint_every=20", "sync.H=24", "sync.fragments=4", "run.eval_every_s=5"]


def _root_features() -> tuple[bool, bool]:
    root = os.geteuid() == 0
    cgroup = root and ((_CG_V1 / "cpu.cfs_quota_us").exists()
                       or (_CG_V2 / "cgroup.controllers").exists())
    nft = root and shutil.which("nft") is not None
    return cgroup, nft


def _overrides(tmp_path: Path, extra: list[str]) -> list[str]:
    corpus = make_corpus(tmp_path / "corpus")
    return [*SMALL, f"data.corpus={json.dumps([str(corpus)])}", "data.val_fraction=0.2",
            *extra]


def test_every_fault_type_fires_and_recovers(tmp_path: Path) -> None:
    from ddiloco.chaos.runner import run_chaos
    from ddiloco.workers.config import load_config

    cgroup, nft = _root_features()
    faults = [
        "  - {at: 6s, kill: learner-0, down: 3s}",
        "  - {at: 12s, kill: shard-1, down: 1s}",
        "  - {at: 18s, pause: learner-1, for: 5s}",
        "  - {at: 26s, kill: redis, down: 2s}",
        "  - {at: 33s, pause: redis, for: 2s}",
    ]
    if cgroup:
        faults.append("  - {at: 38s, slow: learner-0, factor: 3.0, for: 6s}")
    if nft:
        faults.append("  - {at: 46s, partition: learner-1, from: syncers, for: 5s}")
    script = tmp_path / "all.yaml"
    script.write_text("name: every-fault\nseed: 1\nduration_s: 62\nfaults:\n"
                      + "\n".join(faults) + "\n")
    cfg = load_config(None, _overrides(tmp_path, ["run.learners=2", "run.shards=2"]))
    out = tmp_path / "out"
    report = run_chaos(cfg, script, out, live=False)  # raises if an invariant fails
    d = report["modes"]["diloco"]
    assert report["ok"] and d["invariants"]["ok"], d["invariants"]
    fired = {(f["kind"], f["target"]) for f in d["faults"]}
    assert {("kill", "learner-0"), ("kill", "shard-1"), ("pause", "learner-1"),
            ("kill", "redis"), ("pause", "redis")} <= fired
    rec = {r["id"]: r for r in d["recoveries"]}
    for r in rec.values():
        if r["kind"] != "slow":
            assert r["recover_s"] is not None, f"no recovery from {r}"
    # A killed learner rejoined as a new incarnation, the killed shard resumed under a new
    # epoch, and both were noticed by the store (TTL / lease expiry).
    assert any(r["detect_s"] is not None for r in rec.values() if r["target"] == "learner-0")
    assert any(r["detect_s"] is not None for r in rec.values() if r["target"] == "shard-1")
    fate = d["token_fate"]
    assert fate["fragment_tokens"]["balance"] == 0 and fate["fragment_tokens"]["merged"] > 0
    assert fate["fragment_tokens"]["lost"].get("learner_killed", 0) >= 0
    if cgroup:
        assert ("slow", "learner-0") in fired
    if nft:
        assert ("partition", "learner-1") in fired
        part = next(r for r in rec.values() if r["kind"] == "partition")
        assert part["recover_s"] is not None
    assert (out / "chaos.png").stat().st_size > 10_000
    # Nothing is left behind: no cgroup, no nftables table, no worker process.
    if cgroup:
        root = _CG_V1 if (_CG_V1 / "cpu.cfs_quota_us").exists() else _CG_V2
        assert not list(root.glob("ddiloco-*"))
    if nft:
        tables = subprocess.run(["nft", "list", "tables"], capture_output=True, text=True)
        assert "ddiloco_" not in tables.stdout


def test_chaos_cli_both_modes_goodput(tmp_path: Path) -> None:
    corpus = make_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    args = [sys.executable, "-m", "ddiloco.cli", "chaos", "run",
            str(ROOT / "chaos" / "scripts" / "ci-storm-short.yaml"), "--baseline", "dp",
            "--out", str(out), "--no-live", "-M", "4", "-S", "2"]
    for o in [*SMALL, f"data.corpus={json.dumps([str(corpus)])}", "data.val_fraction=0.2"]:
        args += ["--set", o]
    res = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=580)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((out / "chaos.json").read_text())
    d, b = report["modes"]["diloco"], report["modes"]["dp"]
    for blk in (d, b):
        assert blk["invariants"]["ok"], blk["invariants"]
        assert blk["token_fate"]["fragment_tokens"]["balance"] == 0
        assert blk["faults_injected"] == {"kill:learner": 3, "pause:learner": 1}
    # No elasticity: the DP job stood still while the killed learner was down.
    assert b["global_downtime_s"] >= 8.0 > d["global_downtime_s"]
    assert d["goodput"] > b["goodput"], (d["goodput"], b["goodput"])
    assert (out / "chaos.png").exists()
