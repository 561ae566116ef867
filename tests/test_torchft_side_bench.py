"""bench/torchft_side.py: its ``--variant`` rows and their ratios to the torchft row (pure
functions; the bench itself needs torchft and runs for minutes)."""

from __future__ import annotations

import argparse

import pytest

from tests._bench import load_bench

side = load_bench("torchft_side")


def test_variant_splits_its_name_and_settings() -> None:
    assert side.parse_variant("eval-after:run.evaluator=after") == (
        "eval-after", ("run.evaluator=after",))
    assert side.parse_variant(" t : a.b=1 , c.d=x ") == ("t", ("a.b=1", "c.d=x"))


@pytest.mark.parametrize("bad", ["noname", ":a.b=1", "x:", "x:a.b", "x:a.b=1,c"])
def test_a_malformed_variant_is_refused_with_the_form(bad: str) -> None:
    with pytest.raises(argparse.ArgumentTypeError, match="NAME:K=V"):
        side.parse_variant(bad)


def test_variant_settings_override_the_common_ones() -> None:
    args = argparse.Namespace(learners=4, steps=10, H=24, jax=False,
                              sets=["run.evaluator=during", "sync.tau=2"])
    out = side._overrides(args, ("run.evaluator=after",))
    assert out["run.evaluator"] == "after" and out["sync.tau"] == 2
    assert out["run.torch_learners"] == 4 and out["train.steps"] == 10


def test_ratios_are_ddiloco_over_torchft() -> None:
    tft = {"wall_s": 200.0, "tokens_per_s": 1000, "final_val_loss": 2.0,
           "wire_bytes_per_token": 100.0}
    row = {"wall_s": 150.0, "tokens_per_s": 1250, "final_val_loss": 1.9,
           "wire_bytes_per_token": 8.0}
    assert side.ratios_of(row, tft) == {"wall_s": 0.75, "tokens_per_s": 1.25,
                                        "final_val_loss": 0.95, "wire_bytes_per_token": 0.08}
