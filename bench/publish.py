"""A publish of one fragment through the real store against the disk's own write rate, side by
side in one run on an otherwise idle host.

    python bench/publish.py [--mb 336] [--reps 5] [--dir DIR] [--json PATH]

Each repetition, in alternating order (so a disk that slows down slows both):

* ``publish``: :meth:`ddiloco.store.RedisStore.publish` of a fragment value of ``--mb`` MB
  (float32, given as its blob parts, :func:`ddiloco.workers.run.blobs.blob_parts`, as a shard
  publishes) and an empty momentum to a ``file://`` object store in ``--dir``, against a real
  embedded Redis (AOF ``appendfsync always``), keeping 2 versions: the direct write through
  the bounce buffers with its CRC-32C, the fsyncs of file and directory and the head's
  compare-and-set. The collection of the version that left the window runs in the
  background, as in a shard; the bench waits for it after the timed call, so it does not
  spill into the next measurement;
* ``fdatasync``: the same number of bytes (rounded up to 64 MiB chunks) written to a file in
  the same directory, each chunk followed by ``os.fdatasync``: ``bench/scale.py``'s disk
  measurement, :func:`scale.fdatasync_gbps`.

It prints a table (GB/s of each, best and median, and their ratio) and one JSON line. Where
``bench/scale.py`` measures publishes during a run, on a host whose cores, memory and disk the
learners and shards share, this is the publish path's own rate.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

GB = 1e9


def main() -> int:
    from scale import fdatasync_gbps  # this directory's bench/scale.py

    from ddiloco.store import EmbeddedRedis, RedisStore
    from ddiloco.store.connect import connect
    from ddiloco.workers.run.blobs import blob_parts

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=336,
                    help="fragment size, MB of float32 (336: the largest of the 1B layout)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--dir", default=None, help="where the object store and Redis live")
    ap.add_argument("--json", help="write the result object to this file")
    args = ap.parse_args()

    value = np.random.default_rng(0).standard_normal(args.mb * 1_000_000 // 4,
                                                     dtype=np.float32)
    parts = blob_parts([value])
    nbytes = sum(p.nbytes for p in parts)
    with tempfile.TemporaryDirectory(prefix="ddl-publish-", dir=args.dir) as tmp:
        work = Path(tmp)
        with EmbeddedRedis(work / "redis") as server:
            store = RedisStore(connect(server.url), "publish-bench")
            store.set_blob_location(f"file://{work / 'blobs'}")
            times: dict[str, list[float]] = {"publish": [], "fdatasync": []}
            version = -1
            for rep in range(args.reps):
                order = ("publish", "fdatasync") if rep % 2 == 0 else ("fdatasync", "publish")
                for kind in order:
                    if kind == "publish":
                        t0 = time.perf_counter()
                        version = store.publish(0, expected_version=version, epoch=1,
                                                value=parts, momentum=b"", keep=2)
                        times[kind].append(time.perf_counter() - t0)
                        store.wait_collected()
                    else:
                        rate = fdatasync_gbps(work, nbytes)["all"]
                        times[kind].append(nbytes / rate / GB)
                pub = nbytes / times["publish"][-1] / GB
                print(f"[publish] {rep + 1}/{args.reps}: publish {pub:.2f}"
                      f" GB/s, fdatasync {nbytes / times['fdatasync'][-1] / GB:.2f} GB/s",
                      file=sys.stderr, flush=True)
            store.flush_run()
    rates = {k: [nbytes / t / GB for t in v] for k, v in times.items()}
    res: dict[str, Any] = {"bench": "publish", "bytes": nbytes, "reps": args.reps}
    for k, v in rates.items():
        res[f"{k}_gbps_median"] = round(statistics.median(v), 3)
        res[f"{k}_gbps_best"] = round(max(v), 3)
        res[f"{k}_gbps"] = [round(x, 3) for x in v]
    res["publish_over_fdatasync"] = round(res["publish_gbps_median"]
                                          / res["fdatasync_gbps_median"], 3)
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"publish of a {nbytes / GB:.3f} GB fragment vs fdatasync, {args.reps} reps")
    for col in ("", "median GB/s", "best GB/s"):
        t.add_column(col, justify="right" if col else "left")
    for k in ("publish", "fdatasync"):
        t.add_row(k, str(res[f"{k}_gbps_median"]), str(res[f"{k}_gbps_best"]))
    t.add_row("ratio (medians)", str(res["publish_over_fdatasync"]), ">= 0.7")
    Console(stderr=True).print(t)
    line = json.dumps(res)
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
