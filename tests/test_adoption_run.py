"""Every adoption policy end to end: real learners, shard and Redis via ``ddiloco run``.

Token fate must balance exactly under each policy; carry must discard nothing in a fault-free
run (its unsent work leaves in the next delta), overwrite counts what it throws away. The
overwrite run also has HeLoCo's correction and the inner schedule on the global clock on.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from ddiloco.store import EmbeddedRedis, RedisStore
from ddiloco.store.connect import connect

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parent.parent


# carry with int4 is the default every other run test covers: here it runs with eager updates.
@pytest.mark.parametrize(("policy", "codec"), [("carry+eager", "int4"), ("carry", "topk-d5-b4"),
                                               ("overwrite", "int4")])
def test_policy_keeps_token_fate_exact(policy: str, codec: str, tmp_path: Path) -> None:
    out = tmp_path / "run"
    eager = policy.endswith("+eager")
    policy = policy.removesuffix("+eager")
    proc = subprocess.run(
        [sys.executable, "-m", "ddiloco.cli", "run", "--config",
         str(ROOT / "configs" / "ci-tiny.yaml"), "--steps", "120", "--no-live", "--out",
         str(out), "--set", f"sync.adopt={policy}", "--set", f"sync.codec_up={codec}",
         "--set", f"sync.eager={'true' if eager else 'false'}",
         # eager: every round merged and adopted, so that every send after a fragment's
         # first merge has an estimate, whatever the machine's load
         *(("--set", "sync.blocking=true", "--set", "sync.min_quorum=2") if eager else ()),
         # overwrite also runs HeLoCo's correction and the schedule on the global clock
         *(("--set", "sync.correction=heloco", "--set", "train.lr_clock=global")
           if policy == "overwrite" else ())],
        capture_output=True, text=True, timeout=280, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    block = json.loads((out / "report.json").read_text())["diloco"]
    fate = block["token_fate"]
    assert fate["processed"] == 2 * 120 * 8 * 32  # learners x steps x batch x seq
    assert fate["balance"] == 0
    assert sum(fate["lost"].values()) == 0
    if policy == "carry":
        assert fate["discarded"]["overwritten"] == 0
        assert fate["merged"] >= 0.95 * fate["processed"]  # only a small drain remainder
    if codec == "int4":
        # trained from ln(256) = 5.55; a 5% top-k uplink needs many more rounds than this
        # short run makes (docs/QUALITY.md), so only the dense codec is held to a loss
        assert block["final_val_loss"] < 4.5
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    with EmbeddedRedis(out / "redis") as server:
        events = [e for _, e in RedisStore(connect(server.url), run_id).events()]
    leaves = [e for e in events if e["kind"] == "leave"]
    assert len(leaves) == 2
    corrected = {(e["shard"], e["fragment"]): e["corrected"] for e in events
                 if e["kind"] == "merge" and "corrected" in e}
    if policy == "overwrite":  # every fragment merged more than once: each counted tensors
        assert corrected and all(sum(c.values()) > 0 for c in corrected.values())
    else:
        assert corrected == {}
    for e in leaves:
        # An estimate needs one outer step of the fragment seen: every send but each
        # fragment's first (4) and the drain's has one.
        n = e["eager_estimates"]
        assert (e["deltas_sent"] - 8 <= n <= e["deltas_sent"]) if eager else (n == 0), (n, e)
