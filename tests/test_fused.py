"""The shard's fused merge path against the reference functions it implements.

Hand-computed numbers first (one payload of each codec decoded straight into a running sum),
then the merge, the outer step and the downlink against ``merge_fragment``,
``OuterOptimizer.step`` and ``quantize_roundtrip`` on the same inputs.
"""

from __future__ import annotations

import numpy as np
import pytest

from ddiloco.pipeline import codec
from ddiloco.pipeline.accumulate import add_range, pack_raw, sumsq_range, unpack
from ddiloco.pipeline.codec_spec import raw_size
from ddiloco.pipeline.errors import CodecError, NonFinite
from ddiloco.workers.syncer.fused import MergeEngine
from ddiloco.workers.syncer.merge import OuterConfig, OuterOptimizer, merge_fragment

CODECS = ["fp32", "bf16", "int8", "int4", "topk-d2-b2", "topk-d5-b4", "topk-d0.5-b3",
          "topk-d100-b8"]


def f32(*xs: float) -> np.ndarray:
    return np.array(xs, np.float32)


def test_int4_adds_weighted_codes_into_the_sum() -> None:
    # one block: max 1.4 -> scale 0.2, codes round(x / 0.2) = 7, -3, 0, 2
    x = f32(1.4, -0.6, 0.01, 0.4)
    p = unpack(codec.encode([x], "int4"), [(4,)], "int4")
    assert p.nbytes == raw_size(4, "int4") == 4 + 2
    out = f32(1.0, 1.0, 1.0, 1.0)
    add_range(p, 0, 4, 0.5, out)
    s = np.float32(1.4) / np.float32(7)
    want = f32(1, 1, 1, 1) + np.float32(0.5) * (f32(7, -3, 0, 2) * s)
    np.testing.assert_array_equal(out, want)
    np.testing.assert_allclose(out, [1.7, 0.7, 1.0, 1.2], rtol=1e-6)
    # a range: values 1..2 into a buffer of two
    part = np.zeros(2, np.float32)
    add_range(p, 1, 3, 2.0, part)
    np.testing.assert_allclose(part, [-1.2, 0.0], rtol=1e-6)
    assert sumsq_range(p, 0, 4) == pytest.approx(1.4**2 + 0.6**2 + 0.4**2, rel=1e-6)


def test_topk_adds_only_kept_entries() -> None:
    # d50-b2 on 4 values keeps 2: |4| and |-2|; scale 4, levels -1, -1/3, 1/3, 1
    x = f32(0.5, 4.0, -2.0, 0.1)
    p = unpack(codec.encode([x], "topk-d50-b2"), [(4,)], "topk-d50-b2")
    out = np.zeros(4, np.float32)
    add_range(p, 0, 4, 1.0, out)
    np.testing.assert_allclose(out, [0.0, 4.0, -4.0 / 3.0, 0.0], rtol=1e-6)


@pytest.mark.parametrize("name", CODECS)
def test_add_range_is_bit_identical_to_decode_then_add(name: str) -> None:
    rng = np.random.default_rng(3)
    shapes = [(3, 5000), (7,), (4099,)]
    xs = [rng.normal(size=s).astype(np.float32) for s in shapes]
    payload = codec.encode(xs, name)
    ref = np.concatenate([t.reshape(-1) for t in codec.decode(payload, shapes, name)])
    p = unpack(payload, shapes, name)
    n = ref.size
    for a, b in [(0, n), (3, 4099), (15000, n), (100, 101), (5, 5)]:
        out = rng.normal(size=b - a).astype(np.float32)
        want = out.copy()
        add_range(p, a, b, 0.3, out)
        want += np.float32(0.3) * ref[a:b]
        np.testing.assert_array_equal(out, want)
        ss = float(np.sum(ref[a:b].astype(np.float64) ** 2))
        # int codecs: s^2 * sum(q^2) against the squares of the float32 products q * s
        rel = 2.0**-23 if name in ("int4", "int8") else 1e-9
        assert sumsq_range(p, a, b) == pytest.approx(ss, rel=rel, abs=1e-30)
    for got, want_t in zip(p.tensors(), codec.decode(payload, shapes, name), strict=True):
        np.testing.assert_array_equal(got, want_t)


@pytest.mark.parametrize("name", ["int4", "int8"])
@pytest.mark.parametrize("block", [1, 2, 7, 63, 64])
def test_int_ranges_of_any_alignment_match_decode(name: str, block: int) -> None:
    """Whole blocks take the vectorized loops, range edges and odd int4 blocks the per-value
    ones: the same float32 result either way."""
    rng = np.random.default_rng(4)
    n = 2 * block * 5 + 3
    x = rng.normal(size=n).astype(np.float32)
    p = unpack(codec.encode([x], name, block=block), [(n,)], name, block=block)
    ref = codec.decode(codec.encode([x], name, block=block), [(n,)], name, block=block)[0]
    for a, b in [(0, n), (1, n), (block, 3 * block), (block + 1, 3 * block - 1), (n - 1, n),
                 (2, 3), (0, block - 1)]:
        out = rng.normal(size=b - a).astype(np.float32)
        want = out + np.float32(-1.7) * ref[a:b]
        add_range(p, a, b, -1.7, out)
        np.testing.assert_array_equal(out, want)
        ss = float(np.sum(ref[a:b].astype(np.float64) ** 2))
        assert sumsq_range(p, a, b) == pytest.approx(ss, rel=2.0**-23, abs=1e-30)


@pytest.mark.parametrize("name", ["int4", "int8"])
def test_unpack_checks_every_code_and_sums_each_tensor(name: str) -> None:
    """The pass that checks the codes also sums each tensor's squares: a bad code anywhere
    (first or last byte, either side of a tensor boundary) is refused, and the sums are
    those of :func:`sumsq_range` over each tensor's range."""
    shapes = [(3, 333), (1,), (1 << 15,), (64,)]
    xs = [np.linspace(-1, 1, int(np.prod(s))).astype(np.float32) for s in shapes]
    n = sum(x.size for x in xs)
    raw = codec.quantize(xs, name)
    p = unpack(codec._compressor(1).compress(raw.tobytes()), shapes, name)
    assert p.sumsq is not None and len(p.sumsq) == len(shapes)
    bounds = np.cumsum([0] + [x.size for x in xs])
    for i, want in enumerate(p.sumsq):
        assert want == sumsq_range(p, int(bounds[i]), int(bounds[i + 1]))
    per_byte = 2 if name == "int4" else 1
    body = len(raw) - -(-n // per_byte)
    code = 0x08 if name == "int4" else 0x80
    for value in (0, 998, 999, 1000, n - 65, n - 1):
        bad = raw.copy()
        bad[body + value // per_byte] = code << 4 * (value % per_byte)
        with pytest.raises(CodecError, match="below -"):
            unpack(codec._compressor(1).compress(bad.tobytes()), shapes, name)


@pytest.mark.parametrize("at", [0, (1 << 14) - 1, 1 << 14, 40_000 - 1])
def test_unpack_names_the_first_non_finite_bf16_value(at: int) -> None:
    raw = codec.quantize([np.ones(40_000, np.float32)], "bf16")
    raw[2 * at : 2 * at + 2] = [0x80, 0x7F]  # +Inf
    raw[-2:] = [0xC0, 0x7F]  # NaN, found only when nothing comes before it
    frame = codec._compressor(1).compress(raw.tobytes())
    with pytest.raises(NonFinite, match=f"value {at} of"):
        unpack(frame, [(40_000,)], "bf16")


@pytest.mark.parametrize("name", ["fp32", "bf16", "int8", "int4", "topk-d2-b2"])
def test_unpack_rejects_what_decode_rejects(name: str) -> None:
    x = np.linspace(-1, 1, 300).astype(np.float32)
    raw = codec.quantize([x], name)
    bad = raw.copy()
    if name == "fp32":
        bad[:4] = np.frombuffer(np.float32(np.inf).tobytes(), np.uint8)
    elif name == "bf16":
        bad[:2] = [0x80, 0x7F]  # +Inf
    elif name in ("int8", "int4"):
        bad[-1] = 0x80 if name == "int8" else 0x08  # code -128 / -8
    else:
        bad[:4] = np.frombuffer(np.float32(-1).tobytes(), np.uint8)  # negative scale
    frame = codec._compressor(1).compress(bad.tobytes())
    with pytest.raises((CodecError, NonFinite)) as ref_exc:
        codec.decode(frame, [(300,)], name)
    with pytest.raises(type(ref_exc.value)):
        unpack(frame, [(300,)], name)
    with pytest.raises(CodecError):
        unpack(b"not zstd", [(300,)], name)


def _flat(ts: list[np.ndarray]) -> np.ndarray:
    return np.concatenate([t.reshape(-1) for t in ts])


@pytest.mark.parametrize("method", ["rda", "average"])
@pytest.mark.parametrize("name", ["int4", "fp32", "topk-d5-b4"])
def test_fused_merge_matches_merge_fragment(method: str, name: str) -> None:
    rng = np.random.default_rng(7)
    shapes = [(300, 70), (5,), (1000,)]
    mask = [False, False, True]
    ds = [[rng.normal(size=s).astype(np.float32) for s in shapes] for _ in range(3)]
    packed = [[unpack(codec.encode(d, name), shapes, name)] for d in ds]
    decoded = [p[0].tensors() for p in packed]
    w = [1.0, 2.0, 0.0]  # weight 0: left out
    engine = MergeEngine(threads=2)
    got = engine.merge(packed, w, shapes, mask, method)
    want = _flat(merge_fragment(decoded, w, mask, method))
    if method == "average":
        np.testing.assert_array_equal(got, want)  # same float32 operations
    else:  # float64 norms against float32 ones: float32 rounding of the tensor's scale
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6 * float(np.abs(want).max()))
    # a single contribution is copied exactly
    one = engine.merge(packed[:1], [5.0], shapes, mask, method)
    np.testing.assert_array_equal(one, _flat(decoded[0]))


def test_fused_merge_of_several_parts_is_their_sum() -> None:
    """A folded or re-anchored contribution: the merge of payloads a + b + c equals the
    reference merge of the decoded sum (RDA norms of the sum, not of the parts)."""
    rng = np.random.default_rng(8)
    shapes = [(2000,), (70, 3)]
    parts = [[rng.normal(size=s).astype(np.float32) for s in shapes] for _ in range(3)]
    other = [rng.normal(size=s).astype(np.float32) for s in shapes]
    pk = [unpack(codec.encode(p, "int4"), shapes, "int4") for p in parts]
    po = unpack(codec.encode(other, "int4"), shapes, "int4")
    summed = [a.tensors() for a in pk]
    total = [x + y + z for x, y, z in zip(*summed, strict=True)]
    got = MergeEngine(threads=1).merge([pk, [po]], [3.0, 1.0], shapes, [False, False], "rda")
    want = _flat(merge_fragment([total, po.tensors()], [3.0, 1.0], [False, False], "rda"))
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


def test_cancelling_directions_fall_back_to_the_average() -> None:
    x = f32(1.0, -2.0, 3.0, 0.5)
    a = pack_raw(x.view(np.uint8), [(4,)], "fp32")
    b = pack_raw((-x).view(np.uint8), [(4,)], "fp32")
    got = MergeEngine(threads=1).merge([[a], [b]], [1.0, 1.0], [(4,)], [False], "rda")
    np.testing.assert_array_equal(got, np.zeros(4, np.float32))


@pytest.mark.parametrize("down", ["int4", "int8"])
@pytest.mark.parametrize("feedback", [False, True])
@pytest.mark.parametrize("block", [64, 7])
def test_outer_int_matches_optax_and_the_downlink(down: str, feedback: bool,
                                                  block: int) -> None:
    rng = np.random.default_rng(9)
    # a partial last block, an odd count for int4's pad nibble, and with block 7 blocks that
    # split bytes and several ranges for the two threads
    n = 64 * 37 + 21 if block == 64 else 7 * 20011
    g = rng.normal(scale=1e-3, size=n).astype(np.float32)
    value = rng.normal(size=n).astype(np.float32)
    mom = rng.normal(scale=1e-3, size=n).astype(np.float32)
    res = rng.normal(scale=1e-5, size=n).astype(np.float32) if feedback else None
    cfg = OuterConfig(lr=0.7, momentum=0.9)
    target, want_mom = OuterOptimizer(cfg).step([value], [g], [mom])
    diff = [target[0] - value]
    want_sq = float(np.sum(diff[0].astype(np.float64) ** 2))
    if res is not None:
        diff = [diff[0] + res]
    diff_q = codec.quantize_roundtrip(diff, down, block)
    want_value = value + diff_q[0]
    want_bcast = codec.quantize(diff_q, down, block)

    v, b = value.copy(), mom.copy()
    r = None if res is None else res.copy()
    raw_d = np.empty(raw_size(n, down, block), np.uint8)
    raw_b = np.empty(raw_size(n, down, block), np.uint8)
    engine = MergeEngine(threads=2)
    args = (g, v, b, r, cfg.lr, cfg.momentum, down, block)
    sq, finite = engine.outer_int(*args, raw_d, raw_b)
    assert finite and sq == pytest.approx(want_sq, rel=1e-4)
    np.testing.assert_allclose(b, want_mom[0], rtol=1e-6, atol=1e-9)
    applied = pack_raw(raw_d, [(n,)], down, block).tensors()[0]
    np.testing.assert_array_equal(v, value + applied)  # the kept difference is exact
    # optax's float32 rounding differs from the fused step's: a value at a rounding midpoint
    # may take the next code (one in the 140k values of block 7); such values, and the
    # broadcast blocks that hold them, are compared within that code step only
    step = np.repeat(raw_d[: 4 * -(-n // block)].view(np.float32), block)[:n]
    gap = np.abs(applied - diff_q[0])
    off = gap > 0.5 * step
    assert off.sum() <= n // 50_000
    assert np.all(gap[off] <= 1.0001 * step[off])
    np.testing.assert_allclose(v[~off], want_value[~off], rtol=1e-6, atol=1e-7)
    # d = (Theta + u) - Theta is exact to an ulp of Theta: so are residuals and scales
    ulp = float(np.spacing(np.float32(np.abs(value).max())))
    if r is not None:
        np.testing.assert_allclose(r[~off], (diff[0] - diff_q[0])[~off], atol=2 * ulp)
    # the broadcast re-quantizes the applied difference, as codec.encode(diff_q) does
    np.testing.assert_array_equal(raw_b, codec.quantize([applied], down, block))
    bcast = pack_raw(raw_b, [(n,)], down, block).tensors()[0]
    ref_bcast = codec.dequantize(want_bcast, [(n,)], down, block)[0]
    same_block = ~np.repeat(np.add.reduceat(off, np.arange(0, n, block)) > 0, block)[:n]
    np.testing.assert_allclose(bcast[same_block], ref_bcast[same_block], rtol=1e-5,
                               atol=2 * ulp)
    assert not np.isnan(sq)
