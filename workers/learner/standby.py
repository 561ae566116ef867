"""A standby learner: a process warmed up to its first inner step that waits for the name of
the learner it is to replace.

A restarted learner spends seconds before it trains again: the interpreter, imports, JAX's
start-up, the task, tracing and compiling the inner step (``bench/learner.py`` prints the
stages). None of that depends on which learner it will be. A standby does all of it ahead of
time, then blocks on one line of JSON on its standard input (:class:`Handover`): the learner
id, its Redis URL, its log file. From there it is that learner: it registers a new
incarnation, adopts the store's newest versions and restores the learner's checkpoint
(DESIGN §2.4, rejoin) like a fresh process, and its first inner step hits the step it compiled
while waiting.

:class:`~ddiloco.workers.run.launch.LocalCluster` keeps ``run.standby_learners`` of them and
hands one over when it restarts a learner (a fresh process where none is ready).

Cost: one more learner process per standby: the model's parameters and inner optimizer state
(about 3x the parameters' float32 bytes), the compiled step and the JAX runtime, and its
start-up CPU once; no CPU while it waits.
"""

from __future__ import annotations

import json
import logging
import os
import sys
from dataclasses import dataclass
from typing import IO, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ddiloco.pipeline.errors import DDilocoError

#: the learner id a standby gives its log lines until its handover
STANDBY_NAME = "standby"


class BadHandover(DDilocoError):
    """The handover line is not a :class:`Handover` (its fields and why)."""


class Handover(BaseModel):
    """What makes a standby a learner: one JSON object on one line of its standard input.

    Attributes:
        id: the learner it becomes, e.g. ``learner-1``.
        redis_url: the Redis URL of that learner (its own ACL user, where the run has them).
        log: a file its output goes to from now on (appended); None: where it went so far.
        steps: stop after this many inner steps (None: the run's ``train.steps``).
        cpu: pin the process to this core (None: leave its affinity).
        metrics_port: serve Prometheus metrics there (None: none).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    id: str = Field(min_length=1, max_length=128, pattern=r"^[A-Za-z0-9_.-]+$")
    redis_url: str = Field(min_length=1)
    log: str | None = None
    steps: int | None = Field(default=None, ge=1)
    cpu: int | None = Field(default=None, ge=0)
    metrics_port: int | None = Field(default=None, ge=1, le=65535)

    def line(self) -> bytes:
        """This handover as the line a standby reads (JSON, newline-terminated)."""
        return (self.model_dump_json() + "\n").encode()


def read_handover(stream: IO[str]) -> Handover | None:
    """Block until the supervisor writes the handover line; None when ``stream`` ends first
    (the supervisor closed it: the standby is not needed and exits).

    Raises:
        BadHandover: the line is not JSON or not a :class:`Handover`.
    """
    line = stream.readline()
    if not line:
        return None
    try:
        return Handover.model_validate(json.loads(line))
    except (json.JSONDecodeError, ValidationError) as exc:
        raise BadHandover(f"standby: the handover line is not a learner's handover "
                          f"({' '.join(str(exc).split())[:300]})") from None


@dataclass(frozen=True)
class Prepared:
    """What a standby built before it knew its learner id: the run's task and its inner-step
    engine with the step compiled (:func:`warm`).

    Attributes:
        run_id: the run it was built for.
        task: the run's task.
        inner: the inner-step engine (its jitted step is warm).
    """

    run_id: str
    task: Any
    inner: Any


def warm(manifest: dict[str, Any], log: logging.Logger) -> Prepared:
    """Build the run's task and inner-step engine as a learner's SYNCING does, and run one
    inner step on zero parameters and a batch of data shard 0, so that the jitted step and the
    optimizer's init are compiled (from the persistent cache where it has them) and traced.

    Args:
        manifest: the run's manifest (its config and layout).
        log: where to say what was built.

    Raises:
        TaskError: the task cannot be built, or is not the manifest's model.
    """
    import numpy as np

    # A learner's SYNCING restores its checkpoint with orbax, whose import alone takes about
    # a second: done here, before the handover.
    import orbax.checkpoint  # noqa: F401

    from ddiloco.workers.learner.engines import build_engine
    from ddiloco.workers.run.manifest import manifest_config
    from ddiloco.workers.task.api import DataShard
    from ddiloco.workers.task.loader import build_task

    cfg = manifest_config(manifest)
    t = cfg.train
    task = build_task(cfg)  # the run's task: not a run.torch_learners PyTorch twin
    inner = build_engine(task, cfg)
    tree = task.tree()
    params = inner.place_all({n: np.zeros(tree.shapes[n], np.float32) for n in tree.names})
    opt_state = inner.init_opt(params)
    batches = task.batches(DataShard(0, max(cfg.run.learners, 1), 0, t.seed))
    _, _, loss = inner.step(params, opt_state, [next(batches) for _ in range(inner.accumulate)])
    inner.ready(loss)
    log.info("standby: task %s built and its inner step compiled; waiting for a handover",
             task.name)
    return Prepared(manifest["run_id"], task, inner)


def become(h: Handover) -> None:
    """Take on learner ``h.id``'s process settings: its log file on stdout and stderr, its
    core, and a logging set-up that :func:`ddiloco.workers.run.runtime.setup_logging` makes
    again under its name."""
    if h.log is not None:
        sys.stdout.flush()
        sys.stderr.flush()
        fd = os.open(h.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
        os.dup2(fd, 1)
        os.dup2(fd, 2)
        os.close(fd)
    if h.cpu is not None and hasattr(os, "sched_setaffinity"):
        os.sched_setaffinity(0, {h.cpu})
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
