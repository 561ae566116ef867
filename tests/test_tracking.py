"""Experiment tracking (ddiloco.workers.tracking): TensorBoard event files read back, a W&B
offline run read back with wandb's own reader, the missing extra, and the real evaluator
process writing event files."""

from __future__ import annotations

import json
import shutil
import struct
import subprocess
import sys
from pathlib import Path
from typing import Any

import crc32c
import pytest

from ddiloco.pipeline.errors import DDilocoError
from ddiloco.store.redis_store import RedisStore
from ddiloco.workers.run.config import load_config
from ddiloco.workers.tracking import (
    TRACK_EXTRA,
    MergeCounter,
    Tracker,
    TrackingUnavailable,
    check_tracking,
    loss_tag,
    open_tracker,
    wandb_mode,
)

ROOT = Path(__file__).resolve().parents[1]

POINTS = [  # (fields of an eval event, merges so far)
    ({"loss": 5.5, "tokens": 0, "wire_bytes": 0}, 0),
    ({"loss": 3.25, "tokens": 4096, "wire_bytes": 12_000}, 6),
    ({"loss": 2.125, "tokens": 8192, "wire_bytes": 30_500}, 13),
]


def _masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC32-C of ``data``."""
    crc = crc32c.crc32c(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_scalars(logdir: Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar of the event files in ``logdir``, ``{tag: [(step, value), ...]}``: the
    TFRecord framing (length, masked CRC32-C of length and data, both checked) around
    tensorboardX's own ``Event`` protobuf."""
    from tensorboardX.proto.event_pb2 import Event

    out: dict[str, list[tuple[int, float]]] = {}
    files = sorted(logdir.glob("events.out.tfevents.*"))
    assert files, f"no event file in {logdir}"
    for path in files:
        data = path.read_bytes()
        pos = 0
        while pos < len(data):
            header = data[pos:pos + 8]
            (length,) = struct.unpack("<Q", header)
            (len_crc,) = struct.unpack("<I", data[pos + 8:pos + 12])
            assert len_crc == _masked_crc(header), f"{path}: bad length CRC at {pos}"
            body = data[pos + 12:pos + 12 + length]
            (body_crc,) = struct.unpack("<I", data[pos + 12 + length:pos + 16 + length])
            assert body_crc == _masked_crc(body), f"{path}: bad data CRC at {pos}"
            pos += 16 + length
            event = Event()
            event.ParseFromString(body)
            for v in event.summary.value:
                out.setdefault(v.tag, []).append((event.step, v.simple_value))
    return out


def test_loss_tag_names_the_unit() -> None:
    assert loss_tag("nats/byte") == "val/loss_nats_per_byte"
    assert loss_tag("nats/token") == "val/loss_nats_per_token"
    assert loss_tag("bits per char") == "val/loss_bits_per_char"
    assert loss_tag("") == "val/loss"


def test_tensorboard_event_files_read_back(tmp_path: Path) -> None:
    tracker = Tracker(tmp_path, "run-x", "nats/byte", tensorboard=True, wandb=False)
    assert tracker.active and tracker.wb is None
    for fields, merges in POINTS:
        tracker.log(fields, merges)
    tracker.close()
    tracker.close()  # idempotent
    scalars = read_scalars(tmp_path / "tensorboard")
    assert set(scalars) == {"val/loss_nats_per_byte", "train/tokens", "sync/merges",
                            "sync/wire_bytes"}
    # x-axis: global tokens; every scalar once per evaluation, in order
    assert scalars["val/loss_nats_per_byte"] == [(0, 5.5), (4096, 3.25), (8192, 2.125)]
    assert scalars["train/tokens"] == [(0, 0.0), (4096, 4096.0), (8192, 8192.0)]
    assert scalars["sync/merges"] == [(0, 0.0), (4096, 6.0), (8192, 13.0)]
    assert scalars["sync/wire_bytes"] == [(0, 0.0), (4096, 12000.0), (8192, 30500.0)]


def _wandb_history(wandb_dir: Path) -> list[dict[str, Any]]:
    """The history rows of the one offline run under ``wandb_dir``, through wandb's own
    reader of its transaction log (``wandb leet inspect --json``)."""
    runs = sorted(wandb_dir.glob("wandb/offline-run-*/run-*.wandb"))
    assert len(runs) == 1, f"expected one offline run under {wandb_dir}: {runs}"
    exe = shutil.which("wandb", path=str(Path(sys.executable).parent))
    assert exe is not None, "the wandb command is missing: " + TRACK_EXTRA
    out = subprocess.run([exe, "leet", "inspect", "--json", str(runs[0])], check=True,
                         capture_output=True, text=True, timeout=60).stdout
    rows = []
    for line in out.splitlines():
        if line.startswith("{"):
            record = json.loads(line)
            if record.get("type") == "history":
                rows.append(record["history"]["item"])
    return rows


@pytest.mark.timeout(120)
def test_wandb_offline_run_holds_the_logged_values(tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_DIR", str(tmp_path / "elsewhere"))
    monkeypatch.setenv("WANDB_SILENT", "true")
    tracker = Tracker(tmp_path, "run-w", "nats/token", tensorboard=False, wandb=True,
                      wandb_project="ddiloco-test", config={"sync": {"H": 6}})
    assert tracker.tb is None
    for fields, merges in POINTS:
        tracker.log(fields, merges)
    tracker.close()
    # the run directory is the tracker's (RUN_DIR/wandb), not WANDB_DIR
    rows = _wandb_history(tmp_path / "wandb")
    assert [(r["_step"], r["val/loss_nats_per_token"], r["train/tokens"], r["sync/merges"],
             r["sync/wire_bytes"]) for r in rows] == [
        (0, 5.5, 0, 0, 0), (4096, 3.25, 4096, 6, 12000), (8192, 2.125, 8192, 13, 30500)]


def test_wandb_mode_never_waits_on_the_network_without_a_key(tmp_path: Path) -> None:
    no_netrc = tmp_path / "absent-netrc"
    assert wandb_mode({}, no_netrc) == "offline"
    assert wandb_mode({"WANDB_MODE": "disabled"}, no_netrc) == "disabled"
    assert wandb_mode({"WANDB_MODE": "dryrun"}, no_netrc) == "offline"
    assert wandb_mode({"WANDB_MODE": "bogus"}, no_netrc) == "offline"  # no key: offline
    assert wandb_mode({"WANDB_MODE": "offline", "WANDB_API_KEY": "k"}, no_netrc) == "offline"
    assert wandb_mode({"WANDB_API_KEY": "k" * 40}, no_netrc) == "online"
    netrc = tmp_path / "netrc"
    netrc.write_text("machine api.wandb.ai\n  login user\n  password " + "k" * 40 + "\n")
    netrc.chmod(0o600)
    assert wandb_mode({}, netrc) == "online"
    assert wandb_mode({"WANDB_BASE_URL": "https://wandb.example.org"}, netrc) == "offline"
    netrc.write_text("this is not a netrc file {")
    assert wandb_mode({}, netrc) == "offline"


def test_missing_extra_is_a_clear_error(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # None in sys.modules: find_spec answers None and import raises, as with no package
    monkeypatch.setitem(sys.modules, "tensorboardX", None)
    cfg = load_config(None, ["tracking.tensorboard=true"])
    with pytest.raises(TrackingUnavailable) as err:
        check_tracking(cfg.tracking)
    msg = str(err.value)
    assert "tracking.tensorboard = true" in msg and "pip install 'ddiloco[track]'" in msg
    assert "\n" not in msg
    assert isinstance(err.value, DDilocoError)  # the CLI prints it on one line, exit 2
    with pytest.raises(TrackingUnavailable, match=r"pip install 'ddiloco\[track\]'"):
        open_tracker(cfg, tmp_path, "r", "nats/byte")
    check_tracking(load_config(None, []).tracking)  # nothing asked, nothing needed
    assert open_tracker(load_config(None, []), tmp_path, "r", "nats/byte") is None


def test_tracking_section_defaults_and_bounds() -> None:
    t = load_config(None, []).tracking
    assert (t.tensorboard, t.wandb, t.progress_every_s, t.log_level) == (False, False, 30.0,
                                                                          "info")
    for bad in ("tracking.progress_every_s=0", "tracking.log_level=loud",
                "tracking.wandb_project=''", "tracking.nope=1"):
        with pytest.raises(DDilocoError, match="tracking"):
            load_config(None, [bad])


def test_merge_counter_reads_only_new_events(fake_redis: Any) -> None:
    store = RedisStore(fake_redis, "t-merges")
    count = MergeCounter(store)
    assert count() == 0
    for p in range(3):
        store.add_event("merge", {"fragment": p})
    store.add_event("eval", {"loss": 1.0})
    assert count() == 3
    assert count() == 3  # nothing new: nothing counted twice
    store.add_event("merge", {"fragment": 0})
    assert count() == 4


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_the_evaluator_process_writes_event_files(redis_server: Any, tmp_path: Path) -> None:
    """A real evaluator process, started by the launcher as a local run starts it, evaluates
    the stored model once and writes its point to OUT/<mode>/tensorboard/; the launcher's log
    level reaches it (its debug line is in its log)."""
    from ddiloco.store.connect import connect
    from ddiloco.workers.run.blobs import encode_blob
    from ddiloco.workers.run.launch import LocalCluster
    from ddiloco.workers.run.manifest import init_run

    run_id = "it-tracking"
    cfg = load_config(ROOT / "configs" / "ci-tiny.yaml",
                      ["tracking.tensorboard=true", "tracking.log_level=debug",
                       "security.curve=false"])
    store = RedisStore(connect(redis_server.url), run_id)
    try:
        manifest = init_run(store, cfg, run_id)
        # version 0 of every fragment, as a shard writes it from the initial values
        for p in range(len(manifest["layout"])):
            store.claim_fragment(p, 1)
            store.publish(p, expected_version=-1, epoch=1, value=store.get_initial(p),
                          momentum=encode_blob([]), keep=cfg.sync.history, meta={"init": True})
        store.incr_counter("tokens", "learner-0", 1234)
        run_dir = tmp_path / "diloco"
        cluster = LocalCluster.for_run(cfg, redis_server.url, run_id, run_dir)
        assert cluster.log_level == "debug"
        cluster.workers["evaluator"].argv.append("--once")
        cluster.start("evaluator")
        assert cluster.wait(["evaluator"], timeout_s=150)
        log = cluster.log_tail("evaluator", 20000)
        assert cluster.workers["evaluator"].proc is not None
        assert cluster.workers["evaluator"].proc.returncode == 0, log
        assert " DEBUG evaluated versions [0, 0, 0, 0]" in log
        scalars = read_scalars(run_dir / "tensorboard")
        (step, loss), = scalars["val/loss_nats_per_byte"]
        assert step == 1234 and 4.0 < loss < 7.0  # about ln(256) for an untrained byte model
        assert scalars["train/tokens"] == [(1234, 1234.0)]
    finally:
        store.flush_run()
