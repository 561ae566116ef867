"""The user-model examples run as a user runs them: ``python examples/nnx_transformer.py`` (a Flax
NNX transformer defined in the file, trained through ``ddiloco.train``) on real processes.
The BPE example's run, with a learner killed and rejoining, is in tests/test_integration_runs.py."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

from tests._cluster import make_corpus

pytestmark = [pytest.mark.integration, pytest.mark.timeout(300)]

ROOT = Path(__file__).resolve().parent.parent


def run_example(script: str, tmp_path: Path) -> None:
    """``python examples/SCRIPT`` in ``tmp_path`` as a user runs it: 2 learners, 1 shard, 40
    steps of batch 8 on :func:`make_corpus`'s plays; asserts it exits 0."""
    corpus = make_corpus(tmp_path / "corpus")
    sets = {"run.learners": 2, "run.shards": 1, "train.steps": 40, "train.batch_size": 8,
            "train.warmup_steps": 5, "sync.H": 6, "sync.fragments": 4, "run.eval_every_s": 2,
            "data.corpus": json.dumps([str(corpus)]), "data.val_fraction": 0.2}
    args = [sys.executable, str(ROOT / "examples" / script)]
    for k, v in sets.items():
        args += ["--set", f"{k}={v}"]
    res = subprocess.run(args, cwd=tmp_path, capture_output=True, text=True, timeout=280)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def test_nnx_example_trains_through_the_public_api(tmp_path: Path) -> None:
    run_example("nnx_transformer.py", tmp_path)
    report = json.loads((tmp_path / "out" / "nnx" / "report.json").read_text())["diloco"]
    assert report["task"]["name"] == "nnx-bytes" and report["model"] is None
    assert report["tokens"] == 2 * 40 * 8 * 64
    assert report["merges"] > 0
    first, last = report["val_loss"][0][1], report["final_val_loss"]
    assert math.isfinite(last) and last < first - 0.5  # from about ln(256) = 5.5
    assert report["token_fate"]["balance"] == 0 and report["token_fate"]["processed"] > 0


def test_hf_gpt2_example_trains_with_pytorch_learners(tmp_path: Path) -> None:
    """``python examples/hf_gpt2.py``: a transformers GPT-2 built from a config, every learner
    a PyTorch one; its learners never import JAX for the model."""
    pytest.importorskip("transformers", reason="the example needs transformers")
    run_example("hf_gpt2.py", tmp_path)
    out = tmp_path / "out" / "hf-gpt2"
    report = json.loads((out / "report.json").read_text())["diloco"]
    assert report["task"]["name"] == "hf-gpt2-bytes" and report["model"] is None
    assert report["tokens"] == 2 * 40 * 8 * 64 and report["merges"] > 0
    # the evaluator may first look only after these few steps: judged against the initial
    # model's loss, about ln(256) = 5.55 nats/byte
    last = report["final_val_loss"]
    assert math.isfinite(last) and last < math.log(256) - 0.5
    assert report["token_fate"]["balance"] == 0
    for m in (0, 1):
        log = (out / "diloco" / "logs" / f"learner-{m}.log").read_text()
        assert "(TorchInner)" in log
        assert (out / "diloco" / "learners" / f"learner-{m}" / "ckpt").is_dir()
