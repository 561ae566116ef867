"""Large messages: one int4 delta of a ~2 GB fp32 fragment, learner to shard, over ZeroMQ.

A learner-side sender process encodes one delta of a random fragment (normal values of scale
1e-3, four float32 tensors of 16384 x 7744 by default: 507.5 M values, 2.03 GB, about 250 MB
once int4-quantized and compressed) with the real codec (``wire.encode``), and pushes it
through a :class:`~ddiloco.pipeline.transport.DeltaPush` to a shard-side receiver process: a
:class:`~ddiloco.pipeline.transport.ShardSockets` PULL whose MAXMSGSIZE comes from the fragment
layout and the codec (``transport.max_message_bytes``), which decodes it (``wire.decode``).
Once over plain TCP on loopback and once with CURVE (keys written by
``pipeline.security.create_keys``, the shard's ZAP handler ``security.Authenticator`` admitting
the learner's key), each time with a fresh receiver process.

Reported: encode seconds (once; the same payload is sent both times), send+receive seconds
(from the send call to the receiver's ``recv`` returning, ``CLOCK_MONOTONIC`` of both
processes), MB/s of payload, decode seconds, and peak RSS in multiples of the message size
``M``: the whole process's peak, and what each phase added above the RSS before it (the kernel's
high-water mark ``VmHWM`` is reset before every phase through ``/proc/self/clear_refs``; where
that is not writable, the process-lifetime peak of ``getrusage`` is used and phases are not
separated).

    python bench/bigmsg.py [--tensors 4] [--rows 16384] [--cols 7744] [--codec int4]
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import resource
import sys
import tempfile
import time
from multiprocessing.connection import Connection
from pathlib import Path
from typing import Any

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from ddiloco.pipeline import codec as codec_mod
from ddiloco.pipeline import wire
from ddiloco.pipeline.wire import Header, Kind

RUN = "bench-bigmsg"
#: Seconds the receiver waits for the message before giving up.
RECV_TIMEOUT_S = 300


# ---------------------------------------------------------------------------- memory probes


def _status_bytes(field: str) -> int | None:
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return None


def rss() -> int:
    """Resident set size now, bytes (0 where /proc is missing)."""
    return _status_bytes("VmRSS") or 0


def reset_peak() -> bool:
    """Reset the kernel's peak-RSS mark of this process; False where that is not possible."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def peak() -> int:
    """Peak RSS since the last :func:`reset_peak` (else since start), bytes."""
    hwm = _status_bytes("VmHWM")
    if hwm is not None:
        return hwm
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


# ---------------------------------------------------------------------------- the two ends


def sender(conn: Connection, shapes: list[tuple[int, ...]], codec: str, keys_dir: str) -> None:
    """Learner side: encode once, then send to each receiver the parent names."""
    import zmq

    from ddiloco.pipeline.security import ClientKeys, load_keys
    from ddiloco.pipeline.transport import DeltaPush, max_message_bytes

    n = sum(int(np.prod(s)) for s in shapes)
    rng = np.random.default_rng(0)
    tensors = [rng.standard_normal(s, dtype=np.float32) for s in shapes]
    for t in tensors:
        t *= np.float32(1e-3)
    header = Header(kind=Kind.DELTA, run=RUN, sender="learner-0", inc=1, seq=1, frag=0, base=0,
                    c_steps=24, c_tokens=24 * 4096, new_tokens=24 * 4096, step=24,
                    step_time=0.5, codec=codec)
    before = rss()
    exact = reset_peak()
    t0 = time.perf_counter()
    frames = wire.encode(header, tensors)
    encode_s = time.perf_counter() - t0
    msg = wire.message_nbytes(frames)
    conn.send({"encode_s": encode_s, "msg_bytes": msg, "payload_bytes": len(frames[1]),
               "encode_extra": peak() - before, "encode_peak": peak(), "exact_peaks": exact,
               "fragment_bytes": 4 * n, "raw_bytes": codec_mod.raw_size(n, codec)})
    seq = 1
    while True:
        order = conn.recv()
        if order is None:
            break
        ctx = zmq.Context()
        curve = None
        if order["curve"]:
            curve = ClientKeys(load_keys(keys_dir, "learner-0"), Path(keys_dir))
        push = DeltaPush(ctx, max_message_bytes(n, [codec]), curve)
        push.update({0: order["endpoint"]})
        seq += 1
        warm = wire.encode(Header(kind=Kind.CONTROL, run=RUN, sender="learner-0", inc=1,
                                  seq=seq, frag=0, extra={"action": "join"}))
        while not push.send(0, warm):
            time.sleep(0.01)
        assert conn.recv() == "go"  # the receiver has the warm-up: connected, handshaken
        base = rss()
        reset_peak()
        t_send = time.monotonic()
        while not push.send(0, frames):
            time.sleep(0.001)
        assert conn.recv() == "received"
        conn.send({"t_send": t_send, "send_extra": peak() - base, "send_peak": peak(),
                   "send_base": base})
        push.close()
        ctx.term()


def receiver(conn: Connection, shapes: list[tuple[int, ...]], codec: str, keys_dir: str,
             curve: bool) -> None:
    """Shard side: bind, announce the endpoint, take the warm-up and the delta, decode it."""
    import zmq

    from ddiloco.pipeline.security import Authenticator, load_keys
    from ddiloco.pipeline.transport import ShardSockets, max_message_bytes

    n = sum(int(np.prod(s)) for s in shapes)
    ctx = zmq.Context()
    auth = None
    keys = None
    if curve:
        auth = Authenticator(ctx, keys_dir, roles=("learner-",))
        auth.start()
        keys = load_keys(keys_dir, "shard-0")
    max_msg = max_message_bytes(n, [codec])
    socks = ShardSockets(ctx, max_msg, curve=keys)
    conn.send({"endpoint": socks.pull_endpoint, "max_msg": max_msg})
    warm = socks.recv(60_000)
    if warm is None:
        raise RuntimeError("the warm-up message did not arrive within 60 s")
    assert wire.decode(warm, run_id=RUN).kind == Kind.CONTROL
    del warm
    base = rss()
    reset_peak()
    conn.send("ready")
    frames = socks.recv(RECV_TIMEOUT_S * 1000)
    t_recv = time.monotonic()
    if frames is None:
        raise RuntimeError(f"the delta did not arrive within {RECV_TIMEOUT_S} s")
    recv_extra, recv_peak = peak() - base, peak()
    peer = socks.last_peer
    before = rss()
    reset_peak()
    t0 = time.perf_counter()
    msg = wire.decode(frames, run_id=RUN, expected_shapes=lambda h: shapes if h.frag == 0 else None,
                      allowed_codecs=[codec])
    decode_s = time.perf_counter() - t0
    decode_extra = peak() - before
    assert msg.tensors is not None and [t.shape for t in msg.tensors] == shapes
    conn.send({"t_recv": t_recv, "recv_extra": recv_extra, "recv_peak": recv_peak,
               "recv_base": base, "decode_s": decode_s, "decode_extra": decode_extra,
               "total_peak": max(recv_peak, peak()), "peer": peer})
    del msg, frames
    socks.close()
    if auth is not None:
        auth.stop()
    ctx.term()


# ---------------------------------------------------------------------------- orchestration


def run_mode(ctx: Any, snd: Connection, shapes: list[tuple[int, ...]], codec: str,
             keys_dir: str, curve: bool) -> dict[str, Any]:
    """One transfer through a fresh receiver process; returns both ends' figures."""
    parent, child = ctx.Pipe()
    proc = ctx.Process(target=receiver, args=(child, shapes, codec, keys_dir, curve))
    proc.start()
    try:
        hello = parent.recv()
        snd.send({"endpoint": hello["endpoint"], "curve": curve})
        assert parent.recv() == "ready"
        snd.send("go")
        got = parent.recv()
        snd.send("received")
        sent = snd.recv()
    finally:
        proc.join(timeout=60)
    return {**hello, **got, **sent}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tensors", type=int, default=4)
    ap.add_argument("--rows", type=int, default=16384)
    ap.add_argument("--cols", type=int, default=7744)
    ap.add_argument("--codec", default="int4")
    args = ap.parse_args()

    from rich.console import Console
    from rich.table import Table

    from ddiloco.pipeline.security import create_keys

    shapes = [(args.rows, args.cols)] * args.tensors
    ctx = mp.get_context("spawn")
    with tempfile.TemporaryDirectory() as tmp:
        keys_dir = str(Path(tmp) / "keys")
        for name in ("shard-0", "learner-0"):
            create_keys(keys_dir, name)
        snd, child = ctx.Pipe()
        sproc = ctx.Process(target=sender, args=(child, shapes, args.codec, keys_dir))
        sproc.start()
        try:
            enc = snd.recv()
            modes = {m: run_mode(ctx, snd, shapes, args.codec, keys_dir, m == "curve")
                     for m in ("plain", "curve")}
            snd.send(None)
        finally:
            sproc.join(timeout=60)

    m = enc["msg_bytes"]
    mb = m / 1e6
    res: dict[str, Any] = {
        "bench": "bigmsg", "codec": args.codec, "shapes": [list(s) for s in shapes],
        "fragment_MB": round(enc["fragment_bytes"] / 1e6, 1),
        "raw_MB": round(enc["raw_bytes"] / 1e6, 1), "msg_MB": round(mb, 1),
        "maxmsgsize_MB": round(modes["plain"]["max_msg"] / 1e6, 1),
        "encode_s": round(enc["encode_s"], 3),
        "encode_extra_over_msg": round(enc["encode_extra"] / m, 2),
        "exact_phase_peaks": enc["exact_peaks"],
    }
    for name, r in modes.items():
        dt = r["t_recv"] - r["t_send"]
        res.update({
            f"{name}_transfer_s": round(dt, 3),
            f"{name}_MBps": round(mb / dt, 1),
            f"{name}_decode_s": round(r["decode_s"], 3),
            f"{name}_send_extra_over_msg": round(r["send_extra"] / m, 2),
            f"{name}_send_peak_over_msg": round(max(enc["encode_peak"], r["send_peak"]) / m, 2),
            f"{name}_recv_extra_over_msg": round(r["recv_extra"] / m, 2),
            f"{name}_recv_peak_over_msg": round(r["recv_peak"] / m, 2),
            f"{name}_decode_extra_over_msg": round(r["decode_extra"] / m, 2),
            f"{name}_recv_total_peak_over_msg": round(r["total_peak"] / m, 2),
        })
    res["curve_peer"] = modes["curve"]["peer"]
    res["curve_over_plain_transfer"] = round(res["curve_transfer_s"] / res["plain_transfer_s"], 2)

    t = Table(title=f"one {args.codec} delta of {res['fragment_MB']:,} MB fp32 "
                    f"({res['msg_MB']:,} MB on the wire), learner -> shard on loopback; "
                    f"encode {res['encode_s']} s")
    t.add_column("")
    t.add_column("plain TCP", justify="right")
    t.add_column("CURVE", justify="right")
    t.add_column("CURVE / plain", justify="right")
    rows = [("send + receive, s", "transfer_s"), ("payload MB/s", "MBps"),
            ("decode, s", "decode_s"),
            ("sender: encode added / M", "encode_extra_over_msg"),
            ("sender: send added / M", "send_extra_over_msg"),
            ("sender: peak RSS / M", "send_peak_over_msg"),
            ("receiver: receive added / M", "recv_extra_over_msg"),
            ("receiver: peak RSS at receipt / M", "recv_peak_over_msg"),
            ("receiver: decode added / M", "decode_extra_over_msg"),
            ("receiver: peak RSS / M", "recv_total_peak_over_msg")]
    for label, key in rows:
        if key == "encode_extra_over_msg":  # one encode, sent both ways
            a = b = res[key]
        else:
            a, b = res[f"plain_{key}"], res[f"curve_{key}"]
        t.add_row(label, f"{a:,}", f"{b:,}", f"{b / a:.2f}" if a else "-")
    Console().print(t)
    print(json.dumps(res))


if __name__ == "__main__":
    main()
