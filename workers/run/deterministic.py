"""What ``run.deterministic`` forces and refuses: the rule-set of a run whose losses and final
model depend on its seed alone, not on merge timing (docs/QUALITY.md, "Deterministic mode").

A deterministic run is synchronous Streaming DiLoCo decided by step counts: every round holds
all M learners' contributions of one scheduled send (``sync.blocking`` with ``sync.min_quorum``
= M, no early joins, no phase lock, no pacing), each learner adopts a round's version exactly
after inner step ``send + tau`` (:mod:`ddiloco.workers.learner.blocking`), shards sum
contributions in learner order (:func:`ddiloco.workers.syncer.merge.learner_order`), and the
evaluator evaluates whole rounds (:func:`complete_round`) and the final model instead of
whatever the store holds at a wall-clock tick.

Everything here is pure: the configuration's validator (:func:`force_deterministic`), the
checks of a learner's start (:func:`check_learner_start`) and of a local run
(:func:`check_local_run`) take plain values.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from typing import Any

from ddiloco.pipeline.errors import ConfigError

__all__ = ["LAUNCHED_ENV", "check_learner_start", "check_local_run", "complete_round",
           "deterministic_settings", "force_deterministic", "round_tokens"]

#: The environment variable :class:`ddiloco.workers.run.launch.LocalCluster` gives the workers
#: it starts: the run id. A learner of a deterministic run without it was started by hand.
LAUNCHED_ENV = "DDILOCO_LAUNCHED_RUN"


def deterministic_settings(learners: int) -> dict[str, Any]:
    """The ``sync`` settings ``run.deterministic`` forces, by dotted key, for M = ``learners``.

    * ``sync.blocking = true`` and ``sync.min_quorum = M``: a round merges only with every
      learner's contribution of the same scheduled send, and a learner waits for it;
    * ``sync.round_notice = false``: no early joins (a blocked learner ignores notices anyway;
      the shards then do not send them);
    * ``sync.phase_lock = false``: a fragment's period restarts at a send step, never at an
      adoption;
    * ``sync.merge_every = 0``: a round that holds every learner merges at once (pacing only
      delays it: every learner waits for that merge).
    """
    return {"sync.blocking": True, "sync.min_quorum": learners, "sync.round_notice": False,
            "sync.phase_lock": False, "sync.merge_every": 0.0}


def _same(a: Any, b: Any) -> bool:
    """Whether a user's value equals a forced one as the schema reads it (``0`` is ``0.0``,
    the text ``"true"`` of a file is ``True``)."""
    if isinstance(b, bool):
        if isinstance(a, str):
            return a.strip().lower() in (("true", "yes", "on", "1") if b
                                         else ("false", "no", "off", "0"))
        return isinstance(a, (bool, int)) and bool(a) == b
    try:
        return float(a) == float(b)
    except (TypeError, ValueError):
        return False


def _on(value: Any) -> bool:
    """A boolean as the schema reads it (``true``, ``"true"``, ``1``)."""
    return _same(value, True)


def _show(value: Any) -> str:
    """A forced value as ``--set`` takes it (``true``, ``0``, ``4``)."""
    if isinstance(value, bool):
        return "true" if value else "false"
    return f"{value:g}" if isinstance(value, float) else str(value)


def force_deterministic(tree: Mapping[str, Any], default_learners: int) -> dict[str, Any]:
    """A raw configuration tree with the settings of :func:`deterministic_settings` filled in
    when ``run.deterministic`` is on; the tree unchanged (a shallow copy) otherwise.

    A key the tree leaves out takes the forced value; a key it sets to that value is kept; a
    key it sets to anything else is refused (forcing it silently would run another
    experiment than the one written down).

    Args:
        tree: ``{section: {key: value}}`` as read from a file and ``--set`` items, not yet
            validated.
        default_learners: ``run.learners`` when the tree leaves it out (the schema's default).

    Returns:
        A new tree; its ``sync`` section is a new dict.

    Raises:
        ValueError: one line naming the setting, the value ``run.deterministic`` needs and the
            value given (the configuration's validator turns it into a ``ConfigError``).
    """
    out = dict(tree)
    run = out.get("run")
    if not isinstance(run, Mapping) or not _on(run.get("deterministic", False)):
        return out
    learners = run.get("learners", default_learners)
    sync = out.get("sync")
    sync = dict(sync) if isinstance(sync, Mapping) else {}
    # A learner count the schema will refuse is named by its own check, not here.
    for path, value in deterministic_settings(
            learners if isinstance(learners, int) else default_learners).items():
        key = path.split(".", 1)[1]
        if key in sync and not _same(sync[key], value):
            raise ValueError(f"run.deterministic needs {path} = {_show(value)}; got "
                             f"{sync[key]} (leave {path} out: run.deterministic sets it)")
        sync[key] = value
    out["sync"] = sync
    return out


def check_learner_start(learner: str, run_id: str, environ: Mapping[str, str],
                        incarnation: int | None = None) -> None:
    """Refuse a learner of a deterministic run that ``ddiloco run`` did not start, or that
    starts again: its rounds would not line up with the others' schedule, step for step.

    Args:
        learner: the learner's id.
        run_id: the run's id.
        environ: the process's environment (:data:`LAUNCHED_ENV` names the run its launcher
            started it for).
        incarnation: the incarnation the store gave this start (None: not registered yet);
            above 1 is a restart.

    Raises:
        ConfigError: one line naming the reason.
    """
    if environ.get(LAUNCHED_ENV) != run_id:
        raise ConfigError(f"run.deterministic: {learner} was not started by `ddiloco run` "
                          f"for run {run_id} (no {LAUNCHED_ENV}={run_id} in its environment); "
                          "a deterministic run takes only the learners its launcher starts")
    if incarnation is not None and incarnation > 1:
        raise ConfigError(f"run.deterministic: {learner} starts again (incarnation "
                          f"{incarnation}); a deterministic run cannot take a learner back "
                          "mid-run: start a new run")


def check_local_run(deterministic: bool, *, regions: bool = False,
                    resume: bool = False) -> None:
    """Refuse what a deterministic ``ddiloco run`` cannot do (chaos runs refuse
    ``run.deterministic`` themselves: :func:`ddiloco.chaos.runner.check_diagnostics`).

    Args:
        deterministic: ``run.deterministic``.
        regions: the run is spread over emulated regions (``--regions``).
        resume: the run resumes from its checkpoints (``--resume``).

    Raises:
        ConfigError: one line naming the option and the fix.
    """
    if not deterministic:
        return
    if regions:
        raise ConfigError("run.deterministic with --regions: emulated links only add "
                          "latency to a run that waits for every learner; leave --regions out "
                          "or set run.deterministic=false")
    if resume:
        raise ConfigError("run.deterministic with --resume: learners restart from "
                          "checkpoints between rounds, so the resumed run is not the one the "
                          "seed gives; start a new run")


def complete_round(versions: Iterable[int | None]) -> int | None:
    """The newest round every fragment has merged: the least head version (versions count
    rounds from 0, the initial value); None while a fragment has none."""
    vs = list(versions)
    if not vs or any(v is None for v in vs):
        return None
    return min(v for v in vs if v is not None)


def round_tokens(merged: Sequence[Mapping[str, int]], tokens_per_step: int) -> int:
    """Tokens trained up to a round: per learner, the latest send step any fragment's version
    of the round merged (``merged`` maps, learner -> step), summed over the learners, times
    ``tokens_per_step``. Round 0 (no merges): 0."""
    last: dict[str, int] = {}
    for m in merged:
        for learner, step in m.items():
            last[learner] = max(last.get(learner, 0), int(step))
    return sum(last.values()) * tokens_per_step
