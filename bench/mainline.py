"""The default run (``make run``: ``ddiloco run --baseline dp``) at another revision and at this
checkout, side by side on one machine in one invocation: final validation loss, wall time and
tokens/s of each mode, and their ratios.

The other revision is checked out with ``git worktree`` and installed, without its
dependencies, into a venv that borrows this venv's packages (a ``.pth`` line), so both run on the
same libraries. The runs alternate (reference, current, reference, ...) so a machine that slows
down during the bench slows both.

    python bench/mainline.py --ref origin/main [--repeat 1] [--set K=V ...] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent


def ref_venv(rev: str, work: Path) -> Path:
    """A venv whose ``ddiloco`` is revision ``rev``, on this venv's dependencies."""
    tree = work / "tree"
    subprocess.run(["git", "-C", str(ROOT), "worktree", "add", "--detach", str(tree), rev],
                   check=True, capture_output=True)
    venv = work / "venv"
    # no pip of its own: a venv's bundled setuptools would shadow this venv's newer one
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    site = next((venv / "lib").glob("python*/site-packages"))
    (site / "_deps.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    subprocess.run([sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"),
                    "install", "-q", "--no-deps", "--no-build-isolation", "-e", str(tree)],
                   check=True, capture_output=True)
    return venv


def one_run(exe: Path, cwd: Path, out: Path, overrides: list[str]) -> dict[str, Any]:
    cmd = [str(exe), "run", "--baseline", "dp", "--no-live", "--out", str(out)]
    for kv in overrides:
        cmd += ["--set", kv]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, cwd=cwd, capture_output=True, text=True)
    if proc.returncode != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stderr[-3000:]}")
    report = json.loads((out / "report.json").read_text())
    got: dict[str, Any] = {"total_s": round(time.monotonic() - t0, 1)}
    for mode in ("diloco", "dp"):
        r = report[mode]
        got[mode] = {"final_val_loss": r["final_val_loss"], "wall_s": r["wall_s"],
                     "tokens_per_s": r["tokens_per_s"], "tokens": r["tokens"]}
    return got


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref", default="origin/main", help="the revision to compare against")
    ap.add_argument("--repeat", type=int, default=1, help="runs of each revision")
    ap.add_argument("--set", dest="overrides", action="append", default=[],
                    help="configuration override for both, e.g. train.steps=120")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()

    work = Path(tempfile.mkdtemp(prefix="ddl-mainline-"))
    try:
        venv = ref_venv(args.ref, work)
        exes = {"ref": venv / "bin" / "ddiloco", "current": Path(sys.executable).parent / "ddiloco"}
        cwds = {"ref": work / "tree", "current": ROOT}
        runs: dict[str, list[dict[str, Any]]] = {"ref": [], "current": []}
        for i in range(args.repeat):
            for which in ("ref", "current"):
                print(f"[{which} {i + 1}/{args.repeat}] ddiloco run --baseline dp", flush=True)
                runs[which].append(one_run(exes[which], cwds[which], work / f"{which}-{i}",
                                           args.overrides))
    finally:
        subprocess.run(["git", "-C", str(ROOT), "worktree", "remove", "--force",
                        str(work / "tree")], capture_output=True)
        shutil.rmtree(work, ignore_errors=True)

    def mean(which: str, mode: str, key: str) -> float:
        xs = [r[mode][key] for r in runs[which]]
        return sum(xs) / len(xs)

    res: dict[str, Any] = {"bench": "mainline", "ref": args.ref, "repeat": args.repeat,
                           "overrides": args.overrides, "runs": runs}
    from rich.console import Console
    from rich.table import Table

    table = Table("mode", "metric", f"ref ({args.ref})", "current", "current / ref")
    for mode in ("diloco", "dp"):
        for key in ("final_val_loss", "wall_s", "tokens_per_s"):
            a, b = mean("ref", mode, key), mean("current", mode, key)
            res[f"{mode}_{key}_ratio"] = round(b / a, 4)
            table.add_row(mode, key, f"{a:.4f}", f"{b:.4f}", f"{b / a:.3f}")
    Console().print(table)
    line = json.dumps(res)
    print(line)
    if args.json:
        args.json.write_text(line + "\n")


if __name__ == "__main__":
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    main()
