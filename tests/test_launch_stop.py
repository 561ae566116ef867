"""The launcher's stop: a second interrupt while workers drain leaves no worker behind.

Workers run in their own sessions (a terminal's Ctrl-C does not reach them), so a launcher
that gave up half-way through :meth:`LocalCluster.stop_all` would leave them running for ever.
Real processes, a real signal delivered to this process while it waits for a worker.
"""

from __future__ import annotations

import os
import signal
import sys
import threading
import time
from pathlib import Path
from types import FrameType

import pytest

from ddiloco.workers.run.launch import LocalCluster, Worker

# A worker that drains slowly: it notes SIGTERM in a file and keeps running.
SLOW_DRAIN = """
import pathlib, signal, sys, time
mark = pathlib.Path(sys.argv[1])
signal.signal(signal.SIGTERM, lambda *_: mark.write_text("term"))
pathlib.Path(sys.argv[2]).write_text("up")
while True:
    time.sleep(0.05)
"""


def _wait_for(path: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"{path} never appeared")
        time.sleep(0.02)


def test_a_second_interrupt_during_stop_all_kills_every_worker(tmp_path: Path) -> None:
    cluster = LocalCluster("redis://127.0.0.1:1", "run-stop", tmp_path)
    names = ["learner-0", "learner-1", "shard-0"]
    for name in names:
        argv = [sys.executable, "-c", SLOW_DRAIN, str(tmp_path / f"{name}.term"),
                str(tmp_path / f"{name}.up")]
        cluster.workers[name] = Worker(name, argv)
        cluster.start(name)
    for name in names:
        _wait_for(tmp_path / f"{name}.up")

    def interrupt(signum: int, frame: FrameType | None) -> None:
        raise KeyboardInterrupt

    def second_interrupt() -> None:
        # the first worker is draining (it got SIGTERM): now the user presses Ctrl-C again
        _wait_for(tmp_path / "learner-0.term")
        os.kill(os.getpid(), signal.SIGUSR1)

    previous = signal.signal(signal.SIGUSR1, interrupt)
    sender = threading.Thread(target=second_interrupt, daemon=True)
    sender.start()
    try:
        with pytest.raises(KeyboardInterrupt):
            cluster.stop_all()
    finally:
        signal.signal(signal.SIGUSR1, previous)
        sender.join(timeout=30)
    for name in names:
        w = cluster.workers[name]
        assert not w.alive, f"{name} still running after the interrupted stop"
        assert w.proc is not None and w.proc.returncode == -signal.SIGKILL
        assert w.log is None  # logs closed on the way out
    # the interrupt came while learner-0 drained: the others never got SIGTERM first
    assert not (tmp_path / "shard-0.term").exists()
