"""Experiment tracking from the evaluator: TensorBoard event files and Weights & Biases.

The run's ``tracking`` section turns each on (``--set tracking.tensorboard=true``,
``tracking.wandb=true``); both need the optional extra, ``pip install 'ddiloco[track]'``
(tensorboardX, wandb). The evaluator logs one point per evaluation, with the global tokens
trained so far as the x-axis (TensorBoard's step, W&B's step):

=============================== ===================================================
tag                             value
=============================== ===================================================
``val/loss_<unit>``             validation loss of the global model, in the task's unit
                                (``val/loss_nats_per_byte`` for the built-in GPT)
``train/tokens``                tokens trained by every learner together
``sync/merges``                 merges published by the syncer shards so far
``sync/wire_bytes``             bytes on the wire so far, up and down
=============================== ===================================================

W&B never blocks on the network: it runs offline (files under ``RUN_DIR/wandb/``, upload later
with ``wandb sync``) when ``WANDB_MODE=offline`` or when no API key is configured
(``WANDB_API_KEY`` or ``wandb login``'s netrc entry).
"""

from __future__ import annotations

import importlib.util
import netrc
import os
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from ddiloco.pipeline.errors import DDilocoError
from ddiloco.store.base import ParameterStore

__all__ = [
    "TRACK_EXTRA",
    "MergeCounter",
    "Tracker",
    "TrackingUnavailable",
    "check_tracking",
    "loss_tag",
    "open_tracker",
    "wandb_mode",
]

#: How to install what tracking needs.
TRACK_EXTRA = "pip install 'ddiloco[track]'"


class TrackingUnavailable(DDilocoError):
    """A tracking backend was asked for and its package is not installed."""


def check_tracking(tracking: Any) -> None:
    """Check that the packages the ``tracking`` section asks for are installed, without
    importing them (the launcher calls this before it starts any worker).

    Raises:
        TrackingUnavailable: naming the setting, the missing package and the install command.
    """
    for setting, module in (("tensorboard", "tensorboardX"), ("wandb", "wandb")):
        if getattr(tracking, setting) and importlib.util.find_spec(module) is None:
            raise TrackingUnavailable(
                f"tracking.{setting} = true needs the {module} package: {TRACK_EXTRA} "
                f"(or set tracking.{setting}=false)")


def loss_tag(unit: str) -> str:
    """The scalar tag of the validation loss, its unit in the name: ``nats/byte`` ->
    ``val/loss_nats_per_byte``."""
    slug = re.sub(r"[^0-9a-zA-Z]+", "_", unit.replace("/", " per ")).strip("_").lower()
    return f"val/loss_{slug}" if slug else "val/loss"


WandbMode = Literal["online", "offline", "disabled"]

#: ``WANDB_MODE`` values and the mode each means (``dryrun`` and ``run``: older spellings)
_WANDB_MODES: dict[str, WandbMode] = {"online": "online", "run": "online",
                                      "offline": "offline", "dryrun": "offline",
                                      "disabled": "disabled"}


def wandb_mode(environ: Mapping[str, str] | None = None,
               netrc_path: Path | None = None) -> WandbMode:
    """The W&B mode the evaluator uses: ``WANDB_MODE`` when it names one, else ``online`` when
    an API key is configured (``WANDB_API_KEY``, or an ``api.wandb.ai`` entry in the netrc file
    that ``wandb login`` writes), else ``offline``: a run without credentials never waits on
    the network."""
    env = os.environ if environ is None else environ
    named = _WANDB_MODES.get(env.get("WANDB_MODE", "").strip().lower())
    if named is not None:
        return named
    if env.get("WANDB_API_KEY"):
        return "online"
    path = netrc_path or Path(env.get("NETRC", Path.home() / ".netrc"))
    try:
        host = env.get("WANDB_BASE_URL", "https://api.wandb.ai").split("://")[-1].split("/")[0]
        if netrc.netrc(str(path)).authenticators(host) is not None:
            return "online"
    except (OSError, netrc.NetrcParseError):
        pass
    return "offline"


@dataclass
class MergeCounter:
    """The number of ``merge`` events of a run, read incrementally from the event stream (each
    call reads only the events after the last merge it saw)."""

    store: ParameterStore
    count: int = 0
    last_id: str | None = None

    def __call__(self) -> int:
        """Merges so far.

        Raises:
            StoreUnavailable: the store did not answer.
        """
        start = "-" if self.last_id is None else f"({self.last_id}"
        new = self.store.events(start=start, kinds={"merge"})
        if new:
            self.count += len(new)
            self.last_id = new[-1][0]
        return self.count


class Tracker:
    """Where the evaluator's scalars go: TensorBoard, W&B, both or neither.

    Args:
        run_dir: ``run_dir/tensorboard/`` and ``run_dir/wandb/`` hold the files.
        run_id: names the W&B run.
        loss_unit: the task's loss unit (the loss tag names it).
        tensorboard: write TensorBoard event files.
        wandb: log to W&B (:func:`wandb_mode`).
        wandb_project: the W&B project; ``wandb_entity``: its entity (None: the key's).
        config: the run configuration, recorded with the W&B run.

    Raises:
        TrackingUnavailable: a backend is asked for and its package is missing.
        OSError: the run directory cannot be written.
    """

    def __init__(self, run_dir: Path, run_id: str, loss_unit: str, *, tensorboard: bool,
                 wandb: bool, wandb_project: str = "ddiloco", wandb_entity: str | None = None,
                 config: Mapping[str, Any] | None = None) -> None:
        self.loss_tag = loss_tag(loss_unit)
        self.tb: Any = None
        self.wb: Any = None
        self.tb_dir = Path(run_dir) / "tensorboard"
        self.wandb_dir = Path(run_dir) / "wandb"
        try:
            if tensorboard:
                from tensorboardX import SummaryWriter

                self.tb_dir.mkdir(parents=True, exist_ok=True)
                # flush_secs: a reader (TensorBoard, the report) sees each point within seconds
                self.tb = SummaryWriter(logdir=str(self.tb_dir), flush_secs=5)
            if wandb:
                import wandb as wandb_lib

                self.wandb_dir.mkdir(parents=True, exist_ok=True)
                self.wb = wandb_lib.init(
                    project=wandb_project, entity=wandb_entity, name=run_id,
                    dir=str(self.wandb_dir), mode=wandb_mode(),
                    config=dict(config or {}),
                    # the evaluator's own log is the console; W&B need not copy it
                    settings=wandb_lib.Settings(console="off", silent=True))
        except ImportError as exc:
            self.close()
            raise TrackingUnavailable(f"experiment tracking needs {exc.name}: "
                                      f"{TRACK_EXTRA}") from None

    @property
    def active(self) -> bool:
        """Whether any backend is on."""
        return self.tb is not None or self.wb is not None

    def log(self, fields: Mapping[str, Any], merges: int) -> None:
        """Log one evaluation: ``fields`` of an ``eval`` event (``loss``, ``tokens``,
        ``wire_bytes``) and the merges so far, at x = ``fields["tokens"]``."""
        step = int(fields["tokens"])
        scalars = {self.loss_tag: float(fields["loss"]), "train/tokens": step,
                   "sync/merges": int(merges),
                   "sync/wire_bytes": int(fields.get("wire_bytes", 0))}
        if self.tb is not None:
            for tag, value in scalars.items():
                self.tb.add_scalar(tag, value, global_step=step)
            self.tb.flush()
        if self.wb is not None:
            self.wb.log(scalars, step=step)

    def close(self) -> None:
        """Flush and close every backend (idempotent)."""
        if self.tb is not None:
            self.tb.close()
            self.tb = None
        if self.wb is not None:
            self.wb.finish()
            self.wb = None


def open_tracker(cfg: Any, run_dir: Path, run_id: str, loss_unit: str) -> Tracker | None:
    """The :class:`Tracker` a run's config asks for (its ``tracking`` section), or None when
    neither TensorBoard nor W&B is on.

    Raises:
        TrackingUnavailable: a backend is asked for and its package is missing.
    """
    t = cfg.tracking
    if not (t.tensorboard or t.wandb):
        return None
    return Tracker(run_dir, run_id, loss_unit, tensorboard=t.tensorboard, wandb=t.wandb,
                   wandb_project=t.wandb_project, wandb_entity=t.wandb_entity,
                   config=cfg.model_dump(mode="json"))
