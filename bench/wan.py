"""Both modes across emulated wide-area regions vs the same run on this machine's loopback.

Four fixed-length runs, no faults: Decoupled DiLoCo and the data-parallel baseline, each without
the WAN (every worker on the loopback) and with it (workers in the topology's regions: network
namespaces, shaped links with delay; root). For each mode it prints and writes:

* bytes on the wire per trained token (learners' own accounting: deltas/gradients up, versions
  down), and the ratio DP / DiLoCo;
* merged tokens per second with and without the WAN, and their ratio; final validation loss;
* the link rate each mode needs to keep its learners 95 % busy at the measured step time
  (:mod:`ddiloco.chaos.wan.bandwidth`; the analogue of the paper's 198 vs 0.84 Gbit/s), and the
  ratio;
* per link, the bytes its counter saw during each WAN run against the bytes the learners
  counted between workers of its two regions (within a stated margin, docs/REGIONS.md).

    python bench/wan.py [--topology configs/regions-4.yaml] [--duration 120] [--set k=v ...]
                        [--out bench-out/wan]

Ends with a table, ``OUT/wan.json``, ``OUT/wan.png`` and one JSON line on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ddiloco.chaos.runner import run_chaos
from ddiloco.chaos.wan.bandwidth import required_bps_diloco, required_bps_dp
from ddiloco.chaos.wan.regions_cli import fmt_rate
from ddiloco.chaos.wan.session import link_bytes_table
from ddiloco.store.connect import connect
from ddiloco.store.embedded import EmbeddedRedis
from ddiloco.store.redis_store import RedisStore
from ddiloco.workers.run.config import Config, load_config

MODES = ("diloco", "dp")


def _traffic(out: Path, report: dict[str, Any], cfg: Config) -> dict[str, dict[str, Any]]:
    """Per mode: wire bytes (up, down), trained tokens and learner steps from the run's store."""
    tokens_per_step = cfg.train.batch_size * cfg.model_config_obj().seq_len
    got: dict[str, dict[str, Any]] = {}
    with EmbeddedRedis(out / "redis") as server:
        client = connect(server.url)
        for mode in MODES:
            block = report["modes"][mode]
            store = RedisStore(client, block["run_id"])
            wire = store.counters("wire")
            tokens = sum(store.counters("tokens").values())
            up, down = int(wire.get("up", 0)), int(wire.get("down", 0))
            steps = tokens / tokens_per_step
            got[mode] = {
                "wire_up": up, "wire_down": down, "tokens": tokens, "learner_steps": steps,
                "bytes_per_token": (up + down) / tokens if tokens else None,
                "bytes_per_learner_step": (up + down) / steps if steps else None,
                "tokens_per_s": block["tokens_per_s"], "goodput": block["goodput"],
                "final_val_loss": block["final_val_loss"], "ref_step_s": block["ref_step_s"],
                "region_tx_bytes": block.get("region_tx_bytes"),
                "link_bytes": block.get("link_bytes"),
            }
    return got


def link_totals(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Application and link bytes summed over the links that carried application traffic,
    the overall overhead and how many links were within the margin."""
    used = [r for r in rows if r["app_bytes"]]
    app = sum(r["app_bytes"] for r in used)
    link = sum(r["link_bytes"] for r in used)
    return {"links": len(used), "within_margin": sum(bool(r["within_margin"]) for r in used),
            "app_bytes": app, "link_bytes": link,
            "overhead": round(link / app - 1, 4) if app else None}


def _plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, axes = plt.subplots(1, 3, figsize=(13, 4))
    labels = ["DiLoCo", "DP"]
    x = range(len(MODES))
    for ax, key, title in ((axes[0], "tokens_per_s", "merged tokens/s"),
                           (axes[1], "bytes_per_token", "wire bytes per token")):
        local = [result["local"][m][key] or 0 for m in MODES]
        wan = [result["wan"][m][key] or 0 for m in MODES]
        ax.bar([i - 0.2 for i in x], local, width=0.4, label="loopback")
        ax.bar([i + 0.2 for i in x], wan, width=0.4, label="WAN")
        ax.set_xticks(list(x), labels)
        ax.set_title(title)
        if key == "bytes_per_token":
            ax.set_yscale("log")
        ax.legend()
    need = [result["required_bps"][m] / 1e6 for m in MODES]
    axes[2].bar(labels, need, color=["tab:green", "tab:red"])
    axes[2].set_yscale("log")
    axes[2].set_title("link for 95 % busy learners (Mbit/s)")
    fig.suptitle(f"{result['topology']}: {result['duration_s']:g} s per run")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--topology", type=Path, default=Path("configs/regions-4.yaml"))
    ap.add_argument("--config", type=Path, default=None)
    ap.add_argument("--duration", type=float, default=120.0, help="seconds per run")
    ap.add_argument("--set", dest="overrides", action="append", default=[])
    ap.add_argument("--out", type=Path, default=Path("bench-out/wan"))
    ap.add_argument("--busy", type=float, default=0.95)
    ap.add_argument("--no-live", action="store_true")
    args = ap.parse_args()
    from rich.console import Console
    from rich.table import Table

    cfg = load_config(args.config, args.overrides)
    args.out.mkdir(parents=True, exist_ok=True)
    script = args.out / "no-faults.yaml"
    script.write_text(f"name: no-faults\nduration_s: {args.duration}\nfaults: []\n")
    result: dict[str, Any] = {"topology": str(args.topology), "duration_s": args.duration,
                              "learners": cfg.run.learners, "H": cfg.sync.H,
                              "P": cfg.sync.fragments, "tau": cfg.sync.tau, "busy": args.busy}
    for label, regions in (("local", None), ("wan", args.topology)):
        out = args.out / label
        report = run_chaos(cfg, script, out, baseline="dp", live=not args.no_live,
                           regions=regions)
        result[label] = _traffic(out, report, cfg)
    # Compute time of one inner step: DiLoCo's loopback step time (its loop never waits on
    # the network; the DP step time includes the all-reduce wait).
    step_s = float(result["local"]["diloco"]["ref_step_s"])
    per_step = {m: float(result["local"][m]["bytes_per_learner_step"]) for m in MODES}
    result["step_s"] = step_s
    result["required_bps"] = {
        "diloco": required_bps_diloco(per_step["diloco"], step_s, cfg.sync.H,
                                      cfg.sync.fragments, cfg.sync.tau, args.busy),
        "dp": required_bps_dp(per_step["dp"], step_s, args.busy),
    }
    d, p = result["local"]["diloco"], result["local"]["dp"]
    result["bytes_per_token_ratio"] = p["bytes_per_token"] / d["bytes_per_token"]
    result["required_bps_ratio"] = result["required_bps"]["dp"] / result["required_bps"]["diloco"]
    result["wan_over_local_tokens_per_s"] = {
        m: result["wan"][m]["tokens_per_s"] / result["local"][m]["tokens_per_s"] for m in MODES}
    result["link_totals"] = {m: link_totals(result["wan"][m]["link_bytes"] or []) for m in MODES}
    (args.out / "wan.json").write_text(json.dumps(result, indent=2))
    _plot(result, args.out / "wan.png")

    console = Console()
    table = Table(title=f"{args.topology}: {args.duration:g} s per run, M={cfg.run.learners}, "
                        f"step {step_s * 1e3:.0f} ms")
    for col in ("", "DiLoCo", "DP", "DP / DiLoCo"):
        table.add_column(col, justify="right")
    rows: list[tuple[str, str, str, str]] = [
        ("bytes/token (loopback)", f"{d['bytes_per_token']:,.1f}", f"{p['bytes_per_token']:,.1f}",
         f"{result['bytes_per_token_ratio']:.0f}x"),
    ]
    for label in ("local", "wan"):
        a, b = result[label]["diloco"], result[label]["dp"]
        rows.append((f"merged tokens/s ({label})", f"{a['tokens_per_s']:,.0f}",
                     f"{b['tokens_per_s']:,.0f}", f"{b['tokens_per_s'] / a['tokens_per_s']:.2f}"))
        rows.append((f"final val loss ({label})", f"{a['final_val_loss']:.3f}",
                     f"{b['final_val_loss']:.3f}", ""))
    w = result["wan_over_local_tokens_per_s"]
    rows.append(("tokens/s WAN / loopback", f"{w['diloco']:.2f}", f"{w['dp']:.2f}", ""))
    rows.append((f"link for {args.busy:.0%} busy", fmt_rate(result["required_bps"]["diloco"]),
                 fmt_rate(result["required_bps"]["dp"]), f"{result['required_bps_ratio']:.0f}x"))
    for row in rows:
        table.add_row(*row)
    console.print(table)
    for m in MODES:
        console.print(link_bytes_table(result["wan"][m]["link_bytes"] or [],
                                       f"{m}, WAN run: bytes per link, application vs link"))
    console.print(f"wrote {args.out / 'wan.json'} and {args.out / 'wan.png'}")
    print(json.dumps({"bench": "wan", **{k: result[k] for k in (
        "step_s", "bytes_per_token_ratio", "required_bps", "required_bps_ratio",
        "wan_over_local_tokens_per_s", "link_totals")},
        "bytes_per_token": {m: result["local"][m]["bytes_per_token"] for m in MODES},
        "tokens_per_s": {lbl: {m: result[lbl][m]["tokens_per_s"] for m in MODES}
                         for lbl in ("local", "wan")},
        "final_val_loss": {lbl: {m: result[lbl][m]["final_val_loss"] for m in MODES}
                           for lbl in ("local", "wan")}}))


if __name__ == "__main__":
    main()
