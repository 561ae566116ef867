"""``run.deterministic``: what it forces and refuses, the step gate that adopts a round's
version at its send step + tau, the learner order of a merge's sums, and the evaluator's
round keys, each with hand-computed cases (docs/QUALITY.md, "Deterministic mode").

The end-to-end check, two runs of one seed giving the same bits, is
``tests/test_deterministic_run.py``.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import fakeredis
import numpy as np
import pytest

from ddiloco.pipeline.errors import ConfigError, DeterminismBroken
from ddiloco.store import RedisStore
from ddiloco.workers.learner.blocking import (
    END,
    NoWait,
    RoundGate,
    StepGate,
    adoption_step,
    gate_for,
)
from ddiloco.workers.run.config import Config, config_from_dict, load_config
from ddiloco.workers.run.deterministic import (
    LAUNCHED_ENV,
    check_learner_start,
    check_local_run,
    complete_round,
    deterministic_settings,
    force_deterministic,
    round_tokens,
)
from ddiloco.workers.run.manifest import build_manifest
from ddiloco.workers.run.resume import resume_rule
from ddiloco.workers.syncer.core import ShardCore
from ddiloco.workers.syncer.fused import MergeEngine
from ddiloco.workers.syncer.merge import learner_order, token_weight
from ddiloco.workers.task.model import init_params
from tests.test_syncer_core import RUN, TINY, Clock, delta_frames, rand_like

ON = ["run.deterministic=true"]


# ---------------------------------------------------------------- configuration
def test_off_by_default_and_nothing_forced() -> None:
    cfg = Config()
    assert cfg.run.deterministic is False
    assert (cfg.sync.blocking, cfg.sync.min_quorum, cfg.sync.round_notice) == (False, 1, True)


def test_on_forces_the_blocking_settings_for_the_run_s_learners() -> None:
    cfg = load_config(None, ON)
    assert (cfg.sync.blocking, cfg.sync.min_quorum, cfg.sync.round_notice,
            cfg.sync.phase_lock, cfg.sync.merge_every) == (True, 4, False, False, 0.0)
    assert load_config(None, [*ON, "run.learners=3"]).sync.min_quorum == 3
    # the order of the items does not matter: the rule sees the whole tree
    assert load_config(None, ["run.learners=5", *ON]).sync.min_quorum == 5


def test_values_it_would_set_are_kept_and_others_refused_naming_the_setting() -> None:
    same = load_config(None, [*ON, "run.learners=2", "sync.min_quorum=2", "sync.blocking=true",
                              "sync.merge_every=0", "sync.round_notice=false"])
    assert same.sync.min_quorum == 2
    for item, needs in (("sync.min_quorum=1", "sync.min_quorum = 4; got 1"),
                        ("sync.blocking=false", "sync.blocking = true; got False"),
                        ("sync.round_notice=true", "sync.round_notice = false; got True"),
                        ("sync.phase_lock=true", "sync.phase_lock = false; got True"),
                        ("sync.merge_every=1", "sync.merge_every = 0; got 1")):
        with pytest.raises(ConfigError) as exc:
            load_config(None, [*ON, item])
        assert str(exc.value).startswith(f"run.deterministic needs {needs}"), str(exc.value)
        assert "\n" not in str(exc.value)


def test_refuses_an_overlap_of_a_period_or_more_and_the_dp_mode() -> None:
    with pytest.raises(ConfigError, match=r"needs sync.tau < sync.H \(6\); got 6"):
        load_config(None, [*ON, "sync.H=6", "sync.tau=6"])
    assert load_config(None, [*ON, "sync.H=6", "sync.tau=5"]).sync.tau == 5
    with pytest.raises(ConfigError, match=r"run.mode = dp\) is deterministic already"):
        load_config(None, [*ON, "run.mode=dp"])


def test_a_stored_config_round_trips_and_its_dp_copy_is_exempt() -> None:
    cfg = load_config(None, [*ON, "run.learners=2"])
    tree = cfg.model_dump(mode="json")
    assert config_from_dict(tree, stored=True) == cfg
    # the DP half of `ddiloco run --baseline dp` stores a copy with run.mode = dp
    tree["run"]["mode"] = "dp"
    assert config_from_dict(tree, stored=True).run.deterministic


def test_force_deterministic_on_a_raw_tree() -> None:
    assert deterministic_settings(2) == {
        "sync.blocking": True, "sync.min_quorum": 2, "sync.round_notice": False,
        "sync.phase_lock": False, "sync.merge_every": 0.0}
    tree = {"run": {"deterministic": True, "learners": 2}, "sync": {"H": 6, "blocking": "true"}}
    out = force_deterministic(tree, default_learners=4)
    assert out["sync"] == {"H": 6, "blocking": True, "min_quorum": 2, "round_notice": False,
                           "phase_lock": False, "merge_every": 0.0}
    assert tree["sync"] == {"H": 6, "blocking": "true"}  # the input is left alone
    assert force_deterministic({"run": {"deterministic": False}}, 4) == {
        "run": {"deterministic": False}}
    assert force_deterministic({"run": {"deterministic": True}}, 4)["sync"]["min_quorum"] == 4


def test_it_cannot_change_on_resume() -> None:
    safe, why = resume_rule("run.deterministic")
    assert not safe and "refused a resume" in why


# ---------------------------------------------------------------- refusals at start
def test_a_learner_the_launcher_did_not_start_is_refused() -> None:
    with pytest.raises(ConfigError, match=r"learner-0 was not started by `ddiloco run`"):
        check_learner_start("learner-0", "run-a", {})
    with pytest.raises(ConfigError, match="not started by"):
        check_learner_start("learner-0", "run-a", {LAUNCHED_ENV: "run-b"})
    check_learner_start("learner-0", "run-a", {LAUNCHED_ENV: "run-a"})
    check_learner_start("learner-0", "run-a", {LAUNCHED_ENV: "run-a"}, incarnation=1)
    with pytest.raises(ConfigError, match=r"starts again \(incarnation 2\)"):
        check_learner_start("learner-0", "run-a", {LAUNCHED_ENV: "run-a"}, incarnation=2)


def test_the_launcher_marks_its_workers_and_commands_sh_does_not(tmp_path: Path) -> None:
    from ddiloco.workers.run.launch import LocalCluster

    cluster = LocalCluster("redis://127.0.0.1:1", "run-a", tmp_path, platform="cpu")
    cluster.add_learner(0)
    assert cluster._env()[LAUNCHED_ENV] == "run-a"
    cluster.write_commands(tmp_path / "commands.sh")
    assert LAUNCHED_ENV not in (tmp_path / "commands.sh").read_text()


def test_regions_resume_and_chaos_are_refused(tmp_path: Path) -> None:
    check_local_run(False, regions=True, resume=True)
    with pytest.raises(ConfigError, match=r"run\.deterministic with --regions"):
        check_local_run(True, regions=True)
    with pytest.raises(ConfigError, match=r"run\.deterministic with --resume"):
        check_local_run(True, resume=True)

    from ddiloco.chaos.faults import ChaosError
    from ddiloco.chaos.runner import check_diagnostics
    from ddiloco.localrun import run_local

    cfg = load_config(None, ON)
    with pytest.raises(ChaosError, match=r"set run\.deterministic=false for chaos runs"):
        check_diagnostics(cfg)
    # refused before the run folder is touched
    with pytest.raises(ConfigError, match="--regions"):
        run_local(cfg, tmp_path / "out", regions=tmp_path / "topology.yaml")
    with pytest.raises(ConfigError, match="--resume"):
        run_local(cfg, tmp_path / "out", resume=True)
    assert not (tmp_path / "out").exists()


# ---------------------------------------------------------------- the step gate
class Tick:
    """A hand-driven monotonic clock, seconds."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_adoption_step_is_the_send_step_plus_tau() -> None:
    assert adoption_step(7, 2) == 9
    assert adoption_step(7, 0) == 7


def test_a_version_is_adopted_at_send_plus_tau_never_earlier() -> None:
    gate = StepGate("learner-0", tau=2, timeout_s=10.0, clock=Tick())
    gate.sent(1, base=3, step=7)
    # version 4 arrived after step 7 or 8: kept until step 9 is done
    assert [gate.may_adopt(1, 4, s) for s in (7, 8, 9, 10)] == [False, False, True, True]
    assert not gate.may_adopt(1, 3, 9)  # not newer than the base
    assert not gate.may_adopt(0, 1, 9)  # no round of fragment 0 awaited
    # and a missing version holds step 10, not step 9
    assert (gate.held(9), gate.held(10)) == ([], [1])
    gate.adopted(1, 4, {"learner-0": 7})
    assert gate.held(10) == []
    assert not gate.may_adopt(1, 5, 20)  # released: nothing awaited for it any more
    (r,) = gate.releases()
    assert (r.awaited.step, r.version, r.included) == (7, 4, True)


def test_tau_zero_adopts_between_the_send_step_and_the_next() -> None:
    gate = StepGate("learner-0", tau=0, timeout_s=10.0, clock=Tick())
    gate.sent(0, base=0, step=6)
    assert gate.may_adopt(0, 1, 6)
    assert gate.held(7) == [0]


def test_the_end_of_training_holds_and_lets_in_every_awaited_round() -> None:
    gate = StepGate("learner-0", tau=2, timeout_s=10.0, clock=Tick())
    gate.sent(3, base=5, step=36)
    gate.sent(2, base=5, step=35)
    assert gate.held(37) == []
    assert gate.held(END) == [2, 3]
    assert gate.may_adopt(3, 6, END - 1) and gate.may_adopt(2, 6, END - 1)


def test_a_wait_past_the_timeout_stops_the_learner() -> None:
    clock = Tick()
    gate = StepGate("learner-1", tau=0, timeout_s=10.0, clock=clock)
    gate.sent(2, base=4, step=12)
    clock.t = 109.9
    assert gate.expire(13) == []
    clock.t = 110.0
    assert gate.expire(12) == []  # the round does not hold step 12
    with pytest.raises(DeterminismBroken, match=r"learner-1 has no version of fragment 2 newer "
                       r"than 4 10.0 s after its send at step 12"):
        gate.expire(13)


def test_other_gates_adopt_whatever_arrives() -> None:
    gate = RoundGate("learner-0", tau=2, timeout_s=10.0, clock=Tick())
    gate.sent(1, base=3, step=7)
    assert gate.may_adopt(1, 4, 7) and gate.may_adopt(0, 9, 7)
    assert NoWait().may_adopt(0, 1, 0)
    assert isinstance(gate_for(True, "l", 2, 10.0, deterministic=True), StepGate)
    assert type(gate_for(True, "l", 2, 10.0)) is RoundGate
    assert isinstance(gate_for(False, "l", 2, 10.0), NoWait)


# ---------------------------------------------------------------- the merge's order
def test_learner_order_is_by_name_then_index() -> None:
    assert learner_order(["learner-10", "shard-x", "learner-2", "a", "learner-0"]) == [
        "a", "learner-0", "learner-2", "learner-10", "shard-x"]


LEARNERS = ("learner-0", "learner-1", "learner-2")


@contextmanager
def three_learner_shard(overrides: dict[str, object]) -> Iterator[tuple[ShardCore, RedisStore]]:
    """Shard 0 of a fakeredis store with three registered, live learners."""
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    try:
        store = RedisStore(client, RUN)
        cfg = load_config(None, overrides)
        manifest = store.put_manifest(build_manifest(cfg, RUN))
        epoch = store.acquire_lease(0, "owner", 5000)
        assert epoch is not None
        core = ShardCore(manifest, 0, store, epoch, clock=Clock())
        core.load(lambda: init_params(cfg.model_config_obj(), cfg.train.seed))
        for lid in LEARNERS:
            store.register_learner(lid)
        core.set_live(set(LEARNERS))
        yield core, store
    finally:
        client.close()


def test_a_round_merges_the_same_bits_whatever_order_its_deltas_arrive_in() -> None:
    overrides = {**TINY, "run.learners": 3, "sync.codec_down": "int4",
                 "run.deterministic": True}
    p = 0
    results = []
    for order in ((0, 1, 2), (2, 0, 1), (1, 2, 0)):
        with three_learner_shard(overrides) as (core, store):
            deltas = [rand_like(core, p, 10 + i) for i in range(3)]
            for i in order:
                core.handle(delta_frames(core, LEARNERS[i], 1, p, 0, deltas[i],
                                         c_tokens=1000 + 300 * i, c_steps=10))
                # K = M = 3: no round merges before every learner is in
                assert core.tick() == [] or i == order[-1]
            head = store.get_latest(p)
            assert head is not None and head.version == 1
            assert head.meta["contributors"] == list(LEARNERS)
            results.append(bytes(head.value))
            shapes = core.layout.shapes(p)
    assert results[0] == results[1] == results[2]

    # and arrival order would have changed them: float sums of three terms are not associative
    from ddiloco.pipeline.accumulate import unpack
    from ddiloco.pipeline.codec import encode

    packed = [[unpack(encode(d, "fp32"), [tuple(s) for s in shapes], "fp32")] for d in deltas]
    weights = [token_weight(1000 + 300 * i, 10) for i in range(3)]
    engine = MergeEngine(1)
    sums = {}
    for order in ((0, 1, 2), (2, 0, 1), (1, 2, 0)):
        acc = engine.merge([packed[i] for i in order], [weights[i] for i in order], shapes,
                           [False] * len(shapes), "average")
        sums[order] = acc.tobytes()
    assert len(set(sums.values())) > 1


# ---------------------------------------------------------------- the evaluator's keys
def test_complete_round_is_the_least_head_version() -> None:
    assert complete_round([3, 2, 4]) == 2
    assert complete_round([0, 0]) == 0
    assert complete_round([1, None]) is None
    assert complete_round([]) is None


def test_round_tokens_count_each_learner_up_to_its_latest_merged_send() -> None:
    # two fragments' versions of one round: learner-0 sent at steps 6 and 3, learner-1 at 6
    # and 4 (a learner's tokens up to its latest send held anywhere in the round)
    merged = [{"learner-0": 6, "learner-1": 6}, {"learner-0": 3, "learner-1": 4}]
    assert round_tokens(merged, 256) == (6 + 6) * 256
    assert round_tokens([{"learner-0": 3}, {"learner-0": 9, "learner-1": 2}], 10) == 110
    assert round_tokens([{}, {}], 256) == 0  # round 0: the initial value


def test_codecs_use_no_unseeded_randomness() -> None:
    """The codecs a deterministic run sends through give the same bytes twice."""
    from ddiloco.pipeline.codec import encode

    x = [np.random.default_rng(0).normal(size=5000).astype(np.float32)]
    for name in ("fp32", "bf16", "int8", "int4", "topk-d2-b2"):
        assert encode(x, name) == encode(x, name), name
