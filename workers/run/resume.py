"""What a resumed run may change: the rule, as a table of configuration fields and a pure diff.

``ddiloco run --resume OUT`` continues a run from its store and its learners' checkpoints. The
new configuration (the run's stored one plus the command line's overrides) is compared with
the stored one field by field (:func:`resume_changes`):

* a *safe* field (``train.steps``, timings, process placement, ...) takes effect: the run
  writes it into the stored manifest's configuration
  (:func:`ddiloco.workers.run.manifest.amend_manifest`), where every worker reads it, also one
  restarted later by hand;
* an *unsafe* field (everything in the manifest's schema hash, and what learners' checkpoints
  or stored versions depend on) is refused before anything changes
  (:func:`check_resume` raises :class:`ResumeRefused`).

The reasons are in :data:`RESUME_RULES`; a field without an entry there is unsafe until
someone decides otherwise (``tests/test_resume.py`` checks that every field has one).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ddiloco.pipeline.errors import ConfigError

__all__ = ["RESUME_RULES", "FieldChange", "ResumeRefused", "check_resume", "flat_config",
           "resume_changes", "resume_rule"]

_SCHEMA = "it is part of the run's schema (the manifest's schema hash)"

#: dotted config field (or ``section.*``) -> (safe to change on resume, why)
RESUME_RULES: dict[str, tuple[bool, str]] = {
    # The model and the fragment layout over it: the stored versions have its shapes.
    "model.*": (False, _SCHEMA),
    # Every sync field shapes merges, codecs or the stored history of the run.
    "sync.*": (False, _SCHEMA),
    "train.steps": (True, "the token budget: learners read it from the manifest when they "
                    "start and train on from their checkpoints to the new budget; a decaying "
                    "lr schedule stretches to the new end"),
    "train.checkpoint_every": (True, "how often learners write checkpoints; only the disk "
                               "sees it"),
    "train.*": (False, _SCHEMA + ": the inner optimizer, its restored state and the shards' "
                "token bounds depend on it"),
    "data.corpus": (False, "learners resume at a data position in this corpus"),
    "data.iid": (False, "it re-partitions the data under the learners' restored positions"),
    "data.val_fraction": (False, "it moves the train/validation split: training data "
                          "changes and losses are no longer comparable"),
    "data.eval_batches": (True, "the evaluator's sample size only"),
    "run.mode": (False, "each mode is its own run with its own schema"),
    "run.learners": (False, "every learner's data shard is 1/M of the corpus: another M "
                     "re-partitions the data under the restored positions"),
    "run.deterministic": (False, "it decides what a round holds and when learners adopt its "
                          "version; a deterministic run is refused a resume altogether"),
    "run.shards": (False, "fragments are owned by shard p mod S with fenced epochs; a new S "
                   "mid-run is not supported"),
    "run.redis_url": (False, "the run's versions and manifest live in that Redis"),
    "run.redis_ha": (False, "the run's versions and manifest live in the Redis it started "
                            "(one server, or the replicated set in OUT/redis-ha)"),
    "run.run_id": (False, "the run's identity in the store and in every checkpoint"),
    "run.eval_every_s": (True, "the evaluator's period only"),
    "run.evaluator": (True, "when the evaluator runs; it reads the store, never changes it"),
    "run.eval_every_tokens": (True, "the evaluator's cadence only"),
    "run.eval_nice": (True, "the evaluator's CPU priority only"),
    "run.torch_learners": (False, "which framework each learner trains in: its checkpoint "
                           "is that engine's"),
    "run.standby_learners": (True, "how fast a restarted learner trains again; nothing it "
                                   "computes"),
    "run.fork_server": (True, "how a local run starts its worker processes; nothing they "
                              "compute"),
    "run.heartbeat_s": (True, "liveness timing; every worker restarts on resume"),
    "run.learner_ttl_s": (True, "liveness timing; every worker restarts on resume"),
    "run.lease_ttl_s": (True, "shard lease timing; every shard restarts on resume"),
    "run.dp_publish_every": (True, "how often the data-parallel job stores a checkpoint"),
    "run.xla_threads": (True, "threads of each process"),
    "run.merge_threads": (True, "threads of each shard's merge; the results do not depend on them"),
    "run.devices": (True, "learners restore their optimizer state by tree path onto any mesh"),
    "run.sharding": (True, "learners restore their optimizer state by tree path onto any "
                     "placement"),
    "run.metrics_port": (True, "where workers serve metrics"),
    "run.platform": (True, "learners restore by tree path on any JAX platform"),
    "run.pin": (True, "CPU pinning of the learner processes"),
    "run.bind_host": (True, "shards announce their endpoints in the store at each start"),
    "run.advertise_host": (True, "shards announce their endpoints in the store at each start"),
    "store.blobs": (False, "the run's stored versions are there"),
    "store.redis_max_fragment_mb": (True, "a check at the init step only"),
    "security.curve": (True, "every worker of a local run restarts on resume and reads it from "
                       "the manifest"),
    "security.keys_dir": (True, "workers load their keys when they start"),
    "tracking.*": (True, "how the run is followed (progress lines, logs, TensorBoard, W&B); "
                   "no worker's computation reads it"),
}

_UNKNOWN = (False, "not known to be safe to change mid-run")


def resume_rule(path: str) -> tuple[bool, str]:
    """``(safe, why)`` for the dotted field ``path`` (e.g. ``"train.steps"``): its own entry
    in :data:`RESUME_RULES`, else its section's ``section.*``, else unsafe."""
    if path in RESUME_RULES:
        return RESUME_RULES[path]
    return RESUME_RULES.get(path.split(".", 1)[0] + ".*", _UNKNOWN)


@dataclass(frozen=True)
class FieldChange:
    """One configuration field that differs between the stored run and its resume."""

    path: str
    old: Any
    new: Any
    safe: bool
    why: str

    def describe(self) -> str:
        """``train.steps 600 -> 1000``."""
        return f"{self.path} {_show(self.old)} -> {_show(self.new)}"


class ResumeRefused(ConfigError):
    """A resume that would change a field the run cannot change (the message names it)."""


def _show(value: Any) -> str:
    return "none" if value is None else str(value)


def flat_config(tree: Mapping[str, Any]) -> dict[str, Any]:
    """A config dump (``Config.model_dump(mode="json")``) as ``{"section.field": value}``;
    mapping-valued fields (``train.speed``) stay whole."""
    return {f"{section}.{name}": value
            for section, fields in tree.items() if isinstance(fields, Mapping)
            for name, value in fields.items()}


def resume_changes(old: Mapping[str, Any], new: Mapping[str, Any],
                   defaults: Mapping[str, Any] | None = None) -> list[FieldChange]:
    """The fields that differ between two config dumps, each with its rule, sorted by path.

    Args:
        old: the stored run's configuration (``run.json``'s ``config``), possibly written by
            an older version: a field it lacks had its default then, and a field the schema
            no longer has is not compared.
        new: the configuration the resume asks for (every field of the current schema).
        defaults: the current schema's defaults (None: ``Config()``'s).
    """
    if defaults is None:
        from ddiloco.workers.run.config import Config

        defaults = Config().model_dump(mode="json")
    a, b, d = flat_config(old), flat_config(new), flat_config(defaults)
    out = []
    for path in sorted(b):
        before = a.get(path, d.get(path))
        if _norm(before) != _norm(b[path]):
            safe, why = resume_rule(path)
            out.append(FieldChange(path, before, b[path], safe, why))
    return out


def _norm(value: Any) -> Any:
    # A JSON round trip makes tuples lists: () and [] are the same corpus.
    return list(value) if isinstance(value, tuple) else value


def check_resume(run_dir: str, changes: list[FieldChange]) -> list[FieldChange]:
    """The safe changes of a resume of ``run_dir``; refuse it if any change is unsafe.

    Raises:
        ResumeRefused: one line naming the first unsafe field with its old and new value,
            why it cannot change, and the fix (a new run folder).
    """
    unsafe = [c for c in changes if not c.safe]
    if unsafe:
        c = unsafe[0]
        more = (f" (also {', '.join(u.path for u in unsafe[1:])})" if len(unsafe) > 1 else "")
        raise ResumeRefused(
            f"--resume {run_dir}: {c.path} cannot change on resume ({_show(c.old)} -> "
            f"{_show(c.new)}){more}: {c.why}; start a new run with --out NEW")
    return changes
