"""Configuration: files, overrides and errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddiloco.pipeline.errors import ConfigError
from ddiloco.workers.config import load_config, parse_override

ROOT = Path(__file__).resolve().parent.parent


def test_defaults_and_shipped_files() -> None:
    cfg = load_config()
    assert (cfg.run.learners, cfg.run.shards, cfg.sync.min_quorum, cfg.sync.codec_up) == (
        4, 2, 1, "int4")
    assert cfg.sync.H == 24 and cfg.model.preset == "tiny"
    assert load_config(ROOT / "configs" / "default.toml") == cfg
    tiny = load_config(ROOT / "configs" / "ci-tiny.yaml")
    assert tiny.model_config_obj().d_model == 32


def test_overrides_strings_and_mapping(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("sync: {H: 12}\n")
    cfg = load_config(f, ["sync.H=6", "sync.grace=false", "data.corpus=[a, b]"])
    assert cfg.sync.H == 6 and cfg.sync.grace is False and cfg.data.corpus == ("a", "b")
    assert load_config(None, {"train.lr": 1e-3}).train.lr == 1e-3
    assert parse_override("a.b=0.5") == ("a.b", 0.5)


@pytest.mark.parametrize(
    ("override", "field"),
    [
        ({"sync.H": 0}, "sync.H"),
        ({"sync.codec_up": "int3"}, "codec_up"),
        ({"run.learners": -1}, "run.learners"),
        ({"sync.gamma": 2.0}, "sync.gamma"),
        ({"model.preset": "huge"}, "model.preset"),
        ({"sync.bogus": 1}, "sync.bogus"),
        ({"train.lr": "fast"}, "train.lr"),
        ({"train.speed": {"learner-3": 1.5}}, "speed.learner-3"),
        ({"train.speed": {"learner-3": 0}}, "speed.learner-3"),
        ({"sync.upload_bps": 0}, "sync.upload_bps"),
    ],
)
def test_bad_values_name_the_field(override: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(None, override)
    assert field in str(exc.value)


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="nope"):
        load_config(tmp_path / "nope.toml")
    bad = tmp_path / "bad.toml"
    bad.write_text("[sync\nH=")
    with pytest.raises(ConfigError, match=r"bad\.toml"):
        load_config(bad)
    with pytest.raises(ConfigError, match="expected"):
        parse_override("novalue")


def test_model_overrides_validated() -> None:
    with pytest.raises(ConfigError, match="n_heads"):
        load_config(None, {"model.d_model": 30, "model.n_heads": 4}).model_config_obj()


def test_unknown_policy_or_codec_names_the_valid_ones() -> None:
    with pytest.raises(ConfigError, match="'carry', 'overwrite' or 'mix'"):
        load_config(None, {"sync.adopt": "eager"})
    with pytest.raises(ConfigError, match=r"fp32, bf16, int8 or int4, or topk-d"):
        load_config(None, {"sync.codec_up": "int2"})
    with pytest.raises(ConfigError, match="cosine"):
        load_config(None, {"train.schedule": "step"})
    assert load_config(None, {"sync.codec_up": "topk-d2-b2"}).sync.codec_up == "topk-d2-b2"
