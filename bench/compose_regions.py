"""The compose demo against the same topology in network namespaces: tokens/s per learner.

Runs the same training twice on this machine, one after the other, with no faults:

* ``ddiloco run --regions configs/regions-compose.yaml --steps N`` (network namespaces, HTB
  links, NFQUEUE delay; chaos/wan/regions.py), the baseline;
* ``docker compose up`` of compose.yaml with ``DDILOCO_STEPS=N`` (containers, one router per
  region applying the same topology file; chaos/wan/router.py), which ends on its own.

Both use configs/default.toml (4 learners, 2 shards) and report each learner's tokens per second
from its join to its leave (``per_learner`` in report.json). Prints a table with the ratio
compose / regions per learner and in total, writes ``OUT/compose_regions.json`` and one JSON
line. Needs root, a Docker engine with Compose v2 and the images (``make compose-test`` or
docs/COMPOSE.md builds them; BASE_IMAGE, REDIS_IMAGE, ... as there).

    python bench/compose_regions.py [--steps 240] [--out bench-out/compose-regions]
                                    [--reuse-regions]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
TOPOLOGY = ROOT / "configs" / "regions-compose.yaml"


def _run_regions(steps: int, out: Path) -> dict[str, Any]:
    cmd = [sys.executable, "-m", "ddiloco.cli", "run", "--regions", str(TOPOLOGY),
           "--steps", str(steps), "--out", str(out), "--no-live", "--force"]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
    return dict(json.loads((out / "report.json").read_text())["diloco"])


def _run_compose(steps: int, out: Path, project: str) -> dict[str, Any]:
    env = {**os.environ, "DDILOCO_STEPS": str(steps), "DDILOCO_OUT": str(out.resolve()),
           "DDILOCO_NET": os.environ.get("DDILOCO_NET", "172.30")}
    compose = ["docker", "compose", "-p", project]
    try:
        subprocess.run([*compose, "build", "-q"], cwd=ROOT, env=env, check=True)
        # Detached, as a deployment runs: an attached `up` streams every container's log
        # through the compose client, which competes with the learners for the CPU.
        subprocess.run([*compose, "up", "-d"], cwd=ROOT, env=env, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        finish = subprocess.run([*compose, "ps", "-a", "-q", "finish"], cwd=ROOT, env=env,
                                check=True, capture_output=True, text=True).stdout.strip()
        subprocess.run(["docker", "wait", finish], check=True, stdout=subprocess.DEVNULL,
                       timeout=3600)
    finally:
        subprocess.run([*compose, "down", "-v"], cwd=ROOT, env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return dict(json.loads((out / "report.json").read_text())["diloco"])


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=240)
    parser.add_argument("--out", type=Path, default=ROOT / "bench-out" / "compose-regions")
    parser.add_argument("--project", default="ddiloco-bench")
    parser.add_argument("--reuse-regions", action="store_true",
                        help="take the --regions run from OUT/regions/report.json")
    args = parser.parse_args()
    from rich.console import Console
    from rich.table import Table

    from ddiloco.chaos.wan.topology import load_topology

    args.out.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    if args.reuse_regions:
        regions = dict(json.loads((args.out / "regions" / "report.json").read_text())["diloco"])
    else:
        regions = _run_regions(args.steps, args.out / "regions")
    t1 = time.monotonic()
    compose = _run_compose(args.steps, args.out / "compose", args.project)
    t2 = time.monotonic()
    topo = load_topology(TOPOLOGY)
    table = Table(title=f"tokens/s per learner, {args.steps} steps: compose vs --regions")
    for col in ("learner", "region", "--regions", "compose", "compose / regions"):
        table.add_column(col)
    rows: dict[str, Any] = {}
    for lid in sorted(regions["per_learner"]):
        r = regions["per_learner"][lid]["tokens_per_s"]
        c = compose["per_learner"].get(lid, {}).get("tokens_per_s")
        ratio = round(c / r, 3) if r and c else None
        rows[lid] = {"region": topo.region_of(lid), "regions": r, "compose": c, "ratio": ratio}
        table.add_row(lid, topo.region_of(lid), f"{r:,.0f}", f"{c:,.0f}" if c else "-",
                      f"{ratio:.2f}" if ratio else "-")
    total = {k: {"regions": regions[k], "compose": compose[k]}
             for k in ("tokens_per_s", "wall_s", "final_val_loss", "wire_bytes_per_token",
                       "merges")}
    for k, v in total.items():
        table.add_row(k, "", f"{v['regions']}", f"{v['compose']}",
                      f"{v['compose'] / v['regions']:.2f}" if v["regions"] else "-")
    Console().print(table)
    result = {"bench": "compose_regions", "steps": args.steps, "per_learner": rows,
              "total": total, "run_s": {"regions": round(t1 - t0, 1),
                                        "compose": round(t2 - t1, 1)}}
    (args.out / "compose_regions.json").write_text(json.dumps(result, indent=2))
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
