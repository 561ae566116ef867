"""``chaos.png`` rendering (chaos/plot.py) on full, partial and empty reports."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ddiloco.chaos.plot import plot_chaos

PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


def _mode_block(seed: int, n_fragments: int, loss0: float) -> dict[str, Any]:
    """A plausible mode block: four learners, two shards, redis, a handful of faults."""
    versions = {
        str(f): [[float(t), t // (3 + f + seed)] for t in range(0, 120, 4)]
        for f in range(n_fragments)
    }
    return {
        "goodput": 0.72 - 0.1 * seed,
        "wall_s": 120.0,
        "token_fate": {"tokens": {
            "processed": 1_000_000.0,
            "merged": 720_000.0,
            "discarded": {"overwritten": 100_000.0, "dropped:stale": 50_000.0, "drain": 10_000.0},
            "lost": {"learner_killed": 80_000.0, "in_flight": 25_000.0, "shard_lost": 15_000.0},
        }},
        "global_downtime_s": 6.5,
        "recovery_s": {"p50": 3.2, "max": 9.8, "n": 4},
        "final_val_loss": loss0 - 1.0,
        "timeline": {
            "learner-10": [[70.0, 80.0, "slow"]],
            "learner-2": [[10.0, 25.0, "down"]],
            "learner-0": [[40.0, 48.0, "paused"]],
            "shard-1": [[55.0, 62.0, "partitioned"], [90.0, 95.0, "down"]],
            "shard-0": [],
            "redis": [[100.0, 103.0, "down"]],
        },
        "faults": [
            {"at_s": 10.0, "kind": "kill", "target": "learner-2"},
            {"at_s": 40.0, "kind": "pause", "target": "learner-0"},
            {"at_s": 55.0, "kind": "partition", "target": "shard-1"},
            {"at_s": 70.0, "kind": "slow", "target": "learner-10"},
            {"at_s": 90.0, "kind": "kill", "target": "shard-1"},
            {"at_s": 100.0, "kind": "kill", "target": "redis"},
        ],
        "versions": versions,
        "val_loss": [[float(t), loss0 - t / 120.0] for t in range(0, 121, 10)],
    }


def _full_report() -> dict[str, Any]:
    return {
        "script": {"name": "mixed-faults", "seed": 7, "duration_s": 120.0},
        "modes": {"diloco": _mode_block(0, 4, 3.5), "dp": _mode_block(1, 1, 3.4)},
        "fault_free": {"diloco": {"final_val_loss": 2.4}, "dp": {"final_val_loss": 2.3}},
    }


def _assert_png(path: Path, min_bytes: int = 1) -> None:
    data = path.read_bytes()
    assert data.startswith(PNG_SIGNATURE)
    assert len(data) > min_bytes


def test_full_report_renders(tmp_path: Path) -> None:
    path = tmp_path / "chaos.png"
    plot_chaos(_full_report(), path)
    _assert_png(path, min_bytes=10_000)


def test_diloco_only_with_missing_keys_renders(tmp_path: Path) -> None:
    block = _mode_block(0, 2, 3.5)
    for key in ("versions", "token_fate", "recovery_s", "wall_s"):
        del block[key]
    block["goodput"] = None
    block["global_downtime_s"] = None
    block["val_loss"] = [[0.0, 3.0], [5.0, None], "junk", [10.0, float("nan")]]
    block["timeline"]["learner-0"] = [[5.0, 1.0, "down"], [1.0, 2.0, "mystery"], None]
    block["faults"].append({"kind": "kill"})
    block["faults"].append({"at_s": 30.0, "kind": "kill"})
    report: dict[str, Any] = {"script": {"name": None}, "modes": {"diloco": block},
                              "fault_free": {"dp": {"final_val_loss": 2.0}, "diloco": None}}
    path = tmp_path / "chaos.png"
    plot_chaos(report, path)
    _assert_png(path)


@pytest.mark.parametrize("report", [
    {"modes": {}},
    {},
    {"modes": {"diloco": {}, "dp": None}},
    {"modes": {"diloco": {"token_fate": {"tokens": {"processed": 0.0, "lost": 5.0}}}},
     "script": None, "fault_free": None},
])
def test_empty_reports_render(tmp_path: Path, report: dict[str, Any]) -> None:
    path = tmp_path / "chaos.png"
    plot_chaos(report, path)
    _assert_png(path)


def test_loss_axis_names_the_task_unit() -> None:
    from ddiloco.chaos.plot import _loss_unit

    assert _loss_unit({"loss_unit": "bits/[char]"}) == "bits/[char]"
    # reports written before they recorded the unit: the built-in GPT is byte-level
    assert _loss_unit({"config": {"model": {"task": None}}}) == "nats/byte"
    assert _loss_unit({"config": {"model": {"task": "my.mod:task"}}}) == "nats/token"
