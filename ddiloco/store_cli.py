"""``ddiloco store``: maintenance of a run's parameter store (docs/RELIABILITY.md).

* ``ddiloco store rebuild --redis-url URL --run-id RUN --blobs LOCATION``: recreate a run's
  heads, kept versions, manifest and counters in a Redis that lost them (or a new one), from
  the version records in its object store (:mod:`ddiloco.store.rebuild`).
"""

from __future__ import annotations

import json
from typing import Annotated

import typer

from ddiloco.workers.cli import guard, new_app

store_app = new_app("maintenance of a run's parameter store (docs/RELIABILITY.md)")


@store_app.command("rebuild")
def store_rebuild(
    redis_url: Annotated[str, typer.Option(
        "--redis-url", help="the Redis to rebuild into (it must not hold the run)")],
    run_id: Annotated[str, typer.Option("--run-id", help="the run to rebuild")],
    blobs: Annotated[str, typer.Option(
        "--blobs", help="the run's blob location, e.g. s3://bucket/prefix or file:///dir "
        "(credentials from the standard AWS_* variables)")],
    as_json: Annotated[bool, typer.Option("--json", help="print the report as JSON")] = False,
) -> None:
    """Rebuild run RUN's state in Redis from its object store: blob location, manifest,
    initial values, each fragment's head, kept versions and merge ledger, and the shard-epoch
    and incarnation counters. Refuses (exit 2) a Redis that already holds the run. Telemetry
    (events, counters) is not rebuilt: it lived in Redis only."""
    def go() -> int:
        from ddiloco.store.connect import connect
        from ddiloco.store.rebuild import rebuild

        client = connect(redis_url, attempts=3)
        report = rebuild(client, run_id, blobs)
        if as_json:
            typer.echo(json.dumps(report.to_json(), sort_keys=True))
            return 0
        typer.echo(f"rebuilt run {run_id!r} from {report.location} in {report.seconds:.2f} s")
        for p in sorted(report.heads):
            typer.echo(f"  fragment {p}: head version {report.heads[p]}, "
                       f"{report.kept[p]} kept version(s)")
        typer.echo(f"  shard epochs from {report.epoch + 1}; {len(report.learners)} learner(s) "
                   f"registered; {report.skipped} record(s) of unacknowledged or older "
                   "versions not used")
        return 0

    guard(go)
