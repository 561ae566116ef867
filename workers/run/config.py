"""One typed, validated run configuration: TOML or YAML file plus command-line overrides.

Validation happens at construction: a bad value raises :class:`ddiloco.pipeline.errors.ConfigError`
whose message names the key's full path and what it accepts (``sync.H: 0 is out of range;
allowed: >= 1``, ``unknown key sync.HH; did you mean sync.H?``). Overrides use dotted paths,
``--set sync.H=12`` (:func:`parse_override`). Every key, with its type, default, range and
meaning, is in docs/CONFIG.md (``ddiloco config docs``).
"""

from __future__ import annotations

import hashlib
import json
import tomllib
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    BaseModel,
    ConfigDict,
    Field,
    ValidationError,
    ValidationInfo,
    model_validator,
)

from ddiloco.pipeline.codec import is_codec, unknown_codec_message
from ddiloco.pipeline.errors import ConfigError
from ddiloco.pipeline.security import is_loopback
from ddiloco.workers.run.config_schema import (
    REMOVED_KEYS,
    coerce_value,
    error_message,
    lookup,
    parse_value,
)
from ddiloco.workers.run.deterministic import force_deterministic


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class ModelSection(_Section):
    """Model: your own task (``task``), or the built-in GPT, a preset of
    ``workers.task.model.PRESETS`` with optional overrides."""

    task: str | None = Field(
        default=None, description="a task factory, 'package.module:function' or "
        "'path/to/file.py:function', returning a ddiloco.Task (docs/API.md); none: the "
        "built-in byte-level GPT below")
    preset: Literal["tiny", "small"] = Field(
        default="tiny", description="size of the built-in GPT: tiny (0.84M parameters, "
        "context 64 bytes) or small (10.8M, context 256); the fields below override it")
    d_model: int | None = Field(default=None, ge=8, description="built-in GPT: width of "
                                "the residual stream (none: the preset's)")
    n_layers: int | None = Field(default=None, ge=1, description="built-in GPT: "
                                 "transformer blocks (none: the preset's)")
    n_heads: int | None = Field(default=None, ge=1, description="built-in GPT: attention "
                                "heads; must divide d_model (none: the preset's)")
    d_ff: int | None = Field(default=None, ge=8, description="built-in GPT: hidden width "
                             "of the MLP (none: the preset's)")
    seq_len: int | None = Field(default=None, ge=8, description="built-in GPT: context "
                                "length, tokens (bytes) per sequence (none: the preset's)")


class TrainSection(_Section):
    """Inner optimisation (AdamW) and the token budget of every learner."""

    batch_size: int = Field(default=32, ge=1, description="sequences per inner step of "
                            "one learner (tokens per step: batch_size * seq_len)")
    lr: float = Field(default=8.5e-3, gt=0, description="peak inner (AdamW) learning rate, "
                      "reached after the warm-up (tuned with the warm-up on one grid with "
                      "the baseline's, docs/QUALITY.md)")
    dp_lr: float | None = Field(
        default=6e-3, gt=0, description="peak learning rate of the data-parallel baseline, "
        "tuned for its M times larger global batch (none: lr)")
    optimizer: Literal["adamw", "muon"] = Field(
        default="adamw", description="inner optimizer of both modes: adamw, or muon (Muon on "
        "the blocks' weight matrices, AdamW on embeddings and norm scales; MuLoCo, arXiv "
        "2505.23725; same lr, schedule and weight decay)")
    warmup_fraction: float = Field(
        default=0.25, ge=0, lt=1, description="linear learning-rate warm-up from 0 to lr "
        "(both modes) as a share of train.steps: round(warmup_fraction * steps) inner steps, "
        "so one setting holds for runs of any length; warmup_steps, when set, replaces it")
    warmup_steps: int | None = Field(default=None, ge=0, description="the warm-up in inner "
                                     "steps instead of warmup_fraction (none: the fraction)")
    schedule: Literal["cosine", "linear", "constant"] = Field(
        default="cosine", description="inner learning rate after warm-up: decay to "
        "lr_floor * lr at train.steps, or constant (both modes use the same schedule)")
    lr_floor: float = Field(default=0.1, ge=0, le=1, description="final lr as a share of lr")
    lr_clock: Literal["own", "global"] = Field(
        default="own", description="the step the inner schedule (warm-up, decay) follows: "
        "own (a learner's inner steps) or global (the run's tokens over M learners' tokens "
        "per step, from the steps versions report: learners of unequal speed share one "
        "schedule); the data-parallel baseline's step is the global one (docs/QUALITY.md)")
    weight_decay: float = Field(default=0.01, ge=0, description="AdamW decoupled weight "
                                "decay, per unit of learning rate")
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
    seed: int = Field(default=0, description="seed of the initial parameters, data "
                      "shards and batch order")
    checkpoint_every: int = Field(default=100, ge=1, description="period of a learner's "
                                  "checkpoint (inner optimizer state, data position), "
                                  "inner steps")
    speed: dict[str, float] = Field(
        default_factory=dict, description="per-learner speed factor in (0, 1], e.g. "
        "{learner-3: 0.5}: that learner pads each inner step to twice its compute time, "
        "emulating slower hardware (heterogeneous learners)")

    @property
    def warmup(self) -> int:
        """The warm-up both modes use, inner steps: ``warmup_steps`` when set, else
        ``round(warmup_fraction * steps)`` (Python's rounding: half to even)."""
        if self.warmup_steps is not None:
            return self.warmup_steps
        return round(self.warmup_fraction * self.steps)

    @model_validator(mode="after")
    def _schedule(self) -> TrainSection:
        if self.schedule != "constant" and self.steps <= self.warmup:
            if self.warmup_steps is not None:
                name = what = "train.warmup_steps"
            else:
                name = "train.warmup_fraction"
                what = (f"round(train.warmup_fraction * train.steps) "
                        f"= round({self.warmup_fraction} * {self.steps})")
            raise ValueError(
                f"train.steps: {self.steps} must exceed {what} "
                f"({self.warmup}) for a decaying schedule; lower {name} "
                f"or set train.schedule=constant")
        return self

    @model_validator(mode="after")
    def _speeds(self) -> TrainSection:
        for name, factor in self.speed.items():
            if not 0 < factor <= 1:
                raise ValueError(f"train.speed.{name}: {factor} is out of range; "
                                 "allowed: (0, 1]")
        return self


class SyncSection(_Section):
    """Decoupled DiLoCo synchronisation (DESIGN §2)."""

    H: int = Field(default=24, ge=1, description="sync period: each fragment is sent "
                   "once every H inner steps of a learner, inner steps (DESIGN §1-2; "
                   "paper: 24)")
    fragments: int = Field(default=12, ge=1, description="P, fragments: disjoint groups of "
                           "whole tensors, each synchronised on its own schedule (DESIGN §2, "
                           "balanced tensor fragmentation; paper: 24)")
    tau: int = Field(default=2, ge=0, description="overlap: a fragment sent at step s is "
                     "adopted at step s + tau at the earliest, inner steps (DESIGN §1; "
                     "paper: 2)")
    min_quorum: int = Field(default=1, ge=1, description="K, minimum quorum: contributions "
                            "a round needs before it may merge (DESIGN §2, syncer round; "
                            "paper: 1)")
    grace: bool = Field(default=True, description="adaptive grace window: after the quorum, "
                        "wait for more contributions within the slack the overlap leaves "
                        "(DESIGN §2, syncer round step 2)")
    gamma: float = Field(default=0.9, gt=0, le=1, description="share of the slack the "
                         "grace window may use: grace = min(grace_cap_s, gamma * max(0, tau "
                         "* step_time - quorum_time - sync_time)) (DESIGN §2; paper: "
                         "gamma < 1)")
    grace_cap_s: float = Field(default=2.0, ge=0, description="upper bound of the grace "
                               "window, seconds (DESIGN §2)")
    grace_steps: float = Field(
        default=0.0, ge=0, le=1000, description="floor of the grace window in the learners' "
        "step times, under grace_cap_s: a round waits this long after its quorum for every "
        "live learner's contribution before it merges without them; at most H step times, "
        "since a longer wait only lets a learner's next outer gradient replace its first (0: "
        "the adaptive window alone, the paper's; docs/QUALITY.md)")
    round_wait: Literal["grace", "live"] = Field(
        default="live", description="when a round with its quorum merges: live (ours): wait "
        "for every live learner whose "
        "next outer gradient for the fragment is predicted, from the step count and step time "
        "its own deltas carry, within late_fraction * H of its step time after the quorum, "
        "and for no learner predicted later (a straggler or one out of phase) or not live, "
        "in place of grace, gamma and grace_steps; or grace: the adaptive grace window (the "
        "paper's rule) (DESIGN §2, syncer round step 2; docs/QUALITY.md)")
    late_fraction: float = Field(
        default=0.5, gt=0, le=1, description="round_wait = live: the longest wait after a "
        "round's quorum, as a share of H step times; a learner predicted later than that is "
        "really late and not waited for")
    outer_lr: float = Field(default=1.0, gt=0, description="outer SGD learning rate "
                            "(DESIGN §2, syncer round step 5; lineage: 0.7 with momentum 0.9; "
                            "docs/QUALITY.md)")
    outer_momentum: float = Field(default=0.0, ge=0, lt=1, description="outer Nesterov momentum "
                                  "(DESIGN §2, syncer round step 5; lineage: 0.9; 0: plain SGD)")
    outer_delay: int = Field(
        default=1, ge=1, le=64, description="delayed Nesterov: the outer momentum is updated "
        "every outer_delay outer steps of a fragment, from the mean of their outer gradients, "
        "and each step applies its own at outer_lr / outer_delay (arXiv 2401.09135); 1: "
        "Nesterov at every step (docs/QUALITY.md)")
    outer_c: float = Field(
        default=0.0, ge=0, le=1, description="delayed Nesterov: share of the momentum applied "
        "on the steps between two momentum updates, at most 1 / outer_delay (arXiv "
        "2401.09135; 0 in its experiments)")
    merge: Literal["rda", "average"] = Field(
        default="rda", description="merge rule of a round: rda (token-weighted average on "
        "embeddings, RDA on other tensors) or average (token-weighted average everywhere) "
        "(DESIGN §2, syncer round step 4; paper)")
    codec_up: str = Field(default="int4", description="codec of learner -> shard deltas: "
                          "fp32, bf16, int8, int4 (per-block scales) or topk-dD-bB "
                          "(DESIGN §4; paper: int4 nearly lossless)")
    codec_down: str = Field(default="int4", description="codec of shard -> learner version "
                            "broadcasts (same choices as codec_up)")
    codec_dp: str = Field(default="bf16", description="codec of the data-parallel "
                          "baseline's gradients, both ways (DESIGN §2, data-parallel "
                          "baseline)")
    adopt: Literal["carry", "overwrite", "mix"] = Field(
        default="carry", description="adoption policy: carry (keep unsent local work), "
        "overwrite (paper) or mix (alpha) (DESIGN §2, learner loop step 3)")
    alpha: float = Field(default=0.5, ge=0, le=1, description="mix: theta = a*theta + (1-a)*Theta "
                       "(lineage; DESIGN §2, learner loop step 3)")
    history: int = Field(default=8, ge=2, description="versions kept per fragment in the "
                         "store; a delta against an older version is dropped and the learner "
                         "resyncs (DESIGN §2, syncer round step 3)")
    merge_every: float = Field(
        default=1.0, ge=0, le=2, description="paced merges: no round merges before "
        "merge_every * H * step_time after the fragment's last merge (at most one version "
        "per fragment per sync period); 0: merge as soon as the quorum and grace window "
        "allow (paper)")
    update_guard: float = Field(
        default=20.0, ge=0, description="refuse a merge whose update norm exceeds this "
        "multiple of the fragment's recent update norm (its contributions are dropped as "
        "merge_refused); a non-finite update is always refused; 0: no norm bound")
    partial_merge: Literal["full", "share"] = Field(
        default="full", description="a merge of n of the M live learners' contributions "
        "(K < M, asynchronous rounds): full applies their token-weighted merge as a whole "
        "(paper: with outer lr 1 a lone contribution replaces the fragment by that learner's "
        "model) or share applies n / M of it, as if the absent learners sent zero outer "
        "gradients (docs/QUALITY.md)")
    norm_clip: Literal["none", "median"] = Field(
        default="none", description="norm scaling of contributions: median (a contribution "
        "longer than the median of this round's and the fragment's recent contribution norms "
        "is scaled down to it before the merge; Covenant-72B, arXiv 2603.08163) or none "
        "(docs/QUALITY.md)")
    correction: Literal["none", "heloco"] = Field(
        default="none", description="correction of each incoming outer gradient before the "
        "merge: heloco (per tensor against the fragment's trajectory: the outer momentum, or "
        "the recent outer steps at momentum 0; anti-aligned tensors shrunk, weakly aligned "
        "ones turned towards it; arXiv 2606.00271) or none (docs/QUALITY.md)")
    heloco_keep: float = Field(default=0.2, ge=0, le=1, description="heloco: c_ok, the cosine "
                               "with the reference from which a tensor passes unchanged")
    heloco_shrink: float = Field(default=1.0, ge=0, le=100, description="heloco: k_s, "
                                 "strength of the shrinkage of anti-aligned tensors")
    heloco_shrink_max: float = Field(default=0.5, ge=0, le=1, description="heloco: beta_max, "
                                     "the largest share of an anti-aligned component removed")
    heloco_reorient: float = Field(default=0.5, ge=0, le=100, description="heloco: k_d, "
                                   "strength of the turn of weakly aligned tensors")
    heloco_kappa: float = Field(default=1.0, ge=0, le=100, description="heloco: weight of the "
                                "reference's norm in the confidence ||x|| / (||x|| + kappa "
                                "||r||)")
    round_notice: bool = Field(default=True, description="shards announce open rounds")
    phase_lock: bool = Field(default=False, description="send a fragment H steps after adopting "
                             "its version (aligns learners' rounds)")
    early_fraction: float = Field(default=0.5, ge=0, lt=1,
                                  description="share of H a learner may send early to join")
    error_feedback: bool = Field(default=True, description="shards carry the "
                                 "quantization error of each broadcast into the next one "
                                 "(downlink error feedback)")
    upload_bps: float | None = Field(
        default=None, gt=0, description="cap on each learner's delta upload rate, bit/s "
        "(paced one message at a time; none: as fast as the link allows)")
    eager: bool = Field(
        default=False, description="eager updates (arXiv 2502.12996): at each send a "
        "learner moves the fragment to its estimate of the next version, anchor - outer_lr "
        "/ M * its delta - (M - 1) / M * the fragment's last outer step, and spends the "
        "overlap's tau steps there instead of on its own drifted copy; needs adopt = carry "
        "(docs/QUALITY.md)")
    blocking: bool = Field(
        default=False, description="diagnostic, not for training runs: after sending a "
        "fragment's delta a learner takes at most tau more inner steps, then waits until it "
        "has adopted a newer version of that fragment (the merge of its round); with "
        "fragments = 1, tau = 0, min_quorum = run.learners and codec_up = codec_down = fp32 "
        "this is synchronous DiLoCo (docs/QUALITY.md, the ablation ladder); needs "
        "min_quorum = run.learners, refused in chaos runs and with run.mode = dp")
    blocking_timeout_s: float = Field(
        default=60.0, gt=0, le=3600, description="sync.blocking: longest wait for the merge "
        "of a learner's round, seconds; past it the learner logs a warning and trains on "
        "(a dropped contribution or a round merged without it must not stop the run); under "
        "run.deterministic it stops instead, and the run fails")

    @model_validator(mode="after")
    def _codecs(self) -> SyncSection:
        for name in ("codec_up", "codec_down", "codec_dp"):
            if not is_codec(getattr(self, name)):
                raise ValueError(f"sync.{name}: "
                                 f"{unknown_codec_message(getattr(self, name))}")
        return self

    @model_validator(mode="after")
    def _delayed_nesterov(self) -> SyncSection:
        if self.outer_c * self.outer_delay > 1 + 1e-9:
            raise ValueError(f"sync.outer_c: {self.outer_c} is out of range; allowed: "
                             f"[0, 1 / sync.outer_delay] = [0, {1 / self.outer_delay:g}]")
        if self.eager and self.adopt != "carry":
            raise ValueError(f"sync.eager: needs sync.adopt = carry (got {self.adopt!r}): the "
                             "estimate is replaced by the version plus the work since the send")
        if self.round_wait == "live" and self.grace_steps > 0:
            raise ValueError("sync.grace_steps: a floor of the grace window, which "
                             "sync.round_wait = live replaces; set one of them")
        if self.outer_delay > 1 and self.outer_momentum == 0:
            raise ValueError("sync.outer_delay: delayed Nesterov needs sync.outer_momentum > 0 "
                             "(with no momentum there is nothing to delay)")
        return self


class DataSection(_Section):
    """Corpus: Shakespeare by default, or local text files / directories."""

    corpus: tuple[str, ...] = Field(
        default=(), description="text files or directories to train on (empty: Shakespeare, "
        "fetched once); `--set data.corpus=a.txt,b.txt` or a YAML list")
    iid: bool = Field(default=False, description="shuffle documents across learners (IID "
                      "shards); false: contiguous documents per learner, non-IID like real "
                      "regions")
    val_fraction: float = Field(default=0.05, gt=0, lt=1, description="share of the "
                                "documents held out for validation")
    eval_batches: int = Field(default=8, ge=1, description="validation batches the "
                              "evaluator averages its loss over")


class RunSection(_Section):
    """Processes of a local run and where they keep things."""

    mode: Literal["diloco", "dp"] = Field(
        default="diloco", description="diloco (Decoupled DiLoCo) or dp (the data-parallel "
        "baseline; `ddiloco run --baseline dp` runs both)")
    learners: int = Field(default=4, ge=1, description="M, learners: independent training "
                          "processes, each with its own data shard (DESIGN §1; paper: 8)")
    deterministic: bool = Field(
        default=False, description="deterministic mode, for quality experiments: two runs "
        "with the same seed give the same validation losses and final model, bit for bit on "
        "one machine. Every round holds all M learners' contributions of one scheduled send, "
        "each learner adopts a round's version exactly tau steps after its send, shards sum "
        "contributions in learner order and the evaluator evaluates whole rounds and the "
        "final model. Sets sync.blocking = true, sync.min_quorum = run.learners, "
        "sync.round_notice = false, sync.phase_lock = false and sync.merge_every = 0 (another "
        "value given for one of them is refused); needs sync.tau < sync.H; refused with "
        "run.mode = dp, in chaos runs, with --regions and --resume (docs/QUALITY.md)")
    shards: int = Field(default=2, ge=1, description="S, syncer shards: processes that "
                        "merge and publish a subset of the fragments each")
    redis_url: str | None = Field(default=None, description="redis:// URL of an existing "
                                  "store (none: `ddiloco run` starts an embedded Redis in "
                                  "OUT/redis)")
    redis_ha: bool = Field(default=False, description="`ddiloco run` and `ddiloco chaos "
                           "run` start a highly available Redis (a primary, two replicas and "
                           "three sentinels, real redis-server processes) instead of one; "
                           "workers reach it through redis+sentinel:// (docs/RELIABILITY.md)")
    run_id: str | None = Field(default=None, description="run id, the key prefix of the "
                               "run in the store (none: run-<date>-<time>-<hex>)")
    eval_every_s: float = Field(default=5.0, gt=0, description="how often the evaluator "
                                "looks at the store, seconds; with run.eval_every_tokens = 0 "
                                "its period")
    evaluator: Literal["during", "after", "off"] = Field(
        default="during", description="when the global model is evaluated: during training "
        "(the evaluator process, on run.eval_every_tokens, at CPU niceness run.eval_nice), "
        "after it (the final model once, when the learners are done: no evaluation competes "
        "with training, and the report has the final loss only) or off (no validation loss; "
        "`ddiloco evaluator --once` evaluates a finished run's store later)")
    eval_every_tokens: int | None = Field(
        default=None, ge=0, description="with run.evaluator = during: evaluate each time the "
        "learners' global tokens have grown by this many since the last evaluation; none: "
        "the token budget / 20; 0: every run.eval_every_s seconds, whatever the tokens")
    eval_nice: int = Field(default=10, ge=0, le=19, description="the evaluator's CPU "
                           "niceness (os.nice; 0: as the other workers): on shared cores it "
                           "yields them to learners and shards")
    standby_learners: int = Field(
        default=0, ge=0, le=8, description="learner processes a local run keeps warmed up "
        "(imports, JAX, the task, the compiled inner step) to replace a learner that is "
        "restarted: a killed learner trains again without waiting for its process to start "
        "(workers/learner/standby.py); each costs one learner's memory and start-up CPU once, "
        "no CPU while it waits; 0: restarted learners start from scratch")
    fork_server: bool = Field(
        default=True, description="start a local run's workers (learners, shards, the "
        "evaluator) by forking them from one process that has imported their modules "
        "(workers/run/forkserver.py) instead of an interpreter each: a worker reaches its "
        "main in milliseconds instead of 1.3-1.6 s of a core (4.7 s more with PyTorch "
        "learners), and a restarted learner skips them too (docs/SCALE.md, the fork "
        "server); Linux only (elsewhere, and for standbys and workers in emulated regions, "
        "processes of their own); false: every worker an interpreter of its own")
    torch_learners: int = Field(
        default=0, ge=0, description="how many of the M learners train the built-in GPT in "
        "PyTorch (learner-0 to learner-<n-1>; its twin has the same parameters, initial "
        "values and loss, workers/task/torch_gpt.py), the others in JAX: one model trained by "
        "both frameworks through the same shards. Needs `pip install 'ddiloco[torch]'`; "
        "DiLoCo only (the data-parallel baseline's learners are JAX ones); a model.task "
        "returning a ddiloco.TorchTask makes every learner a PyTorch one without it")
    heartbeat_s: float = Field(default=0.5, gt=0, description="period of learner "
                               "heartbeats and shard housekeeping, seconds")
    learner_ttl_s: float = Field(default=3.0, gt=0, description="a learner without a "
                                 "heartbeat for this long is not live, seconds (the floor "
                                 "of an adaptive TTL)")
    lease_ttl_s: float = Field(default=3.0, gt=0, description="lease of a syncer shard on "
                               "its fragments, renewed every lease_ttl_s / 4, seconds")
    dp_publish_every: int = Field(
        default=10, ge=1, description="DP: checkpoint period, steps (value and AdamW state to "
        "the store; a failed DP job resumes from the last one)")
    xla_threads: int = Field(default=1, ge=1, description="XLA CPU threads per worker "
                             "process")
    merge_threads: int | None = Field(
        default=None, ge=1, le=1024, description="merge threads per syncer shard; none: the "
        "cores the shard process may use. On a host shared by several shards, its cores "
        "divided by the shards: the merge of a large fragment is bound by memory traffic, "
        "and more threads than cores add CPU time without speed (docs/SCALE.md)")
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
    pin: bool = Field(default=True, description="pin learner i to core i mod cores (one XLA "
                      "thread on the CPU); a local run spreads the learners still training "
                      "over every core again as others finish")
    bind_host: str = Field(default="127.0.0.1", description="address a syncer shard's "
                           "sockets bind to (`ddiloco syncer --bind`); 0.0.0.0: every "
                           "interface")
    advertise_host: str | None = Field(
        default=None, description="address a syncer shard announces to learners in the "
        "store (`ddiloco syncer --advertise`; none: the bound address)")


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


#: Python logging levels a worker accepts (``tracking.log_level``, ``--log-level``).
LogLevel = Literal["debug", "info", "warning", "error"]


class TrackingSection(_Section):
    """Following a run: progress lines, the workers' log level, and the evaluator's
    TensorBoard and Weights & Biases logs (``pip install 'ddiloco[track]'``)."""

    progress_every_s: float = Field(
        default=30.0, gt=0, le=86400, description="seconds between two progress lines of "
        "`ddiloco run --no-live` and `ddiloco chaos run --no-live` (tokens, tokens/s, "
        "validation loss, merges, drops, ETA); `--progress-every`")
    log_level: LogLevel = Field(
        default="info", description="Python logging level of a local run's workers "
        "(OUT/<mode>/logs/<worker>.log); `--log-level`")
    tensorboard: bool = Field(
        default=False, description="the evaluator writes TensorBoard event files (validation "
        "loss, tokens, merges, wire bytes against global tokens) to OUT/<mode>/tensorboard/")
    wandb: bool = Field(
        default=False, description="the evaluator logs the same scalars to Weights & Biases, "
        "offline (files under OUT/<mode>/wandb/) when WANDB_MODE=offline or no API key is "
        "configured")
    wandb_project: str = Field(
        default="ddiloco", min_length=1, max_length=128, description="W&B project of the "
        "evaluator's run (the run is named after the run id)")
    wandb_entity: str | None = Field(
        default=None, max_length=128, description="W&B entity (team or user); none: the "
        "API key's default")


class Config(_Section):
    """The whole run configuration."""

    model: ModelSection = ModelSection()
    train: TrainSection = TrainSection()
    sync: SyncSection = SyncSection()
    data: DataSection = DataSection()
    run: RunSection = RunSection()
    store: StoreSection = StoreSection()
    security: SecuritySection = SecuritySection()
    tracking: TrackingSection = TrackingSection()

    @model_validator(mode="before")
    @classmethod
    def _deterministic(cls, data: Any) -> Any:
        # Before validation: only the raw tree tells a key the user set from a default.
        if isinstance(data, Mapping):
            return force_deterministic(data, RunSection.model_fields["learners"].default)
        return data

    @model_validator(mode="after")
    def _cross(self, info: ValidationInfo) -> Config:
        if self.run.deterministic and self.run.mode == "dp" and not _stored(info):
            # A stored config is exempt, as for sync.blocking below: the DP half of
            # `ddiloco run --baseline dp` is a copy of the DiLoCo config.
            raise ValueError("run.deterministic: the data-parallel baseline (run.mode = dp) "
                             "is deterministic already (every step waits for every learner "
                             "and averages in learner order): set run.deterministic=false")
        if self.run.deterministic and self.sync.tau >= self.sync.H:
            raise ValueError(f"run.deterministic needs sync.tau < sync.H ({self.sync.H}); got "
                             f"{self.sync.tau}: a fragment's next send would meet its "
                             "previous round before or after the merge, by timing")
        if self.run.mode == "dp" and self.train.accumulate != 1:
            raise ValueError(f"train.accumulate: {self.train.accumulate} with run.mode=dp; "
                             "the data-parallel baseline steps one batch at a time: set "
                             "train.accumulate=1")
        if self.sync.fragments > self.sync.H * 64:
            raise ValueError(f"sync.fragments: {self.sync.fragments} is more than 64 per "
                             f"step of sync.H ({self.sync.H}); lower sync.fragments or "
                             "raise sync.H")
        if self.sync.blocking and self.sync.min_quorum != self.run.learners:
            raise ValueError(f"sync.blocking needs sync.min_quorum = run.learners "
                             f"(M = {self.run.learners}); got {self.sync.min_quorum}")
        if self.sync.blocking and self.run.mode == "dp" and not _stored(info):
            # The baseline is synchronous by construction. A stored config is exempt: the
            # DP half of `ddiloco run --baseline dp` is a copy of the DiLoCo config with
            # run.mode = dp, and its workers ignore the setting.
            raise ValueError("sync.blocking is a DiLoCo diagnostic; the data-parallel "
                             "baseline (run.mode = dp) is synchronous already: set "
                             "sync.blocking=false")
        if self.run.torch_learners > self.run.learners:
            raise ValueError(f"run.torch_learners: {self.run.torch_learners} of "
                             f"run.learners = {self.run.learners}")
        if self.run.torch_learners and self.model.task is not None:
            raise ValueError("run.torch_learners picks PyTorch learners of the built-in GPT; "
                             f"model.task {self.model.task!r} decides its own framework (a "
                             "factory returning ddiloco.TorchTask trains in PyTorch)")
        if self.run.torch_learners and self.run.mode == "dp" and not _stored(info):
            raise ValueError("run.torch_learners: the data-parallel baseline's learners are "
                             "JAX ones (run.mode = dp); set run.torch_learners=0")
        if not self.security.curve and not is_loopback(self.run.bind_host):
            raise ValueError(f"security.curve = false (--insecure) with run.bind_host "
                             f"{self.run.bind_host!r}: plain TCP is allowed on loopback only; "
                             "set run.bind_host=127.0.0.1 or keep CURVE on")
        return self

    def model_config_obj(self) -> Any:
        """The :class:`ddiloco.workers.task.gpt_params.ModelConfig` this config describes
        (numpy only: neither JAX nor torch is imported)."""
        from ddiloco.workers.task.gpt_params import model_config_of

        return model_config_of(self.model)


#: validation context key: the config being validated is a stored run's (a manifest's)
STORED = "stored"


def _stored(info: ValidationInfo) -> bool:
    """Whether the config under validation is a stored run's (:func:`config_from_dict`)."""
    return bool(isinstance(info.context, dict) and info.context.get(STORED))


def _set_dotted(tree: dict[str, Any], path: str, value: Any) -> None:
    parts = path.split(".")
    node = tree
    for i, part in enumerate(parts[:-1]):
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise ConfigError(f"{path}: {'.'.join(parts[:i + 1])} is set to a value in the "
                              "file, not a section")
    node[parts[-1]] = value


def _without_removed(tree: dict[str, Any]) -> dict[str, Any]:
    """``tree`` less the keys of :data:`REMOVED_KEYS` (a stored run's config may predate their
    removal; a user's file that still has one is told so by validation instead)."""
    for path in REMOVED_KEYS:
        section, _, key = path.rpartition(".")
        node = tree.get(section)
        if isinstance(node, dict):
            node.pop(key, None)
    return tree


def parse_override(item: str) -> tuple[str, Any]:
    """Parse ``section.key=value`` the way a shell user means it (:func:`parse_value`): a
    number, boolean or table as YAML; a string key's text as typed; a path where a list is
    wanted as a one-element list (``data.corpus=/p/a.txt``), ``a,b`` as two items; ``none``
    for an optional key as None.

    Raises:
        ConfigError: no ``=`` in the item.
    """
    if "=" not in item:
        raise ConfigError(f"--set {item!r}: expected section.key=value, e.g. sync.H=12")
    key, raw = item.split("=", 1)
    key = key.strip()
    try:
        _, annotation = lookup(Config, key)
    except ConfigError:
        annotation = Any  # an unknown key: load_config names it
    return key, parse_value(raw, annotation)


def load_config(
    path: str | Path | None = None,
    overrides: Mapping[str, Any] | Sequence[str] | None = None,
    base: Mapping[str, Any] | None = None,
) -> Config:
    """Build a validated :class:`Config` from an optional TOML/YAML file and overrides.

    Args:
        path: ``*.toml``, ``*.yaml`` or ``*.yml`` file; None for defaults.
        overrides: dotted-path -> value mapping, or ``"a.b=v"`` strings (:func:`parse_override`).
        base: a nested mapping to start from instead of a file (e.g. a stored run's config).

    Raises:
        ConfigError: unreadable file, unknown key (with the closest valid one) or any invalid
            value (the message names the key's full path, e.g. ``train.steps``).
    """
    tree: dict[str, Any] = _without_removed(json.loads(json.dumps(base))) if base else {}
    if path is not None:
        tree = read_config_file(path)
    items: list[tuple[str, Any]]
    if overrides is None:
        items = []
    elif isinstance(overrides, Mapping):
        items = [(k, coerce_value(v, lookup(Config, k)[1])) for k, v in overrides.items()]
    else:
        items = [parse_override(s) for s in overrides]
    for key, value in items:
        lookup(Config, key)  # an unknown key is named before anything else
        _set_dotted(tree, key, value)
    return config_from_dict(tree)


def read_config_file(path: str | Path) -> dict[str, Any]:
    """The nested mapping of a TOML (``*.toml``) or YAML file, not yet validated.

    Raises:
        ConfigError: the file cannot be read or parsed, or is not a table at the top;
            ``UnknownBundledName``: a bare name that is neither a file nor a bundled config.
    """
    from ddiloco.workers.run.bundled import resolve_config

    p = resolve_config(path)  # a bundled config's name (ci-tiny) reads the installed file
    try:
        text = p.read_text()
    except OSError as exc:
        raise ConfigError(f"config file {p}: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise ConfigError(f"config file {p}: not a text file") from None
    try:
        loaded = tomllib.loads(text) if p.suffix == ".toml" else yaml.safe_load(text)
    except (tomllib.TOMLDecodeError, yaml.YAMLError) as exc:
        raise ConfigError(f"config file {p}: {' '.join(str(exc).split())}") from None
    if loaded is None:
        loaded = {}
    if not isinstance(loaded, dict):
        raise ConfigError(f"config file {p}: the top level must be a table of sections")
    return loaded


def config_from_dict(tree: Mapping[str, Any], *, stored: bool = False) -> Config:
    """Validate a nested mapping into a :class:`Config`.

    Args:
        stored: the mapping is a stored run's config (a manifest's): keys this version no
            longer has (:data:`REMOVED_KEYS`) are dropped instead of refused.

    Raises:
        ConfigError: every invalid key, each with its full path, in one line.
    """
    if stored:
        tree = _without_removed(json.loads(json.dumps(tree)))
    try:
        return Config.model_validate(tree, context={STORED: True} if stored else None)
    except ValidationError as exc:
        errs = list(dict.fromkeys(error_message(Config, e) for e in exc.errors()))
        raise ConfigError("; ".join(errs)) from None


def schema_hash(manifest_core: Mapping[str, Any]) -> str:
    """Hash of what every worker of a run must agree on (model, layout, sync, mode)."""
    blob = json.dumps(manifest_core, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.sha256(blob).hexdigest()[:16]
