"""bench/quality.py: cell expansion, DP sharing, report parsing and aggregation on hand-built
report dicts, and ``--dry-run`` end to end (no training)."""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "quality.py"


def _load() -> ModuleType:
    spec = importlib.util.spec_from_file_location("bench_quality", SCRIPT)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses resolve their module by name
    spec.loader.exec_module(mod)
    return mod


q = _load()

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
