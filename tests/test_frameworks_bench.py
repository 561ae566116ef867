"""bench/frameworks.py's verdict over its runs: ratios to the all-JAX mean of each seed, the
same-seed range, and the per-kind median, with hand-computed numbers."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from tests._bench import load_bench


def _bench() -> Any:
    return load_bench("frameworks")


def _run(seed: int, k: int, loss: float, tps: int = 100) -> dict[str, Any]:
    return {"seed": seed, "torch_learners": k, "early_val_loss": 4.0,
            "final_val_loss": loss, "wall_s": 1.0, "tokens": 10, "tokens_per_s": tps,
            "merged_share": 1.0}


def test_ratios_are_to_the_mean_of_the_seeds_all_jax_runs() -> None:
    fw = _bench()
    rows = [_run(0, 0, 2.0), _run(0, 0, 2.2), _run(0, 2, 2.1), _run(0, 4, 2.31),
            _run(1, 0, 1.0, 300), _run(1, 2, 1.05), _run(1, 4, 0.9)]
    res = fw.summarize(rows, 4, "c.toml", 600, False)
    by = {(r["seed"], r["torch_learners"], r["final_val_loss"]): r for r in res["runs"]}
    assert by[(0, 2, 2.1)]["loss_vs_jax"] == pytest.approx(1.0)  # 2.1 / mean(2.0, 2.2)
    assert by[(0, 2, 2.1)]["within_jax_spread"]
    assert by[(0, 4, 2.31)]["loss_vs_jax"] == pytest.approx(1.1)
    assert not by[(0, 4, 2.31)]["within_jax_spread"]
    assert by[(1, 2, 1.05)]["loss_vs_jax"] == pytest.approx(1.05)
    assert not by[(1, 2, 1.05)]["within_jax_spread"]  # one all-JAX run: its range is a point
    assert res["jax_spread"]["0"] == {"min": 2.0, "max": 2.2, "runs": 2,
                                      "spread": pytest.approx(0.2 / 2.1, abs=1e-5)}
    two = res["summary"]["2"]
    assert two["loss_vs_jax_median"] == pytest.approx(1.025)
    assert (two["loss_vs_jax_min"], two["loss_vs_jax_max"], two["runs"]) == (1.0, 1.05, 2)
    assert res["summary"]["0"]["tokens_per_s_mean"] == 167  # (100 + 100 + 300) / 3
    assert res["summary"]["4"]["loss_vs_jax_median"] == pytest.approx(1.0)  # 1.1 and 0.9


def test_a_seed_without_an_all_jax_run_is_refused() -> None:
    with pytest.raises(SystemExit, match=r"seeds \[1\] have no all-JAX run"):
        _bench().summarize([_run(0, 0, 2.0), _run(1, 2, 2.0)], 4, "c", 600, False)


def test_merge_judges_pieces_together_and_refuses_different_settings(tmp_path: Path) -> None:
    fw = _bench()
    a = fw.summarize([_run(0, 0, 2.0), _run(0, 2, 2.2)], 4, "c.toml", 600, False)
    b = fw.summarize([_run(1, 0, 1.0), _run(1, 2, 1.1)], 4, "c.toml", 600, False)
    pa, pb, out = tmp_path / "a.json", tmp_path / "b.json", tmp_path / "out.json"
    pa.write_text(json.dumps(a))
    pb.write_text(json.dumps(b))
    assert fw.main(["--merge", str(pa), str(pb), "--json", str(out)]) == 0
    merged = json.loads(out.read_text())
    assert merged["summary"]["2"]["runs"] == 2
    assert merged["summary"]["2"]["loss_vs_jax_median"] == pytest.approx(1.1)
    b["steps"] = 300
    pb.write_text(json.dumps(b))
    with pytest.raises(SystemExit, match="differ in config, steps"):
        fw.main(["--merge", str(pa), str(pb)])
