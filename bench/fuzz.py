"""Coverage-guided fuzzing of the shard's and the learner's message handlers.

Usage::

    python bench/fuzz.py [--seconds 600] [--out bench-out/fuzz] [--engine auto]

Target: one module-level :class:`ddiloco.workers.syncer.core.ShardCore` on fakeredis (the tiny run
of
``tests/test_hostile.py``; injected clock) and one learner
:class:`ddiloco.workers.learner.core.Comms`
of the
same run. Every input is cut into ZeroMQ frames and fed to ``core.handle(frames)``, then
``core.tick()`` after advancing the clock by one second, and to ``comms._on_message(frames)``.
Anything but a normal return is a crash, and so is an ``internal`` drop on either side (an
unexpected exception that the handlers caught) or a non-finite fragment value afterwards.

Input layout (byte 0 is a flags byte, so the fuzzer can get past the checksums):

* byte 0, flags: bit 0 recomputes the header's ``len`` and ``crc`` for frame 1; bit 1 treats
  frame 1 as a *raw* codec payload and compresses it first (zstd with content size and
  checksum, as ``pipeline.codec`` writes it; implies bit 0); bit 2 passes the CURVE identity
  ``learner-0`` to the shard (``peer``); bit 3 sends an empty frame 1 when nothing follows
  frame 0;
* bytes 1-2, big endian: the length L of frame 0; then frame 0 (L bytes) and frame 1 (the rest,
  when not empty). Inputs of under 3 bytes are one frame.

Seed corpus (written to ``<out>/corpus``): valid frames of each kind either side takes: DELTAs
of both fragments (and a raw-payload variant), a shard CONTROL (join), VERSION broadcasts (full,
diff, raw), a HEARTBEAT and CONTROLs (resync, round_open).

Engines: ``atheris`` (libFuzzer; ``pip install atheris``): this script runs itself in a
subprocess with ``-max_total_time`` and ``atheris.instrument_imports()`` around the imports of
``pipeline`` and ``workers``, parses libFuzzer's ``cov:``/``ft:`` and final stats from its
stderr, and restarts it after a crash (at most :data:`MAX_RESTARTS` times) until the time is
spent; crashing inputs go to ``<out>/crashes``. ``hypothesis``: the fallback when atheris does
not install: random and mutated-seed inputs through the same harness for the same time (no
coverage numbers). Prints engine, execs, execs/s, coverage, crashes and corpus size, then one
JSON line ``{"bench": "fuzz", ...}`` (also ``<out>/fuzz.json``). Exit status 1 on a crash.
"""

from __future__ import annotations

import argparse
import contextlib
import hashlib
import json
import logging
import os
import re
import subprocess
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

import fakeredis
import msgpack
import numpy as np
import optax  # noqa: F401  (imported before the instrumented block: not instrumented)
import zstandard

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

try:
    import atheris
except ImportError:  # the hypothesis engine is the fallback
    atheris = None

#: Environment variable that makes this script the libFuzzer worker.
WORKER_ENV = "DDILOCO_FUZZ_WORKER"
IS_WORKER = os.environ.get(WORKER_ENV) == "atheris"
#: atheris runs restarted after a crash before giving up.
MAX_RESTARTS = 5


def _instrumented() -> contextlib.AbstractContextManager[Any]:
    """atheris's import hook in the worker (coverage of our packages only), else nothing."""
    if IS_WORKER and atheris is not None:
        return atheris.instrument_imports(include=["pipeline", "workers"])
    return contextlib.nullcontext()


with _instrumented():
    from ddiloco.pipeline import codec, wire
    from ddiloco.pipeline.wire import Header, Kind
    from ddiloco.store import RedisStore
    from ddiloco.workers.learner.comms import Comms
    from ddiloco.workers.run.config import load_config
    from ddiloco.workers.run.manifest import build_manifest
    from ddiloco.workers.syncer.core import ShardCore
    from ddiloco.workers.task.model import init_params

RUN = "fuzz-run"
#: The tiny run of tests/test_hostile.py (plain TCP: the Comms opens no connection here).
TINY: dict[str, Any] = {
    "model.d_model": 16, "model.n_layers": 1, "model.n_heads": 2, "model.d_ff": 32,
    "model.seq_len": 16, "sync.fragments": 2, "run.shards": 1, "sync.grace_cap_s": 1.0,
    "sync.codec_down": "fp32", "sync.codec_up": "int4", "sync.merge_every": 0.0,
    "train.batch_size": 4, "security.curve": False}
TPB = 4 * 16  # tokens per batch of TINY
FIX_CRC, RAW_PAYLOAD, WITH_PEER, EMPTY_FRAME1 = 1, 2, 4, 8
#: Trim the store's event stream every this many inputs (flat memory over long runs).
TRIM_EVERY = 5000


class Clock:
    """The shard's injected monotonic clock."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Crash(RuntimeError):
    """An input that a handler did not survive as a named drop."""


class _Captured(logging.Handler):
    """Keeps the last logged traceback (the handlers log an ``internal`` drop's)."""

    def __init__(self) -> None:
        super().__init__(logging.ERROR)
        self.last = ""

    def emit(self, record: logging.LogRecord) -> None:
        self.last = record.getMessage()
        if record.exc_info:
            self.last += "\n" + "".join(traceback.format_exception(*record.exc_info))


class Harness:
    """The shard core and the learner comms under test, fed one input at a time."""

    def __init__(self) -> None:
        self.client = fakeredis.FakeRedis(server=fakeredis.FakeServer())
        self.store = RedisStore(self.client, RUN)
        cfg = load_config(None, TINY)
        self.manifest = self.store.put_manifest(build_manifest(cfg, RUN))
        self.clock = Clock()
        epoch = self.store.acquire_lease(0, "fuzz", 10**9)
        assert epoch is not None
        self.core = ShardCore(self.manifest, 0, self.store, epoch, clock=self.clock)
        self.core.load(lambda: init_params(cfg.model_config_obj(), cfg.train.seed))
        for lid in ("learner-0", "learner-1"):
            self.store.register_learner(lid)
        self.core.set_live({"learner-0", "learner-1"})
        self.log = _Captured()
        root = logging.getLogger("ddiloco")
        root.addHandler(self.log)
        root.propagate = False
        self.comms = Comms(self.store, self.manifest, "learner-0", 1,
                           logging.getLogger("ddiloco.fuzz"))
        self.layout = self.core.layout
        for p in range(self.layout.n_fragments):
            self.comms.seed(p, 0, [np.zeros(s, np.float32) for s in self.layout.shapes(p)])
        self.execs = 0

    # ---------------------------------------------------------------- input -> frames
    @staticmethod
    def frames_of(data: bytes) -> tuple[list[bytes], bool]:
        """Cut an input into frames (module doc); returns (frames, pass the peer)."""
        if len(data) < 3:
            return [data], False
        flags = data[0]
        n0 = int.from_bytes(data[1:3], "big")
        frame0, rest = data[3:3 + n0], data[3 + n0:]
        if not rest and not flags & EMPTY_FRAME1:
            return [frame0], bool(flags & WITH_PEER)
        frame1 = rest
        if flags & RAW_PAYLOAD:
            frame1 = zstandard.ZstdCompressor(
                level=1, write_checksum=True, write_content_size=True).compress(rest)
        if flags & (FIX_CRC | RAW_PAYLOAD):
            frame0 = fix_header(frame0, frame1)
        return [frame0, frame1], bool(flags & WITH_PEER)

    # ---------------------------------------------------------------- one input
    def one_input(self, data: bytes) -> None:
        """Feed one input to both handlers; raises :class:`Crash` on anything but a normal
        return or a named drop."""
        self.execs += 1
        frames, with_peer = self.frames_of(data)
        self.core.handle(frames, "learner-0" if with_peer else None)
        self.clock.now += 1.0
        self.core.tick()
        self._check(self.core.drops, "shard")
        for st in self.core.frags.values():
            if not all(np.isfinite(v).all() for v in st.value):
                raise Crash("shard: a fragment value is not finite")
        self.comms._on_message(frames)
        self._check(self.comms.drops, "learner")
        for _ver, value in self.comms.view.values():
            if not all(np.isfinite(v).all() for v in value):
                raise Crash("learner: a fragment view is not finite")
        if self.execs % TRIM_EVERY == 0:
            self.client.xtrim(self.store.keys.events, maxlen=1000, approximate=True)

    def _check(self, drops: dict[str, int], who: str) -> None:
        if drops.pop("internal", 0):
            raise Crash(f"{who}: internal drop:\n{self.log.last}")


def fix_header(frame0: bytes, frame1: bytes) -> bytes:
    """Frame 0 with ``len`` and ``crc`` set for ``frame1`` when it is a msgpack map, else
    unchanged."""
    try:
        raw = msgpack.unpackb(frame0, raw=False, strict_map_key=False)
    except Exception:  # any undecodable header stays as it is
        return frame0
    if not isinstance(raw, dict):
        return frame0
    raw["len"] = len(frame1)
    raw["crc"] = wire.payload_crc(frame1)
    try:
        return bytes(msgpack.packb(raw, use_bin_type=True))
    except Exception:  # e.g. a key type msgpack cannot write back
        return frame0


def pack_input(frames: list[bytes], flags: int = 0) -> bytes:
    """The fuzz input for ``frames`` (inverse of :meth:`Harness.frames_of`)."""
    out = bytes([flags]) + len(frames[0]).to_bytes(2, "big") + frames[0]
    return out + (frames[1] if len(frames) > 1 else b"")


def seeds() -> dict[str, bytes]:
    """Valid inputs of every kind either handler takes (module doc)."""
    cfg = load_config(None, TINY)
    layout = build_manifest(cfg, RUN)["layout"]
    from ddiloco.pipeline.fragments import FragmentLayout

    lay = FragmentLayout.from_json(layout)
    rng = np.random.default_rng(0)

    def tensors(p: int, scale: float = 1e-2) -> list[np.ndarray]:
        return [rng.normal(scale=scale, size=s).astype(np.float32) for s in lay.shapes(p)]

    def delta(p: int, seq: int) -> Header:
        return Header(kind=Kind.DELTA, run=RUN, sender="learner-0", inc=1, seq=seq, frag=p,
                      base=0, c_steps=24, c_tokens=24 * TPB, new_tokens=24 * TPB, step=24,
                      step_time=0.5, codec="int4", extra={"fate": [100, 50, 0, 0]})

    out: dict[str, bytes] = {}
    for p in range(lay.n_fragments):
        out[f"seed-delta-f{p}"] = pack_input(wire.encode(delta(p, p + 1), tensors(p)))
    t0 = tensors(0)
    d_frames = wire.encode(delta(0, 9), t0)
    out["seed-delta-raw"] = pack_input(
        [d_frames[0], codec.quantize(t0, "int4").tobytes()], RAW_PAYLOAD | WITH_PEER)
    out["seed-control-join"] = pack_input(wire.encode(Header(
        kind=Kind.CONTROL, run=RUN, sender="learner-1", inc=1, seq=1, frag=0,
        extra={"action": "join"})))
    version = Header(kind=Kind.VERSION, run=RUN, sender="shard-0", inc=1, seq=1, frag=1,
                     base=0, ver=1, codec="fp32", enc="diff", extra={"merged": {"learner-0": 3}})
    t1 = tensors(1)
    out["seed-version-diff"] = pack_input(wire.encode(version, t1))
    out["seed-version-full"] = pack_input(wire.encode(
        Header(**{**version.__dict__, "enc": "full", "ver": 2, "seq": 2}), t1))
    v_frames = wire.encode(Header(**{**version.__dict__, "base": 2, "ver": 3, "seq": 5}), t1)
    out["seed-version-raw"] = pack_input(
        [v_frames[0], codec.quantize(t1, "fp32").tobytes()], RAW_PAYLOAD)
    out["seed-heartbeat"] = pack_input(wire.encode(Header(
        kind=Kind.HEARTBEAT, run=RUN, sender="shard-0", inc=1, seq=3,
        extra={"versions": {"0": 0, "1": 1}})))
    for action in ("resync", "round_open"):
        out[f"seed-control-{action}"] = pack_input(wire.encode(Header(
            kind=Kind.CONTROL, run=RUN, sender="shard-0", inc=1, seq=4, frag=0,
            extra={"to": "learner-0", "action": action})))
    return out


def write_seeds(corpus: Path) -> int:
    """Write the seed corpus; returns how many seeds."""
    corpus.mkdir(parents=True, exist_ok=True)
    s = seeds()
    for name, data in s.items():
        (corpus / name).write_bytes(data)
    return len(s)


# -------------------------------------------------------------------- atheris


def atheris_worker() -> None:
    """The libFuzzer process: ``sys.argv`` holds libFuzzer's arguments."""
    assert atheris is not None
    harness = Harness()
    atheris.Setup(sys.argv, harness.one_input)
    atheris.Fuzz()


_STATS = re.compile(r"cov: (\d+) ft: (\d+)")


def parse_libfuzzer(text: str) -> dict[str, Any]:
    """Execs, last ``cov:``/``ft:`` and final stats from one libFuzzer run's output."""
    cov = ft = None
    execs = 0
    for line in text.splitlines():
        m = _STATS.search(line)
        if m:
            cov, ft = int(m.group(1)), int(m.group(2))
        m2 = re.match(r"#(\d+)\s", line)
        if m2:
            execs = max(execs, int(m2.group(1)))
        m3 = re.match(r"stat::number_of_executed_units: (\d+)", line)
        if m3:
            execs = max(execs, int(m3.group(1)))
        m4 = re.match(r"Done (\d+) runs", line)
        if m4:
            execs = max(execs, int(m4.group(1)))
    tracebacks = re.findall(
        r"=== Uncaught Python exception: ===\n(.*?)(?=\n==\d+==|\n\n|\nINFO:|\Z)", text,
        flags=re.S)
    return {"cov": cov, "ft": ft, "execs": execs, "tracebacks": tracebacks}


def run_atheris(seconds: float, out: Path, corpus: Path, crashes: Path) -> dict[str, Any]:
    """Run the libFuzzer worker for ``seconds`` in all, restarting it after crashes."""
    log_path = out / "fuzz.log"
    log_path.write_text("")
    deadline = time.monotonic() + seconds
    execs, runs = 0, 0
    cov = ft = None
    tracebacks: list[str] = []
    env = {**os.environ, WORKER_ENV: "atheris", "PYTHONUNBUFFERED": "1"}
    while runs <= MAX_RESTARTS:
        left = int(deadline - time.monotonic())
        if left < 5:
            break
        cmd = [sys.executable, str(Path(__file__).resolve()), str(corpus),
               f"-max_total_time={left}", f"-artifact_prefix={crashes}/",
               "-print_final_stats=1", "-timeout=60", "-rss_limit_mb=4096"]
        proc = subprocess.run(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                              text=True, errors="replace", timeout=left + 300)
        runs += 1
        text = proc.stdout
        with log_path.open("a") as f:
            f.write(f"### run {runs}: {' '.join(cmd)} -> exit {proc.returncode}\n{text}\n")
        got = parse_libfuzzer(text)
        execs += got["execs"]
        if got["cov"] is not None:
            cov = max(cov or 0, got["cov"])
            ft = max(ft or 0, got["ft"])
        tracebacks += [t[:4000] for t in got["tracebacks"]]
        if proc.returncode == 0:
            break
        if not got["tracebacks"] and "ERROR: libFuzzer" not in text:
            tracebacks.append(f"worker exit {proc.returncode}:\n{text[-4000:]}")
            break  # not a fuzz finding (e.g. the worker failed to start): do not spin
    return {"execs": execs, "cov": cov, "ft": ft, "runs": runs, "tracebacks": tracebacks}


# -------------------------------------------------------------------- hypothesis fallback


def run_hypothesis(seconds: float, corpus: Path, crashes: Path) -> dict[str, Any]:
    """Random and mutated-seed inputs through the same harness for ``seconds``."""
    from hypothesis import HealthCheck, given, settings
    from hypothesis import strategies as st

    harness = Harness()
    pool = [p.read_bytes() for p in sorted(corpus.iterdir()) if p.is_file()]

    def mutate(args: tuple[bytes, list[tuple[int, int, str]]]) -> bytes:
        data, ops = bytearray(args[0]), args[1]
        for pos, val, op in ops:
            if not data:
                break
            i = pos % len(data)
            if op == "flip":
                data[i] ^= 1 << (val % 8)
            elif op == "set":
                data[i] = val
            elif op == "cut":
                del data[i:]
            else:
                data[i:i] = bytes([val])
        return bytes(data)

    op = st.tuples(st.integers(0, 2**31), st.integers(0, 255),
                   st.sampled_from(["flip", "set", "cut", "insert"]))
    inputs = st.one_of(
        st.binary(max_size=4096),
        st.tuples(st.sampled_from(pool), st.lists(op, min_size=1, max_size=8)).map(mutate))
    found: list[str] = []

    @settings(max_examples=500, deadline=None, database=None, derandomize=False,
              suppress_health_check=list(HealthCheck))
    @given(data=inputs)
    def prop(data: bytes) -> None:
        try:
            harness.one_input(data)
        except Exception:
            name = "crash-" + hashlib.sha1(data).hexdigest()
            (crashes / name).write_bytes(data)
            raise

    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        try:
            prop()
        except Exception as exc:
            found.append("".join(traceback.format_exception(exc))[-4000:])
    return {"execs": harness.execs, "cov": None, "ft": None, "runs": 1, "tracebacks": found}


# -------------------------------------------------------------------- main


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Coverage-guided fuzzing of the message handlers.")
    ap.add_argument("--seconds", type=float, default=600.0)
    ap.add_argument("--out", type=Path, default=Path("bench-out/fuzz"))
    ap.add_argument("--engine", choices=("auto", "atheris", "hypothesis"), default="auto",
                    help="auto: atheris when it imports, else hypothesis")
    args = ap.parse_args(argv)
    engine = args.engine
    if engine == "auto":
        engine = "atheris" if atheris is not None else "hypothesis"
    if engine == "atheris" and atheris is None:
        ap.error("atheris is not installed (pip install atheris)")
    out: Path = args.out
    corpus, crashes = out / "corpus", out / "crashes"
    crashes.mkdir(parents=True, exist_ok=True)
    n_seeds = write_seeds(corpus)
    before = {p.name for p in crashes.iterdir()}
    t0 = time.monotonic()
    run: Callable[[], dict[str, Any]] = (
        (lambda: run_atheris(args.seconds, out, corpus, crashes)) if engine == "atheris"
        else (lambda: run_hypothesis(args.seconds, corpus, crashes)))
    got = run()
    elapsed = time.monotonic() - t0
    new_crashes = sorted(p.name for p in crashes.iterdir() if p.name not in before)
    n_crashes = max(len(new_crashes), len(got["tracebacks"]))
    result = {
        "bench": "fuzz", "engine": engine, "seconds": round(elapsed, 1),
        "execs": got["execs"], "execs_per_s": round(got["execs"] / elapsed, 1) if elapsed else 0,
        "cov": got["cov"], "ft": got["ft"], "crashes": n_crashes, "crash_files": new_crashes,
        "corpus_size": sum(1 for p in corpus.iterdir() if p.is_file()), "seeds": n_seeds,
        "engine_runs": got["runs"], "tracebacks": got["tracebacks"][:5],
    }
    print(f"engine      {engine}")
    print(f"execs       {result['execs']} in {elapsed:.0f} s ({result['execs_per_s']}/s)")
    print(f"coverage    cov: {got['cov']} ft: {got['ft']}"
          + ("" if engine == "atheris" else " (hypothesis engine: not measured)"))
    print(f"crashes     {n_crashes}" + (f" -> {crashes}" if n_crashes else ""))
    print(f"corpus      {result['corpus_size']} inputs ({n_seeds} seeds) in {corpus}")
    for tb in got["tracebacks"][:3]:
        print("--- crash ---\n" + tb)
    (out / "fuzz.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 1 if n_crashes else 0


if __name__ == "__main__":
    if IS_WORKER:
        atheris_worker()
    else:
        sys.exit(main())
