"""bench/overhead.py: its configs match the issue's (tokens, batch, sequence) and it refuses an
unknown config or part by name."""

from __future__ import annotations

import pytest

from tests._bench import load_bench

overhead = load_bench("overhead")


def test_seq128_is_three_point_one_million_tokens() -> None:
    cfg = overhead.CONFIGS["seq128"]
    assert cfg.learners * cfg.batch * cfg.seq * cfg.steps == 3_096_576
    sets = cfg.run_sets(None)
    assert "model.seq_len=128" in sets and "train.batch_size=16" in sets
    assert "train.steps=120" in cfg.run_sets(120)


def test_a_part_on_costs_what_its_absence_gains() -> None:
    # "live" is on in its variant, "no-curve" off: the share's sign follows
    assert overhead.PARTS["live"][1] is True and overhead.PARTS["no-curve"][1] is False
    assert overhead.PARTS["evaluator-after"][0] == ["--set", "run.evaluator=after"]


@pytest.mark.parametrize("argv", [["--configs", "huge"], ["--parts", "gpu"]])
def test_unknown_names_are_refused(argv: list[str]) -> None:
    with pytest.raises(SystemExit, match="unknown config or part"):
        overhead.main(argv)


def test_the_steady_state_is_tokens_per_step_over_each_learners_mean_step() -> None:
    block = {"tokens": 3_096_576, "learners": 4, "steps": 378, "per_learner": {
        f"learner-{i}": {"step_time_mean_s": t} for i, t in enumerate((0.25, 0.25, 0.5, 0.5))}}
    # 2,048 tokens a step: 8,192 + 8,192 + 4,096 + 4,096
    assert overhead.steady_tokens_per_s(block) == pytest.approx(24_576.0)
    block["per_learner"]["learner-3"]["step_time_mean_s"] = None
    assert overhead.steady_tokens_per_s(block) != overhead.steady_tokens_per_s(block)  # NaN
