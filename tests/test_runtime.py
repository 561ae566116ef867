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


def _last_json_of_fresh_jax_process(code: str) -> object:
    """Run ``code`` in a fresh interpreter on the CPU platform, with none of this process's
    JAX_* settings; returns the JSON of its last output line."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("JAX_")}
    env["JAX_PLATFORMS"] = "cpu"
    proc = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_setup_jax_leaves_jax_unimported_and_jax_sees_the_cache(tmp_path) -> None:
    # A PyTorch learner never imports JAX: setup_jax must not either, and a JAX learner that
    # imports it afterwards must find the persistent cache configured.
    cache = tmp_path / "cache"
    before, cache_dir, min_s, min_bytes = _last_json_of_fresh_jax_process(
        "import json, sys; from pathlib import Path; "
        "from ddiloco.workers.run.runtime import setup_jax; "
        f"setup_jax(Path({str(cache)!r}), 1, None); "
        "before = 'jax' in sys.modules; import jax; c = jax.config; "
        "print(json.dumps([before, c.jax_compilation_cache_dir, "
        "c.jax_persistent_cache_min_compile_time_secs, "
        "c.jax_persistent_cache_min_entry_size_bytes]))"
    )
    assert before is False
    assert cache_dir == str(cache) and cache.is_dir()
    assert min_s == 0.0 and min_bytes == 0


def test_setup_jax_after_jax_is_imported_uses_its_config(tmp_path) -> None:
    cache = tmp_path / "cache2"
    assert _last_json_of_fresh_jax_process(
        "import json, jax; from pathlib import Path; "
        "from ddiloco.workers.run.runtime import setup_jax; "
        f"setup_jax(Path({str(cache)!r}), 1, None); "
        "print(json.dumps(jax.config.jax_compilation_cache_dir))"
    ) == str(cache)
