"""Following a run without the live view: the progress line (ddiloco.workers.run.live), the log
level plumbing (ddiloco.workers.run.runtime, launch) and ``ddiloco --version``."""

from __future__ import annotations

import logging
from importlib.metadata import version
from pathlib import Path
from typing import Any

import pytest
from typer.testing import CliRunner

from ddiloco.cli import app
from ddiloco.pipeline.errors import ConfigError
from ddiloco.store.redis_store import RedisStore
from ddiloco.workers.run.config import load_config
from ddiloco.workers.run.launch import LocalCluster
from ddiloco.workers.run.live import (
    Progress,
    ProgressMeter,
    ProgressPrinter,
    estimate_eta,
    format_duration,
    format_progress,
    start_lines,
    token_budget,
)
from ddiloco.workers.run.runtime import LOG_LEVEL_ENV, log_level, setup_logging

ROOT = Path(__file__).resolve().parents[1]


def test_format_progress_from_hand_made_numbers() -> None:
    p = Progress(mode="diloco", elapsed_s=125.9, tokens=1_228_800, budget=4_915_200,
                 tokens_per_s=9830.4, val_loss=2.34567, loss_unit="nats/byte", merges=48,
                 drops=3, eta_s=375.0)
    assert format_progress(p) == (
        "diloco 2:05  tokens 1,228,800 / 4,915,200 (25%)  9,830 tokens/s  "
        "val loss 2.3457 nats/byte  merges 48  drops 3  ETA 6:15")


def test_format_progress_before_anything_is_known() -> None:
    p = Progress(mode="diloco chaos", elapsed_s=3725, tokens=0, budget=None,
                 tokens_per_s=None, val_loss=None, loss_unit="nats/token", merges=0,
                 drops=0, eta_s=None)
    assert format_progress(p) == ("diloco chaos 1:02:05  tokens 0  - tokens/s  val loss -  "
                                  "merges 0  drops 0  ETA -")


def test_format_progress_caps_the_share_at_100_percent() -> None:
    # a restarted learner may train a few steps past the nominal budget
    p = Progress("dp", 10, 1_100, 1_000, 100.0, 1.5, "nats/byte", 2, 0, 0.0)
    assert "tokens 1,100 / 1,000 (100%)" in format_progress(p)
    assert format_progress(p).endswith("ETA 0:00")


def test_duration_and_eta() -> None:
    assert [format_duration(s) for s in (0, 59.9, 60, 3599, 3600, -5)] == [
        "0:00", "0:59", "1:00", "59:59", "1:00:00", "0:00"]
    assert estimate_eta(250, 1000, 50.0, 10.0) == 15.0
    assert estimate_eta(1200, 1000, 50.0, 10.0) == 0.0
    assert estimate_eta(250, None, 50.0, 10.0) is None
    assert estimate_eta(250, 1000, None, 10.0) is None
    assert estimate_eta(250, 1000, 0.0, 10.0) is None
    assert estimate_eta(1000, 1000, 0.0, 10.0) == 0.0  # spent: done, whatever the rate
    # a run with a deadline (a chaos window) ends at the deadline, whatever the rate
    assert estimate_eta(250, None, None, 10.0, deadline_s=60.0) == 50.0
    assert estimate_eta(250, None, None, 70.0, deadline_s=60.0) == 0.0


class Clock:
    """A hand-driven monotonic clock, seconds."""

    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_meter_reads_the_store_incrementally(fake_redis: Any) -> None:
    store = RedisStore(fake_redis, "t-progress")
    clock = Clock()
    meter = ProgressMeter(store, "diloco", "nats/byte", budget=10_000, t0=clock.t, clock=clock)
    first = meter.snapshot()
    assert (first.tokens, first.tokens_per_s, first.val_loss, first.merges, first.drops,
            first.eta_s) == (0, None, None, 0, 0, None)
    clock.t += 10
    store.incr_counter("tokens", "learner-0", 1_000)
    store.incr_counter("tokens", "learner-1", 1_000)
    store.incr_counter("drops", "stale", 2)
    store.incr_counter("drops", "bad_header", 1)
    for p in range(3):
        store.add_event("merge", {"fragment": p})
    store.add_event("eval", {"loss": 3.5, "tokens": 2_000})
    second = meter.snapshot()
    assert (second.tokens, second.merges, second.drops, second.val_loss) == (2_000, 3, 3, 3.5)
    assert second.tokens_per_s == pytest.approx(200.0)  # 2,000 tokens in the last 10 s
    assert second.eta_s == pytest.approx(40.0)          # 8,000 left at 200 tokens/s
    clock.t += 5
    store.incr_counter("tokens", "learner-0", 2_000)
    store.add_event("merge", {"fragment": 3})
    store.add_event("eval", {"loss": 3.0, "tokens": 4_000})
    third = meter.snapshot()
    # the rate is the last interval's, not the mean since the start; merges not re-counted
    assert third.tokens_per_s == pytest.approx(400.0)
    assert (third.tokens, third.merges, third.val_loss) == (4_000, 4, 3.0)
    assert third.elapsed_s == pytest.approx(15.0)
    assert format_progress(third) == (
        "diloco 0:15  tokens 4,000 / 10,000 (40%)  400 tokens/s  val loss 3.0000 nats/byte  "
        "merges 4  drops 3  ETA 0:15")


def test_printer_prints_every_period(fake_redis: Any) -> None:
    store = RedisStore(fake_redis, "t-printer")
    clock = Clock()
    lines: list[str] = []
    printer = ProgressPrinter(ProgressMeter(store, "dp", "nats/byte", None, clock.t,
                                            clock=clock), 30.0, lines.append)
    assert not printer.tick()          # nothing due at the start
    clock.t += 29.9
    assert not printer.tick()
    clock.t += 0.2
    assert printer.tick()
    assert not printer.tick()          # the next one is 30 s later
    assert printer.tick(force=True)    # the final line, whenever asked
    assert len(lines) == 2 and all(line.startswith("dp 0:30  tokens 0") for line in lines)


def test_token_budget_of_a_run() -> None:
    cfg = load_config(ROOT / "configs" / "ci-tiny.yaml", ["train.accumulate=2"])
    manifest = {"task": {"tokens_per_batch": 8 * 32}}
    # learners x steps x tokens per batch x micro-batches per step
    assert token_budget(cfg, manifest) == 2 * 200 * 256 * 2


def test_start_lines_name_the_logs_and_the_commands(tmp_path: Path) -> None:
    (line,) = start_lines(tmp_path / "diloco", "diloco", "debug")
    assert f"{tmp_path}/diloco/logs/" in line and f"{tmp_path}/diloco/commands.sh" in line
    assert "level debug" in line


def test_log_level_from_option_environment_or_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(LOG_LEVEL_ENV, raising=False)
    assert log_level() == logging.INFO
    monkeypatch.setenv(LOG_LEVEL_ENV, "warning")
    assert log_level() == logging.WARNING
    assert log_level("DEBUG") == logging.DEBUG  # the option wins over the environment
    with pytest.raises(ConfigError, match=r"--log-level 'loud'.*debug, info, warning, error"):
        log_level("loud")
    monkeypatch.setenv(LOG_LEVEL_ENV, "verbose")
    with pytest.raises(ConfigError, match=LOG_LEVEL_ENV):
        log_level()


def test_setup_logging_applies_the_level_even_when_configured(
        monkeypatch: pytest.MonkeyPatch) -> None:
    root = logging.getLogger()
    before = root.level
    try:
        monkeypatch.setenv(LOG_LEVEL_ENV, "error")
        log = setup_logging("learner-0")  # pytest has configured the root logger already
        assert root.level == logging.ERROR and not log.isEnabledFor(logging.WARNING)
        setup_logging("learner-0", "debug")
        assert log.isEnabledFor(logging.DEBUG)
    finally:
        root.setLevel(before)


def test_the_launcher_passes_the_log_level_to_workers(tmp_path: Path) -> None:
    cfg = load_config(ROOT / "configs" / "ci-tiny.yaml", ["tracking.log_level=warning"])
    cluster = LocalCluster.for_run(cfg, "redis://127.0.0.1:1/0", "r", tmp_path)
    assert cluster._env()[LOG_LEVEL_ENV] == "warning"
    cluster.write_commands(tmp_path / "commands.sh")
    assert "export DDILOCO_LOG_LEVEL=warning" in (tmp_path / "commands.sh").read_text()
    # the evaluator is told where its tracking files go
    argv = cluster.workers["evaluator"].argv
    assert argv[argv.index("--run-dir") + 1] == str(tmp_path)


def test_cli_version_and_follow_options() -> None:
    runner = CliRunner()
    result = runner.invoke(app, ["--version"])
    assert result.exit_code == 0
    assert result.output == f"ddiloco {version('ddiloco')}\n"
    for args in (["run", "--help"], ["chaos", "run", "--help"]):
        text = runner.invoke(app, args).output
        assert "--log-level" in text and "--progress-every" in text, args
    for worker in ("learner", "syncer", "evaluator"):
        assert "--log-level" in runner.invoke(app, [worker, "--help"]).output
    bad = runner.invoke(app, ["run", "--log-level", "loud", "--no-live"])
    assert bad.exit_code == 2 and "loud" in bad.output
    bad = runner.invoke(app, ["run", "--progress-every", "0", "--no-live"])
    assert bad.exit_code == 2 and "--progress-every" in bad.output


def test_live_table_shows_the_same_with_the_incremental_meter(fake_redis: Any,
                                                              tmp_path: Path) -> None:
    from ddiloco.workers.run.live import live_table

    store = RedisStore(fake_redis, "t-live")
    cluster = LocalCluster("redis://unused", "t-live", tmp_path)
    clock = Clock()
    meter = ProgressMeter(store, "diloco", "nats/byte", None, clock.t, clock=clock)
    store.incr_counter("tokens", "learner-0", 1_500)
    for p in range(4):
        store.add_event("merge", {"fragment": p})
    store.add_event("eval", {"loss": 2.25, "tokens": 1_500})
    with_meter = live_table(store, cluster, "diloco", 0.0, 2, "nats/byte", meter)
    scanned = live_table(store, cluster, "diloco", 0.0, 2, "nats/byte")
    assert with_meter.caption == scanned.caption
    assert "merges 4" in scanned.caption and "val loss 2.2500 nats/byte" in scanned.caption
    assert "tokens 1,500" in scanned.caption
    store.add_event("merge", {"fragment": 0})  # read once: the meter does not count it twice
    again = live_table(store, cluster, "diloco", 0.0, 2, "nats/byte", meter)
    assert "merges 5" in again.caption
