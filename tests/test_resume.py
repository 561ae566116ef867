"""Resume that does what it says, run folders that are never half-written, checkpoints that
know their run.

* the resume rule (:mod:`ddiloco.workers.run.resume`): every configuration field has one, the
  schema hash's fields are unsafe, a safe change is returned and an unsafe one refused with
  the field, both values and the fix;
* the stored manifest amended with a resume's safe changes (what a learner started by hand
  reads), and never with an unsafe one;
* learner checkpoints carry the run id: another run's is refused with both ids;
* ``--out`` holding another run is refused without ``--resume`` / ``--force``; ``--force``
  removes that run's files (and nothing else);
* every start that fails before training (bad corpus, unreachable Redis, refused resume,
  unwritable ``--out``, a configuration refused at the init step) leaves no folder it
  created and changes nothing of an existing run;
* a finished run resumed with more ``train.steps`` trains on to the new budget (real
  processes, tiny model).
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from pydantic import BaseModel

from ddiloco.localrun import run_local
from ddiloco.pipeline.errors import ConfigError, CorpusUnavailable, StoreUnavailable
from ddiloco.store.redis_store import RedisStore
from ddiloco.workers.run.config import Config, load_config
from ddiloco.workers.run.manifest import TRAIN_OUTSIDE_SCHEMA, amend_manifest, manifest_config
from ddiloco.workers.run.resume import (
    RESUME_RULES,
    ResumeRefused,
    check_resume,
    resume_changes,
    resume_rule,
)
from ddiloco.workers.run.rundir import OutHoldsRun, RunFolder, RunFolderError, check_out, clear_run

ROOT = Path(__file__).resolve().parent.parent
TINY = ROOT / "configs" / "ci-tiny.yaml"
pytestmark = pytest.mark.timeout(120)


def ddiloco(*args: str, timeout: float = 100) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ddiloco.cli", *args], capture_output=True,
                          text=True, cwd=ROOT, timeout=timeout)


def one_error_line(proc: subprocess.CompletedProcess[str]) -> str:
    """The command failed as a user error: exit 2, one line, no traceback."""
    assert proc.returncode == 2, proc.stderr
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), proc.stderr
    return lines[0]


def snapshot(folder: Path) -> dict[str, bytes | None]:
    """Every path under ``folder`` with its bytes (None: a folder)."""
    return {str(p.relative_to(folder)): (p.read_bytes() if p.is_file() else None)
            for p in sorted(folder.rglob("*"))}


def fake_run(folder: Path, cfg: Config | None = None, **info: Any) -> dict[str, bytes | None]:
    """A run folder as a finished run leaves it (run.json, Redis data, a checkpoint, logs,
    the report) without training; returns its snapshot."""
    cfg = cfg or load_config(TINY)
    (folder / "redis").mkdir(parents=True)
    (folder / "redis" / "appendonly.aof").write_bytes(b"*1\r\n$4\r\nPING\r\n")
    ckpt = folder / "diloco" / "learners" / "learner-0" / "ckpt" / "200"
    ckpt.mkdir(parents=True)
    (ckpt / "_CHECKPOINT_METADATA").write_text("{}")
    (folder / "diloco" / "logs").mkdir()
    (folder / "diloco" / "logs" / "learner-0.log").write_text("learner-0 INFO stopped\n")
    (folder / "diloco" / "jax_cache").mkdir()
    (folder / "report.json").write_text("{}")
    (folder / "run.json").write_text(json.dumps({
        "run_id": "run-20260101-000000-ab12", "redis_url": None,
        "config": cfg.model_dump(mode="json"), **info}, indent=2))
    return snapshot(folder)


# ------------------------------------------------------------------------------ the rule
def _fields(cfg: Config) -> list[str]:
    return [f"{section}.{name}" for section, model in cfg if isinstance(model, BaseModel)
            for name in type(model).model_fields]


def test_every_config_field_has_a_resume_rule() -> None:
    undecided = [p for p in _fields(Config())
                 if p not in RESUME_RULES and p.split(".")[0] + ".*" not in RESUME_RULES]
    assert undecided == [], f"decide in workers/run/resume.py whether these may change: {undecided}"


def test_the_schema_hash_fields_are_unsafe() -> None:
    for path in _fields(Config()):
        section, name = path.split(".")
        if section in ("model", "sync"):
            assert not resume_rule(path)[0], path
        if section == "train":
            assert resume_rule(path)[0] == (name in TRAIN_OUTSIDE_SCHEMA), path
    for path in ("run.mode", "run.run_id", "run.redis_url", "store.blobs", "data.corpus"):
        assert not resume_rule(path)[0], path
    assert resume_rule("nosuch.field") == (False, "not known to be safe to change mid-run")


def test_safe_changes_pass_and_unsafe_ones_are_refused_with_the_field() -> None:
    old = Config().model_dump(mode="json")
    steps = load_config(None, ["train.steps=1000", "data.eval_batches=4"])
    changes = check_resume("out", resume_changes(old, steps.model_dump(mode="json")))
    assert [(c.path, c.old, c.new) for c in changes] == [
        ("data.eval_batches", 8, 4), ("train.steps", 600, 1000)]
    assert changes[1].describe() == "train.steps 600 -> 1000"
    both = load_config(None, ["train.steps=1000", "sync.H=12", "run.learners=2"])
    with pytest.raises(ResumeRefused) as err:
        check_resume("out", resume_changes(old, both.model_dump(mode="json")))
    assert str(err.value) == (
        "--resume out: run.learners cannot change on resume (4 -> 2) (also sync.H): every "
        "learner's data shard is 1/M of the corpus: another M re-partitions the data under "
        "the restored positions; start a new run with --out NEW")
    h = load_config(None, ["sync.H=12"])
    with pytest.raises(ResumeRefused, match=r"^--resume out: sync\.H cannot change on resume "
                       r"\(24 -> 12\): it is part of the run's schema .*; start a new run "
                       r"with --out NEW$"):
        check_resume("out", resume_changes(old, h.model_dump(mode="json")))


def test_a_run_json_of_an_older_version_is_compared_field_by_field() -> None:
    """A field the stored config lacks had its default; a field the schema dropped is not
    compared."""
    old = Config().model_dump(mode="json")
    del old["tracking"]
    old["run"]["no_longer_a_field"] = 1
    assert resume_changes(old, Config().model_dump(mode="json")) == []


# ------------------------------------------------------------------------------ manifest
def _stored(store: RedisStore) -> dict[str, Any]:
    manifest = {"schema_hash": "h1", "run_id": store.run_id, "mode": "diloco",
                "config": load_config(TINY).model_dump(mode="json")}
    return store.put_manifest(manifest)


def test_amend_manifest_sets_safe_fields_for_every_later_reader(fake_redis: Any) -> None:
    store = RedisStore(fake_redis, "amend")
    assert amend_manifest(store, {"train.steps": 900}) is None  # no run yet: nothing to do
    before = _stored(store)
    amend_manifest(store, {"train.steps": 900, "data.eval_batches": 2})
    got = store.get_manifest()
    assert got is not None
    cfg = manifest_config(got)  # what a learner started by hand reads
    assert cfg.train.steps == 900 and cfg.data.eval_batches == 2
    assert got["schema_hash"] == before["schema_hash"]
    assert {k: v for k, v in got.items() if k != "config"} == {
        k: v for k, v in before.items() if k != "config"}


def test_amend_manifest_refuses_unsafe_or_invalid_fields(fake_redis: Any) -> None:
    store = RedisStore(fake_redis, "amend-bad")
    before = _stored(store)
    with pytest.raises(ConfigError, match=r"sync\.H cannot change"):
        amend_manifest(store, {"sync.H": 3})
    with pytest.raises(ConfigError):
        amend_manifest(store, {"train.steps": 0})
    assert store.get_manifest() == before


# ------------------------------------------------------------------------------ checkpoints
def test_a_checkpoint_of_another_run_is_refused_with_both_ids(tmp_path: Path) -> None:
    import jax.numpy as jnp
    import optax

    from ddiloco.workers.learner.checkpoint import CheckpointOfAnotherRun, LearnerCheckpoint

    state = optax.adam(1e-3).init({"a": jnp.ones(3)})
    ck = LearnerCheckpoint(tmp_path / "ck", run_id="run-a")
    ck.save(7, state, {"step": 7})
    ck.close()
    with pytest.raises(CheckpointOfAnotherRun,
                       match=r"belongs to run 'run-a', not to this learner's run 'run-b'"):
        LearnerCheckpoint(tmp_path / "ck", run_id="run-b").restore(state)
    got = LearnerCheckpoint(tmp_path / "ck", run_id="run-a").restore(state)
    assert got is not None and got[1] == {"step": 7, "run_id": "run-a"}
    legacy = LearnerCheckpoint(tmp_path / "old")  # written before checkpoints had run ids
    legacy.save(3, state, {"step": 3})
    legacy.close()
    got = LearnerCheckpoint(tmp_path / "old", run_id="run-b").restore(state)
    assert got is not None and got[1] == {"step": 3}


# ------------------------------------------------------------------------------ run folders
def test_out_holding_a_run_is_refused_and_force_removes_only_its_files(tmp_path: Path) -> None:
    out = tmp_path / "out"
    fake_run(out)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(OutHoldsRun) as err:
        check_out(out, force=False)
    assert str(err.value) == (f"{out}: holds run run-20260101-000000-ab12 (pass --resume "
                              f"{out} to continue it, or --force to replace it)")
    assert sorted(clear_run(out)) == ["diloco/learners", "diloco/logs", "redis",
                                      "report.json", "run.json"]
    assert sorted(p.name for p in out.iterdir()) == ["diloco", "notes.txt"]
    assert [p.name for p in (out / "diloco").iterdir()] == ["jax_cache"]
    check_out(out, force=False)  # nothing of a run is left


def test_files_of_a_run_without_run_json_are_refused(tmp_path: Path) -> None:
    (tmp_path / "redis").mkdir()
    with pytest.raises(OutHoldsRun, match=r"holds files of an earlier run \(redis\) \(pass "
                       r"--force"):
        check_out(tmp_path, force=False)


def test_rollback_removes_what_the_start_made_and_restores_what_it_rewrote(
        tmp_path: Path) -> None:
    new = RunFolder.open(tmp_path / "a" / "b" / "out")
    (new.path / "redis").mkdir()
    new.rollback()
    assert list(tmp_path.iterdir()) == []  # the parents it made too
    out = tmp_path / "run"
    before = fake_run(out)
    folder = RunFolder.open(out)
    folder.write("run.json", "{}")
    (out / "s3").mkdir()
    (out / "diloco" / "logs" / "learner-0.log").write_text("a line")  # a file it kept
    folder.rollback()
    after = snapshot(out)
    assert after.keys() == before.keys() and after["run.json"] == before["run.json"]


@pytest.mark.parametrize("bad", ["/dev/null/out", "file"])
def test_an_unusable_out_is_one_line_naming_it(tmp_path: Path, bad: str) -> None:
    out = Path(bad) if bad.startswith("/") else tmp_path / bad
    if bad == "file":
        out.write_text("x")
    with pytest.raises(RunFolderError, match=rf"^--out {re.escape(str(out))}: cannot create "
                       r"the run folder \(.+\); pick a writable path$"):
        RunFolder.open(out)


# ------------------------------------------------------------------------------ failed starts
def test_failed_starts_in_a_new_folder_leave_nothing(tmp_path: Path) -> None:
    out = tmp_path / "new" / "out"
    with pytest.raises(CorpusUnavailable):
        run_local(load_config(TINY, [f"data.corpus=[{tmp_path}/missing.txt]"]), out,
                  live=False)
    assert not (tmp_path / "new").exists()
    # Refused at the init step, with the embedded Redis up and run.json written.
    with pytest.raises(ConfigError, match="redis_max_fragment_mb"):
        run_local(load_config(TINY, ["sync.fragments=1", "model.d_model=512",
                                     "store.redis_max_fragment_mb=1"]), out, live=False)
    assert not (tmp_path / "new").exists()
    # An existing empty folder stays, empty.
    out.mkdir(parents=True)
    with pytest.raises(ConfigError, match="redis_max_fragment_mb"):
        run_local(load_config(TINY, ["sync.fragments=1", "model.d_model=512",
                                     "store.redis_max_fragment_mb=1"]), out, live=False)
    assert list(out.iterdir()) == []
    proc = ddiloco("run", "--out", "/dev/null/out", "--no-live")
    assert "--out /dev/null/out: cannot create the run folder" in one_error_line(proc)


def test_failed_starts_change_nothing_of_an_existing_run(tmp_path: Path) -> None:
    out = tmp_path / "out"
    before = fake_run(out)
    stored = load_config(TINY)
    with pytest.raises(OutHoldsRun):
        run_local(stored, out, live=False)
    with pytest.raises(OutHoldsRun):
        run_local(load_config(TINY, [f"data.corpus=[{tmp_path}/missing.txt]"]), out,
                  live=False)
    with pytest.raises(CorpusUnavailable):  # --force checks everything before removing
        run_local(load_config(TINY, [f"data.corpus=[{tmp_path}/missing.txt]"]), out,
                  live=False, force=True)
    with pytest.raises(ResumeRefused, match=r"sync\.H cannot change on resume \(6 -> 3\)"):
        run_local(load_config(TINY, ["sync.H=3"]), out, live=False, resume=True)
    with pytest.raises(RunFolderError, match="pass one"):
        run_local(stored, out, live=False, resume=True, force=True)
    assert snapshot(out) == before
    proc = ddiloco("run", "--resume", str(out), "--set", "sync.H=3", "--no-live")
    assert one_error_line(proc) == (
        f"error: --resume {out}: sync.H cannot change on resume (6 -> 3): it is part of the "
        "run's schema (the manifest's schema hash); start a new run with --out NEW")
    proc = ddiloco("run", "--config", str(TINY), "--out", str(out), "--no-live")
    assert one_error_line(proc) == (
        f"error: {out}: holds run run-20260101-000000-ab12 (pass --resume {out} to continue "
        "it, or --force to replace it)")
    assert snapshot(out) == before


def test_unreachable_redis_leaves_nothing(tmp_path: Path,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """The Redis is tried before any folder is made (the command line's 8 tries with backoff
    take seconds; in this process one try says the same)."""
    import functools
    import importlib

    # the module, not the function of the same name that ddiloco.store exports
    connect_module = importlib.import_module("ddiloco.store.connect")

    down = "redis://127.0.0.1:1/0"
    out = tmp_path / "out"
    before = fake_run(out, redis_url=down)
    with monkeypatch.context() as patch:
        patch.setattr(connect_module, "connect",
                      functools.partial(connect_module.connect, attempts=1))
        with pytest.raises(StoreUnavailable):
            run_local(load_config(TINY, ["train.steps=400"]), out, live=False, resume=True)
    assert snapshot(out) == before
    proc = ddiloco("run", "--config", str(TINY), "--redis-url", down, "--out",
                   str(tmp_path / "new"), "--no-live")
    assert "cannot reach Redis" in one_error_line(proc)
    assert not (tmp_path / "new").exists()


# ------------------------------------------------------------------------------ a real resume
@pytest.mark.integration
@pytest.mark.timeout(300)
def test_resume_with_more_steps_trains_on_to_the_new_budget(tmp_path: Path) -> None:
    """A finished run (2 learners x 30 steps) resumed with --steps 60: the learners restore
    their checkpoints at step 30 and train to 60; tokens double; run.json records the change;
    the report shows the new budget."""
    out = tmp_path / "out"
    first = ddiloco("run", "--config", str(TINY), "--steps", "30", "--out", str(out),
                    "--no-live", timeout=250)
    assert first.returncode == 0, first.stderr[-3000:]
    r1 = json.loads((out / "report.json").read_text())["diloco"]
    cfg = load_config(TINY)
    per_step = cfg.train.batch_size * (cfg.model.seq_len or 0)
    assert r1["tokens"] == 2 * 30 * per_step and r1["steps"] == 30
    second = ddiloco("run", "--resume", str(out), "--steps", "60", "--no-live", timeout=250)
    assert second.returncode == 0, second.stderr[-3000:]
    assert "resuming run run-" in second.stdout and "train.steps 30 -> 60" in second.stdout
    report = json.loads((out / "report.json").read_text())
    assert report["diloco"]["tokens"] == 2 * 60 * per_step and report["diloco"]["steps"] == 60
    info = json.loads((out / "run.json").read_text())
    assert info["config"]["train"]["steps"] == 60
    assert [r["changes"] for r in info["resumes"]] == [{"train.steps": [30, 60]}]
    assert report["resumes"] == info["resumes"]
    for learner in ("learner-0", "learner-1"):
        ckpt = out / "diloco" / "learners" / learner / "ckpt"
        assert max(int(p.name) for p in ckpt.iterdir() if p.name.isdigit()) == 60
        log = (out / "diloco" / "logs" / f"{learner}.log").read_text()
        assert "restored checkpoint at step 30" in log
