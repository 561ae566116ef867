"""The evaluator that does not compete with training: its cadence of global tokens (pure
functions, hand-computed), the settings' validation, and ``run.evaluator`` end to end on the
CI model: ``after`` evaluates the final model once, when the learners are done; ``off`` never;
``during`` on a cadence of tokens, at a lower CPU priority, with its cost in the report. And the
learners' start-up stages (process, imports, join, store reads, first step) in their
``first_step`` events, which ``bench/learner.py`` prints for a rejoin.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ddiloco.pipeline.errors import ConfigError
from ddiloco.store import EmbeddedRedis, RedisStore
from ddiloco.store.connect import connect
from ddiloco.workers.evaluator import EVALS_PER_RUN, eval_due, eval_interval_tokens
from ddiloco.workers.run.config import load_config
from tests._runs import run_ci_tiny

STEPS = 36
TOKENS_PER_STEP = 2 * 8 * 32  # learners x batch x seq of ci-tiny


def test_interval_is_the_budget_over_twenty_unless_set() -> None:
    assert EVALS_PER_RUN == 20
    assert eval_interval_tokens(None, 4_915_200) == 245_760
    assert eval_interval_tokens(None, 5) == 1  # never 0: that would mean seconds
    assert eval_interval_tokens(1_000, 4_915_200) == 1_000
    assert eval_interval_tokens(0, 4_915_200) == 0


@pytest.mark.parametrize(("tokens", "last", "every", "due"), [
    (0, None, 100, True),      # the initial model
    (99, 0, 100, False),
    (100, 0, 100, True),       # reached the next multiple
    (150, 120, 100, False),    # 120 and 150 share the multiple 100
    (250, 120, 100, True),     # past 200: one evaluation, not one per multiple
    (5, 3, 0, True),           # a cadence of seconds: the caller's period decides
])
def test_due_at_each_multiple_of_the_interval(tokens: int, last: int | None, every: int,
                                             due: bool) -> None:
    assert eval_due(tokens, last, every) is due


@pytest.mark.parametrize(("item", "needle"), [
    ("run.evaluator=sometimes", "run.evaluator"),
    ("run.eval_nice=20", "run.eval_nice"),
    ("run.eval_nice=-1", "run.eval_nice"),
    ("run.eval_every_tokens=-5", "run.eval_every_tokens"),
])
def test_bad_settings_are_refused_by_name(item: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=needle.replace(".", r"\.")):
        load_config(None, [item])


def _run(out: Path, *sets: str) -> tuple[dict[str, Any], list[dict[str, Any]]]:
    """A ci-tiny run; its report block and its events."""
    block, run_id = run_ci_tiny(out, STEPS, sets)
    with EmbeddedRedis(out / "redis") as server:
        events = [e for _, e in RedisStore(connect(server.url), run_id).events()]
    return block, events


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_after_evaluates_the_final_model_once_when_learners_are_done(tmp_path: Path) -> None:
    block, events = _run(tmp_path / "after", "run.evaluator=after")
    evals = [e for e in events if e["kind"] == "eval"]
    assert len(evals) == 1
    assert evals[0]["tokens"] == STEPS * TOKENS_PER_STEP
    # no evaluation while a learner trained: it comes after every learner's last step
    last_step = max(e["t"] for e in events if e["kind"] in ("leave", "merge"))
    assert evals[0]["t"] > last_step
    assert block["final_val_loss"] == evals[0]["loss"]
    cost = block["evaluator"]
    assert cost["when"] == "after" and cost["evals"] == 1 and cost["cpu_s"] > 0
    # every learner's first step says where its start-up went (bench/learner.py prints it)
    firsts = [e for e in events if e["kind"] == "first_step"]
    assert len(firsts) == 2
    for e in firsts:
        stages = e["stages_s"]
        assert set(stages) == {"main", "joined", "synced", "first_step", "total"}
        assert all(v >= 0 for v in stages.values())
        assert stages["total"] == pytest.approx(
            sum(v for k, v in stages.items() if k != "total"), abs=1e-3)
    # a fresh run's compilation cache: one learner compiles the inner step, the other takes
    # its turn after it and loads the entry (first_compile)
    trains = sorted(e["first_calls"]["train"] for e in firsts)
    assert trains == ["compiled", "loaded"], [e["first_calls"] for e in firsts]


@pytest.mark.integration
@pytest.mark.timeout(400)
def test_off_has_no_evaluation_and_during_follows_the_token_cadence(tmp_path: Path) -> None:
    block, events = _run(tmp_path / "off", "run.evaluator=off")
    assert not [e for e in events if e["kind"] in ("eval", "evaluator_stop")]
    assert block["final_val_loss"] is None
    assert block["evaluator"] == {"when": "off", "evals": 0, "eval_s": 0.0, "cpu_s": 0.0}

    every = 6 * TOKENS_PER_STEP  # six global steps
    block, events = _run(tmp_path / "during", f"run.eval_every_tokens={every}")
    tokens = [e["tokens"] for e in events if e["kind"] == "eval"]
    # the initial model, at most one per multiple of the interval, and the final model
    assert 2 <= len(tokens) <= STEPS // 6 + 2, tokens
    multiples = [t // every for t in tokens[:-1]]
    assert multiples == sorted(set(multiples)), tokens
    assert block["evaluator"]["evals"] == len(tokens)
    assert block["evaluator"]["when"] == "during"


def test_process_age_counts_starttime_ticks_after_the_command_name() -> None:
    from ddiloco.workers.learner.report import process_age_s

    # the command name may hold ") " itself: fields count from the last ")"
    stat = "4242 (py ) S) S 1 " + " ".join(str(i) for i in range(5, 22)) + " 150 7 8"
    assert process_age_s(stat, since_boot_s=10.0, ticks_per_s=100) == pytest.approx(8.5)
    with pytest.raises(ValueError):
        process_age_s("no parenthesis here", 1.0, 100)


def test_process_start_time_is_not_before_the_spawn() -> None:
    # The "process" stage used to come from psutil's create_time, which adds the boot time in
    # whole seconds: up to 1 s before the process existed, and every "main" stage that long.
    import subprocess
    import sys
    import time

    before = time.time()
    out = subprocess.run(
        [sys.executable, "-c", "import time; t = time.time(); from ddiloco.workers.learner."
         "report import process_start_time; print(process_start_time(), t)"],
        capture_output=True, text=True, check=True).stdout.split()
    started, at_main = float(out[0]), float(out[1])
    tick = 0.011  # one clock tick (10 ms) and rounding
    assert before - tick <= started <= at_main


def test_rejoin_stages_are_durations_between_stamps() -> None:
    from ddiloco.workers.learner.report import stage_durations

    stamps = {"process": 100.0, "main": 101.5, "joined": 101.75, "synced": 102.25,
              "first_step": 103.0}
    assert stage_durations(stamps) == {"main": 1.5, "joined": 0.25, "synced": 0.5,
                                       "first_step": 0.75, "total": 3.0}
    # a stage not stamped (no process start time) is left out; the rest count on
    del stamps["process"], stamps["joined"]
    assert stage_durations(stamps) == {"synced": 0.75, "first_step": 0.75, "total": 1.5}
    assert stage_durations({}) == {}
