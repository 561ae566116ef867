"""Tests of workers.runtime: a worker process's CPU set-up (XLA threads, affinity, malloc)."""

from __future__ import annotations

import json
import os
import platform
import subprocess
import sys

from ddiloco.workers.run import runtime as R


def test_configure_cpu_runtime_in_a_fresh_process() -> None:
    # In a subprocess: it changes process-wide state (XLA_FLAGS, affinity, malloc).
    code = (
        "import json, os; from ddiloco.workers.run.runtime import configure_cpu_runtime as c; "
        "r = c(cpu=sorted(os.sched_getaffinity(0))[0]); "
        "import jax.numpy as jnp; jnp.ones(3).sum().block_until_ready(); "
        "r['affinity'] = sorted(os.sched_getaffinity(0)); print(json.dumps(r))"
    )
    env = {**os.environ, "XLA_FLAGS": ""}
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    applied = json.loads(proc.stdout.strip().splitlines()[-1])
    assert applied["xla_flags"] == R.SINGLE_THREAD_XLA_FLAGS
    assert len(applied["affinity"]) == 1 and not applied["backend_already_started"]
    if platform.libc_ver()[0] == "glibc":
        assert applied["malloc_tuned"]
