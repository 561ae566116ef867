"""How fragment blobs are encoded, by measurement: the uncompressed ``raw32`` blob (a copy and a
CRC-32C) against the zstd ``fp32`` codec, beside memcpy and this disk's fdatasync write rate.

Compression pays for itself only if it encodes faster than ``disk_rate / saving`` (writing the
saved bytes would have taken longer than compressing them); the table prints that break-even.
The tensors are float32 weights like a trained model's (normal, std 0.02, with a few larger
rows), so zstd sees realistic exponents.

    python bench/blobs.py [--mb 256] [--dir /tmp] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import crc32c

from ddiloco.pipeline import codec
from ddiloco.workers.run.blobs import decode_blob, encode_blob


def best_s(fn: Callable[[], Any], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def fdatasync_gbps(directory: Path, nbytes: int, chunk: int = 64 << 20) -> float:
    """Write ``nbytes`` in ``chunk`` pieces and fdatasync each: the disk's durable write rate."""
    buf = os.urandom(chunk)
    with tempfile.NamedTemporaryFile(dir=directory) as f:
        fd = f.fileno()
        t0 = time.perf_counter()
        done = 0
        while done < nbytes:
            os.write(fd, buf)
            os.fdatasync(fd)
            done += chunk
        return done / (time.perf_counter() - t0) / 1e9


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mb", type=int, default=256, help="fragment size, MB of float32")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--dir", type=Path, default=Path(tempfile.gettempdir()),
                    help="where the fdatasync rate is measured (the blob store's disk)")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    rng = np.random.default_rng(0)
    n = (args.mb << 20) // 4
    rows = 1024
    w = (rng.standard_normal(n, dtype=np.float32) * 0.02).reshape(rows, -1)
    w[:8] *= 50.0  # embeddings and norms sit at other scales
    tensors = [w]
    shapes = [w.shape]
    nbytes = w.nbytes
    raw = encode_blob(tensors)
    zst = codec.encode(tensors, "fp32")
    t = {
        "memcpy": best_s(lambda: np.copy(w), args.reps),
        "zlib_crc32": best_s(lambda: zlib.crc32(w), args.reps),
        "crc32c": best_s(lambda: crc32c.crc32c(w), args.reps),
        "raw32_encode": best_s(lambda: encode_blob(tensors), args.reps),
        "raw32_decode": best_s(lambda: decode_blob(raw, shapes), args.reps),
        "zstd_fp32_encode": best_s(lambda: codec.encode(tensors, "fp32"), 1),
        "zstd_fp32_decode": best_s(lambda: decode_blob(zst, shapes), 1),
    }
    gbps = {k: nbytes / v / 1e9 for k, v in t.items()}
    disk = fdatasync_gbps(args.dir, max(nbytes, 256 << 20))
    saving = 1.0 - len(zst) / nbytes
    break_even = disk / saving if saving > 0 else float("inf")
    res = {
        "bench": "blobs", "fragment_bytes": nbytes,
        **{f"{k}_gbps": round(v, 3) for k, v in gbps.items()},
        "zstd_saving": round(saving, 4), "disk_fdatasync_gbps": round(disk, 3),
        "zstd_break_even_encode_gbps": round(break_even, 2),
        "zstd_pays": gbps["zstd_fp32_encode"] > break_even,
        "raw32_vs_zstd_encode": round(gbps["raw32_encode"] / gbps["zstd_fp32_encode"], 1),
    }

    from rich.console import Console
    from rich.table import Table

    table = Table("pass", "GB/s", "vs memcpy", title=f"fragment blob of {nbytes / 2**20:.0f} MiB")
    for k, v in gbps.items():
        table.add_row(k, f"{v:.2f}", f"{v / gbps['memcpy']:.2f}")
    Console().print(table)
    print(f"zstd saves {saving:.1%}; the disk writes {disk:.2f} GB/s with fdatasync; zstd would "
          f"have to encode at {break_even:.1f} GB/s to pay for itself "
          f"({'it does' if res['zstd_pays'] else 'it does not'})")
    line = json.dumps(res)
    print(line)
    if args.json:
        args.json.write_text(line + "\n")


if __name__ == "__main__":
    main()
