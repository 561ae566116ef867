"""bench/quality.py: cell expansion, DP sharing, report parsing and aggregation on hand-built
report dicts, and ``--dry-run`` end to end (no training)."""

from __future__ import annotations

import itertools
import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests._bench import load_bench

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "quality.py"


q = load_bench("quality")

BASE = {"run.learners": 4, "data.iid": False, "sync.adopt": "carry", "sync.H": 24,
        "sync.codec_up": "int4"}


def _block(loss: float, *, up: int = 800, down: int = 200, tokens: int = 1000,
           fate: dict[str, Any] | None = None, **extra: Any) -> dict[str, Any]:
    return {"learners": 4, "tokens": tokens, "wall_s": 10.0, "tokens_per_s": tokens / 10,
            "final_val_loss": loss, "val_loss": [[0, 5.5], [0, 5.4], [500, 3.0], [1000, loss]],
            "wire_bytes": {"up": up, "down": down, "total": up + down},
            "wire_bytes_per_token": (up + down) / tokens, "merges": 5,
            "merge_contributors_mean": 3.0, "token_fate": fate, **extra}


FATE = {"processed": 1000.0, "merged": 700.0,
        "discarded": {"overwritten": 150.0, "drain": 50.0, "dropped:stale": 25.0},
        "lost": {"in_flight": 50.0, "unsent_at_exit": 25.0}, "balance": 0.0}


def test_parse_list_reads_yaml_values_and_drops_repeats() -> None:
    assert q.parse_list("2,4, 8,4") == [2, 4, 8]
    assert q.parse_list("false,true") == [False, True]
    assert q.parse_list("int4,topk-d2-b2") == ["int4", "topk-d2-b2"]
    with pytest.raises(ValueError):
        q.parse_list(" , ")


def test_one_axis_at_a_time_and_same_setting_merged() -> None:
    axes = {"run.learners": [2, 4], "sync.adopt": ["overwrite", "carry"]}
    cells = q.expand_cells(axes, BASE)
    assert [c.name for c in cells] == ["M=2", "base", "adopt=overwrite"]
    assert cells[0].overrides == {"run.learners": 2}
    # M=4 and adopt=carry both spell the base setting: one cell named "base", no overrides,
    # so its runs are found again by any later grid
    assert cells[1].overrides == {} and cells[1].same_as == ()
    assert q.expand_cells({}, BASE) == [q.Cell("base", {})]


def test_full_grid_is_the_cartesian_product() -> None:
    axes = {"run.learners": [2, 4], "data.iid": [False, True], "sync.H": [24, 48]}
    cells = q.expand_cells(axes, BASE, full_grid=True)
    assert len(cells) == 8
    assert cells[0].name == "M=2,iid=false,H=24"
    assert cells[-1].overrides == {"run.learners": 4, "data.iid": True, "sync.H": 48}
    assert len({c.name for c in cells}) == 8


def test_dp_runs_once_per_learners_iid_seed() -> None:
    axes = {"run.learners": [2], "sync.adopt": ["overwrite", "mix"], "sync.H": [48],
            "data.iid": [True]}
    cells = q.expand_cells(axes, BASE)
    runs = q.plan_runs(cells, [0, 1], BASE, dp=True)
    assert len(runs) == 2 * len(cells)
    assert [r.seed for r in runs[:len(cells)]] == [0] * len(cells)
    carriers = [(r.cell, r.seed) for r in runs if r.with_dp]
    # M=2 and iid=true are their own DP groups; adopt and H cells share the base's (M=4).
    assert carriers == [("M=2", 0), ("adopt=overwrite", 0), ("iid=true", 0),
                        ("M=2", 1), ("adopt=overwrite", 1), ("iid=true", 1)]
    by = {(r.cell, r.seed): r for r in runs}
    assert by[("adopt=mix", 1)].dp_from == "adopt=overwrite"
    assert by[("H=48", 0)].dp_from == "adopt=overwrite"
    assert by[("H=48", 0)].dp_key == "M=4,iid=false,seed=0"
    assert by[("M=2", 1)].overrides == {"run.learners": 2, "train.seed": 1}
    assert not any(r.with_dp or r.dp_from for r in q.plan_runs(cells, [0], BASE, dp=False))


def test_optimizer_axes_compare_numbers_by_value_and_share_dp_unless_inner() -> None:
    base = {**BASE, "sync.outer_lr": 1.0, "sync.outer_momentum": 0.0, "sync.norm_clip": "none",
            "train.optimizer": "adamw"}
    axes = {"sync.outer_momentum": [0, 0.5], "sync.norm_clip": ["none", "median"],
            "train.optimizer": ["adamw", "muon"]}
    cells = q.expand_cells(axes, base)
    # momentum 0 (an int) is the base's 0.0: one "base" cell, not two runs of one setting
    assert [c.name for c in cells] == ["base", "mom=0.5", "clip=median", "opt=muon"]
    runs = q.plan_runs(cells, [0], base, dp=True)
    by = {r.cell: r for r in runs}
    # the outer optimizer and the norm clip are DiLoCo's: one DP; the inner optimizer is both's
    assert by["mom=0.5"].dp_from == "base" and by["clip=median"].dp_from == "base"
    assert by["opt=muon"].with_dp and by["opt=muon"].dp_key == "M=4,iid=false,opt=muon,seed=0"


def test_command_and_set_order(tmp_path: Path) -> None:
    sets = q.set_args(["sync.H=12"], 60, {"sync.H": 48, "data.iid": True})
    assert sets == ["sync.H=12", "train.steps=60", "sync.H=48", "data.iid=true"]
    argv = q.build_command("py", tmp_path / "c", Path("cfg.yaml"), sets, with_dp=True)
    assert argv[:7] == ["py", "-m", "ddiloco.cli", "run", "--out", str(tmp_path / "c"),
                        "--no-live"]
    assert argv[7:9] == ["--config", "cfg.yaml"]
    assert argv[-2:] == ["--baseline", "dp"]
    assert "--baseline" not in q.build_command("py", tmp_path, None, sets, with_dp=False)


def test_val_curve_sorted_deduplicated_finite() -> None:
    block = {"val_loss": [[500, 3.0], [0, 5.5], [0, 5.4], [700, None], [800, math.nan],
                          [1000, 2.5]]}
    assert q.val_curve(block) == [(0.0, 5.4), (500.0, 3.0), (1000.0, 2.5)]
    assert q.val_curve(None) == []


def test_mean_curve_interpolates_on_the_shared_range() -> None:
    a = [(0.0, 4.0), (100.0, 2.0)]
    b = [(0.0, 2.0), (50.0, 2.0), (200.0, 0.0)]
    avg = q.mean_curve([a, b], points=3)
    assert [x for x, _ in avg] == [0.0, 50.0, 100.0]
    # b at 100 lies on its segment from (50, 2) to (200, 0): 2 - 2 * 50 / 150.
    assert [y for _, y in avg] == pytest.approx([3.0, 2.5, (2.0 + 2.0 - 2.0 / 3) / 2])
    assert q.mean_curve([a]) == a
    assert q.mean_curve([[], []]) == []


def test_fate_shares_by_reason() -> None:
    f = q.fate_shares({"token_fate": FATE})
    assert f["merged"] == 0.7
    assert f["discarded"] == 0.225
    assert f["overwritten"] == 0.15
    assert f["other_discarded"] == 0.075
    assert f["discarded_by"] == {"overwritten": 0.15, "drain": 0.05, "dropped:stale": 0.025}
    assert f["lost"] == 0.075
    assert f["merged"] + f["discarded"] + f["lost"] == pytest.approx(1.0)
    empty = q.fate_shares({})
    assert empty["merged"] is None and empty["discarded_by"] == {}


def test_participation_prefers_the_report_field() -> None:
    assert q.participation({"merge_contributors_mean": 3.0}) == (3.0, "merge_contributors_mean")
    assert q.participation({"participation": {"histogram": {"4": 2}, "mean": 3.5},
                            "merge_contributors_mean": 3.0}) == (3.5, "participation")
    assert q.participation({"participation": 2.5}) == (2.5, "participation")
    assert q.participation({}) == (None, None)


def test_run_record_ratios() -> None:
    report = {"diloco": _block(2.2, fate=FATE), "dp": _block(2.0, up=40000, down=40000)}
    rec = q.run_record(report, report["dp"])
    assert rec["loss_ratio"] == pytest.approx(1.1)
    assert rec["bytes_ratio"] == pytest.approx(80.0)
    assert rec["down_over_up"] == pytest.approx(0.25)
    assert rec["participation"] == 3.0 and rec["participation_share"] == 0.75
    assert rec["fate"]["overwritten"] == 0.15
    assert rec["equal_tokens"] is True
    assert rec["dp"]["final_val_loss"] == 2.0
    assert rec["val_loss"][0] == (0.0, 5.4)
    alone = q.run_record({"diloco": _block(2.2)}, None)
    assert alone["dp"] is None and alone["loss_ratio"] is None and alone["bytes_ratio"] is None


def test_stats_and_aggregate_over_seeds() -> None:
    s = q.stats([1.0, None, 3.0])
    assert s == {"n": 2, "mean": 2.0, "min": 1.0, "max": 3.0, "std": pytest.approx(math.sqrt(2))}
    assert q.stats([2.0])["std"] is None
    assert q.stats([])["mean"] is None
    dp = _block(2.0, up=40000, down=40000)
    recs = [{"cell": "c", "seed": s, **q.run_record({"diloco": _block(loss, fate=FATE)}, dp)}
            for s, loss in ((0, 2.2), (1, 2.4))]
    recs.append({"cell": "c", "seed": 2, "error": "exit 2"})
    agg = q.aggregate(recs)
    assert agg["n_seeds"] == 2 and not agg["single_seed"] and agg["failed_seeds"] == [2]
    assert agg["loss_ratio"]["mean"] == pytest.approx(1.15)
    assert (agg["loss_ratio"]["min"], agg["loss_ratio"]["max"]) == pytest.approx((1.1, 1.2))
    assert agg["loss_ratio"]["std"] == pytest.approx(0.1 / math.sqrt(2))
    assert agg["final_val_loss_dp"]["mean"] == 2.0
    assert agg["fate"]["discarded"] == pytest.approx(0.225)
    head = q.headline("c", agg)
    assert head["loss_ratio_spread"] == [1.1, 1.2]
    assert head["bytes_ratio"] == 80.0 and head["participation"] == 3.0
    assert q.aggregate(recs[:1])["single_seed"]


def test_reusable_needs_report_modes_and_same_settings(tmp_path: Path) -> None:
    sets = ["train.steps=60", "train.seed=0"]
    assert not q.reusable(tmp_path, sets, None, with_dp=False)
    (tmp_path / "report.json").write_text(json.dumps({"diloco": {}}))
    assert q.reusable(tmp_path, sets, None, with_dp=False)
    assert not q.reusable(tmp_path, sets, None, with_dp=True)
    (tmp_path / q.RUN_RECORD).write_text(json.dumps({"sets": sets, "config": None}))
    assert q.reusable(tmp_path, sets, None, with_dp=False)
    assert not q.reusable(tmp_path, ["train.steps=80", "train.seed=0"], None, with_dp=False)


def test_dry_run_prints_cells_and_commands(tmp_path: Path) -> None:
    out = tmp_path / "q"
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--config", str(ROOT / "configs" / "ci-tiny.yaml"),
         "--steps", "30", "--learners", "2,3", "--adopt", "overwrite,carry", "--seeds", "0,1",
         "--set", "sync.tau=1", "--dry-run", "--out", str(out)],
        capture_output=True, text=True, timeout=60, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr
    last = json.loads(proc.stdout.strip().splitlines()[-1])
    assert last["dry_run"] is True
    # ci-tiny has M=2 and adopt carry is the default: M=2 and adopt=carry are the base cell.
    assert [c["name"] for c in last["cells"]] == ["base", "M=3", "adopt=overwrite"]
    runs = last["runs"]
    assert len(runs) == 6
    assert [(r["cell"], r["seed"]) for r in runs if r["with_dp"]] == [
        ("base", 0), ("M=3", 0), ("base", 1), ("M=3", 1)]
    cmd = runs[2]["command"]
    assert "-m ddiloco.cli run" in cmd and "--no-live" in cmd and "--baseline" not in cmd
    assert "--set sync.tau=1 --set train.steps=30 --set sync.adopt=overwrite" in cmd
    assert f"--out {out}/adopt=overwrite/seed-0" in cmd
    assert not out.exists()


def test_only_filters_and_rejects_unknown_cells(tmp_path: Path,
                                                capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--config", str(ROOT / "configs" / "ci-tiny.yaml"), "--H", "6,12", "--seeds", "0",
              "--dry-run", "--out", str(tmp_path / "q")]
    assert q.main([*common, "--only", "H=12"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [c["name"] for c in last["cells"]] == ["H=12"]
    # Alone in its selection, it carries its own DP baseline.
    assert last["runs"][0]["with_dp"] is True
    assert q.main([*common, "--only", "H=7"]) == 2
    assert "no such cell" in capsys.readouterr().err
    assert q.main([*common, "--codec", "nope"]) == 2
    assert "codec=nope" in capsys.readouterr().err


# -- the ablation ladder --------------------------------------------------------------------

SYNC = {"sync.blocking": True, "sync.min_quorum": 4, "sync.fragments": 1, "sync.tau": 0,
        "sync.codec_up": "fp32", "sync.codec_down": "fp32", "data.iid": True}


def test_ladder_rungs_add_one_feature_each() -> None:
    rungs = q.ladder_rungs(4, 32, 6e-3)
    assert [r.name for r in rungs] == ["1-dp", "2-diloco-M1", "3-sync", "4-P12", "5-tau2",
                                       "6-int4", "7-async-K1", "8-non-iid"]
    assert [r.dp for r in rungs] == [True] + [False] * 7
    by = {r.name: r.overrides for r in rungs}
    assert by["1-dp"] == {"data.iid": True}
    assert by["2-diloco-M1"] == {**SYNC, "run.learners": 1, "sync.min_quorum": 1,
                                 "train.batch_size": 128, "train.lr": 6e-3}
    assert by["3-sync"] == SYNC
    assert by["4-P12"] == {**SYNC, "sync.fragments": 12}
    assert by["5-tau2"] == {**SYNC, "sync.fragments": 12, "sync.tau": 2}
    int4 = {**SYNC, "sync.fragments": 12, "sync.tau": 2, "sync.codec_up": "int4",
            "sync.codec_down": "int4"}
    assert by["6-int4"] == int4
    assert by["7-async-K1"] == {**int4, "sync.blocking": False, "sync.min_quorum": 1}
    assert by["8-non-iid"] == {**int4, "sync.blocking": False, "sync.min_quorum": 1,
                               "data.iid": False}
    # Each rung after 3 changes exactly the fields of its feature.
    changed = [sorted(k for k in by[b] if by[a].get(k) != by[b][k])
               for a, b in itertools.pairwise([r.name for r in rungs][2:])]
    assert changed == [["sync.fragments"], ["sync.tau"], ["sync.codec_down", "sync.codec_up"],
                       ["sync.blocking", "sync.min_quorum"], ["data.iid"]]
    # K = M follows the base M; no dp_lr keeps train.lr
    two = {r.name: r.overrides for r in q.ladder_rungs(2, 8, None)}
    assert two["3-sync"]["sync.min_quorum"] == 2
    assert "train.lr" not in two["2-diloco-M1"]
    assert two["2-diloco-M1"]["train.batch_size"] == 16


def test_every_ladder_rung_is_a_valid_config() -> None:
    from ddiloco.workers.run.config import load_config

    for rung in q.ladder_rungs(4, 32, 6e-3):
        cfg = load_config(None, {**rung.overrides, "train.seed": 0})
        assert cfg.sync.blocking == rung.overrides.get("sync.blocking", False)


def test_ladder_plan_compares_every_rung_with_the_dp_rung_of_its_seed() -> None:
    rungs = q.ladder_rungs(4, 32, 6e-3)
    runs = q.plan_ladder(rungs, [0, 1])
    assert len(runs) == 16
    assert [(r.cell, r.seed) for r in runs if r.with_dp] == [("1-dp", 0), ("1-dp", 1)]
    assert {r.dp_from for r in runs} == {"1-dp"}
    assert runs[9].overrides == {**rungs[1].overrides, "train.seed": 1}
    assert q.build_command("py", Path("o"), None, ["data.iid=true"], False, dp_only=True) == [
        "py", "-m", "ddiloco.cli", "run", "--out", "o", "--no-live", "--set", "data.iid=true",
        "--baseline", "dp", "--baseline-only"]
    no_dp = q.plan_ladder(rungs[1:], [0])
    assert all(r.dp_from is None and r.dp_key is None and not r.with_dp for r in no_dp)


def test_ladder_steps_per_seed_then_over_seeds() -> None:
    losses = {"a": {0: 1.80, 1: 1.82}, "b": {0: 1.85, 1: 1.83}, "c": {0: 1.95, 1: None},
              "d": {0: 2.00}}
    steps = q.ladder_steps(losses, ["a", "b", "c", "d"])
    assert steps["a"] is None
    b = steps["b"]
    assert b["seeds"] == [0, 1]
    assert b["delta"]["mean"] == pytest.approx(0.03)  # (0.05 + 0.01) / 2
    assert (b["delta"]["min"], b["delta"]["max"]) == (pytest.approx(0.01), pytest.approx(0.05))
    assert b["delta"]["std"] == pytest.approx(math.sqrt(2 * 0.02 ** 2))
    assert b["relative"]["mean"] == pytest.approx((0.05 / 1.80 + 0.01 / 1.82) / 2)
    c = steps["c"]  # seed 1 failed on c: only seed 0 counts
    assert c["seeds"] == [0] and c["delta"]["mean"] == pytest.approx(0.10)
    assert c["delta"]["std"] is None
    assert steps["d"]["delta"]["mean"] == pytest.approx(0.05)


def test_ladder_summary_rows(tmp_path: Path) -> None:
    rungs = q.ladder_rungs(4, 32, 6e-3)[:3]
    records = [
        {"cell": "1-dp", "seed": 0, "final_val_loss": 1.80, "loss_ratio": 1.0},
        {"cell": "2-diloco-M1", "seed": 0, "final_val_loss": 1.83, "loss_ratio": 1.83 / 1.80},
        {"cell": "3-sync", "seed": 0, "error": "exit 1"},
    ]
    rows = q.ladder_summary(rungs, records)
    assert [r["rung"] for r in rows] == ["1-dp", "2-diloco-M1", "3-sync"]
    assert rows[0]["step"] is None and rows[0]["loss"]["mean"] == 1.80
    assert rows[1]["step"]["delta"]["mean"] == pytest.approx(0.03)
    assert rows[1]["loss_ratio"]["mean"] == pytest.approx(1.83 / 1.80)
    assert rows[2]["loss"]["n"] == 0 and rows[2]["step"]["delta"]["n"] == 0
    q._ladder_table(rows)  # renders with missing figures


def test_ladder_dry_run_and_refusals(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    common = ["--config", str(ROOT / "configs" / "ci-tiny.yaml"), "--seeds", "0",
              "--dry-run", "--out", str(tmp_path / "q")]
    assert q.main([*common, "--ladder"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert [r["rung"] for r in last["ladder"]][:3] == ["1-dp", "2-diloco-M1", "3-sync"]
    cmds = [r["command"] for r in last["runs"]]
    assert cmds[0].endswith("--set data.iid=true --set train.seed=0 --baseline dp "
                            "--baseline-only")
    # ci-tiny has M = 2: the synchronous rungs need K = 2
    assert "--set sync.blocking=true --set sync.min_quorum=2" in cmds[2]
    assert all("--baseline" not in c for c in cmds[1:])
    assert q.main([*common, "--ladder", "--H", "6,12"]) == 2
    assert "--ladder has its own cells" in capsys.readouterr().err
    assert q.main([*common, "--ladder", "--no-dp"]) == 0
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["ladder"][0]["rung"] == "2-diloco-M1"


def test_ladder_aggregates_finished_runs(tmp_path: Path,
                                         capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "q"
    losses = {"1-dp": 1.80, "2-diloco-M1": 1.83, "3-sync": 1.86}
    for name, loss in losses.items():
        run = out / name / "seed-0"
        run.mkdir(parents=True)
        # finished runs (no bench note: reused as they are); the DP rung holds DP alone
        report = {"dp": _block(loss)} if name == "1-dp" else {"diloco": _block(loss)}
        (run / "report.json").write_text(json.dumps(report))
    assert q.main(["--config", str(ROOT / "configs" / "ci-tiny.yaml"), "--ladder", "--seeds",
                   "0", "--only", ",".join(losses), "--out", str(out)]) == 0
    assert "The ablation ladder" in capsys.readouterr().out
    result = json.loads((out / "quality.json").read_text())
    rows = {r["rung"]: r for r in result["ladder"]}
    assert rows["1-dp"]["loss"]["mean"] == 1.80 and rows["1-dp"]["loss_ratio"]["mean"] == 1.0
    assert rows["2-diloco-M1"]["loss_ratio"]["mean"] == pytest.approx(1.83 / 1.80)
    assert rows["2-diloco-M1"]["step"]["delta"]["mean"] == pytest.approx(0.03)
    assert rows["3-sync"]["step"]["delta"]["mean"] == pytest.approx(0.03)
    assert rows["3-sync"]["step"]["relative"]["mean"] == pytest.approx(0.03 / 1.83)


def test_deterministic_applies_to_every_run_but_the_asynchronous_ones(
        tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    rungs = q.ladder_rungs(4, 32, 6e-3)
    marked = [r.name for r in rungs
              if q.deterministic_overrides(r.overrides).get("run.deterministic")]
    assert marked == ["1-dp", "2-diloco-M1", "3-sync", "4-P12", "5-tau2", "6-int4"]
    assert q.deterministic_overrides({"sync.blocking": False}) == {"sync.blocking": False}
    assert q.deterministic_overrides({}) == {"run.deterministic": True}

    common = ["--config", str(ROOT / "configs" / "ci-tiny.yaml"), "--seeds", "0",
              "--dry-run", "--out", str(tmp_path / "q")]
    assert q.main([*common, "--ladder", "--deterministic"]) == 0
    cmds = [r["command"] for r in
            json.loads(capsys.readouterr().out.strip().splitlines()[-1])["runs"]]
    assert [("run.deterministic=true" in c) for c in cmds] == [True] * 6 + [False] * 2
    # a grid cell that contradicts what the mode sets is refused before anything runs
    assert q.main([*common, "--deterministic", "--set", "sync.min_quorum=1"]) == 2
    assert "run.deterministic needs sync.min_quorum = 2" in capsys.readouterr().err
