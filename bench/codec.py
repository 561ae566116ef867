"""Codec throughput and quality on outer-gradient-like data (DESIGN §4).

Usage::

    python bench/codec.py [--mb 16] [--repeat 5] [--block 64] [--level 1] [--seed 0]

Data: ``mb · 10^6 / 4`` float32 values drawn from N(0, 1) and scaled by 1e-3, the order of an
outer gradient. For each dense codec and the topk codecs in ``TOPK_ROWS`` it measures, single
thread, best of ``--repeat``:

* encode and decode throughput, in MB/s of fp32-equivalent input (4 bytes per value,
  MB = 10^6 bytes), and the same for quantization alone (no zstd);
* compression ratio (fp32 bytes / payload bytes) and bits per value (8 · payload bytes / n);
* max absolute error and max error relative to the block's max |x| (for topk this includes the
  dropped entries, which decode to 0; error feedback sends them later).

Baselines from the same run: zstd at the same level on the raw fp32 bytes (compress and
decompress) and a numpy copy of the input (memory bandwidth). Prints a table, then one JSON line.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
import zstandard
from rich.console import Console
from rich.table import Table

# Run as a script from anywhere: make the repository root importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddiloco.pipeline.codec import DENSE_CODECS, decode, dequantize, encode, quantize

TOPK_ROWS = ("topk-d1-b2", "topk-d2-b2", "topk-d5-b4")
"""Top-k codecs measured besides the dense ones: SparseLoCo's 1-2% at 2 bits, and a milder one."""


def best_seconds(fn: Callable[[], object], repeat: int) -> float:
    """Best wall time of ``repeat`` calls of ``fn``, in seconds."""
    best = float("inf")
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def block_errors(x: np.ndarray, y: np.ndarray, block: int) -> tuple[float, float]:
    """(max |x - y|, max over blocks of max |x - y| / max |x|) for 1-D float32 arrays."""
    err = np.abs(x.astype(np.float64) - y)
    n_blocks = -(-x.size // block)
    pad = n_blocks * block - x.size
    err_b = np.pad(err, (0, pad)).reshape(n_blocks, block).max(axis=1)
    max_b = np.pad(np.abs(x.astype(np.float64)), (0, pad)).reshape(n_blocks, block).max(axis=1)
    nz = max_b > 0
    rel = float((err_b[nz] / max_b[nz]).max()) if nz.any() else 0.0
    return float(err.max()), rel


def run(mb: float, repeat: int, block: int, level: int, seed: int) -> dict[str, Any]:
    """Measure every codec and the baselines; returns the figures reported as JSON."""
    n = int(mb * 1e6 / 4)
    x = (np.random.default_rng(seed).standard_normal(n) * 1e-3).astype(np.float32)
    in_mb = x.nbytes / 1e6
    shapes = [x.shape]

    cctx = zstandard.ZstdCompressor(level=level, write_checksum=True)
    dctx = zstandard.ZstdDecompressor()
    zpayload = cctx.compress(x.data)
    baseline = {
        "memcpy_mb_s": in_mb / best_seconds(x.copy, repeat),
        "zstd_fp32_compress_mb_s": in_mb / best_seconds(partial(cctx.compress, x.data), repeat),
        "zstd_fp32_decompress_mb_s": in_mb
        / best_seconds(partial(dctx.decompress, zpayload), repeat),
        "zstd_fp32_ratio": x.nbytes / len(zpayload),
    }

    codecs: dict[str, dict[str, float]] = {}
    for name in (*DENSE_CODECS, *TOPK_ROWS):
        payload = encode([x], name, block=block, level=level)
        raw = quantize([x], name, block)
        (y,) = decode(payload, shapes, name, block=block)
        max_abs, max_rel = block_errors(x, y, block)
        enc = in_mb / best_seconds(partial(encode, [x], name, block=block, level=level), repeat)
        dec = in_mb / best_seconds(partial(decode, payload, shapes, name, block=block), repeat)
        codecs[name] = {
            "encode_mb_s": enc,
            "decode_mb_s": dec,
            # fp32 quantize of one contiguous array is a view: its figure is not a throughput.
            "quantize_mb_s": in_mb / best_seconds(partial(quantize, [x], name, block), repeat),
            "dequantize_mb_s": in_mb
            / best_seconds(partial(dequantize, raw, shapes, name, block), repeat),
            "payload_bytes": len(payload),
            "ratio": x.nbytes / len(payload),
            "bits_per_value": 8 * len(payload) / n,
            "raw_bits_per_value": 8 * raw.nbytes / n,
            "max_abs_error": max_abs,
            "max_rel_error_block": max_rel,
            "encode_vs_zstd": enc / baseline["zstd_fp32_compress_mb_s"],
            "decode_vs_zstd": dec / baseline["zstd_fp32_decompress_mb_s"],
            "encode_vs_memcpy": enc / baseline["memcpy_mb_s"],
            "decode_vs_memcpy": dec / baseline["memcpy_mb_s"],
        }
    return {
        "n_values": n,
        "input_mb": in_mb,
        "block": block,
        "level": level,
        "repeat": repeat,
        "zstd_version": zstandard.ZSTD_VERSION,
        "numpy_version": np.__version__,
        "baseline": baseline,
        "codecs": codecs,
    }


def show(result: dict[str, Any], console: Console) -> None:
    """Print the figures as a table."""
    base = result["baseline"]
    table = Table(
        title=(
            f"codecs on {result['n_values']:,} float32 values ({result['input_mb']:.0f} MB), "
            f"block {result['block']}, zstd level {result['level']}, 1 thread, "
            f"best of {result['repeat']}"
        )
    )
    for col in (
        "codec",
        "enc MB/s",
        "dec MB/s",
        "quant MB/s",
        "dequant MB/s",
        "ratio",
        "bits/value",
        "max abs err",
        "max err/blockmax",
        "enc/zstd",
        "dec/zstd",
        "enc/memcpy",
        "dec/memcpy",
    ):
        table.add_column(col, justify="left" if col == "codec" else "right")
    for name, c in result["codecs"].items():
        table.add_row(
            name,
            f"{c['encode_mb_s']:.0f}",
            f"{c['decode_mb_s']:.0f}",
            f"{c['quantize_mb_s']:.0f}",
            f"{c['dequantize_mb_s']:.0f}",
            f"{c['ratio']:.2f}",
            f"{c['bits_per_value']:.2f}",
            f"{c['max_abs_error']:.2e}",
            f"{c['max_rel_error_block']:.2e}",
            f"{c['encode_vs_zstd']:.2f}x",
            f"{c['decode_vs_zstd']:.2f}x",
            f"{c['encode_vs_memcpy']:.3f}x",
            f"{c['decode_vs_memcpy']:.3f}x",
        )
    table.add_section()
    table.add_row(
        "zstd fp32",
        f"{base['zstd_fp32_compress_mb_s']:.0f}",
        f"{base['zstd_fp32_decompress_mb_s']:.0f}",
        "",
        "",
        f"{base['zstd_fp32_ratio']:.2f}",
        f"{32 / base['zstd_fp32_ratio']:.2f}",
        "0",
        "0",
        "1.00x",
        "1.00x",
        "",
        "",
    )
    table.add_row("numpy copy", f"{base['memcpy_mb_s']:.0f}", *[""] * 11)
    console.print(table)
    console.print(
        "MB = 10^6 bytes of fp32 input. quant/dequant: without zstd (fp32 quant of one contiguous"
        " array is a zero-copy view). max err/blockmax: max over blocks of max|x - x̂| / max|x|."
    )


def main(argv: list[str] | None = None) -> None:
    """Parse arguments, run, print the table and the JSON line."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=16.0, help="fp32 input size, MB (10^6 B)")
    parser.add_argument("--repeat", type=int, default=5, help="timed runs; the best counts")
    parser.add_argument("--block", type=int, default=64, help="values per quantization block")
    parser.add_argument("--level", type=int, default=1, help="zstd level")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    if args.mb <= 0 or args.repeat < 1:
        parser.error("--mb must be > 0 and --repeat >= 1")
    result = run(args.mb, args.repeat, args.block, args.level, args.seed)
    show(result, Console(width=200))
    print(json.dumps(result))


if __name__ == "__main__":
    main()
