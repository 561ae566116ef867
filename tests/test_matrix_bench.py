"""bench/matrix.py: cells, plan, DP tuning, medians and the rule for a new default."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from tests._bench import load_bench

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "bench" / "matrix.py"
CI = str(ROOT / "configs" / "ci-tiny.yaml")


m = load_bench("matrix")

BASE: dict[str, Any] = {"train": {"dp_lr": 6e-3, "lr": 3e-3, "batch_size": 32},
                        "run": {"learners": 4}, "model": {"preset": "tiny", "seq_len": None}}


def test_dp_rate_scales_with_the_square_root_of_the_global_batch_in_tokens() -> None:
    assert m.scaled_dp_lr(6e-3, 8192, 8192) == 6e-3
    assert m.scaled_dp_lr(6e-3, 8192, 2 * 8192) == pytest.approx(6e-3 * math.sqrt(2))
    with pytest.raises(ValueError):
        m.scaled_dp_lr(6e-3, 0, 8192)
    cells = {c.name: c for c in m.matrix_cells(BASE)}
    assert list(cells) == ["default", "iid", "seq128-b16", "M2", "M8", "small"]
    # 4 x 32 x 64 = 8192 tokens per DP step; seq 128 x batch 16 and small's 8 x 256 keep it
    assert cells["default"].dp_lr == cells["seq128-b16"].dp_lr == cells["small"].dp_lr == 6e-3
    assert cells["M2"].dp_lr == pytest.approx(6e-3 / math.sqrt(2), rel=1e-3)  # 0.004243
    assert cells["M8"].dp_lr == pytest.approx(6e-3 * math.sqrt(2), rel=1e-3)  # 0.008485
    assert [c.name for c in m.matrix_cells(BASE, ["M8", "iid"])] == ["iid", "M8"]
    with pytest.raises(ValueError, match="no such cell: M16"):
        m.matrix_cells(BASE, ["M16"])


def test_plan_tunes_then_runs_dp_per_seed_then_both_variants() -> None:
    cell = m.MatrixCell("M2", {"run.learners": 2}, 4.2e-3)
    runs = m.plan_matrix([cell], [0, 1], 2, {"sync.min_quorum": 2}, None)
    assert [(r.kind, r.seed, r.repeat) for r in runs] == [
        ("dp", 0, 0), ("dp", 1, 0),
        ("default", 0, 0), ("candidate", 0, 0), ("default", 0, 1), ("candidate", 0, 1),
        ("default", 1, 0), ("candidate", 1, 0), ("default", 1, 1), ("candidate", 1, 1)]
    assert runs[0].overrides == {"run.learners": 2, "train.seed": 0, "train.dp_lr": 4.2e-3}
    assert runs[3].overrides == {"sync.min_quorum": 2, "run.learners": 2, "train.seed": 0}
    # the cell's own overrides win over the candidate's
    clash = m.plan_matrix([cell], [0], 1, {"run.learners": 4}, None)
    assert clash[-1].overrides["run.learners"] == 2
    tuned = m.plan_matrix([cell], [3, 4], 1, None, [1e-3, 2e-3])
    assert [(r.kind, r.seed, r.dp_lr) for r in tuned] == [
        ("tune", 3, 1e-3), ("tune", 3, 2e-3), ("dp", 3, None), ("dp", 4, None),
        ("default", 3, None), ("default", 4, None)]
    out = Path("/o")
    assert tuned[1].path(out) == out / "M2" / "tune" / "lr-0.002"
    assert runs[4].path(out) == out / "M2" / "default" / "seed-0-r1"
    assert runs[1].path(out) == out / "M2" / "dp" / "seed-1"
    # --dp-set: the DP runs only (tuning included), under the cell's own overrides
    dp_set = m.plan_matrix([cell], [0], 1, {"train.lr": 8.5e-3}, [1e-3],
                           {"train.warmup_fraction": 0.25, "run.learners": 3})
    assert [r.overrides.get("train.warmup_fraction") for r in dp_set] == [0.25, 0.25, None, None]
    assert dp_set[0].overrides["run.learners"] == 2
    with pytest.raises(ValueError):
        m.plan_matrix([cell], [], 1, None)
    with pytest.raises(ValueError):
        m.plan_matrix([cell], [0], 0, None)


def test_pick_dp_lr_lowest_finite_loss_ties_to_the_smaller_rate() -> None:
    assert m.pick_dp_lr({3e-3: 1.90, 6e-3: 1.85, 1.2e-2: None}) == 6e-3
    assert m.pick_dp_lr({6e-3: 1.85, 3e-3: 1.85, 1e-2: float("nan")}) == 3e-3
    with pytest.raises(ValueError, match="no DP rate finished"):
        m.pick_dp_lr({3e-3: None, 6e-3: float("inf")})


def test_summary_median_and_spread() -> None:
    s = m.summary([2.0, None, 1.9, 2.1])
    assert (s["n"], s["median"], s["min"], s["max"]) == (3, 2.0, 1.9, 2.1)
    assert s["spread"] == pytest.approx(0.1)
    assert m.summary([1.0, 2.0])["median"] == 1.5
    assert m.summary([None])["median"] is None


def test_verdict_needs_a_mean_win_and_no_cell_past_the_tolerance() -> None:
    default = {"a": 2.0, "b": 1.0, "c": 1.0}
    # -5 %, -1 %, +0.4 %: mean -1.87 %, worst +0.4 % <= 0.5 %
    ok = m.verdict(default, {"a": 1.9, "b": 0.99, "c": 1.004})
    assert ok["accepted"] and ok["worst_cell"] == "c"
    assert ok["mean_change"] == pytest.approx((-0.05 - 0.01 + 0.004) / 3)
    # a big win does not buy a cell lost by 0.6 %
    bad = m.verdict(default, {"a": 1.8, "b": 0.99, "c": 1.006})
    assert not bad["accepted"] and bad["worst_change"] == pytest.approx(0.006)
    # no cell past the tolerance, but no win on the mean either
    assert not m.verdict(default, {"a": 2.0, "b": 1.004, "c": 1.0})["accepted"]
    # a cell without a result blocks acceptance
    missing = m.verdict(default, {"a": 1.0, "b": 0.5, "c": None})
    assert missing["missing"] == ["c"] and not missing["accepted"]
    assert m.verdict(default, {"a": 1.9, "b": 0.99, "c": 1.006}, tolerance=0.01)["accepted"]


def test_cell_records_ratio_against_the_dp_of_the_same_seed() -> None:
    cell = m.MatrixCell("default", {}, 6e-3)
    runs = m.plan_matrix([cell], [0, 1], 1, {"sync.H": 12})
    losses = {("dp", 0): 1.8, ("dp", 1): 2.0, ("default", 0): 1.98, ("default", 1): 2.1,
              ("candidate", 0): 1.89, ("candidate", 1): None}
    rows = m.cell_records(runs, [losses[(r.kind, r.seed)] for r in runs])["default"]
    assert rows["dp"] == {"0": 1.8, "1": 2.0}
    assert rows["default"]["loss"]["median"] == pytest.approx(2.04)
    assert rows["default"]["ratio"]["median"] == pytest.approx((1.1 + 1.05) / 2)
    assert rows["candidate"]["loss"]["n"] == 1
    assert rows["candidate"]["ratio"]["median"] == pytest.approx(1.05)


def test_dry_run_lists_every_run(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(SCRIPT), "--config", CI, "--cells", "default,M8", "--seeds", "0,1",
         "--candidate", "sync.H=12", "--dry-run", "--out", str(tmp_path / "mx")],
        capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {
        "bench": "matrix", "dry_run": True, "cells": ["default", "M8"], "runs": 12}
    assert "--set run.learners=8 --set train.seed=1 --set train.dp_lr=" in proc.stdout
    assert not (tmp_path / "mx").exists()


def test_refusals_name_the_problem(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for extra, msg in ((["--cells", "M3"], "no such cell: M3"),
                       (["--candidate", "H12"], "expected section.field=value"),
                       (["--candidate", "sync.tau=-1"], "sync.tau"),
                       (["--repeats", "0"], "repeats >= 1")):
        rc = m.main(["--config", CI, "--dry-run", "--out", str(tmp_path), *extra])
        err = capsys.readouterr().err
        assert rc == 2 and msg in err, (extra, err)


def test_main_tunes_dp_reuses_runs_and_decides(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                               capsys: pytest.CaptureFixture[str]) -> None:
    """The loop with ``ddiloco run`` replaced by a writer of reports: DP's loss depends on its
    rate (best at 6e-3), the candidate's is 1 % lower than the default's on every run."""
    calls: list[list[str]] = []

    def fake_execute(argv: list[str], path: Path, label: str, heartbeat_s: float = 60.0) -> int:
        calls.append(argv)
        sets = dict(a.split("=", 1) for a in argv[argv.index("--no-live") + 1:]
                    if "=" in a)
        seed = int(sets["train.seed"])
        if "--baseline-only" in argv:
            lr = float(sets["train.dp_lr"])
            report = {"dp": {"final_val_loss": 1.8 + abs(lr - 6e-3) * 10 + 0.01 * seed}}
        else:
            loss = 1.98 + 0.01 * seed - (0.0198 if "sync.H" in sets else 0.0)
            report = {"diloco": {"final_val_loss": loss}}
        (path / "report.json").write_text(json.dumps(report))
        return 0

    monkeypatch.setattr(m.q, "execute", fake_execute)
    argv = ["--config", CI, "--cells", "iid", "--seeds", "0,1", "--dp-lrs", "3e-3,6e-3",
            "--candidate", "sync.H=12", "--out", str(tmp_path / "mx")]
    assert m.main(argv) == 0
    result = json.loads((tmp_path / "mx" / "matrix.json").read_text())
    assert result["dp_lr"] == {"iid": 6e-3}
    row = result["cells"]["iid"]
    assert row["dp"] == {"0": pytest.approx(1.8), "1": pytest.approx(1.81)}
    assert row["default"]["loss"]["median"] == pytest.approx(1.985)
    assert result["verdict"]["accepted"]
    assert result["verdict"]["change"]["iid"] == pytest.approx(-0.0198 / 1.985, rel=1e-3)
    assert len(calls) == 8  # 2 tuning, 2 DP, 2 x 2 DiLoCo
    dp_calls = [c for c in calls if "--baseline-only" in c and "/dp/" in " ".join(c)]
    assert all("train.dp_lr=0.006" in c for c in dp_calls)
    assert "ACCEPTED" in capsys.readouterr().out
    # a rerun reuses every finished run
    assert m.main(argv) == 0
    assert len(calls) == 8
    # --summarize starts nothing: seed 2 counts as missing and blocks the verdict
    summarize = [*argv[:argv.index("--seeds")], "--seeds", "0,1,2",
                 *argv[argv.index("--seeds") + 2:], "--summarize"]
    assert m.main(summarize) == 1
    assert len(calls) == 8
    result = json.loads((tmp_path / "mx" / "matrix.json").read_text())
    assert result["cells"]["iid"]["default"]["loss"]["median"] == pytest.approx(1.985)
    assert result["verdict"]["missing_runs"] == 3
    assert not result["verdict"]["accepted"]
    assert "3 run(s) missing: not accepted" in capsys.readouterr().out
