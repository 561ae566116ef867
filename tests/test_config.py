"""Configuration: files, overrides and errors that name the field."""

from __future__ import annotations

from pathlib import Path

import pytest

from ddiloco.pipeline.errors import ConfigError
from ddiloco.workers.run.config import (
    Config,
    RunSection,
    config_from_dict,
    load_config,
    parse_override,
)

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
        ({"train.speed": {"learner-3": 1.5}}, "train.speed.learner-3"),
        ({"train.speed": {"learner-3": 0}}, "train.speed.learner-3"),
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


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        # a model validator over two keys: the key, both values and the two fixes
        (["train.steps=10", "train.warmup_steps=10"], "train.steps: 10 must exceed "
         "train.warmup_steps (10) for a decaying schedule; lower train.warmup_steps or set "
         "train.schedule=constant"),
        (["train.steps=100", "train.warmup_fraction=0.999"], "train.steps: 100 must exceed "
         "round(train.warmup_fraction * train.steps) = round(0.999 * 100) (100) for a "
         "decaying schedule; lower train.warmup_fraction or set train.schedule=constant"),
        (["train.warmup_fraction=1"], "train.warmup_fraction: 1 is out of range; allowed: "
         "[0, 1)"),
        (["sync.H=0"], "sync.H: 0 is out of range; allowed: >= 1"),
        (["sync.gamma=2"], "sync.gamma: 2 is out of range; allowed: (0, 1]"),
        (["train.b1=1"], "train.b1: 1 is out of range; allowed: [0, 1)"),
        (["model.preset=huge"], "model.preset: 'huge' is not a valid choice; expected 'tiny' "
         "or 'small'"),
        (["train.lr=fast"], "train.lr: expected a number, got 'fast'"),
        (["run.learners=1.5"], "run.learners: expected an integer, got 1.5"),
        (["sync.HH=3"], "unknown key sync.HH; did you mean sync.H?"),
        (["sync.h=3"], "unknown key sync.h; did you mean sync.H?"),
        (["trian.steps=3"], "unknown key trian; did you mean train?"),
        (["run.out=x"], "run.out: not a config key; the run directory is the --out option"),
        (["sync=3"], "sync: a section, not a key; set one of its keys, e.g. sync.H=..."),
        (["sync.H.x=1"], "sync.H.x: sync.H is a value (integer), not a section"),
        (["run.mode=dp", "train.accumulate=2"], "train.accumulate: 2 with run.mode=dp; the "
         "data-parallel baseline steps one batch at a time: set train.accumulate=1"),
    ],
)
def test_messages_name_the_path_and_the_fix(overrides: list[str], message: str) -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(None, overrides)
    assert str(exc.value) == message


def test_no_pydantic_wording_and_every_error_in_one_line(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("sync: {HH: 3, gamma: 0}\nmodel: {d_model: 2}\n")
    with pytest.raises(ConfigError) as exc:
        load_config(f)
    text = str(exc.value)
    assert text == ("model.d_model: 2 is out of range; allowed: >= 8; sync.gamma: 0 is out of "
                    "range; allowed: (0, 1]; unknown key sync.HH; did you mean sync.H?")
    for pydantic_words in ("Value error", "Extra inputs", "Input should", "\n"):
        assert pydantic_words not in text


def test_an_unknown_key_far_from_any_lists_the_section() -> None:
    with pytest.raises(ConfigError) as exc:
        load_config(None, ["data.zzzz=1"])
    assert str(exc.value) == ("unknown key data.zzzz; section data has: corpus, iid, "
                              "val_fraction, eval_batches")
    with pytest.raises(ConfigError, match=r"^unknown key zzzz; the top level has: model, "):
        load_config(None, {"zzzz.a": 1})


def test_run_out_in_a_file_is_refused_but_dropped_from_a_stored_config(tmp_path: Path) -> None:
    f = tmp_path / "old.toml"
    f.write_text('[run]\nout = "elsewhere"\n')
    with pytest.raises(ConfigError, match=r"^run\.out: not a config key; the run directory is "
                       r"the --out option$"):
        load_config(f)
    stored = {"run": {"out": "out", "learners": 3}}
    assert config_from_dict(stored, stored=True).run.learners == 3
    assert load_config(None, ["sync.H=6"], base=stored).run.learners == 3
    assert stored == {"run": {"out": "out", "learners": 3}}  # the caller's mapping is kept


@pytest.mark.parametrize(
    ("item", "value"),
    [
        ("data.corpus=/p/a.txt", ["/p/a.txt"]),  # a path where a list is wanted
        ("data.corpus=a.txt,b.txt", ["a.txt", "b.txt"]),
        ("data.corpus=[a, 'b c']", ["a", "b c"]),  # YAML lists still work
        ("data.corpus=", []),
        ("run.run_id=2024", "2024"),  # a string key keeps the text as typed
        ("run.run_id=none", None),  # an optional key is cleared
        ("model.task=\"a.py:f\"", "a.py:f"),  # quoted: YAML unquotes it
        ("train.clip=null", None),
        ("sync.H=12", 12),
        ("train.lr=1e-3", "1e-3"),  # YAML 1.1 reads no float here; pydantic converts it
        ("sync.grace=false", False),
        ("train.speed={learner-3: 0.5}", {"learner-3": 0.5}),
        ("train.speed.learner-3=0.5", 0.5),
        ("not.a.key=[1]", [1]),  # unknown: YAML, and load_config names it
    ],
)
def test_set_values_are_read_as_a_shell_user_means(item: str, value: object) -> None:
    assert parse_override(item)[1] == value


def test_set_values_build_the_config() -> None:
    cfg = load_config(None, ["data.corpus=/p/a.txt", "train.lr=1e-3", "run.run_id=2024",
                             "train.speed.learner-3=0.5", "train.clip=none"])
    assert cfg.data.corpus == ("/p/a.txt",) and cfg.train.lr == 1e-3
    assert cfg.run.run_id == "2024" and cfg.train.speed == {"learner-3": 0.5}
    assert cfg.train.clip is None
    assert load_config(None, {"data.corpus": "/p/a.txt"}).data.corpus == ("/p/a.txt",)


def test_every_key_has_a_description_with_a_unit_where_it_has_one() -> None:
    for section, info in Config.model_fields.items():
        model = info.annotation
        assert model.__doc__, section
        for key, field in model.model_fields.items():
            text = field.description or ""
            assert len(text) > 10, f"{section}.{key} has no description"
            if key.endswith("_s"):
                assert "second" in text, f"{section}.{key}: no unit"


def test_run_has_no_out_key_and_advertise_reaches_the_shards(tmp_path: Path) -> None:
    from ddiloco.workers.run.launch import LocalCluster

    assert "out" not in RunSection.model_fields
    cfg = load_config(None, ["run.advertise_host=10.1.2.3", "run.bind_host=0.0.0.0",
                             "run.shards=2"])
    cluster = LocalCluster.for_run(cfg, "redis://x", "r", tmp_path)
    for s in range(2):
        argv = cluster.command(f"shard-{s}")
        assert argv[argv.index("--advertise") + 1] == "10.1.2.3"
        assert argv[argv.index("--bind") + 1] == "0.0.0.0"
    assert "--advertise" not in cluster.command("learner-0")
    plain = LocalCluster.for_run(load_config(), "redis://x", "r", tmp_path)
    assert "--advertise" not in plain.command("shard-0")
    # a placement (emulated regions) decides the addresses itself
    cluster.placement["shard-0"] = (["ip", "netns", "exec", "hub"], "10.9.0.1")
    argv = cluster.command("shard-0")
    assert argv.count("--advertise") == 1 and argv[argv.index("--advertise") + 1] == "10.9.0.1"


def test_the_warm_up_is_a_fraction_of_the_run_unless_warmup_steps_is_set() -> None:
    # the default: round(0.25 * 600) = 150; round(0.25 * 202) = round(50.5) = 50 (half to
    # even); a run of one step warms up for round(0.25) = 0 steps, so it is valid
    assert load_config(None).train.warmup == 150
    assert load_config(None, ["train.steps=202"]).train.warmup == 50
    assert load_config(None, ["train.steps=1"]).train.warmup == 0
    assert load_config(None, ["train.warmup_fraction=0.1"]).train.warmup == 60
    # warmup_steps, when set, replaces the fraction (a dumped configuration carries both)
    both = load_config(None, ["train.warmup_fraction=0.1", "train.warmup_steps=20"])
    assert both.train.warmup == 20
    again = load_config(None, base=both.model_dump(mode="json"))
    assert (again.train.warmup_steps, again.train.warmup) == (20, 20)
