"""Fault scripts: parsing, validation messages, seeded expansion and its invariants."""

from __future__ import annotations

import itertools
import json
import math
import re
import statistics
from collections import defaultdict
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

from ddiloco.chaos.script import (
    SCRIPTS_DIR,
    FaultAction,
    FaultKind,
    FaultScript,
    RepairSpec,
    ScriptError,
    describe,
    expand,
    load_script,
    parse_duration,
    parse_script,
)
from ddiloco.pipeline.errors import ConfigError
from ddiloco.workers.run.specfile import SpecError

SHIPPED = (
    "gentle",
    "poisson-kill-storm",
    "stragglers",
    "shard-and-redis",
    "partitions",
    "ci-short",
    "ci-storm",
    "ci-storm-short",
    "compose-mix",
    "object-store",
    "store-faults",
    "redis-failover",
    "redis-wipe",
)


def _script(**fields: Any) -> dict[str, Any]:
    return {"name": "t", "duration_s": 100, **fields}


def _storm(**entry: Any) -> FaultScript:
    """Learner kills, mtbf 60 s, down 10-20 s, from 20 s, over a 150 s run."""
    stochastic = {
        "targets": "learners",
        "fault": "kill",
        "mtbf": "60s",
        "repair": {"dist": "uniform", "min": "10s", "max": "20s"},
        "start": "20s",
        **entry,
    }
    return parse_script({"name": "storm", "duration_s": 150, "stochastic": [stochastic]})


def _by_target(actions: list[FaultAction]) -> dict[str, list[FaultAction]]:
    out: dict[str, list[FaultAction]] = defaultdict(list)
    for a in actions:
        out[a.target].append(a)
    return out


# ---------------------------------------------------------------------------------------------
# Shipped scripts
# ---------------------------------------------------------------------------------------------


def test_every_shipped_script_is_present() -> None:
    assert {p.stem for p in SCRIPTS_DIR.glob("*.yaml")} >= set(SHIPPED)


@pytest.mark.parametrize("path", sorted(SCRIPTS_DIR.glob("*.yaml")), ids=lambda p: p.stem)
def test_shipped_script_parses_and_expands(path: Path) -> None:
    script = load_script(path)
    assert script.name == path.stem
    assert script.source == str(path)
    assert 30 <= script.duration_s <= 180  # CI runs stay short
    actions = expand(script, learners=4, shards=2)
    assert actions, "a chaos script without faults"
    assert [a.at_s for a in actions] == sorted(a.at_s for a in actions)
    assert all(0 <= a.at_s < script.duration_s for a in actions)
    assert len({a.id for a in actions}) == len(actions)


def test_shipped_scripts_say_what_they_promise() -> None:
    gentle = expand(load_script(SCRIPTS_DIR / "gentle.yaml"), 4, 2)
    assert describe(gentle) == {"kill": 1, "pause": 1}
    assert [a.duration_s for a in gentle] == [10.0, 5.0]

    storm = expand(load_script(SCRIPTS_DIR / "poisson-kill-storm.yaml"), 4, 2)
    timeline = [(a.target, a.duration_s) for a in storm if a.source == "timeline"]
    assert sorted(timeline) == [("redis", 3.0), ("shard-1", 2.0)]
    learner_kills = [a for a in storm if a.target.startswith("learner-")]
    assert all(a.kind is FaultKind.KILL and a.at_s >= 20 for a in learner_kills)
    assert all(10 <= (a.duration_s or 0) <= 20 for a in learner_kills)

    stragglers = expand(load_script(SCRIPTS_DIR / "stragglers.yaml"), 4, 2)
    slow = [a for a in stragglers if a.kind is FaultKind.SLOW]
    assert [(a.target, a.at_s, a.factor, a.duration_s) for a in slow] == [
        ("learner-3", 10.0, 3.0, None)
    ]
    pauses = [a for a in stragglers if a.kind is FaultKind.PAUSE]
    assert [(a.target, a.duration_s) for a in pauses] == [("learner-2", 8.0)] * 3

    server = expand(load_script(SCRIPTS_DIR / "shard-and-redis.yaml"), 4, 2)
    assert {(a.kind.value, a.target) for a in server} == {
        ("kill", "shard-0"), ("kill", "shard-1"), ("kill", "redis"), ("pause", "redis")
    }
    assert next(a for a in server if a.kind is FaultKind.PAUSE).duration_s == 5.0

    parts = expand(load_script(SCRIPTS_DIR / "partitions.yaml"), 4, 2)
    assert [(a.target, a.peer, a.duration_s) for a in parts] == [
        ("learner-1", "syncers", 15.0), ("learner-2", "redis", 15.0)
    ]

    blobs = expand(load_script(SCRIPTS_DIR / "object-store.yaml"), 4, 2)
    assert [(a.kind, a.target, a.at_s, a.duration_s) for a in blobs] == [
        (FaultKind.KILL, "blobs", 20.0, 6.0), (FaultKind.PAUSE, "blobs", 45.0, 5.0)
    ]
    assert "--set store.blobs=embedded-s3" in " ".join(
        (load_script(SCRIPTS_DIR / "object-store.yaml").description or "").split())

    ci = load_script(SCRIPTS_DIR / "ci-short.yaml")
    assert ci.duration_s == 70
    for learners in (3, 4):
        kill, pause = expand(ci, learners, 2)
        assert (kill.kind, kill.duration_s) == (FaultKind.KILL, 8.0)
        assert 15 <= kill.at_s <= 25
        assert (pause.kind, pause.duration_s) == (FaultKind.PAUSE, 4.0)
        assert 30 <= pause.at_s <= 40 and pause.target != kill.target


# ---------------------------------------------------------------------------------------------
# Validation: every error names the field path
# ---------------------------------------------------------------------------------------------

_REPAIR = {"dist": "fixed", "value": 3}

BAD: list[tuple[str, dict[str, Any], str]] = [
    (
        "bad duration string",
        _script(faults=[
            {"at": 1, "kill": "learner-0"},
            {"at": 2, "pause": "learner-1", "for": 1},
            {"at": "4O s", "kill": "learner-2"},
        ]),
        "faults[2].at: '4O s' is not a duration",
    ),
    ("unknown top-level key", _script(bogus=1), "bogus: unknown key"),
    (
        "unknown key in a fault",
        _script(faults=[{"at": 1, "kill": "learner-0", "bogus": 3}]),
        "faults[0].bogus: unknown key",
    ),
    (
        "key of another kind",
        _script(faults=[{"at": 1, "kill": "learner-0", "factor": 3}]),
        "faults[0].factor: not allowed with kill",
    ),
    (
        "unknown fault",
        _script(faults=[{"at": 1, "explode": "learner-0"}]),
        "faults[0].explode: unknown fault 'explode'",
    ),
    (
        "two faults in one entry",
        _script(faults=[{"at": 1, "kill": "learner-0", "pause": "learner-1"}]),
        "faults[0].pause: one fault per entry",
    ),
    (
        "unknown stochastic fault",
        _script(stochastic=[
            {"targets": "learners", "fault": "explode", "mtbf": 5, "repair": _REPAIR}
        ]),
        "stochastic[0].fault:",
    ),
    (
        "bad target",
        _script(faults=[{"at": 1, "kill": "learnr-0"}]),
        "faults[0].kill: 'learnr-0' is not a target",
    ),
    (
        "group in the timeline",
        _script(faults=[{"at": 1, "kill": "learners"}]),
        "faults[0].kill: group 'learners' is allowed in stochastic entries only",
    ),
    (
        "bad stochastic target",
        _script(stochastic=[
            {"targets": ["learner-0", "syncer-1"], "fault": "kill", "mtbf": 5, "repair": _REPAIR}
        ]),
        "stochastic[0].targets[1]: 'syncer-1' is not a target",
    ),
    (
        "slow on redis",
        _script(faults=[{"at": 1, "slow": "redis", "factor": 2}]),
        "faults[0].slow: slow applies to learners and shards, not redis",
    ),
    (
        "stochastic partition of redis",
        _script(stochastic=[{
            "targets": "redis", "fault": "partition", "from": "syncers", "mtbf": 5,
            "repair": _REPAIR,
        }]),
        "stochastic[0].targets: partition applies to learners and shards, not redis",
    ),
    (
        "slow on the object store",
        _script(faults=[{"at": 1, "slow": "blobs", "factor": 2}]),
        "faults[0].slow: slow applies to learners and shards, not blobs",
    ),
    (
        "partition of the object store",
        _script(faults=[{"at": 1, "partition": "blobs", "from": "syncers", "for": 3}]),
        "faults[0].partition: partition applies to learners and shards, not blobs",
    ),
    (
        "congest of the object store",
        _script(faults=[{"at": 1, "congest": "blobs", "from": "syncers", "for": 3}]),
        "faults[0].congest: congest applies to learners and shards, not blobs",
    ),
    (
        "stochastic slow of the object store",
        _script(stochastic=[{
            "targets": ["redis", "blobs"], "fault": "slow", "factor": 2, "mtbf": 5,
            "repair": _REPAIR,
        }]),
        "stochastic[0].targets[0]: slow applies to learners and shards, not redis",
    ),
    (
        "blobs is no peer",
        _script(faults=[{"at": 1, "partition": "learner-0", "from": "blobs", "for": 3}]),
        "faults[0].from:",
    ),
    (
        "object store mistyped",
        _script(faults=[{"at": 1, "kill": "blob"}]),
        "faults[0].kill: 'blob' is not a target (learner-<i>, shard-<i>, redis, blobs)",
    ),
    (
        "overlapping faults on the object store",
        _script(faults=[
            {"at": 10, "kill": "blobs", "down": 5},
            {"at": 12, "pause": "blobs", "for": 3},
        ]),
        "faults[1]: pause of blobs at 12 s overlaps faults[0]",
    ),
    (
        "factor == 1",
        _script(faults=[{"at": 1, "slow": "learner-1", "factor": 1.0}]),
        "faults[0].factor: must be a slowdown factor > 1",
    ),
    (
        "factor < 1 in stochastic",
        _script(stochastic=[{
            "targets": "learners", "fault": "slow", "factor": 0.5, "mtbf": 5, "repair": _REPAIR,
        }]),
        "stochastic[0].factor: must be a slowdown factor > 1",
    ),
    (
        "slow without factor",
        _script(faults=[{"at": 1, "slow": "learner-1"}]),
        "faults[0].factor: required with slow",
    ),
    (
        "pause without length",
        _script(faults=[{"at": 1, "pause": "learner-1"}]),
        "faults[0].for: required with pause",
    ),
    (
        "partition from an unknown peer",
        _script(faults=[{"at": 1, "partition": "learner-1", "from": "x", "for": 3}]),
        "faults[0].from:",
    ),
    (
        "down without restart",
        _script(faults=[{"at": 1, "kill": "learner-1", "restart": False, "down": 3}]),
        "faults[0].down: has no meaning with restart: false",
    ),
    (
        "overlapping explicit faults",
        _script(faults=[
            {"at": 10, "kill": "learner-1", "down": 15},
            {"at": "20s", "pause": "learner-1", "for": 3},
        ]),
        "faults[1]: pause of learner-1 at 20 s overlaps faults[0]",
    ),
    (
        "fault after a persistent slow",
        _script(faults=[
            {"at": 10, "slow": "shard-0", "factor": 2},
            {"at": 90, "kill": "shard-0"},
        ]),
        "faults[1]: kill of shard-0 at 90 s overlaps faults[0]",
    ),
    (
        "explicit fault after the run",
        _script(faults=[{"at": "2m", "kill": "learner-1"}]),
        "faults[0].at: 120 s is not before duration_s (100 s)",
    ),
    (
        "stochastic start after the run",
        _script(stochastic=[{"targets": "learners", "fault": "kill", "mtbf": 5, "start": "2m",
                             "repair": _REPAIR}]),
        "stochastic[0].start: 120 s is not before duration_s (100 s)",
    ),
    (
        "negative time",
        _script(faults=[{"at": -1, "kill": "learner-1"}]),
        "faults[0].at: must be >= 0",
    ),
    (
        "zero mtbf",
        _script(stochastic=[{"targets": "learners", "fault": "kill", "mtbf": 0,
                             "repair": _REPAIR}]),
        "stochastic[0].mtbf: must be > 0",
    ),
    (
        "incomplete repair distribution",
        _script(stochastic=[{"targets": "learners", "fault": "kill", "mtbf": 5,
                             "repair": {"dist": "weibull", "shape": 2}}]),
        "stochastic[0].repair.scale: required with dist weibull",
    ),
    (
        "inverted uniform repair",
        _script(stochastic=[{"targets": "learners", "fault": "kill", "mtbf": 5,
                             "repair": {"dist": "uniform", "min": 5, "max": 2}}]),
        "stochastic[0].repair.max: must be >= min",
    ),
    (
        "target listed twice",
        _script(stochastic=[{"targets": ["learner-0", "learner-0"], "fault": "kill",
                             "mtbf": 5, "repair": _REPAIR}]),
        "stochastic[0].targets[1]: 'learner-0' is listed twice",
    ),
    ("missing name", {"duration_s": 10}, "name: required"),
    ("missing duration", {"name": "x"}, "duration_s: required"),
    ("negative seed", _script(seed=-1), "seed: must be >= 0"),
]


@pytest.mark.parametrize(("data", "expected"), [(d, e) for _, d, e in BAD],
                         ids=[name for name, _, _ in BAD])
def test_validation_error_names_file_and_field(data: dict[str, Any], expected: str) -> None:
    with pytest.raises(ScriptError) as info:
        parse_script(data, source="bad.yaml")
    message = str(info.value)
    assert message.startswith("bad.yaml: ")
    assert expected in message


def test_script_error_is_a_config_error() -> None:
    assert issubclass(ScriptError, ConfigError)
    assert issubclass(ScriptError, ValueError)


def test_unknown_key_in_a_yaml_file_names_the_file(tmp_path: Path) -> None:
    path = tmp_path / "typo.yaml"
    path.write_text("name: t\nduration_s: 60\nfaults:\n  - {at: 10s, kill: learner-0, dwon: 3s}\n")
    with pytest.raises(ScriptError, match=r"typo\.yaml: faults\[0\]\.dwon: unknown key"):
        load_script(path)


def test_target_out_of_range_is_reported_at_expand() -> None:
    script = parse_script(_script(faults=[{"at": 1, "kill": "learner-5"}]), "x.yaml")
    expand(script, learners=6, shards=0)
    with pytest.raises(ScriptError, match=r"x\.yaml: faults\[0\]\.kill: learner-5 is out of range"):
        expand(script, learners=4, shards=2)

    script = parse_script(_script(stochastic=[
        {"targets": ["shard-0", "shard-2"], "fault": "pause", "mtbf": 5, "repair": _REPAIR}
    ]), "y.yaml")
    with pytest.raises(ScriptError, match=r"y\.yaml: stochastic\[0\]\.targets\[1\]: shard-2"):
        expand(script, learners=4, shards=2)


def test_expand_rejects_bad_counts_and_seed() -> None:
    script = parse_script(_script())
    with pytest.raises(ScriptError, match="learners"):
        expand(script, learners=-1, shards=2)
    with pytest.raises(ScriptError, match="seed"):
        expand(script, learners=4, shards=2, seed=-3)


def test_missing_file(tmp_path: Path) -> None:
    with pytest.raises(ScriptError, match=r"nope\.yaml: cannot read"):
        load_script(tmp_path / "nope.yaml")


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("name: t\nfaults: [\n", "malformed YAML"),
        ("name: t\nduration_s: 10\nname: u\n", "duplicate key 'name'"),
        ("- 1\n- 2\n", "top level must be a mapping"),
        ("", "empty fault script"),
    ],
    ids=["unterminated", "duplicate-key", "list", "empty"],
)
def test_malformed_yaml(tmp_path: Path, text: str, expected: str) -> None:
    path = tmp_path / "broken.yaml"
    path.write_text(text)
    with pytest.raises(ScriptError) as info:
        load_script(path)
    # one line, the file first (with line and column where YAML says where)
    assert re.match(rf"{re.escape(str(path))}(:\d+:\d+)?: ", str(info.value))
    assert "\n" not in str(info.value)
    assert expected in str(info.value)


# ---------------------------------------------------------------------------------------------
# Durations and the timeline
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("value", "seconds"),
    [
        ("500ms", 0.5), ("1.5m", 90.0), ("40s", 40.0), ("40", 40.0), (" 2 h", 7200.0),
        (".5s", 0.5), ("1e3ms", 1.0), (12, 12.0), (2.5, 2.5), ("0", 0.0),
    ],
)
def test_parse_duration(value: Any, seconds: float) -> None:
    assert parse_duration(value) == seconds


@pytest.mark.parametrize("value", ["4O s", "10 sec", "m", "", "1.5.2s", True, None, [1], "inf"])
def test_parse_duration_rejects(value: Any) -> None:
    with pytest.raises(SpecError, match="not a duration"):
        parse_duration(value)


def test_a_wipe_is_a_timeline_fault_of_redis() -> None:
    script = parse_script(_script(faults=[{"at": "30s", "wipe": "redis", "down": "3s"}]))
    (a,) = expand(script, learners=2, shards=1)
    assert (a.id, a.at_s, a.duration_s, a.end_s) == ("f000-wipe-redis", 30.0, 3.0, 33.0)
    for bad, problem in (
        ({"faults": [{"at": 1, "wipe": "learner-0"}]}, "wipe applies to redis only"),
        ({"faults": [{"at": 1, "wipe": "redis", "for": 2}]}, "faults[0].for: not allowed"),
        ({"stochastic": [{"targets": ["redis"], "fault": "wipe", "mtbf": 10,
                          "repair": {"dist": "fixed", "value": 1}}]},
         "wipe is a timeline fault only"),
    ):
        with pytest.raises(ScriptError, match=re.escape(problem)):
            parse_script(_script(**bad), "s.yaml")


def test_timeline_semantics() -> None:
    script = parse_script(_script(faults=[
        {"at": "10s", "kill": "learner-0"},
        {"at": "10.5s", "kill": "learner-0", "down": "2s"},
        {"at": 20, "kill": "shard-1", "restart": False},
        {"at": 30, "slow": "learner-1", "factor": 2, "for": "15s"},
        {"at": 40, "slow": "learner-2", "factor": 4},
        {"at": 50, "partition": "shard-0", "from": "redis", "for": "500ms"},
        {"at": 60, "pause": "redis", "for": "1m"},
        {"at": 13, "pause": "learner-0", "for": 1},  # back to back with the restart at 12.5
        {"at": 70, "congest": "learner-1", "from": "syncers", "for": "20s"},
    ]))
    actions = expand(script, learners=3, shards=2)
    got = [(a.id, a.at_s, a.duration_s, a.end_s, a.factor, a.peer) for a in actions]
    assert got == [
        ("f000-kill-learner-0", 10.0, 0.0, 10.0, None, None),
        ("f001-kill-learner-0", 10.5, 2.0, 12.5, None, None),
        ("f007-pause-learner-0", 13.0, 1.0, 14.0, None, None),
        ("f002-kill-shard-1", 20.0, None, None, None, None),
        ("f003-slow-learner-1", 30.0, 15.0, 45.0, 2.0, None),
        ("f004-slow-learner-2", 40.0, None, None, 4.0, None),
        ("f005-partition-shard-0", 50.0, 0.5, 50.5, None, "redis"),
        ("f006-pause-redis", 60.0, 60.0, 120.0, None, None),
        ("f008-congest-learner-1", 70.0, 20.0, 90.0, None, "syncers"),
    ]
    assert all(a.source == "timeline" for a in actions)
    assert describe(actions) == {"kill": 3, "pause": 2, "slow": 2, "partition": 1,
                                 "congest": 1}
    for bad, problem in (
        ({"at": 1, "congest": "learner-0", "for": 3}, "faults[0].from: required with congest"),
        ({"at": 1, "congest": "learner-0", "from": "redis"}, "faults[0].for: required"),
        ({"at": 1, "congest": "redis", "from": "syncers", "for": 3}, "not redis"),
    ):
        with pytest.raises(ScriptError, match=re.escape(problem)):
            parse_script(_script(faults=[bad]), "s.yaml")


def test_to_json_round_trips_types() -> None:
    script = parse_script(_script(
        faults=[
            {"at": 5, "kill": "learner-0", "restart": False},
            {"at": 6, "slow": "learner-1", "factor": 2},
            {"at": 7, "partition": "shard-0", "from": "syncers", "for": 3},
        ],
        stochastic=[{"targets": "learners", "fault": "pause", "mtbf": 20, "repair": _REPAIR}],
    ))
    actions = expand(script, learners=3, shards=1)
    assert len(actions) > 3
    for action in actions:
        data = action.to_json()
        wire = json.loads(json.dumps(data))
        assert wire == data
        assert isinstance(wire["kind"], str) and isinstance(wire["at_s"], float)
        assert wire["end_s"] == action.end_s
        back = FaultAction.from_json(wire)
        assert back == action
        assert type(back.kind) is FaultKind


# ---------------------------------------------------------------------------------------------
# Stochastic expansion
# ---------------------------------------------------------------------------------------------


def test_same_inputs_same_actions_and_seed_override() -> None:
    script = _storm()
    first = expand(script, 4, 2)
    assert first == expand(script, 4, 2)
    assert first == expand(script, 4, 2, seed=script.seed)
    assert first != expand(script, 4, 2, seed=1)
    assert expand(script, 4, 2, seed=1) == expand(script, 4, 2, seed=1)
    reseeded = parse_script({**_script(), **script.model_dump(by_alias=True, exclude_none=True),
                             "seed": 1})
    assert expand(reseeded, 4, 2) == expand(script, 4, 2, seed=1)
    outcomes = {tuple(a.at_s for a in expand(script, 4, 2, seed=s)) for s in range(20)}
    assert len(outcomes) == 20


def test_adding_a_target_leaves_the_others_draws_unchanged() -> None:
    script = _storm()
    for seed in range(10):
        four = _by_target(expand(script, 4, 2, seed=seed))
        five = _by_target(expand(script, 5, 2, seed=seed))
        for i in range(4):
            assert four[f"learner-{i}"] == five[f"learner-{i}"]
    listed = parse_script({**_script(duration_s=150), "stochastic": [{
        "targets": ["learner-0"], "fault": "kill", "mtbf": "60s", "start": "20s",
        "repair": {"dist": "uniform", "min": "10s", "max": "20s"},
    }]})
    assert expand(listed, 4, 2) == _by_target(expand(script, 4, 2))["learner-0"]


def test_kill_storm_count_matches_hand_reasoning() -> None:
    # Per learner: first arrival after Exp(60 s) from t = 20 s, then cycles of repair U(10, 20 s)
    # plus Exp(60 s), i.e. 75 s on average, within the 130 s window. A delayed renewal count is
    # about (130 - 60) / 75 + var / (2 * 75^2) + 1/2 with var = 60^2 + 10^2/12, so ~1.75 per
    # learner and ~7 for four. A Poisson process without repairs (rate 1/60) gives 2.17 per
    # learner, an upper bound on the mean: 8.7 for four.
    script = _storm()
    kills = len(expand(script, 4, 2, seed=7))
    assert 3 <= kills <= 16
    counts = [len(expand(script, 4, 2, seed=s)) for s in range(200)]
    assert 6.0 <= statistics.mean(counts) <= 8.0
    # The shipped storm adds a shard and a Redis kill and caps learners down at once at 3.
    shipped = expand(load_script(SCRIPTS_DIR / "poisson-kill-storm.yaml"), 4, 2)
    assert 3 <= describe(shipped)["kill"] - 2 <= 16


def test_no_overlap_per_target_and_everything_inside_the_window() -> None:
    script = parse_script(_script(
        duration_s=150,
        faults=[
            {"at": 30, "kill": "learner-0", "down": 20},
            {"at": 60, "slow": "learner-3", "factor": 3},
            {"at": 90, "pause": "learner-1", "for": 10},
        ],
        stochastic=[
            {"targets": "learners", "fault": "kill", "mtbf": 15, "start": 5,
             "repair": {"dist": "exponential", "mean": 8}},
            {"targets": "learners", "fault": "pause", "mtbf": 20,
             "repair": {"dist": "weibull", "shape": 2, "scale": "5s"}},
            {"targets": ["shard-0", "shard-1"], "fault": "partition", "from": "redis", "mtbf": 30,
             "repair": {"dist": "fixed", "value": "4s"}},
        ],
    ))
    for seed in range(30):
        actions = expand(script, 4, 2, seed=seed)
        assert len({a.id for a in actions}) == len(actions)
        for target, own in _by_target(actions).items():
            for prev, nxt in itertools.pairwise(own):
                end = math.inf if prev.end_s is None else prev.end_s
                assert nxt.at_s >= end, (seed, target, prev, nxt)
                assert nxt.at_s > prev.at_s
        for a in actions:
            assert 0 <= a.at_s < 150
            if a.source == "stochastic[0]":
                assert a.at_s >= 5 and a.kind is FaultKind.KILL and a.duration_s is not None
        assert not [a for a in actions if a.target == "learner-3" and a.at_s >= 60
                    and a.kind is not FaultKind.SLOW]


def test_max_concurrent_is_respected() -> None:
    script = parse_script(_script(duration_s=300, stochastic=[{
        "targets": "learners", "fault": "kill", "mtbf": 10, "max_concurrent": 2,
        "repair": {"dist": "uniform", "min": 5, "max": 15},
    }]))
    for seed in range(10):
        actions = expand(script, 6, 2, seed=seed)
        for a in actions:
            assert a.end_s is not None
            down = [b for b in actions if b.at_s <= a.at_s < (b.end_s or math.inf)]
            assert len(down) <= 2
    uncapped = parse_script(_script(duration_s=300, stochastic=[{
        "targets": "learners", "fault": "kill", "mtbf": 10,
        "repair": {"dist": "uniform", "min": 5, "max": 15},
    }]))
    peak = max(
        sum(1 for b in acts if b.at_s <= a.at_s < (b.end_s or math.inf))
        for acts in [expand(uncapped, 6, 2, seed=0)] for a in acts
    )
    assert peak > 2


def test_stochastic_fields_reach_the_actions() -> None:
    script = parse_script(_script(stochastic=[
        {"targets": "shards", "fault": "slow", "factor": 1.5, "mtbf": 10, "repair": _REPAIR},
        {"targets": "redis", "fault": "pause", "mtbf": 30, "repair": _REPAIR},
    ]))
    actions = expand(script, 4, 3, seed=3)
    slow = [a for a in actions if a.kind is FaultKind.SLOW]
    assert slow and {a.target for a in slow} <= {"shard-0", "shard-1", "shard-2"}
    assert all(a.factor == 1.5 and a.duration_s == 3.0 for a in slow)
    assert all(a.source == "stochastic[0]" and a.id.startswith("s0.") for a in slow)
    assert all(a.target == "redis" for a in actions if a.kind is FaultKind.PAUSE)
    assert expand(script, 0, 0, seed=3) == [a for a in actions if a.target == "redis"]


def test_the_object_store_is_killed_and_paused_like_redis() -> None:
    script = parse_script(_script(
        faults=[{"at": 10, "kill": "blobs", "down": "4s"}, {"at": 30, "pause": "blobs", "for": 2}],
        stochastic=[{"targets": ["blobs", "shard-0"], "fault": "kill", "mtbf": 20,
                     "repair": _REPAIR, "max_concurrent": 1}],
    ))
    actions = expand(script, 2, 1, seed=4)
    timeline = [a for a in actions if a.source == "timeline"]
    assert [(a.id, a.kind, a.duration_s, a.end_s) for a in timeline] == [
        ("f000-kill-blobs", FaultKind.KILL, 4.0, 14.0),
        ("f001-pause-blobs", FaultKind.PAUSE, 2.0, 32.0),
    ]
    drawn = [a for a in actions if a.source == "stochastic[0]" and a.target == "blobs"]
    assert drawn and all(a.kind is FaultKind.KILL and a.duration_s == 3.0 for a in drawn)
    for a in drawn:  # never on top of the timeline's faults on the same target
        assert not any(t.at_s <= a.at_s < (t.end_s or math.inf) for t in timeline)
    # blobs needs no count: a run without learners or shards still has its object store
    forever = expand(parse_script(_script(faults=[{"at": 1, "kill": "blobs", "restart": False}])),
                     0, 0)
    assert [(a.target, a.duration_s) for a in forever] == [("blobs", None)]
    assert FaultAction.from_json(timeline[0].to_json()) == timeline[0]


@pytest.mark.parametrize(
    "repair",
    [
        {"dist": "exponential", "mean": "15s"},
        {"dist": "weibull", "shape": 2.0, "scale": "15s"},
        {"dist": "uniform", "min": "10s", "max": "20s"},
        {"dist": "fixed", "value": "12s"},
    ],
    ids=lambda r: r["dist"],
)
def test_repair_distributions(repair: dict[str, Any]) -> None:
    spec = RepairSpec.model_validate(repair)
    rng = np.random.default_rng(0)
    draws = [spec.sample(rng) for _ in range(4000)]
    assert min(draws) >= 0
    assert statistics.mean(draws) == pytest.approx(spec.mean_s, rel=0.05)


def test_model_dump_reloads() -> None:
    script = load_script(SCRIPTS_DIR / "poisson-kill-storm.yaml")
    text = yaml.safe_dump(script.model_dump(mode="json", by_alias=True, exclude_none=True))
    again = parse_script(yaml.safe_load(text))
    assert expand(again, 4, 2) == expand(script, 4, 2)


def test_a_script_arms_failpoints_and_names_a_bad_one() -> None:
    script = load_script(SCRIPTS_DIR / "store-faults.yaml")
    assert script.failpoints is not None and "store.publish=after-effect" in script.failpoints
    with pytest.raises(ScriptError, match=r"failpoints: unknown failpoint 'store.pubish'"):
        parse_script(_script(failpoints="store.pubish=before"), "t.yaml")
