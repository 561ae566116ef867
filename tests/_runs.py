"""A short ``ddiloco run`` of the CI model as a subprocess, for end-to-end tests that read its
report and its store afterwards."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def run_ci_tiny(out: Path, steps: int, sets: Sequence[str], timeout_s: float = 300.0
                ) -> tuple[dict[str, Any], str]:
    """``ddiloco run --config configs/ci-tiny.yaml --steps STEPS --no-live --out OUT`` with
    ``--set`` items, for at most ``timeout_s`` seconds; asserts it exits 0 (showing the end of
    its output if not). Returns the report's ``diloco`` block and the run id."""
    proc = subprocess.run(
        [sys.executable, "-m", "ddiloco.cli", "run", "--config",
         str(ROOT / "configs" / "ci-tiny.yaml"), "--steps", str(steps), "--no-live", "--out",
         str(out), *[a for s in sets for a in ("--set", s)]],
        capture_output=True, text=True, timeout=timeout_s, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    block = json.loads((out / "report.json").read_text())["diloco"]
    return block, json.loads((out / "run.json").read_text())["run_id"]
