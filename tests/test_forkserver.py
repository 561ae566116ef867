"""The fork server (workers/run/forkserver.py): real server processes, real forks, signals and
reaping, and a local run whose workers it forks."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ddiloco.store import EmbeddedRedis
from ddiloco.workers.run.forkserver import (
    PRELOAD,
    ForkedProcess,
    ForkServer,
    ForkServerError,
    Spawn,
    Warm,
    available,
)
from tests._cluster import start_cluster, wait_for

pytestmark = pytest.mark.skipif(not available(), reason="the fork server needs Linux (fork, "
                                "PR_SET_CHILD_SUBREAPER)")

# Run as a forked worker's __main__: says what it is, then exits, sleeps or fails as told.
PROBE = '''\
import json, os, sys, time
print(json.dumps({"pid": os.getpid(), "ppid": os.getppid(), "sid": os.getsid(0),
                  "probe": os.environ.get("PROBE"), "argv": sys.argv[1:],
                  "preloaded": "email.mime.text" in sys.modules}), flush=True)
if sys.argv[1:2] == ["sleep"]:
    time.sleep(120)
sys.exit(int(sys.argv[2]) if sys.argv[1:2] == ["exit"] else 0)
'''


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    """The server's and its workers' environment: the probe module on the path."""
    (tmp_path / "fsprobe.py").write_text(PROBE)
    path = os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]).strip(os.pathsep)
    return {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", "PROBE": "server",
            "JAX_PLATFORMS": "cpu"}


@pytest.fixture
def server(tmp_path: Path, env: dict[str, str]) -> Iterator[ForkServer]:
    """A fork server that preloads a small stdlib module (fast; JAX's check is below)."""
    fs = ForkServer(env, tmp_path / "server.log", ("email.mime.text",))
    fs.start()
    try:
        yield fs
    finally:
        fs.close()


def said(log: Path) -> dict[str, Any]:
    """The probe's line in ``log``, once it is there."""
    line = wait_for(lambda: log.exists() and log.read_text().strip(), 30, f"{log}'s line")
    out: dict[str, Any] = json.loads(line.splitlines()[0])
    return out


def test_a_forked_worker_is_this_processs_child_with_its_own_env_session_and_log(
        server: ForkServer, env: dict[str, str], tmp_path: Path) -> None:
    log = tmp_path / "w.log"
    proc = server.spawn(["exit", "3"], log, {**env, "PROBE": "worker"}, module="fsprobe")
    assert proc.wait(30) == 3 and proc.returncode == 3 and proc.poll() == 3
    got = said(log)
    assert got["pid"] == proc.pid and got["sid"] == proc.pid  # its own session
    assert got["probe"] == "worker" and got["argv"] == ["exit", "3"]
    assert got["preloaded"], "the worker did not start from the server's imports"
    # reaped here: it was this process's child, not the server's
    with pytest.raises(ChildProcessError):
        os.waitpid(proc.pid, os.WNOHANG)
    assert server.ready is not None and server.ready["modules"] > 0


def test_kill9_a_forked_worker_and_it_outlives_the_server(
        server: ForkServer, env: dict[str, str], tmp_path: Path) -> None:
    log = tmp_path / "sleeper.log"
    proc = server.spawn(["sleep"], log, env, module="fsprobe")
    got = said(log)
    assert got["ppid"] == os.getpid()  # reparented to this subreaper
    with pytest.raises(subprocess.TimeoutExpired):
        proc.wait(0.2)
    server.close()
    assert proc.poll() is None, "the worker ended with its fork server"
    proc.kill()
    assert proc.wait(30) == -signal.SIGKILL
    proc.kill()  # reaped: no signal goes to a pid that may be another's now


def test_bad_requests_are_answered_and_the_server_goes_on(
        server: ForkServer, env: dict[str, str], tmp_path: Path) -> None:
    first = server.spawn([], tmp_path / "a.log", env, module="fsprobe")
    assert first.wait(30) == 0
    assert server.proc is not None and server.proc.stdin is not None
    for line in (b"{not json", b'{"argv": [], "log": "x", "env": {}, "extra": 1}',
                 b'{"argv": [], "log": "x", "env": {}, "module": "os; rm"}'):
        server.proc.stdin.write(line + b"\n")
        server.proc.stdin.flush()
        assert server._reply(30)["error"].startswith("bad request")
    # JAX reads its settings at import: a worker whose differ cannot be one of its forks
    other = {k: v for k, v in env.items() if k != "JAX_PLATFORMS"}
    with pytest.raises(ForkServerError, match="JAX_PLATFORMS differs"):
        server.spawn([], tmp_path / "b.log", other, module="fsprobe")
    # a log that cannot be opened: the worker exits 127, the server is unharmed
    lost = server.spawn([], tmp_path / "no" / "such" / "dir.log", env, module="fsprobe")
    assert lost.wait(30) == 127
    assert "worker set-up failed" in (tmp_path / "server.log").read_text()
    again = server.spawn(["exit", "0"], tmp_path / "c.log", env, module="fsprobe")
    assert again.wait(30) == 0 and said(tmp_path / "c.log")["argv"] == ["exit", "0"]


def test_a_preload_that_fails_is_named_and_nothing_is_forked(
        env: dict[str, str], tmp_path: Path) -> None:
    fs = ForkServer(env, tmp_path / "server.log", ("ddiloco_no_such_module",))
    fs.start()
    try:
        with pytest.raises(ForkServerError, match=r"preload failed.*ddiloco_no_such_module"):
            fs.spawn([], tmp_path / "w.log", env, module="fsprobe")
    finally:
        fs.close()
    assert not (tmp_path / "w.log").exists()


def test_jax_preloaded_without_a_backend_and_a_worker_command_runs(
        env: dict[str, str], tmp_path: Path) -> None:
    """The workers' own preload: JAX is imported but no backend started (the server checks),
    and a worker's command line answers as a fresh process's would."""
    fs = ForkServer(env, tmp_path / "server.log", PRELOAD)
    fs.start()
    try:
        proc = fs.spawn(["learner", "--id", "learner-0"], tmp_path / "w.log", env)
        assert proc.wait(60) == 2
        assert "learner needs --redis-url and --run-id" in (tmp_path / "w.log").read_text()
        assert fs.ready is not None and fs.ready["modules"] > 500
    finally:
        fs.close()


def test_a_request_is_validated_before_anything_forks() -> None:
    with pytest.raises(ValueError):
        Spawn.model_validate({"argv": [], "log": "", "env": {}})
    with pytest.raises(ValueError):
        Spawn.model_validate({"argv": [], "log": "x", "env": {}, "module": "a b"})
    assert Spawn(argv=["learner"], log="x", env={}).module == "ddiloco.workers"


def test_a_corpus_warmed_before_the_fork_is_every_workers(
        tmp_path: Path, env: dict[str, str]) -> None:
    corpus = tmp_path / "corpus"
    corpus.mkdir()
    (corpus / "play.txt").write_text("to be or not to be\n")
    (tmp_path / "fswarm.py").write_text(
        "import json\nfrom pathlib import Path\nfrom ddiloco.workers.task import data\n"
        "kept = [k[0] for key in data._WARM for k in key]\n"
        f"docs = data.load_documents([Path({str(corpus)!r})])\n"
        "print(json.dumps({'kept': kept, 'docs': {k: v.decode() for k, v in docs.items()}}))\n")
    fs = ForkServer(env, tmp_path / "server.log", ("ddiloco.workers.task.data",),
                    warm=Warm(corpus=[str(corpus)]))
    fs.start()
    try:
        log = tmp_path / "w.log"
        assert fs.spawn([], log, env, module="fswarm").wait(30) == 0
        got = said(log)
        assert got == {"kept": ["corpus/play.txt"],
                       "docs": {"corpus/play.txt": "to be or not to be\n"}}
        assert fs.ready is not None and fs.ready["corpus_bytes"] == 19
    finally:
        fs.close()


# A forked learner's first steps: does it get the server's task and trace? The loss is
# Python that runs only while JAX traces, so a counter around it says whether it traced.
PRETRACE_PROBE = '''\
import json, os
from ddiloco.workers.learner.inner import InnerLoop
from ddiloco.workers.run.config import Config
from ddiloco.workers.task.api import DataShard
from ddiloco.workers.task.loader import build_task, prebuilt
cfg = Config.model_validate(json.loads(os.environ["FS_CONFIG"]))
task = build_task(cfg)
calls = []
loss = task.loss
task.loss = lambda p, b: (calls.append(1), loss(p, b))[1]
loop = InnerLoop(task)
params = loop.place_all(task.initial_values())
state = loop.init_opt(params)
batches = task.batches(DataShard(1, cfg.run.learners, 0, cfg.train.seed))
for _ in range(2):
    params, state, out = loop.step(params, state, [next(batches)])
print(json.dumps({"prebuilt": prebuilt() is task, "traced_here": len(calls),
                  "loss": float(out)}))
'''


def test_a_learner_forked_after_the_pretrace_trains_on_the_servers_trace(
        tmp_path: Path, env: dict[str, str]) -> None:
    from ddiloco.workers.run.config import load_config
    from ddiloco.workers.run.launch import fork_warm

    cfg = load_config(None, {"model.seq_len": 32, "train.batch_size": 4})
    warm = fork_warm(cfg)
    assert warm is not None and warm.config is not None
    (tmp_path / "fspretrace.py").write_text(PRETRACE_PROBE)
    env = {**env, "FS_CONFIG": json.dumps(warm.config)}
    fs = ForkServer(env, tmp_path / "server.log", PRELOAD, warm=warm)
    fs.start()
    try:
        log = tmp_path / "w.log"
        assert fs.spawn([], log, env, module="fspretrace").wait(300) == 0, log.read_text()
        forked = json.loads(log.read_text().strip().splitlines()[-1])
        assert fs.ready is not None and fs.ready["traced"] == ["init", "train"], fs.ready
        assert "pretrace_error" not in fs.ready
    finally:
        fs.close()
    assert forked["prebuilt"] and forked["traced_here"] == 0, forked
    # the control, a process of its own: it builds its own task, traces it, same loss
    own = subprocess.run([sys.executable, str(tmp_path / "fspretrace.py")],
                         env={**env, "PYTHONPATH": env["PYTHONPATH"]}, capture_output=True,
                         text=True, timeout=300, check=True)
    alone = json.loads(own.stdout.strip().splitlines()[-1])
    assert not alone["prebuilt"] and alone["traced_here"] >= 1
    assert alone["loss"] == forked["loss"]


# A forked shard's merge kernels: numba dispatchers hold their compiled signatures, so a
# shard forked after the server's warm-up has them before it merges anything.
MERGE_PROBE = '''\
import json
from ddiloco.pipeline import accumulate
from ddiloco.workers.syncer import fused
print(json.dumps({"outer_int": len(fused.outer_int.signatures),
                  "add_int": len(accumulate._add_int.signatures)}))
'''


def test_a_shard_forked_after_the_merge_warm_up_has_its_kernels(
        tmp_path: Path, env: dict[str, str]) -> None:
    (tmp_path / "fsmerge.py").write_text(MERGE_PROBE)
    fs = ForkServer(env, tmp_path / "server.log", ("ddiloco.workers.syncer.fused",),
                    warm=Warm(corpus=None, codecs=["int4", "int8"]))
    fs.start()
    try:
        log = tmp_path / "w.log"
        assert fs.spawn([], log, env, module="fsmerge").wait(120) == 0, log.read_text()
        assert fs.ready is not None and fs.ready["merge_kernels_s"] > 0, fs.ready
    finally:
        fs.close()
    forked = json.loads(log.read_text().strip().splitlines()[-1])
    assert forked["outer_int"] >= 1 and forked["add_int"] >= 1, forked
    # the control, a process of its own: nothing compiled until it merges
    own = subprocess.run([sys.executable, str(tmp_path / "fsmerge.py")], env=env,
                         capture_output=True, text=True, timeout=120, check=True)
    assert json.loads(own.stdout.strip().splitlines()[-1]) == {"outer_int": 0, "add_int": 0}


@pytest.mark.parametrize(("warm", "modules", "key", "says"), [
    # a pretrace that fails: the learners build and trace their own
    (Warm(config={"model": {"preset": "no-such-preset"}}), ("ddiloco.workers.task.data",),
     "pretrace_error", "no-such-preset"),
    # merge kernels that cannot be warmed: each shard warms its own
    (Warm(corpus=None, codecs=["no-such-codec"]), ("email.mime.text",),
     "merge_kernels_error", "no-such-codec"),
], ids=["pretrace", "merge-kernels"])
def test_warm_work_that_fails_is_reported_and_workers_fork(
        tmp_path: Path, env: dict[str, str], warm: Warm, modules: tuple[str, ...], key: str,
        says: str) -> None:
    fs = ForkServer(env, tmp_path / "server.log", modules, warm=warm)
    fs.start()
    try:
        assert fs.spawn(["exit", "0"], tmp_path / "w.log", env, module="fsprobe").wait(60) == 0
        assert fs.ready is not None and says in fs.ready[key]
    finally:
        fs.close()


def test_a_corpus_that_cannot_be_warmed_is_reported_and_workers_fork(
        tmp_path: Path, env: dict[str, str]) -> None:
    fs = ForkServer(env, tmp_path / "server.log", ("email.mime.text",),
                    warm=Warm(corpus=[str(tmp_path / "missing")]))
    fs.start()
    try:
        log = tmp_path / "w.log"
        assert fs.spawn(["exit", "0"], log, env, module="fsprobe").wait(30) == 0
        assert fs.ready is not None and "CorpusUnavailable" in fs.ready["warm_error"]
    finally:
        fs.close()


def test_a_library_that_sets_up_logging_at_import_leaves_the_workers_theirs(
        tmp_path: Path, env: dict[str, str]) -> None:
    # orbax.checkpoint adds a handler to the root logger when imported: in the server it must
    # not become every worker's (their log lines had lost their timestamp and worker name)
    (tmp_path / "fslog.py").write_text(
        "import json, logging\nfrom ddiloco.workers.run.runtime import setup_logging\n"
        "setup_logging('learner-7').info('hello')\n"
        "print(json.dumps({'root_handlers': len(logging.getLogger().handlers)}))\n")
    fs = ForkServer(env, tmp_path / "server.log", ("orbax.checkpoint",))
    fs.start()
    try:
        log = tmp_path / "w.log"
        assert fs.spawn([], log, env, module="fslog").wait(60) == 0
        first, second = log.read_text().splitlines()[:2]
        assert first.endswith(" learner-7 INFO hello") and first[:4].isdigit(), first
        assert json.loads(second) == {"root_handlers": 1}
    finally:
        fs.close()


def test_forked_process_of_a_pid_not_ours_reports_a_lost_code() -> None:
    proc = ForkedProcess(os.getpid())  # not a child of this process
    assert proc.poll() == -255 and proc.wait() == -255


def _ppid(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines()
                    if line.startswith("PPid:")))


def test_a_local_runs_workers_are_forked_and_a_killed_learner_is_forked_again(
        redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    """A real run (ci-tiny): every worker comes from the fork server as this process's child;
    a learner killed with -9 is forked again and finishes its steps."""
    c, store = start_cluster(redis_server, tmp_path, "it-fork",
                             {"train.steps": 60, "run.fork_server": True})
    try:
        names = [*c.names("shard"), *c.names("learner"), "evaluator"]
        assert c.forked == len(names)
        for name in names:
            proc = c.workers[name].proc
            assert isinstance(proc, ForkedProcess) and _ppid(proc.pid) == os.getpid(), name
        wait_for(lambda: store.events(kinds={"first_step"}), 120, "a first step", c)
        c.kill("learner-1")
        assert c.workers["learner-1"].proc is not None
        assert c.workers["learner-1"].proc.returncode == -signal.SIGKILL
        c.start("learner-1")
        assert c.forked == len(names) + 1
        assert c.wait(c.names("learner"), timeout_s=240), "the learners did not finish"
        for name in c.names("learner"):
            proc = c.workers[name].proc
            assert proc is not None and proc.returncode == 0, c.log_tail(name)
    finally:
        c.stop_all()
        store.flush_run()
    assert c._forks is None  # stop_all ended the server


def test_fork_server_off_starts_processes_of_their_own(
        redis_server: EmbeddedRedis, tmp_path: Path) -> None:
    c, store = start_cluster(redis_server, tmp_path, "it-nofork",
                             {"train.steps": 12, "run.fork_server": False})
    try:
        assert c.forked == 0
        assert all(isinstance(w.proc, subprocess.Popen) for w in c.workers.values())
        assert c.wait(c.names("learner"), timeout_s=240)
    finally:
        c.stop_all()
        store.flush_run()


def test_a_run_warms_the_built_in_tasks_corpus_and_trace_only() -> None:
    from ddiloco.workers.run.config import load_config
    from ddiloco.workers.run.launch import fork_warm

    plain = fork_warm(load_config(None, {"run.redis_url": "redis://:hunter2@db:6379/0"}))
    assert plain is not None and plain.corpus is None  # the Shakespeare corpus
    # the task's settings travel, nothing else: the server's argv is public
    assert plain.config is not None and set(plain.config) == {"model", "train", "sync", "data",
                                                              "run"}
    assert "hunter2" not in plain.model_dump_json()
    texts = fork_warm(load_config(None, {"data.corpus": ["texts"]}))
    assert texts is not None and texts.corpus == ["texts"]
    torch_only = fork_warm(load_config(None, {"run.torch_learners": 4}))
    # no JAX learner: nothing to trace; the shards' merge kernels all the same
    assert torch_only == Warm(corpus=None, codecs=list(plain.codecs or ()))
    cfg = load_config(None, {"sync.codec_up": "int8"})
    assert fork_warm(cfg).codecs == ["int8", cfg.sync.codec_dp, cfg.sync.codec_down]  # type: ignore[union-attr]
    assert fork_warm(load_config(None, {"model.task": "examples/nnx_transformer.py:task"})) is None
