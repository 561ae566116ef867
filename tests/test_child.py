"""The store layer's child-server supervision (:mod:`ddiloco.store.child`) on small shell
scripts: the log, readiness (an exit ends the wait at once; a timeout on an injected clock),
a graceful stop, SIGKILL after the grace period, a crash, and signals that reach the group."""

from __future__ import annotations

import os
import signal
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest

from ddiloco.pipeline.waiting import wait_until
from ddiloco.store.child import ChildExited, ChildNotReady, ChildServer, log_tail

#: what these tests wait for a real process to do, at most (a wait, not a speed bound)
PATIENCE_S = 30.0


class FakeClock:
    """A monotonic clock that moves only when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, seconds: float) -> None:
        self.now += seconds


@contextmanager
def running(script: str, log: Path, *, name: str | None = None, own_session: bool = True,
            banner: str | None = None) -> Iterator[ChildServer]:
    """``sh -c script`` as a :class:`ChildServer`, killed on the way out whatever happens."""
    child = ChildServer.spawn(["/bin/sh", "-c", script], log, name=name,
                              own_session=own_session, banner=banner)
    try:
        yield child
    finally:
        child.crash()


def _says(child: ChildServer, line: str) -> None:
    """Wait until ``line`` is in the child's log (the script's own "I am ready")."""
    child.wait_ready(lambda: line in child.log_path.read_text(), timeout_s=PATIENCE_S,
                     what=f"say {line!r}", interval_s=0.01)


def _gone(pid: int) -> bool:
    """Whether ``pid`` no longer runs (reaped, or a zombie its new parent has yet to reap)."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] == "Z"


def test_the_log_gets_the_banner_then_the_output_and_its_tail_is_kept(tmp_path: Path) -> None:
    log = tmp_path / "server.log"
    log.write_bytes(b"an earlier run\n")
    with running("echo started; echo oops >&2; echo ready; exec sleep 60", log,
                 banner="--- starting") as child:
        _says(child, "ready")
        assert log.read_text() == "an earlier run\n--- starting\nstarted\noops\nready\n"
        assert child.log_tail(6) == "ready\n"
        assert child.name == "sh" and child.returncode is None


def test_log_tail_of_a_missing_log_says_so(tmp_path: Path) -> None:
    assert log_tail(tmp_path / "none.log").startswith("(log unreadable: ")


def test_a_missing_binary_is_an_os_error(tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        ChildServer.spawn([str(tmp_path / "no-server")], tmp_path / "x.log")


def test_ready_when_the_probe_passes(tmp_path: Path) -> None:
    clock = FakeClock()
    answers = iter([False, False, True])
    with running("exec sleep 60", tmp_path / "log") as child:
        child.wait_ready(lambda: next(answers), timeout_s=1.0, what="answer", interval_s=0.1,
                         clock=clock, sleep=clock.sleep)
        assert clock.now == pytest.approx(0.2)  # two pauses: the third probe passed


def test_an_exit_ends_the_wait_with_the_code_and_the_log(tmp_path: Path) -> None:
    with running("echo 'Address already in use'; exit 3", tmp_path / "log",
                 name="redis-server on port 1") as child:
        # the probe never passes: only the exit can end the wait before the deadline
        with pytest.raises(ChildExited, match=r"(?s)^redis-server on port 1 exited with "
                                              r"code 3; log .*Address already in use") as info:
            child.wait_ready(lambda: False, timeout_s=PATIENCE_S, what="answer PING",
                             interval_s=0.01)
        assert info.value.returncode == 3


def test_a_probe_that_never_passes_times_out_and_leaves_the_child(tmp_path: Path) -> None:
    clock = FakeClock()
    with running("echo listening nowhere; exec sleep 60", tmp_path / "log",
                 name="weed") as child:
        _says(child, "listening nowhere")
        with pytest.raises(ChildNotReady, match=r"(?s)^weed did not answer within 0.3 s; "
                                                r"log .*listening nowhere"):
            child.wait_ready(lambda: False, timeout_s=0.3, what="answer", interval_s=0.1,
                             clock=clock, sleep=clock.sleep)
        assert child.returncode is None  # the caller decides whether to stop it


def test_retried_errors_mean_not_yet(tmp_path: Path) -> None:
    clock = FakeClock()
    calls: list[int] = []

    def probe() -> bool:
        calls.append(1)
        if len(calls) < 3:
            raise ConnectionRefusedError("not listening yet")
        return True

    with running("exec sleep 60", tmp_path / "log") as child:
        child.wait_ready(probe, timeout_s=1.0, what="answer", retry_on=(ConnectionError,),
                         clock=clock, sleep=clock.sleep)
    assert len(calls) == 3


def test_stop_is_graceful_and_idempotent(tmp_path: Path) -> None:
    script = "trap 'echo bye; exit 0' TERM; echo ready; while :; do sleep 0.05; done"
    with running(script, tmp_path / "log") as child:
        _says(child, "ready")  # the trap is set: a SIGTERM from now on is handled
        assert child.stop(grace_s=PATIENCE_S) == 0
        assert child.log_tail().endswith("bye\n")
        assert child.stop() == 0


def test_stop_resumes_a_paused_child_so_that_it_exits_gracefully(tmp_path: Path) -> None:
    script = "trap 'echo bye; exit 0' TERM; echo ready; while :; do sleep 0.05; done"
    with running(script, tmp_path / "log") as child:
        _says(child, "ready")
        os.killpg(child.pid, signal.SIGSTOP)  # a chaos pause
        assert child.stop(grace_s=PATIENCE_S) == 0  # not -9: SIGTERM was acted on
        assert child.log_tail().endswith("bye\n")


def test_stop_kills_a_child_that_ignores_sigterm(tmp_path: Path) -> None:
    # SIG_IGN survives exec: the loop's sleeps ignore SIGTERM too.
    with running("trap '' TERM; echo ready; while :; do sleep 0.05; done",
                 tmp_path / "log") as child:
        _says(child, "ready")
        assert child.stop(grace_s=0.1) == -signal.SIGKILL


@pytest.mark.parametrize("how", ["stop", "crash"])
def test_signals_reach_what_the_child_forked(tmp_path: Path, how: str) -> None:
    # What Redis's AOF rewrite is to redis-server: a forked process of the server's group.
    with running("sleep 60 & echo forked $!; wait", tmp_path / "log") as child:
        _says(child, "forked")
        forked = int(child.log_tail().split("forked ")[1].split()[0])
        assert not _gone(forked)
        if how == "stop":
            child.stop(grace_s=PATIENCE_S)
        else:
            child.crash()
            assert child.returncode == -signal.SIGKILL
        wait_until(lambda: _gone(forked), timeout_s=PATIENCE_S, interval_s=0.01,
                   what="the forked process to die with the group")


def test_without_its_own_session_only_the_child_is_signalled(tmp_path: Path) -> None:
    with running("exec sleep 60", tmp_path / "log", own_session=False) as child:
        assert os.getpgid(child.pid) == os.getpgid(0)  # in our group: killpg would hit us
        child.crash()
        assert child.returncode == -signal.SIGKILL
        child.crash()  # idempotent
