"""Processes sharing a compilation cache take turns at their first compile
(workers/run/first_compile.py): real processes and real ``flock`` locks."""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import optax
import pytest

from ddiloco.workers.learner import inner as inner_module
from ddiloco.workers.learner.inner import InnerLoop
from ddiloco.workers.run.first_compile import LOCK_NAME, compile_turn
from ddiloco.workers.task.api import Task

# A process that takes its turn, says so, and holds it until a line arrives on stdin.
HOLDER = (
    "import sys; from pathlib import Path; "
    "from ddiloco.workers.run.first_compile import compile_turn\n"
    "with compile_turn(Path(sys.argv[1])) as how:\n"
    "    print(how, flush=True); sys.stdin.readline()\n"
    "print('released', flush=True)\n"
)


@pytest.fixture
def holder(tmp_path: Path) -> Iterator[subprocess.Popen[str]]:
    """Another process that holds the turn of ``tmp_path`` (it answered "first")."""
    proc = subprocess.Popen([sys.executable, "-c", HOLDER, str(tmp_path)], text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert proc.stdout is not None
    assert proc.stdout.readline().strip() == "first"
    yield proc
    if proc.poll() is None:
        proc.kill()
    proc.wait(timeout=30)


def release(proc: subprocess.Popen[str]) -> None:
    assert proc.stdin is not None
    proc.stdin.write("go\n")
    proc.stdin.flush()


def test_without_a_cache_or_its_lock_file_the_block_runs_at_once(tmp_path: Path) -> None:
    with compile_turn(None) as how:
        assert how == "unshared"
    with compile_turn(tmp_path / "missing") as how:
        assert how == "unshared"
    assert not (tmp_path / "missing").exists()


def test_alone_a_process_compiles_first_and_leaves_the_lock_free(tmp_path: Path) -> None:
    with compile_turn(tmp_path) as how:
        assert how == "first"
    assert (tmp_path / LOCK_NAME).exists()
    with compile_turn(tmp_path) as how:
        assert how == "first"


def test_a_second_process_waits_until_the_first_has_compiled(
        tmp_path: Path, holder: subprocess.Popen[str]) -> None:
    sleeps: list[float] = []

    def sleep(s: float) -> None:
        # The waiter found the turn taken: only now does the holder finish its compile.
        if not sleeps:
            release(holder)
            assert holder.stdout is not None
            assert holder.stdout.readline().strip() == "released"
        sleeps.append(s)

    with compile_turn(tmp_path, sleep=sleep) as how:
        assert how == "after"
    assert sleeps, "the waiter never waited"


def test_a_holder_killed_with_sigkill_frees_the_turn(
        tmp_path: Path, holder: subprocess.Popen[str]) -> None:
    killed: list[bool] = []

    def sleep(_s: float) -> None:
        if not killed:
            os.kill(holder.pid, signal.SIGKILL)
            holder.wait(timeout=30)  # the kernel drops its lock with its descriptors
            killed.append(True)

    with compile_turn(tmp_path, sleep=sleep) as how:
        assert how == "after"
    assert killed


def test_a_holder_past_the_timeout_is_not_waited_for(
        tmp_path: Path, holder: subprocess.Popen[str], caplog: pytest.LogCaptureFixture) -> None:
    now = [0.0]

    def monotonic() -> float:
        return now[0]

    def sleep(s: float) -> None:
        now[0] += 10.0

    with caplog.at_level(logging.WARNING), \
            compile_turn(tmp_path, timeout_s=30.0, monotonic=monotonic, sleep=sleep) as how:
        assert how == "timeout"
    assert now[0] == 30.0
    assert "compiling without its cache entry" in caplog.text
    assert holder.poll() is None  # the holder is untouched: it still holds its turn


def test_waiters_do_not_keep_each_other_out(tmp_path: Path,
                                            holder: subprocess.Popen[str]) -> None:
    # Two waiters (separate lock descriptors, as two processes have) both proceed once the
    # holder is done, in either order.
    waiting = threading.Barrier(3)
    got: list[str] = []

    def waiter() -> None:
        first = [True]

        def sleep(_s: float) -> None:
            if first[0]:
                first[0] = False
                waiting.wait(timeout=30)

        with compile_turn(tmp_path, sleep=sleep) as how:
            got.append(how)

    threads = [threading.Thread(target=waiter) for _ in range(2)]
    for t in threads:
        t.start()
    waiting.wait(timeout=30)  # both are waiting
    release(holder)
    for t in threads:
        t.join(timeout=30)
    assert sorted(got) == ["after", "after"]


def test_cache_dir_is_jaxs_persistent_cache(tmp_path: Path) -> None:
    code = ("import jax; from ddiloco.workers.run.first_compile import cache_dir; "
            "print(cache_dir()); "
            f"jax.config.update('jax_compilation_cache_dir', {str(tmp_path)!r}); "
            "print(cache_dir())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout.split()
    assert out == ["None", str(tmp_path)]


def test_the_inner_loop_takes_one_turn_per_program(monkeypatch: pytest.MonkeyPatch,
                                                  tmp_path: Path) -> None:
    turns: list[Path | None] = []
    real = inner_module.compile_turn

    def recording(directory: Path | None, *a: object, **k: object) -> Any:
        turns.append(directory)
        return real(directory)

    monkeypatch.setattr(inner_module, "compile_turn", recording)
    monkeypatch.setattr(inner_module, "cache_dir", lambda: tmp_path)

    def loss(p: dict[str, object], batch: object) -> object:
        import jax.numpy as jnp
        return jnp.sum((p["w"] * batch) ** 2)  # type: ignore[operator]

    import jax.numpy as jnp
    task = Task(params={"w": jnp.ones(4)}, loss=loss, optimizer=optax.sgd(0.1),
                batches=lambda s: iter(()), tokens_per_batch=4, name="t")
    loop = InnerLoop(task)
    params = loop.place_all({"w": np.ones(4, np.float32)})
    state = loop.init_opt(params)
    for _ in range(3):
        params, state, _loss = loop.step(params, state, [np.ones(4, np.float32)])
    grads, _ = loop.grad(params, np.ones(4, np.float32))
    loop.apply(params, state, grads)
    # init, train, grad, apply: one turn each, at the cache the process uses
    assert turns == [tmp_path] * 4


# Builds an InnerLoop on a small task with the persistent cache in argv[1] and takes two steps,
# twice, with JAX's in-memory caches cleared in between (as in a second process), and prints
# what each program's first call did each time.
FIRST_CALLS = '''\
import json, sys
from pathlib import Path
from ddiloco.workers.run.runtime import setup_jax
setup_jax(Path(sys.argv[1]))  # the learners' own set-up: one XLA thread, the cache
import jax, jax.numpy as jnp, numpy as np, optax
from ddiloco.workers.learner.inner import InnerLoop
from ddiloco.workers.task.api import Task
task = Task(params={"w": jnp.ones(8)}, loss=lambda p, b: jnp.sum((p["w"] * b) ** 2),
            optimizer=optax.adam(0.1), batches=lambda s: iter(()), tokens_per_batch=8,
            name="t")
for _ in range(2):
    loop = InnerLoop(task)
    params = loop.place_all({"w": np.ones(8, np.float32)})
    state = loop.init_opt(params)
    for _ in range(2):
        params, state, _ = loop.step(params, state, [np.ones(8, np.float32)])
    print(json.dumps(loop.first_calls, sort_keys=True), flush=True)
    jax.clear_caches()
'''


def test_first_calls_tell_a_compile_from_a_load_of_the_persistent_cache(
        tmp_path: Path) -> None:
    """An empty persistent cache: the first engine compiles both programs; with the
    in-memory caches cleared, a second engine loads them (JAX's cache lookups, not the
    lock's turn, which both get free)."""
    import json

    out = subprocess.run([sys.executable, "-c", FIRST_CALLS, str(tmp_path / "cache")],
                         capture_output=True, text=True, timeout=180, check=True)
    first, second = (json.loads(line) for line in out.stdout.strip().splitlines()[-2:])
    assert first == {"init": "compiled", "train": "compiled"}
    assert second == {"init": "loaded", "train": "loaded"}
