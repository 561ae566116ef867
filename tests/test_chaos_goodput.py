"""``ddiloco chaos run --baseline dp`` end to end through the CLI: both modes under the same
short kill storm (``chaos/scripts/ci-storm-short.yaml``), every invariant holds, and Decoupled
DiLoCo keeps more goodput than data-parallel (which restarts the whole job after each kill).

Marked ``serial``: goodput is judged, so the run does not share the cores with other tests
(``make test`` runs it in its second pass).
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tests._cluster import make_corpus
from tests.test_chaos_integration import ROOT, SMALL

pytestmark = [pytest.mark.integration, pytest.mark.serial, pytest.mark.timeout(600)]


def test_chaos_cli_both_modes_goodput(tmp_path: Path) -> None:
    corpus = make_corpus(tmp_path / "corpus")
    out = tmp_path / "out"
    args = [sys.executable, "-m", "ddiloco.cli", "chaos", "run",
            str(ROOT / "chaos" / "scripts" / "ci-storm-short.yaml"), "--baseline", "dp",
            "--out", str(out), "--no-live", "-M", "4", "-S", "2"]
    for o in [*SMALL, f"data.corpus={json.dumps([str(corpus)])}", "data.val_fraction=0.2"]:
        args += ["--set", o]
    res = subprocess.run(args, capture_output=True, text=True, cwd=ROOT, timeout=580)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((out / "chaos.json").read_text())
    d, b = report["modes"]["diloco"], report["modes"]["dp"]
    for blk in (d, b):
        assert blk["invariants"]["ok"], blk["invariants"]
        assert blk["token_fate"]["fragment_tokens"]["balance"] == 0
        assert blk["faults_injected"] == {"kill:learner": 3, "pause:learner": 1,
                                          "pause:redis": 1}
    # the script's failpoints fired in both modes' shard-0 (exactly once held regardless)
    for mode in ("diloco", "dp"):
        log = (out / mode / "logs" / "shard-0.log").read_text()
        assert "failpoint store.publish:after-effect fired" in log, mode
    # No elasticity: the DP job stood still while the killed learner was down.
    assert b["global_downtime_s"] >= 8.0 > d["global_downtime_s"]
    assert d["goodput"] > b["goodput"], (d["goodput"], b["goodput"])
    assert (out / "chaos.png").exists()
