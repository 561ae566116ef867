"""Loss labels come from the task: the manifest records the task's unit, and the report, the
summary table and ``ddiloco status`` print it (a custom task is not labelled nats/byte)."""

from __future__ import annotations

import dataclasses

import fakeredis
import pytest

from ddiloco.localrun import print_summary
from ddiloco.report import mode_report, render_status, report_loss_unit, store_status
from ddiloco.store import RedisStore
from ddiloco.workers.run.config import load_config
from ddiloco.workers.run.manifest import build_manifest
from ddiloco.workers.task.api import DEFAULT_LOSS_UNIT, manifest_loss_unit
from ddiloco.workers.task.loader import build_task
from tests.test_task import tiny_task


def _store() -> RedisStore:
    return RedisStore(fakeredis.FakeRedis(server=fakeredis.FakeServer()), "unit-run")


def _custom_manifest(unit: str | None = None) -> dict[str, object]:
    cfg = load_config(None, {"model.task": "tests.test_task:tiny_task", "sync.fragments": 2,
                             "run.shards": 1})
    task = build_task(cfg)
    if unit is not None:
        task = dataclasses.replace(task, loss_unit=unit)
    return build_manifest(cfg, "unit-run", task)


def test_the_manifest_records_the_task_unit() -> None:
    assert tiny_task.__name__ == "tiny_task"
    assert _custom_manifest()["loss_unit"] == DEFAULT_LOSS_UNIT == "nats/token"
    assert _custom_manifest("bits/char")["loss_unit"] == "bits/char"
    gpt = build_task(load_config(None, {"model.preset": "tiny"}))
    assert gpt.loss_unit == "nats/byte"


def test_manifests_without_a_unit_fall_back_by_model() -> None:
    # manifests written before the unit was recorded: the built-in GPT has a model block
    assert manifest_loss_unit({"model": {"d_model": 64}}) == "nats/byte"
    assert manifest_loss_unit({"model": None}) == "nats/token"
    assert manifest_loss_unit({"model": None, "loss_unit": "bits/char"}) == "bits/char"


def test_status_report_and_summary_print_the_task_unit(capsys: pytest.CaptureFixture[str]
                                                        ) -> None:
    store = _store()
    store.put_manifest(_custom_manifest("bits/[char]"))
    store.add_event("eval", {"loss": 1.25, "tokens": 640, "wire_bytes": 0})
    st = store_status(store)
    assert st["loss_unit"] == "bits/[char]"
    render_status(st)
    out = capsys.readouterr().out
    assert "last validation loss 1.2500 bits/[char] at 640 tokens" in out
    assert "nats/byte" not in out

    block = mode_report(store, wall_s=2.0)
    assert block["loss_unit"] == "bits/[char]" and block["final_val_loss"] == 1.25
    report = {"diloco": block}
    assert report_loss_unit(report) == "bits/[char]"
    print_summary(report)
    out = capsys.readouterr().out
    assert "final val loss (bits/[char])" in out and "nats/byte" not in out


def test_summary_of_a_report_without_units() -> None:
    assert report_loss_unit({"diloco": {"model": {"d_model": 8}}}) == "nats/byte"
    assert report_loss_unit({"dp": {"model": None}}) == "nats/token"
    assert report_loss_unit({}) == DEFAULT_LOSS_UNIT
