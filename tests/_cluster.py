"""A small cluster of real worker processes for integration tests: a pseudo-English corpus,
a polling wait that shows the workers' logs when it times out, a cluster of the CI model
started on a real Redis, and the rejoin check shared by the built-in model and a user task."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ddiloco.store import EmbeddedRedis, RedisStore
from ddiloco.store.connect import connect
from ddiloco.workers.run.blobs import decode_blob, digest
from ddiloco.workers.run.config import load_config
from ddiloco.workers.run.launch import LocalCluster, fork_warm, with_run_keys
from ddiloco.workers.run.manifest import init_run, manifest_layout

ROOT = Path(__file__).resolve().parent.parent
WORDS = ("the king doth wake tonight and all the court is merry with wine and song "
         "but hark what light through yonder window breaks it is the east ").split()


def make_corpus(path: Path) -> Path:
    """Six small plays of pseudo-English (the real corpus is exercised by test_data)."""
    path.mkdir(parents=True, exist_ok=True)
    for i in range(6):
        words = [WORDS[(i * 7 + j * j + j // 3) % len(WORDS)] for j in range(6000)]
        lines = [" ".join(words[k:k + 10]) for k in range(0, len(words), 10)]
        (path / f"play_{i}.txt").write_text(f"ACT {i}.\n\n" + "\n".join(lines) + "\n")
    return path


def wait_for(pred: Callable[[], Any], timeout_s: float, what: str,
             cluster: LocalCluster | None = None) -> Any:
    """Poll ``pred`` every 0.25 s until it returns something true, and return that; after
    ``timeout_s`` seconds fail with ``what`` and the end of every worker's log."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.25)
    logs = ""
    if cluster is not None:
        logs = "\n".join(f"--- {n}\n{cluster.log_tail(n, 1500)}" for n in cluster.workers)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}\n{logs}")


def start_cluster(server: EmbeddedRedis, run_dir: Path, run_id: str,
                  overrides: dict[str, Any], standby: int = 0
                  ) -> tuple[LocalCluster, RedisStore]:
    """Run ``run_id`` of configs/ci-tiny.yaml with ``overrides`` on :func:`make_corpus`'s
    plays: its shards, the evaluator, its learners and ``standby`` standby learners,
    started."""
    corpus = make_corpus(run_dir / "corpus")
    cfg = load_config(ROOT / "configs" / "ci-tiny.yaml",
                      {**overrides, "data.corpus": [str(corpus)], "data.val_fraction": 0.2})
    cfg = with_run_keys(cfg, run_dir)
    store = RedisStore(connect(server.url), run_id)
    init_run(store, cfg, run_id)
    cluster = LocalCluster(server.url, run_id, run_dir, standby=standby,
                           torch_learners=cfg.run.torch_learners, fork_server=cfg.run.fork_server,
                           fork_warm=fork_warm(cfg))
    for s in range(cfg.run.shards):
        cluster.add_syncer(s)
    cluster.add_evaluator(cfg.run.eval_every_s)
    for m in range(cfg.run.learners):
        cluster.add_learner(m)
    cluster.start_all()
    return cluster, store


def versions(store: RedisStore, fragments: int = 4) -> list[int]:
    """Each fragment's head version (-1: none yet)."""
    return [h.version if h else -1 for h in store.heads(fragments)]


def check_rejoin(c: LocalCluster, store: RedisStore, name: str = "learner-1"
                 ) -> dict[str, Any]:
    """Kill learner ``name`` with SIGKILL once it trains, wait for its heartbeat to lapse,
    start it again, and check it adopted the store's versions bit for bit, trains on and has a delta
    merged. Returns its ``adopted`` event."""
    wait_for(lambda: name in store.live_learners()
             and store.live_learners()[name].get("step", 0) > 3, 120,
             f"{name} training", c)
    c.kill(name)
    assert not c.workers[name].alive
    wait_for(lambda: name not in store.live_learners(), 20, f"{name}'s TTL to expire", c)
    c.start(name)
    adopted: dict[str, Any] = wait_for(
        lambda: [e for _, e in store.events(kinds={"adopted"})
                 if e["learner"] == name and e["incarnation"] >= 2],
        120, f"{name} to rejoin", c)[-1]
    # every fragment it adopted is bit-identical to the store's version it names
    manifest = store.get_manifest()
    assert manifest is not None
    layout = manifest_layout(manifest)
    for p, v in enumerate(adopted["versions"]):
        blob = store.get_version(p, v)
        assert blob is not None, f"fragment {p} version {v} was garbage-collected too soon"
        assert digest(decode_blob(blob.value, layout.shapes(p))) == adopted["digests"][str(p)]
    # and it trains again, and its deltas are merged
    wait_for(lambda: store.live_learners().get(name, {}).get("step", 0)
             > adopted["step"] + 5, 90, f"{name} to train after rejoining", c)
    wait_for(lambda: any(x["learner"] == name and x["inc"] >= 2
                         for _, m in store.events(kinds={"merge"})
                         for x in m.get("contributions", [])),
             90, f"a merge of the rejoined {name}'s delta", c)
    return adopted
