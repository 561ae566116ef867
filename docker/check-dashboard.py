"""Every query of the shipped Grafana dashboard returns data from a running Prometheus.

    python3 docker/check-dashboard.py HOST:PORT [--workers 7] [--timeout 180]

Waits until Prometheus scrapes ``--workers`` targets as up, then until every panel query of
configs/grafana/dashboards/ddiloco.json returns at least one series; exits 1 naming the empty
queries after ``--timeout`` seconds. Standard library only (runs on any host with python3).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any

DASHBOARD = Path(__file__).resolve().parent.parent / "configs/grafana/dashboards/ddiloco.json"


def query(prom: str, expr: str) -> list[Any]:
    """The result vector of instant query ``expr`` (empty on any error)."""
    url = f"http://{prom}/api/v1/query?" + urllib.parse.urlencode({"query": expr})
    try:
        with urllib.request.urlopen(url, timeout=5) as r:
            body = json.loads(r.read())
    except OSError:
        return []
    return list(body["data"]["result"]) if body.get("status") == "success" else []


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("prometheus", help="HOST:PORT")
    parser.add_argument("--workers", type=int, default=7)
    parser.add_argument("--timeout", type=float, default=180.0)
    args = parser.parse_args()
    dash = json.loads(DASHBOARD.read_text())
    queries = [(p["title"], t["expr"]) for p in dash["panels"] for t in p["targets"]]
    deadline = time.monotonic() + args.timeout
    empty = queries
    up = 0
    while time.monotonic() < deadline:
        up = len(query(args.prometheus, "up == 1"))
        if up >= args.workers:
            empty = [(title, expr) for title, expr in queries if not query(args.prometheus, expr)]
            if not empty:
                print(json.dumps({"dashboard_queries": len(queries), "with_data": len(queries),
                                  "targets_up": up}))
                return 0
        time.sleep(5)
    print(f"targets up: {up}/{args.workers}; queries without data: {empty}", file=sys.stderr)
    return 1


if __name__ == "__main__":
    sys.exit(main())
