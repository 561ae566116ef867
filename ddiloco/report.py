"""Reading a run back from its store: status, the run report and its plots.

Everything here is derived from the store (manifest, heads, counters, event stream), so the
same figures come out of a live run, a finished one and a resumed one.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np

from ddiloco.store.base import ParameterStore
from ddiloco.workers.run.blobs import decode_blob
from ddiloco.workers.run.config import Config
from ddiloco.workers.run.manifest import manifest_config, manifest_layout
from ddiloco.workers.task.api import DEFAULT_LOSS_UNIT, manifest_loss_unit


def load_global_params(store: ParameterStore) -> tuple[dict[str, np.ndarray], Config]:
    """The latest global parameters (float32 numpy, by tensor name) and the run config.

    Raises:
        ddiloco.pipeline.errors.DDilocoError: no manifest or a fragment without a version.
    """
    from ddiloco.pipeline.errors import DDilocoError

    manifest = store.get_manifest()
    if manifest is None:
        raise DDilocoError(f"run {store.run_id!r} has no manifest in this store")
    layout = manifest_layout(manifest)
    params: dict[str, np.ndarray] = {}
    for p, blob in enumerate(store.get_latest_many(list(range(layout.n_fragments)))):
        if blob is None:
            raise DDilocoError(f"fragment {p} has no version yet")
        params.update(zip(layout.names(p), decode_blob(blob.value, layout.shapes(p)),
                          strict=True))
    return params, manifest_config(manifest)


def blob_outages(events: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Shards that cannot reach the object store now: the last ``blobs_unavailable`` of each
    shard not followed by its ``blobs_restored``.

    Returns:
        ``{shard: {"since": wall-clock seconds, "error": str}}``; empty when none.
    """
    out: dict[str, dict[str, Any]] = {}
    for e in events:
        if e["kind"] == "blobs_unavailable":
            out[str(e["shard"])] = {"since": e["t"], "error": e.get("error", "")}
        elif e["kind"] == "blobs_restored":
            out.pop(str(e["shard"]), None)
    return out


def store_status(store: ParameterStore) -> dict[str, Any]:
    """A JSON-able snapshot of a run: manifest summary, versions, learners, shards, counters."""
    manifest = store.get_manifest()
    if manifest is None:
        return {"run_id": store.run_id, "manifest": None}
    layout = manifest_layout(manifest)
    heads = store.heads(layout.n_fragments)
    events = store.events()
    kinds: dict[str, int] = {}
    last_eval = None
    for _, e in events:
        kinds[e["kind"]] = kinds.get(e["kind"], 0) + 1
        if e["kind"] == "eval":
            last_eval = e
    cfg = manifest["config"]
    return {
        "run_id": store.run_id,
        "mode": manifest["mode"],
        "schema_hash": manifest["schema_hash"],
        "model": manifest["model"],
        "fragments": layout.n_fragments,
        "sync": {k: cfg["sync"][k] for k in ("H", "fragments", "tau", "min_quorum", "codec_up",
                                             "codec_down")},
        "versions": [h.version if h else None for h in heads],
        "learners": store.live_learners(),
        "shards": {str(k): v for k, v in store.shards().items()},
        # where the blobs live (a location, never credentials: check_location refuses those)
        "blobs": store.blob_location,
        "blob_outage": blob_outages(e for _, e in events),
        "merges": kinds.get("merge", 0),
        "events": kinds,
        "drops": store.counters("drops"),
        # refused CURVE handshakes (docs/SECURITY.md) and token claims clamped to 4 H
        "auth": store.counters("auth"),
        "claims": store.counters("claims"),
        "wire_bytes": store.counters("wire"),
        "tokens": sum(store.counters("tokens").values()),
        "last_eval": last_eval,
        "loss_unit": manifest_loss_unit(manifest),
    }


def render_status(st: dict[str, Any]) -> None:
    """Print :func:`store_status` as rich tables."""
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    if st.get("manifest", 1) is None:
        console.print(f"run {st['run_id']}: no manifest")
        return
    console.print(f"[bold]run[/] {st['run_id']}  mode {st['mode']}  schema {st['schema_hash']}"
                  f"  tokens {st['tokens']:,}  merges {st['merges']}")
    console.print(f"versions {st['versions']}")
    # host: the container (compose sets each hostname to its service) or machine; pid alone
    # is 1 in every container.
    t = Table("learner", "state", "step", "tokens", "loss", "incarnation", "host", "pid")
    for lid, info in sorted(st["learners"].items()):
        t.add_row(lid, str(info.get("state")), str(info.get("step")), f"{info.get('tokens', 0):,}",
                  str(info.get("loss")), str(info.get("incarnation")), str(info.get("host", "-")),
                  str(info.get("pid")))
    console.print(t)
    console.print(f"shards {sorted(st['shards'])}  drops {st['drops']}  wire {st['wire_bytes']}")
    console.print(f"blobs {escape(str(st.get('blobs')))}")
    for shard, o in sorted(st.get("blob_outage", {}).items()):
        console.print(f"[bold red]object store unreachable[/] from shard {escape(shard)} for "
                      f"{time.time() - o['since']:.0f} s (publishes retry): {escape(o['error'])}")
    if st.get("auth") or st.get("claims"):
        console.print(f"refused handshakes {st.get('auth', {})}  clamped claims "
                      f"{st.get('claims', {})}")
    if st["last_eval"]:
        unit = escape(str(st.get("loss_unit", DEFAULT_LOSS_UNIT)))
        console.print(f"last validation loss {st['last_eval']['loss']:.4f} {unit} at "
                      f"{st['last_eval']['tokens']:,} tokens")


def learner_rates(events: Iterable[dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """Per learner, over its last incarnation: tokens, seconds from ``join`` to ``leave`` and
    tokens per second (tokens/s per learner, to compare deployments of one topology).

    Returns:
        ``{learner: {"tokens": int, "wall_s": float, "tokens_per_s": float | None,
        "step_time_mean_s": float | None}}`` for every learner with a ``leave`` after a
        ``join``.
    """
    joined: dict[str, float] = {}
    out: dict[str, dict[str, Any]] = {}
    for e in events:
        lid = e.get("learner")
        if not isinstance(lid, str):
            continue
        if e.get("kind") == "join":
            joined[lid] = float(e["t"])
        elif e.get("kind") == "leave" and lid in joined:
            wall = float(e["t"]) - joined[lid]
            tokens = int(e.get("tokens") or 0)
            out[lid] = {"tokens": tokens, "wall_s": round(wall, 2),
                        "tokens_per_s": round(tokens / wall, 1) if wall > 0 else None,
                        "step_time_mean_s": e.get("step_time_mean_s")}
    return out


def evaluator_cost(when: str, events: list[tuple[str, dict[str, Any]]]) -> dict[str, Any]:
    """What the evaluator cost (``run.evaluator`` ``when``): evaluations, their wall seconds
    and the process's CPU seconds, from its last ``evaluator_stop`` event (zeros: none)."""
    stops = [e for _, e in events if e["kind"] == "evaluator_stop"]
    last = stops[-1] if stops else {}
    return {"when": when, "evals": int(last.get("evals", 0)),
            "eval_s": float(last.get("eval_s", 0.0)), "cpu_s": float(last.get("cpu_s", 0.0))}


def mode_report(store: ParameterStore, wall_s: float) -> dict[str, Any]:
    """The report block of one mode of a run (see ``report.json`` in the README).

    Raises:
        ddiloco.pipeline.errors.DDilocoError: the run has no manifest in this store.
    """
    from ddiloco.pipeline.errors import DDilocoError

    manifest = store.get_manifest()
    if manifest is None:
        raise DDilocoError(f"run {store.run_id!r} has no manifest in this store")
    cfg = manifest_config(manifest)
    events = store.events()
    evals = [e for _, e in events if e["kind"] == "eval"]
    merges = [e for _, e in events if e["kind"] == "merge"]
    wire = store.counters("wire")
    tokens = sum(store.counters("tokens").values())
    up, down = int(wire.get("up", 0)), int(wire.get("down", 0))
    return {
        "mode": manifest["mode"],
        "run_id": store.run_id,
        "learners": cfg.run.learners,
        "shards": cfg.run.shards,
        "model": manifest["model"],
        "task": manifest.get("task"),
        "params": int(sum(np.prod(s) for frag in manifest["layout"] for _, s in frag)),
        "sync": cfg.sync.model_dump(),
        "tokens": tokens,
        "wall_s": round(wall_s, 2),
        "tokens_per_s": round(tokens / wall_s, 1) if wall_s > 0 else None,
        "final_val_loss": evals[-1]["loss"] if evals else None,
        "evaluator": evaluator_cost(cfg.run.evaluator, events),
        "loss_unit": manifest_loss_unit(manifest),
        "val_loss": [[e["tokens"], e["loss"]] for e in evals],
        "wire_vs_tokens": [[e["tokens"], e.get("wire_bytes", 0)] for e in evals],
        "val_loss_wall": [[e["t"] - events[0][1]["t"], e["loss"]] for e in evals] if events
        else [],
        "wire_bytes": {"up": up, "down": down, "total": up + down},
        "wire_bytes_per_token": round((up + down) / tokens, 2) if tokens else None,
        "merges": len(merges),
        "merge_contributors_mean": (float(np.mean([len(m.get("contributors", []))
                                                   for m in merges])) if merges else None),
        "dropped": store.counters("drops"),
        "per_learner": learner_rates(e for _, e in events),
        "token_fate": _token_fate(store),
        "versions": [h.version if h else None
                     for h in store.heads(manifest_layout(manifest).n_fragments)],
    }


def _token_fate(store: ParameterStore) -> dict[str, Any]:
    """Token fate in tokens, with shares of the processed tokens (DESIGN §5)."""
    from ddiloco.chaos.chaos_report import store_token_fate

    fate = store_token_fate(store).to_json()
    return {**fate["tokens"], "shares": fate["shares"]}


def report_loss_unit(report: dict[str, Any]) -> str:
    """The loss unit of a report (``report.json``): its first mode's ``loss_unit``; a report
    written before reports recorded it: nats/byte for the built-in GPT, else nats/token."""
    for key in ("diloco", "dp"):
        block = report.get(key)
        if isinstance(block, dict):
            return manifest_loss_unit(block)  # a mode block has the manifest's keys
    return DEFAULT_LOSS_UNIT


def plot_report(report: dict[str, Any], path: Path) -> None:
    """``report.png``: validation loss vs tokens, and wire bytes vs tokens, for every mode."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax1, ax2) = plt.subplots(1, 2, figsize=(11, 4.2))
    for key, label in (("diloco", "Decoupled DiLoCo"), ("dp", "data-parallel")):
        block = report.get(key)
        if not block or not block["val_loss"]:
            continue
        xs, ys = zip(*block["val_loss"], strict=True)
        ax1.plot(xs, ys, marker="o", ms=3, label=label)
        series = [(t, b) for t, b in block["wire_vs_tokens"] if t > 0 and b > 0]
        if series:
            wx, wy = zip(*series, strict=True)
            per_token = block["wire_bytes_per_token"] or 0.0
            ax2.plot(wx, np.asarray(wy) / 1e6, marker="o", ms=3,
                     label=f"{label} ({per_token:,.1f} B/token)")
    ax1.set_xlabel("tokens trained (all learners)")
    ax1.set_ylabel(f"validation loss ({report_loss_unit(report)})")
    ax1.set_title("Validation loss of the global model")
    ax1.grid(alpha=0.3)
    ax1.legend()
    ax2.set_xlabel("tokens trained (all learners)")
    ax2.set_ylabel("wire MB (up + down)")
    ax2.set_yscale("log")
    ax2.set_title("Bytes on the wire")
    ax2.grid(alpha=0.3)
    ax2.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
