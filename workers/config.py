"""One typed, validated run configuration: TOML or YAML file plus command-line overrides.

Validation happens at construction: a bad value raises :class:`ddiloco.pipeline.errors.ConfigError`
whose message names the field (``sync.H: must be >= 1``). Overrides use dotted paths,
``--set sync.H=12``.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import tomllib
import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from ddiloco.pipeline.codec import is_codec, unknown_codec_message
from ddiloco.pipeline.errors import ConfigError
from ddiloco.pipeline.security import is_loopback


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Section):
    """Model: your own task (``task``), or the built-in GPT, a preset of
    ``workers.model.PRESETS`` with optional overrides."""

    task: str | None = Field(
        default=None, description="a task factory, 'package.module:function' or "
        "'path/to/file.py:function', returning a ddiloco.Task (docs/API.md); none: the "
        "built-in byte-level GPT below")
    preset: Literal["tiny", "small"] = "tiny"
    d_model: int | None = Field(default=None, ge=8)
    n_layers: int | None = Field(default=None, ge=1)
    n_heads: int | None = Field(default=None, ge=1)
    d_ff: int | None = Field(default=None, ge=8)
    seq_len: int | None = Field(default=None, ge=8)


class TrainSection(_Section):
    """Inner optimisation (AdamW) and the token budget of every learner."""

    batch_size: int = Field(default=32, ge=1)
    lr: float = Field(default=3e-3, gt=0, description="peak inner learning rate")
    dp_lr: float | None = Field(
        default=6e-3, gt=0, description="peak learning rate of the data-parallel baseline, "
        "tuned for its M times larger global batch (none: lr)")
    warmup_steps: int = Field(default=50, ge=0)
    schedule: Literal["cosine", "linear", "constant"] = Field(
        default="cosine", description="inner learning rate after warm-up: decay to "
        "lr_floor * lr at train.steps, or constant (both modes use the same schedule)")
    lr_floor: float = Field(default=0.1, ge=0, le=1, description="final lr as a share of lr")
    weight_decay: float = Field(default=0.01, ge=0)
    b1: float = Field(default=0.9, ge=0, lt=1, description="Adam first-moment decay")
    b2: float = Field(default=0.95, ge=0, lt=1, description="Adam second-moment decay")
    clip: float | None = Field(default=1.0, gt=0, description="per-tensor gradient norm "
                               "bound (both modes; none: no clipping)")
    steps: int = Field(default=600, ge=1, description="inner steps per learner")
    accumulate: int = Field(default=1, ge=1, description="micro-batches per inner step "
                            "(gradient accumulation, optax.MultiSteps)")
    compute_dtype: Literal["float32", "bfloat16"] = Field(
        default="float32", description="dtype of the forward and backward pass; parameters, "
        "inner and outer optimizer state stay float32")
    seed: int = 0
    checkpoint_every: int = Field(default=100, ge=1, description="inner steps")
    speed: dict[str, float] = Field(
        default_factory=dict, description="per-learner speed factor in (0, 1], e.g. "
        "{learner-3: 0.5}: that learner pads each inner step to twice its compute time, "
        "emulating slower hardware (heterogeneous learners)")

    @model_validator(mode="after")
    def _schedule(self) -> TrainSection:
        if self.schedule != "constant" and self.steps <= self.warmup_steps:
            raise ValueError(f"steps ({self.steps}) must exceed warmup_steps "
                             f"({self.warmup_steps}) for a decaying schedule")
        return self

    @model_validator(mode="after")
    def _speeds(self) -> TrainSection:
        for name, factor in self.speed.items():
            if not 0 < factor <= 1:
                raise ValueError(f"speed.{name}: must be in (0, 1], got {factor}")
        return self


class SyncSection(_Section):
    """Decoupled DiLoCo synchronisation (DESIGN §2)."""

    H: int = Field(default=24, ge=1, description="sync period, inner steps")
    fragments: int = Field(default=12, ge=1, description="P")
    tau: int = Field(default=2, ge=0, description="overlap, inner steps")
    min_quorum: int = Field(default=1, ge=1, description="K")
    grace: bool = True
    gamma: float = Field(default=0.9, gt=0, le=1)
    grace_cap_s: float = Field(default=2.0, ge=0)
    outer_lr: float = Field(default=1.0, gt=0, description="outer SGD learning rate "
                            "(lineage: 0.7 with momentum 0.9; docs/QUALITY.md)")
    outer_momentum: float = Field(default=0.0, ge=0, lt=1, description="outer Nesterov momentum")
    merge: Literal["rda", "average"] = "rda"
    codec_up: str = "int4"
    codec_down: str = "int4"
    codec_dp: str = "bf16"
    adopt: Literal["carry", "overwrite", "mix"] = Field(
        default="carry", description="adoption policy: carry (keep unsent local work), "
        "overwrite (paper) or mix (alpha)")
    alpha: float = Field(default=0.5, ge=0, le=1, description="mix: theta = a*theta + (1-a)*Theta")
    history: int = Field(default=8, ge=2, description="versions kept per fragment")
    merge_every: float = Field(
        default=1.0, ge=0, le=2, description="paced merges: no round merges before "
        "merge_every * H * step_time after the fragment's last merge (at most one version "
        "per fragment per sync period); 0: merge as soon as the quorum and grace window "
        "allow (paper)")
    update_guard: float = Field(
        default=20.0, ge=0, description="refuse a merge whose update norm exceeds this "
        "multiple of the fragment's recent update norm (its contributions are dropped as "
        "merge_refused); a non-finite update is always refused; 0: no norm bound")
    round_notice: bool = Field(default=True, description="shards announce open rounds")
    phase_lock: bool = Field(default=False, description="send a fragment H steps after adopting "
                             "its version (aligns learners' rounds)")
    early_fraction: float = Field(default=0.5, ge=0, lt=1,
                                  description="share of H a learner may send early to join")
    error_feedback: bool = True
    upload_bps: float | None = Field(
        default=None, gt=0, description="cap on each learner's delta upload rate, bit/s "
        "(paced one message at a time; none: as fast as the link allows)")

    @model_validator(mode="after")
    def _codecs(self) -> SyncSection:
        for name in ("codec_up", "codec_down", "codec_dp"):
            if not is_codec(getattr(self, name)):
                raise ValueError(f"{name}: {unknown_codec_message(getattr(self, name))}")
        return self


class DataSection(_Section):
    """Corpus: Shakespeare by default, or local text files / directories."""

    corpus: tuple[str, ...] = ()
    iid: bool = False
    val_fraction: float = Field(default=0.05, gt=0, lt=1)
    eval_batches: int = Field(default=8, ge=1)


class RunSection(_Section):
    """Processes of a local run and where they keep things."""

    mode: Literal["diloco", "dp"] = "diloco"
    learners: int = Field(default=4, ge=1, description="M")
    shards: int = Field(default=2, ge=1, description="S")
    redis_url: str | None = None
    out: str = "out"
    run_id: str | None = None
    eval_every_s: float = Field(default=5.0, gt=0)
    heartbeat_s: float = Field(default=0.5, gt=0)
    learner_ttl_s: float = Field(default=3.0, gt=0)
    lease_ttl_s: float = Field(default=3.0, gt=0)
    dp_publish_every: int = Field(
        default=10, ge=1, description="DP: checkpoint period, steps (value and AdamW state to "
        "the store; a failed DP job resumes from the last one)")
    xla_threads: int = Field(default=1, ge=1)
    devices: int | None = Field(default=None, ge=1, description="devices per learner "
                                "(a jax.sharding.Mesh); none: every device the process sees")
    sharding: Literal["replicated", "fsdp"] = Field(
        default="replicated", description="parameters on a learner's mesh: replicated (data "
        "parallel) or fsdp (each split along its largest divisible axis)")
    metrics_port: int | None = Field(
        default=None, ge=1, le=65000, description="Prometheus metrics of a local run's "
        "workers: shard s on this port + s, the evaluator on + 50, learner i on + 100 + i "
        "(none: off; `ddiloco run --metrics` uses 9400)")
    platform: str | None = Field(
        default=None, description="JAX_PLATFORMS of the workers; none: cuda when an NVIDIA "
        "GPU and jax's CUDA plugin are present, else cpu")
    pin: bool = Field(default=True, description="pin learner i to core i mod cores")
    bind_host: str = "127.0.0.1"
    advertise_host: str | None = None


class StoreSection(_Section):
    """Where the parameter store keeps fragment blobs (:mod:`ddiloco.store.objects`)."""

    blobs: str = Field(
        default="redis", description="fragment values and outer momentum: 'redis' (Redis "
        "strings, for models whose fragments fit), 'file:///dir', 's3://bucket/prefix' "
        "(credentials in the standard AWS_* variables), or 'embedded-s3' (`ddiloco run` "
        "starts a private S3 server, SeaweedFS, in OUT/s3)")
    redis_max_fragment_mb: int = Field(
        default=256, ge=1, description="largest fragment (MB of float32) a run may keep in "
        "Redis; above it the run is refused and told to use an object store")

    @model_validator(mode="after")
    def _location(self) -> StoreSection:
        if self.blobs != EMBEDDED_S3:
            from ddiloco.store.objects import check_location

            object.__setattr__(self, "blobs", check_location(self.blobs))
        return self


#: ``store.blobs`` value that asks a local run for a private S3 server.
EMBEDDED_S3 = "embedded-s3"


class SecuritySection(_Section):
    """Who may talk to a shard (docs/SECURITY.md, :mod:`ddiloco.pipeline.security`)."""

    curve: bool = Field(default=True, description="CURVE-encrypted, key-authenticated "
                        "ZeroMQ; false (`--insecure`): plain TCP, loopback binds only")
    keys_dir: str | None = Field(
        default=None, description="key directory: <name>.key public certificates (the "
        "allow-list) and private/<name>.key_secret; a local run creates <out>/keys")


class Config(_Section):
    """The whole run configuration."""

    model: ModelSection = ModelSection()
    train: TrainSection = TrainSection()
    sync: SyncSection = SyncSection()
    data: DataSection = DataSection()
    run: RunSection = RunSection()
    store: StoreSection = StoreSection()
    security: SecuritySection = SecuritySection()

    @model_validator(mode="after")
    def _cross(self) -> Config:
        if self.run.mode == "dp" and self.train.accumulate != 1:
            raise ValueError("train.accumulate: the data-parallel baseline steps one batch "
                             "at a time (set 1)")
        if self.sync.fragments > self.sync.H * 64:
            raise ValueError("sync.fragments: unreasonably many fragments for H")
        if not self.security.curve and not is_loopback(self.run.bind_host):
            raise ValueError(f"security.curve = false (--insecure) with run.bind_host "
                             f"{self.run.bind_host!r}: plain TCP is allowed on loopback only")
        return self

    def model_config_obj(self) -> Any:
        """The :class:`ddiloco.workers.model.ModelConfig` this config describes."""
        from ddiloco.workers.model import PRESETS  # jax import deferred: the CLI must start fast

        base = PRESETS[self.model.preset]
        overrides = {k: v for k, v in self.model.model_dump().items()
                     if k != "preset" and v is not None}
        return base.__class__(**{**base.__dict__, **overrides})


def _set_dotted(tree: dict[str, Any], path: str, value: Any) -> None:
    parts = path.split(".")
    node = tree
    for part in parts[:-1]:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{path}: {part} is not a section")
    node[parts[-1]] = value


def parse_override(item: str) -> tuple[str, Any]:
    """Parse ``section.field=value``; the value is read as YAML (ints, floats, bools, lists).

    Raises:
        ConfigError: no ``=`` in the item.
    """
    if "=" not in item:
        raise ConfigError(f"override {item!r}: expected section.field=value")
    key, raw = item.split("=", 1)
    try:
        value = yaml.safe_load(raw) if raw else ""
    except yaml.YAMLError:
        value = raw
    return key.strip(), value


def load_config(
    path: str | Path | None = None,
    overrides: Mapping[str, Any] | Sequence[str] | None = None,
    base: Mapping[str, Any] | None = None,
) -> Config:
    """Build a validated :class:`Config` from an optional TOML/YAML file and overrides.

    Args:
        path: ``*.toml``, ``*.yaml`` or ``*.yml`` file; None for defaults.
        overrides: dotted-path -> value mapping, or ``"a.b=v"`` strings.
        base: a nested mapping to start from instead of a file (e.g. a stored run's config).

    Raises:
        ConfigError: unreadable file or any invalid field (the message names it).
    """
    tree: dict[str, Any] = json.loads(json.dumps(base)) if base else {}
    if path is not None:
        from ddiloco.workers.bundled import resolve_config

        p = resolve_config(path)  # a bundled config's name (ci-tiny) reads the installed file
        try:
            text = p.read_text()
        except OSError as exc:
            raise ConfigError(f"config file {p}: {exc.strerror}") from None
        try:
            loaded = tomllib.loads(text) if p.suffix == ".toml" else yaml.safe_load(text)
        except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
            raise ConfigError(f"config file {p}: {exc}") from None
        if loaded is None:
            loaded = {}
        if not isinstance(loaded, dict):
            raise ConfigError(f"config file {p}: top level must be a table")
        tree = loaded
    items: list[tuple[str, Any]]
    if overrides is None:
        items = []
    elif isinstance(overrides, Mapping):
        items = list(overrides.items())
    else:
        items = [parse_override(s) for s in overrides]
    for key, value in items:
        _set_dotted(tree, key, value)
    return config_from_dict(tree)


def config_from_dict(tree: Mapping[str, Any]) -> Config:
    """Validate a nested mapping into a :class:`Config`.

    Raises:
        ConfigError: naming the first invalid field.
    """
    try:
        return Config.model_validate(tree)
    except ValidationError as exc:
        errs = []
        for e in exc.errors():
            loc = ".".join(str(x) for x in e["loc"])
            errs.append(f"{loc}: {e['msg']}" if loc else e["msg"])
        raise ConfigError("invalid configuration: " + "; ".join(errs)) from None


def schema_hash(manifest_core: Mapping[str, Any]) -> str:
    """Hash of what every worker of a run must agree on (model, layout, sync, mode)."""
    blob = json.dumps(manifest_core, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
