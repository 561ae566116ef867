"""The shard's merge engine: decode, weight, merge and outer-step a fragment in a few passes.

:func:`ddiloco.workers.syncer.merge.merge_fragment` and
:class:`ddiloco.workers.syncer.merge.OuterOptimizer`
are the specification; this module computes the same numbers (bit-identical for the weighted
average of single-payload contributions, within float32 rounding elsewhere: RDA norms are
summed in float64, re-anchored contributions add the kept version differences one by one)
without a float32 copy of any contribution:

1. every contribution stays quantized (:class:`ddiloco.pipeline.accumulate.Packed`), one or
   more payloads each (a pending delta folded with a newer one, the version differences that
   re-anchor it);
2. RDA norms come from the quantized payloads: for an int8/int4 payload, the sums of squares
   :func:`ddiloco.pipeline.accumulate.unpack` took while checking it; otherwise one read of
   each payload, no output;
3. each contribution is dequantized, scaled by its coefficient and added into one preallocated
   float32 accumulator in one pass (:func:`ddiloco.pipeline.accumulate.add_range`); the work is
   cut into ranges of at most :data:`CHUNK` values within a tensor, and each range takes every
   contribution in turn, so its slice of the accumulator stays in cache;
4. for an int4 or int8 downlink, the outer Nesterov step, the update norm of the guard, the
   error-feedback residual, the downlink quantization and its re-quantization for the broadcast
   are one pass over blocks (:func:`outer_int`) that writes the payloads and updates the
   fragment's state in place. The guard's verdict (the update's norm, finiteness) is known
   only at its end: a refused update leaves the state changed, and the shard reads the
   fragment back from the store (as after a fenced publish). A pass that checked first and a
   second one that applied read the fragment's four float32 buffers twice; at a 1B model's
   fragment sizes the merge is bound by memory traffic, and that check was a quarter of it.

Threads: ranges run on a thread pool (``threads``, default: the cores this process may use);
the kernels release the GIL.

Memory, for a shard owning fragments of ``F`` float32 bytes in all, the largest ``F_max``:
the accumulator, ``F_max`` (one for the shard, reused by every merge); scratch per thread,
``4 * CHUNK`` bytes for contributions of several payloads.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numba
import numpy as np
import numpy.typing as npt

from ddiloco.pipeline.accumulate import (
    Packed,
    _sumsq_f32,
    add_range,
    sumsq_f32,
    sumsq_range,
)
from ddiloco.pipeline.quantize import _SCALE_LIMIT
from ddiloco.workers.syncer.merge import NORM_FLOOR

__all__ = ["CHUNK", "FUSED_DOWN", "MergeEngine", "default_threads", "outer_int", "warm_up"]

#: values per unit of work: 256 KiB of accumulator, which stays in a core's L2 cache
CHUNK = 1 << 16
#: downlink codecs whose quantization is fused into the outer step
FUSED_DOWN = {"int4": 7, "int8": 127}
#: values per piece of :func:`outer_int`: its seven scratch arrays stay in L1 and L2
_PIECE = 1024

T = TypeVar("T")


def default_threads() -> int:
    """The cores this process may run on."""
    try:
        return max(1, len(os.sched_getaffinity(0)))
    except AttributeError:  # pragma: no cover - not Linux
        return max(1, os.cpu_count() or 1)


Contrib = Sequence[Packed]


class MergeEngine:
    """Merges of one shard's fragments on a pool of threads.

    Args:
        threads: worker threads (None: :func:`default_threads`).
    """

    def __init__(self, threads: int | None = None) -> None:
        self.threads = threads or default_threads()
        self._pool = ThreadPoolExecutor(self.threads, thread_name_prefix="merge") \
            if self.threads > 1 else None
        self._acc = np.zeros(0, np.float32)

    def _map(self, fn: Callable[[T], object], items: Sequence[T]) -> list[object]:
        if self._pool is None or len(items) < 2:
            return [fn(x) for x in items]
        return list(self._pool.map(fn, items))

    def accumulator(self, n: int) -> npt.NDArray[np.float32]:
        """The shard's accumulator, ``n`` float32 values (grown, never shrunk)."""
        if self._acc.size < n:
            self._acc = np.zeros(n, np.float32)
        return self._acc[:n]

    # ---------------------------------------------------------------- merge
    def merge(self, contribs: Sequence[Contrib], weights: Sequence[float],
              shapes: Sequence[tuple[int, ...]], embedding_mask: Sequence[bool],
              method: str = "rda") -> npt.NDArray[np.float32]:
        """The merged outer gradient of one fragment (as
        :func:`ddiloco.workers.syncer.merge.merge_fragment`).

        Args:
            contribs: per contribution, its payloads; the contribution is their sum.
            weights: token weights; contributions of weight 0 are left out.
            shapes: the fragment's tensor shapes; ``n`` values in all.
            embedding_mask: per tensor, True for a weighted average whatever ``method``.
            method: "rda" or "average".

        Returns:
            The accumulator, float32, shape ``(n,)``: the tensors flattened and concatenated.
            Valid until the next call.

        Raises:
            ValueError: no contribution with weight > 0, or unknown method.
        """
        if method not in ("rda", "average"):
            raise ValueError(f"merge method: unknown {method!r} (expected 'rda' or 'average')")
        live = [(c, w) for c, w in zip(contribs, weights, strict=True) if w > 0.0]
        if not live:
            raise ValueError("merge_fragment: no contribution with weight > 0")
        cs = [c for c, _ in live]
        ws = [w for _, w in live]
        total = float(sum(ws))
        sizes = [math.prod(s) for s in shapes]
        offsets = np.concatenate([[0], np.cumsum(sizes)]).astype(np.int64)
        n = int(offsets[-1])
        acc = self.accumulator(n)
        items = [(i, int(offsets[i]) + a, int(offsets[i]) + min(a + CHUNK, sizes[i]))
                 for i in range(len(sizes)) for a in range(0, sizes[i], CHUNK)]
        m = len(cs)
        avg = [np.float32(1.0)] if m == 1 else [np.float32(w / total) for w in ws]
        coefs = np.array([avg] * len(sizes), dtype=np.float32)  # (tensors, contributions)
        rda_t = [m > 1 and method == "rda" and not emb for emb in embedding_mask]
        radius = np.zeros(len(sizes))
        if any(rda_t):
            sq = np.zeros((len(sizes), m))
            # a payload unpacked with these shapes brings its tensors' sums of squares along
            shapes_t = tuple(tuple(s) for s in shapes)
            read = []
            for k, c in enumerate(cs):
                if len(c) == 1 and c[0].sumsq is not None and c[0].shapes == shapes_t:
                    sq[:, k] = c[0].sumsq
                else:
                    read.append(k)
            if read:
                sums = self._map(lambda it: [_sumsq(cs[k], it[1], it[2]) if rda_t[it[0]]
                                             else 0.0 for k in read], items)
                for (i, _, _), row in zip(items, sums, strict=True):
                    sq[i, read] += np.asarray(row)
            for i in range(len(sizes)):
                if not rda_t[i]:
                    continue
                norms = [float(np.sqrt(x)) for x in sq[i]]
                radius[i] = sum(w * nn for w, nn in zip(ws, norms, strict=True)) / total
                coefs[i] = [np.float32(w / (total * nn)) if nn > NORM_FLOOR else np.float32(0)
                            for w, nn in zip(ws, norms, strict=True)]
        dsq = self._map(lambda it: _accumulate(acc, cs, coefs[it[0]], it[1], it[2],
                                               rda_t[it[0]]), items)
        dnorm2 = np.zeros(len(sizes))
        for (i, _, _), x in zip(items, dsq, strict=True):
            dnorm2[i] += float(x)  # type: ignore[arg-type]
        scale = np.ones(len(sizes), np.float32)
        redo = []
        for i in range(len(sizes)):
            if rda_t[i]:
                dnorm = float(np.sqrt(dnorm2[i]))
                if dnorm <= NORM_FLOOR:
                    redo.append(i)  # directions cancel: the weighted average instead
                    coefs[i] = avg
                else:
                    scale[i] = np.float32(radius[i] / dnorm)
        if redo:
            self._map(lambda it: _accumulate(acc, cs, coefs[it[0]], it[1], it[2], False),
                      [it for it in items if it[0] in redo])
        scaled = [it for it in items if rda_t[it[0]] and it[0] not in redo]
        self._map(lambda it: np.multiply(acc[it[1]:it[2]], scale[it[0]],
                                         out=acc[it[1]:it[2]]), scaled)
        return acc

    # ---------------------------------------------------------------- outer step
    def outer_int(self, acc: npt.NDArray[np.float32], value: npt.NDArray[np.float32],
                  momentum: npt.NDArray[np.float32], residual: npt.NDArray[np.float32] | None,
                  lr: float, mu: float, codec: str, block: int,
                  raw_down: npt.NDArray[np.uint8], raw_bcast: npt.NDArray[np.uint8],
                  ) -> tuple[float, bool]:
        """The outer step and the int downlink of one fragment (:func:`outer_int`), in one
        pass threaded over block-aligned ranges: the payloads are written and ``value``,
        ``momentum`` and ``residual`` are updated in place, whatever the returned verdict.

        Args:
            acc, value, momentum: float32, shape ``(n,)``: the outer gradient, Theta, b
                (``momentum`` of size 0: none kept, ``mu`` is 0).
            residual: float32 ``(n,)`` (error feedback) or None.
            raw_down: uint8, the raw layout of the quantized update (written).
            raw_bcast: uint8, the raw layout of its re-quantization, the broadcast payload
                (written).

        Returns:
            ``(sum of squared updates before the residual, every new value finite)``: the
            guard's inputs (:func:`ddiloco.workers.syncer.merge.guard_norm`).
        """
        n = acc.size
        nb = -(-n // block)
        # ranges of whole blocks and an even count: no int4 byte is shared by two threads
        step = max(2 * block, CHUNK // (2 * block) * 2 * block)
        ranges = [(a, min(n, a + step)) for a in range(0, n, step)]
        k = FUSED_DOWN[codec]
        bits = 4 if codec == "int4" else 8
        r = residual if residual is not None else np.zeros(0, np.float32)
        scales_d, body_d = raw_down[: 4 * nb].view(np.float32), raw_down[4 * nb:]
        scales_b, body_b = raw_bcast[: 4 * nb].view(np.float32), raw_bcast[4 * nb:]
        limit = _SCALE_LIMIT[codec]
        out: list[Any] = self._map(lambda ab: outer_int(
            acc, value, momentum, r, np.float32(lr), np.float32(mu), k, bits, block, limit,
            ab[0], ab[1], scales_d, body_d, scales_b, body_b), ranges)
        sq = 0.0
        finite = True
        for part_sq, part_finite in out:
            sq += float(part_sq)
            finite = finite and bool(part_finite)
        return sq, finite

    def close(self) -> None:
        """Stop the worker threads."""
        if self._pool is not None:
            self._pool.shutdown(wait=False)


def _sumsq(parts: Contrib, start: int, stop: int) -> float:
    if len(parts) == 1:
        return sumsq_range(parts[0], start, stop)
    scratch = np.zeros(stop - start, np.float32)
    for p in parts:
        add_range(p, start, stop, 1.0, scratch)
    return sumsq_f32(scratch)


def _accumulate(acc: npt.NDArray[np.float32], cs: Sequence[Contrib],
                coefs: npt.NDArray[np.float32], start: int, stop: int, norm: bool) -> float:
    """acc[start:stop] = sum_m coefs[m] * x_m[start:stop]; returns its squared norm when
    ``norm``."""
    out = acc[start:stop]
    out[:] = 0
    scratch = None
    for parts, c in zip(cs, coefs, strict=True):
        if c == 0:
            continue
        if len(parts) == 1:
            add_range(parts[0], start, stop, float(c), out)
            continue
        if scratch is None:
            scratch = np.empty(stop - start, np.float32)
        scratch[:] = 0
        for p in parts:
            add_range(p, start, stop, 1.0, scratch)
        np.multiply(scratch, c, out=scratch)
        np.add(out, scratch, out=out)
    return sumsq_f32(out) if norm else 0.0


@numba.njit(nogil=True, cache=True)
def _quantize(x: npt.NDArray[np.float32], m: int, block: int, k: int, limit: np.float32,
              codes: npt.NDArray[np.int32], scales: npt.NDArray[np.float32],
              sv: npt.NDArray[np.float32], inv: npt.NDArray[np.float32],
              top: npt.NDArray[np.int32]) -> None:  # pragma: no cover - jit
    """:func:`ddiloco.pipeline.quantize._quantize_int` of ``x[:m]`` (``m`` values from a block
    boundary): ``codes[:m]``, one scale per block in ``scales``, and each value's scale in
    ``sv[:m]``. ``inv`` and ``top`` are scratch of ``m`` values.

    ``max|x|`` is taken on the bit patterns with the sign cleared: for non-negative floats
    integer order is float order, and a NaN's pattern lies above every number's, so a NaN in a
    block gives a NaN maximum as the float comparison does, in loops that vectorize without
    fast-math flags.
    """
    xb = x.view(np.int32)
    for t in range(m):
        u = np.uint64(t)
        top[u] = xb[u] & np.int32(0x7FFFFFFF)
    tf = top.view(np.float32)
    kf = np.float32(k)
    nb = -(-m // block)
    for b in range(nb):
        a = b * block
        z = min(m, a + block)
        o = np.uint64(a)
        mx = np.int32(0)
        for t in range(z - a):
            mx = max(mx, top[o + np.uint64(t)])
        top[o] = mx
        absmax = tf[o]
        iv = np.float32(kf / absmax) if absmax > 0 else np.float32(np.inf)
        if not np.isfinite(iv):
            iv = np.float32(0)
            s = np.float32(0)
        else:
            s = np.float32(absmax / kf)
            if s > limit:
                s = limit
        scales[b] = s
        for t in range(z - a):
            u = o + np.uint64(t)
            inv[u] = iv
            sv[u] = s
    for t in range(m):
        u = np.uint64(t)
        codes[u] = np.int32(np.rint(np.float32(x[u] * inv[u])))


@numba.njit(nogil=True, cache=True)
def _step(acc: npt.NDArray[np.float32], value: npt.NDArray[np.float32],
          momentum: npt.NDArray[np.float32], residual: npt.NDArray[np.float32],
          lr: np.float32, mu: np.float32, j: int, m: int, d: npt.NDArray[np.float32],
          e: npt.NDArray[np.float32]) -> None:  # pragma: no cover - jit
    """The values ``j + t``, ``t < m``: ``d[t]``, the applied step, and ``e[t] = d + r``."""
    neg_lr = np.float32(-lr)
    o = np.uint64(j)
    if momentum.size > 0:
        for t in range(m):
            u = np.uint64(t)
            g = acc[o + u]
            bn = np.float32(g + np.float32(mu * momentum[o + u]))
            step = np.float32(neg_lr * np.float32(g + np.float32(mu * bn)))
            p = value[o + u]
            d[u] = np.float32(np.float32(p + step) - p)
    else:  # no momentum buffer: mu is 0 and b' = g (the shard keeps none)
        for t in range(m):
            u = np.uint64(t)
            g = acc[o + u]
            step = np.float32(neg_lr * np.float32(g + np.float32(mu * g)))
            p = value[o + u]
            d[u] = np.float32(np.float32(p + step) - p)
    if residual.size > 0:
        for t in range(m):
            u = np.uint64(t)
            e[u] = np.float32(d[u] + residual[o + u])
    else:
        for t in range(m):
            u = np.uint64(t)
            e[u] = d[u]


@numba.njit(nogil=True, cache=True)
def outer_int(acc: npt.NDArray[np.float32], value: npt.NDArray[np.float32],
              momentum: npt.NDArray[np.float32], residual: npt.NDArray[np.float32],
              lr: np.float32, mu: np.float32, k: int, bits: int, block: int,
              limit: np.float32, start: int, stop: int,
              scales_d: npt.NDArray[np.float32], body_d: npt.NDArray[np.uint8],
              scales_b: npt.NDArray[np.float32],
              body_b: npt.NDArray[np.uint8]) -> tuple[float, bool]:  # pragma: no cover - jit
    """Outer Nesterov step and int downlink over the blocks of ``[start, stop)`` (``start`` a
    multiple of ``block``), in place.

    Per value, as optax's ``sgd(lr, mu, nesterov=True)`` then the shard: ``b' = g + mu b``,
    ``u = -lr (g + mu b')``, ``d = (Theta + u) - Theta``, ``e = d + r``; per block ``e`` is
    quantized (``q``, scale ``s``: the int codec) into ``scales_d``/``body_d``,
    ``Theta' = Theta + q s``, ``r' = e - q s``, and ``q s`` is quantized again for the
    broadcast (what :func:`ddiloco.pipeline.codec.encode` of the update sends) into
    ``scales_b``/``body_b``. ``value``, ``momentum`` and ``residual`` are overwritten.

    The range is done in pieces of about :data:`_PIECE` values (whole blocks), each stage a
    loop over the whole piece: long loops that vectorize, over scratch that stays in L1.

    Returns:
        ``(sum d^2, every Theta' finite)``.
    """
    piece = max(block, _PIECE // block * block)
    d = np.empty(piece, np.float32)
    e = np.empty(piece, np.float32)
    dq = np.empty(piece, np.float32)
    sv = np.empty(piece, np.float32)
    inv = np.empty(piece, np.float32)
    top = np.empty(piece, np.int32)
    codes = np.empty(piece, np.int32)
    has_m = momentum.size > 0
    has_r = residual.size > 0
    sq = 0.0
    bad = 0
    for j in range(start, stop, piece):
        m = min(stop, j + piece) - j
        b0 = j // block
        nb = -(-m // block)
        o = np.uint64(j)
        _step(acc, value, momentum, residual, lr, mu, j, m, d, e)
        sq += _sumsq_f32(d, 0, m)  # the same eight-sum order as every norm here
        _quantize(e, m, block, k, limit, codes, scales_d[b0 : b0 + nb], sv, inv, top)
        _store_codes(body_d, codes, j, m, bits)
        for t in range(m):
            u = np.uint64(t)
            i = o + u
            dqt = np.float32(np.float32(codes[u]) * sv[u])
            dq[u] = dqt
            nv = np.float32(value[i] + dqt)
            bad += (nv - nv) != 0  # Inf - Inf and NaN - NaN are NaN
            value[i] = nv
        if has_r:
            for t in range(m):
                u = np.uint64(t)
                residual[o + u] = np.float32(e[u] - dq[u])
        if has_m:
            for t in range(m):
                i = o + np.uint64(t)
                momentum[i] = np.float32(acc[i] + np.float32(mu * momentum[i]))
        _quantize(dq, m, block, k, limit, codes, scales_b[b0 : b0 + nb], sv, inv, top)
        _store_codes(body_b, codes, j, m, bits)
    return sq, bad == 0


@numba.njit(nogil=True, cache=True)
def _store_codes(body: npt.NDArray[np.uint8], codes: npt.NDArray[np.int32], j: int, m: int,
                 bits: int) -> None:  # pragma: no cover - jit
    """Codes ``codes[:m]`` of the values ``j ..`` into their raw layout."""
    o = np.uint64(j)
    if bits == 8:
        for t in range(m):
            u = np.uint64(t)
            body[o + u] = np.uint8(codes[u] & 0xFF)
        return
    if j & 1 == 0:
        o = np.uint64(j >> 1)
        for t in range(m >> 1):
            u = np.uint64(t)
            lo = codes[u + u] & 0xF
            hi = codes[u + u + np.uint64(1)] & 0xF
            body[o + u] = np.uint8(lo | (hi << 4))
        if m & 1:  # the high nibble follows in the next block (or stays 0: the pad)
            body[o + np.uint64(m >> 1)] = np.uint8(codes[m - 1] & 0xF)
        return
    for t in range(m):  # an odd block size: blocks split bytes
        i = j + t
        nib = np.uint8(codes[t] & 0xF)
        if i & 1:
            body[i >> 1] = np.uint8((body[i >> 1] & 0x0F) | (nib << 4))
        else:
            body[i >> 1] = nib


def warm_up(codecs: Sequence[str]) -> float:
    """Compile the merge's numba kernels now, for payloads in ``codecs`` and both int
    downlinks, on a few hundred values; returns the seconds it took.

    Compiling holds the GIL for seconds (tens on a small machine; numba's on-disk cache makes
    later starts quick). A shard that compiled at its first delta would meanwhile stall its
    other threads: the ZAP handler (handshakes time out), the lease ticker (the lease may
    lapse). So a shard calls this before it takes its lease and opens its sockets.

    Raises:
        ValueError: an unknown codec name.
    """
    import time

    from ddiloco.pipeline import codec
    from ddiloco.pipeline.accumulate import pack_raw, unpack
    from ddiloco.pipeline.codec_spec import DEFAULT_BLOCK, raw_size

    t0 = time.perf_counter()
    n = 300
    shapes = [(n,)]
    x = [np.linspace(-1.0, 1.0, n, dtype=np.float32)]
    engine = MergeEngine(1)
    for name in dict.fromkeys(codecs):
        packed = unpack(codec.encode(x, name), shapes, name)
        for method in ("rda", "average"):
            engine.merge([[packed], [packed, packed]], [1.0, 2.0], shapes, [False], method)
    acc = np.full(n, 1e-3, np.float32)
    for down in FUSED_DOWN:
        raw = [np.zeros(raw_size(n, down), np.uint8) for _ in range(2)]
        for momentum in (np.zeros(n, np.float32), np.zeros(0, np.float32)):
            args = (acc, np.zeros(n, np.float32), momentum, np.zeros(n, np.float32), 1.0,
                    0.5 if momentum.size else 0.0, down, DEFAULT_BLOCK)
            engine.outer_int(*args, raw[0], raw[1])
        pack_raw(raw[0], shapes, down)
    engine.close()
    return time.perf_counter() - t0
