"""Pinned learners spread over the cores again as learners finish (``run.pin``):
:func:`pin_plan` with hand-computed plans, and :meth:`LocalCluster.rebalance_pins` moving real
processes' threads."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from ddiloco.workers.run.launch import LocalCluster, Worker
from ddiloco.workers.run.runtime import pin_plan, repin


def test_a_full_run_pinned_by_index_stays_where_it_is() -> None:
    assert pin_plan({0: 0, 1: 1, 2: 0, 3: 1}, [0, 1]) == {0: 0, 1: 1, 2: 0, 3: 1}
    assert pin_plan({0: 4, 1: 5}, [4, 5]) == {0: 4, 1: 5}


def test_finished_learners_cores_are_used_again_with_the_fewest_moves() -> None:
    # learners 0 and 2 (core 0) are done: one of core 1's moves there
    assert pin_plan({1: 1, 3: 1}, [0, 1]) == {1: 1, 3: 0}
    # three on two cores is as balanced as it gets: nothing moves
    assert pin_plan({1: 1, 2: 0, 3: 1}, [0, 1]) == {1: 1, 2: 0, 3: 1}
    # six learners on three cores, all on core 0 after the others finished: two stay
    plan = pin_plan({0: 0, 3: 0, 6: 0, 9: 0, 12: 0, 15: 0}, [0, 1, 2])
    assert plan == {0: 0, 3: 0, 6: 1, 9: 1, 12: 2, 15: 2}


def test_a_learner_not_pinned_yet_gets_a_free_core() -> None:
    assert pin_plan({0: 0, 1: None}, [0, 1]) == {0: 0, 1: 1}
    assert pin_plan({0: 0, 1: 7}, [0, 1]) == {0: 0, 1: 1}  # a core not among ours
    assert pin_plan({}, [0, 1]) == {} and pin_plan({0: None}, []) == {}


def test_every_core_gets_its_share_whatever_the_start() -> None:
    for n in range(0, 9):
        for start in (0, 1, None):
            plan = pin_plan({i: start for i in range(n)}, [0, 1, 2])
            counts = [list(plan.values()).count(k) for k in (0, 1, 2)]
            assert sorted(plan) == list(range(n)) and max(counts) - min(counts) <= 1


def test_repin_of_a_process_that_is_gone_is_false() -> None:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert repin(proc.pid, 0) is False


needs_two = pytest.mark.skipif(not hasattr(os, "sched_getaffinity")
                               or len(os.sched_getaffinity(0)) < 2,
                               reason="needs sched_setaffinity and two cores")

# two threads, so that a move must cover every thread of the process
SLEEPER = ("import threading, time\n"
           "threading.Thread(target=time.sleep, args=(120,), daemon=True).start()\n"
           "time.sleep(120)\n")


@pytest.fixture
def learners(tmp_path: Path) -> Iterator[LocalCluster]:
    cluster = LocalCluster("redis://127.0.0.1:1/0", "pins", tmp_path, pin=True,
                           platform="cpu")
    cores = sorted(os.sched_getaffinity(0))[:2]
    for i in range(4):
        proc = subprocess.Popen([sys.executable, "-c", SLEEPER])
        os.sched_setaffinity(proc.pid, {cores[i % 2]})  # as learner i pins itself
        cluster.workers[f"learner-{i}"] = Worker(f"learner-{i}", [], proc=proc)
    try:
        yield cluster
    finally:
        for w in cluster.workers.values():
            assert w.proc is not None
            w.proc.kill()
            w.proc.wait()


def _threads_on(pid: int) -> set[frozenset[int]]:
    return {frozenset(os.sched_getaffinity(int(t))) for t in os.listdir(f"/proc/{pid}/task")}


@needs_two
def test_the_cluster_moves_a_learner_onto_the_core_its_finished_mates_left(
        learners: LocalCluster) -> None:
    c0, c1 = sorted(os.sched_getaffinity(0))[:2]
    assert learners.rebalance_pins() == {}  # all four running, each where it pinned itself
    for name in ("learner-0", "learner-2"):  # both of core c0's learners finish
        proc = learners.workers[name].proc
        assert proc is not None
        proc.kill()
        proc.wait()
    assert learners.rebalance_pins() == {"learner-3": c0}
    pid = learners.workers["learner-3"].pid
    assert pid is not None and _threads_on(pid) == {frozenset({c0})}  # every thread moved
    assert learners.rebalance_pins() == {}  # balanced: nothing more to do
    other = learners.workers["learner-1"].pid
    assert other is not None and _threads_on(other) == {frozenset({c1})}


@needs_two
def test_no_pin_or_several_xla_threads_moves_nothing(learners: LocalCluster) -> None:
    proc = learners.workers["learner-0"].proc
    assert proc is not None
    proc.kill()
    proc.wait()
    learners.pin = False
    assert learners.rebalance_pins() == {}
    learners.pin, learners.xla_threads = True, 2  # learners that do not pin themselves
    assert learners.rebalance_pins() == {}
