"""The chaos report (DESIGN §5): each mode's block (token fate, goodput, availability,
downtime, recoveries, the audit of every invariant) from the store and the event stream, the
accounting of a stored run (``ddiloco chaos report``), the simulator's prediction, the plot and
the printed summary. The pure rules are in :mod:`ddiloco.chaos.accounting` and
:mod:`ddiloco.chaos.recoveries`."""

from __future__ import annotations

import json
import statistics
from contextlib import ExitStack
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ddiloco.pipeline.errors import DDilocoError
from ddiloco.store.base import ParameterStore
from ddiloco.workers.run.config import EMBEDDED_S3, Config


@dataclass
class ModeRun:
    """What one mode's chaos run leaves for the accounting."""

    mode: str
    run_id: str
    t0: float
    t_end: float
    restarts: dict[str, int]


def effective_fates(records: list[dict[str, Any]], mode: str,
                    final_resume_step: int) -> list[dict[str, Any]]:
    """Fate records for :mod:`ddiloco.chaos.accounting`: per incarnation, the latest consistent
    snapshot among its heartbeat record and the send-time snapshots shards received.

    An incarnation that did not drain was killed. DP: a killed incarnation's committed work
    ends where the job resumed (the next incarnation's first step).
    """
    out = []
    for rec in records:
        cands: list[tuple[int, ...]] = []
        if "processed" in rec:
            cands.append((int(rec["processed"]), int(rec["sent"]),
                          int(rec["discarded"]["overwritten"]), int(rec["discarded"]["drain"])))
        cands += [tuple(int(x) for x in w) for w in rec.get("wire", [])]
        best = max(cands) if cands else (0, 0, 0, 0)
        out.append({
            "learner": rec["learner"], "incarnation": int(rec["incarnation"]),
            "ended": "drained" if rec.get("ended") == "drained" else "killed",
            "processed": best[0], "sent": best[1],
            "discarded": {"overwritten": best[2], "drain": best[3]},
            "start_step": int(rec.get("start_step", 0)), "step": int(rec.get("step", 0)),
            "committed_step": None, "step_time_mean_s": rec.get("step_time_mean_s"),
        })
    if mode == "dp":
        by_learner: dict[str, list[dict[str, Any]]] = {}
        for f in out:
            by_learner.setdefault(f["learner"], []).append(f)
        for incs in by_learner.values():
            incs.sort(key=lambda f: f["incarnation"])
            for i, f in enumerate(incs):
                if f["ended"] == "drained":
                    f["committed_step"] = f["step"]
                elif i + 1 < len(incs):
                    f["committed_step"] = max(f["start_step"], incs[i + 1]["start_step"])
                else:
                    f["committed_step"] = max(f["start_step"], final_resume_step)
    return out


def _manifest(store: ParameterStore) -> dict[str, Any]:
    """The run's manifest.

    Raises:
        DDilocoError: the run has no manifest in this store (not a run, or flushed).
    """
    manifest = store.get_manifest()
    if manifest is None:
        raise DDilocoError(f"run {store.run_id!r} has no manifest in the store")
    return manifest


def _fates_and_fate(store: ParameterStore, events: list[dict[str, Any]]) -> tuple[
        list[dict[str, Any]], Any]:
    """The learner incarnations' effective fate records and the run's token fate
    (:class:`ddiloco.chaos.accounting.TokenFate`), from the store and the run's ``events``."""
    from ddiloco.chaos import accounting as acc
    from ddiloco.workers.run.blobs import dp_step_of
    from ddiloco.workers.run.manifest import manifest_layout, tokens_per_batch

    manifest = _manifest(store)
    P = manifest_layout(manifest).n_fragments
    records = store.fate_records()
    heads = store.get_latest_many(list(range(P)))
    final_resume = min((dp_step_of(b.meta) if b is not None else -1) for b in heads) + 1
    fates = effective_fates(records, manifest["mode"], final_resume)
    if manifest["mode"] == "dp":
        return fates, acc.dp_token_fate(fates, tokens_per_batch(manifest), P)
    received = {(r["learner"], int(r["incarnation"])): int(r.get("received", 0))
                for r in records}
    return fates, acc.token_fate(fates, [e for e in events if e["kind"] == "merge"],
                                 [e for e in events if e["kind"] == "drop"], received, P)


def store_token_fate(store: ParameterStore) -> Any:
    """The token fate (:class:`ddiloco.chaos.accounting.TokenFate`) of a finished run in
    ``store``."""
    return _fates_and_fate(store, [e for _, e in store.events(kinds={"merge", "drop"})])[1]


def mode_block(store: ParameterStore, run: ModeRun, cfg: Config,
               ref_step_s: float | None = None) -> dict[str, Any]:
    """Goodput, token fate, downtime, recoveries and the audit of one mode's chaos run.

    Args:
        ref_step_s: the mode's fault-free step time (from a reference run); None: the median
            over this run's learner incarnations.
    """
    from ddiloco.chaos import accounting as acc
    from ddiloco.chaos import invariants as inv
    from ddiloco.chaos import recoveries as rec
    from ddiloco.workers.run.manifest import manifest_layout, tokens_per_batch

    manifest = _manifest(store)
    P = manifest_layout(manifest).n_fragments
    events = dedupe(sorted((e for _, e in store.events()), key=lambda e: e["t"]))
    merges = [e for e in events if e["kind"] == "merge"]
    # Versions only: a head whose blob is gone is the audit's finding, not a crash here.
    head_versions = store.heads(P)
    fates, fate = _fates_and_fate(store, events)
    # One learner step's tokens, from the run's task (accumulated micro-batches included).
    tokens_per_step = tokens_per_batch(manifest) * cfg.train.accumulate
    wall_s = run.t_end - run.t0
    step_means = [f["step_time_mean_s"] for f in fates if f["step_time_mean_s"]]
    own_step_s = statistics.median(step_means) if step_means else None
    step_source = "reference" if ref_step_s else ("own" if own_step_s else None)
    ref_step_s = ref_step_s or own_step_s
    # Goodput counts tokens merged during the scripted window: learner-time after t0.
    merged_window = _merged_in_window(run.mode, merges, fates, run, tokens_per_step, P)
    gp = (acc.goodput(merged_window, P, tokens_per_step, ref_step_s, cfg.run.learners, wall_s)
          if ref_step_s else None)
    window_merges = [m["t"] for m in merges if run.t0 <= m["t"] <= run.t_end]
    downtime, d_start, d_end = acc.global_downtime(window_merges, run.t0, run.t_end)
    recs = rec.recoveries(events)
    down = {e["id"]: e.get("duration_s") for e in events
            if e["kind"] == "fault" and e.get("phase") == "inject"}
    evals = [e for e in events if e["kind"] == "eval"]
    heads = {p: (h.version if h is not None else None) for p, h in enumerate(head_versions)}
    # Digests read during the run first (old versions leave the store), then what is left.
    stored: dict[tuple[int, int], str | None] = inv.adoption_digests(events, store)
    for e in events:
        if e["kind"] == "stored_digests":
            for p, v, d in e["pairs"]:
                if d is not None:
                    stored[(int(p), int(v))] = d
    checks = [inv.check_versions(events, heads), inv.check_exactly_once(
                  events, inv.stored_metas(store, heads, cfg.sync.history)),
              inv.check_token_fate(fate), inv.check_adoptions(events, stored),
              inv.check_final_store(store, P), inv.check_objects(store, P),
              inv.check_no_nan(events, store, P), inv.check_rebuilds(events)]
    audit = inv.audit(checks)
    versions: dict[str, list[list[float]]] = {}
    for m in merges:
        versions.setdefault(str(m["fragment"]), []).append(
            [round(m["t"] - run.t0, 3), m["version"]])
    faults = [{"at_s": round(e["t"] - run.t0, 3), "kind": e["fault"], "target": e["target"]}
              for e in events if e["kind"] == "fault" and e.get("phase") == "inject"]
    return {
        "mode": run.mode,
        "run_id": run.run_id,
        "learners": cfg.run.learners,
        "wall_s": round(wall_s, 2),
        "ref_step_s": ref_step_s,
        "step_time_source": step_source,
        "own_step_s": own_step_s,
        "tokens_per_step": tokens_per_step,
        "goodput": round(gp, 4) if gp is not None else None,
        "merged_tokens_in_window": merged_window / P,
        "tokens_per_s": round(merged_window / P / wall_s, 1) if wall_s > 0 else None,
        "token_fate": fate.to_json(),
        "global_downtime_s": round(downtime, 3),
        "downtime_interval_s": [round(d_start - run.t0, 3), round(d_end - run.t0, 3)],
        "recovery_s": rec.percentile_summary([r.recover_s for r in recs
                                              if r.recover_s is not None]),
        "rejoin_s": rec.rejoin_summary(recs, down),
        "availability": _availability(gp, fate),
        "detect_s": rec.percentile_summary([r.detect_s for r in recs
                                            if r.detect_s is not None]),
        "recoveries": [r.__dict__ for r in recs],
        "faults_injected": rec.fault_counts(events),
        "worker_restarts": run.restarts,
        # healthy learners whose heartbeat entry lapsed (DiLoCo mode): control-plane failures
        "looked_dead": [{"at_s": round(e["t"] - run.t0, 3), "learner": e["learner"]}
                        for e in events if e["kind"] == "looked_dead"],
        "final_val_loss": evals[-1]["loss"] if evals else None,
        "val_loss": [[round(e["t"] - run.t0, 3), e["loss"]] for e in evals],
        "merges_per_fragment": {str(k): v for k, v in rec.merges_per_fragment(merges).items()},
        "participation": rec.participation(merges),
        "timeline": _with_gang_failures(rec.timeline(events, run.t0), events, run),
        "faults": faults,
        "versions": versions,
        "invariants": audit,
    }


def _availability(goodput: float | None, fate: Any) -> float | None:
    """Goodput counting every token that was not lost to a fault (merged or discarded by the
    algorithm, e.g. overwritten): the share of learner-time the faults left usable. This is
    what :mod:`ddiloco.chaos.simulator` models; goodput also charges the algorithm's discards."""
    if goodput is None or fate.merged <= 0:
        return None
    return round(goodput * (fate.merged + sum(fate.discarded.values())) / fate.merged, 4)


def dedupe(events: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Drop repeated runner events (same ``uid``), keeping the first."""
    seen: set[str] = set()
    out = []
    for e in events:
        uid = e.get("uid")
        if uid is not None:
            if uid in seen:
                continue
            seen.add(uid)
        out.append(e)
    return out


def _with_gang_failures(tl: dict[str, list[Any]], events: list[dict[str, Any]],
                        run: ModeRun) -> dict[str, list[Any]]:
    """DP: a gang failure takes every worker down until the job restarts."""
    restarts = {e["id"]: e["t"] for e in events if e["kind"] == "gang_restart"}
    for e in events:
        if e["kind"] != "gang_failure":
            continue
        end = restarts.get(e["id"], run.t_end)
        for name in e["killed"]:
            lane = tl.setdefault(name, [])
            interval = (round(e["t"] - run.t0, 3), round(end - run.t0, 3), "down")
            if interval not in lane:
                lane.append(interval)
    return tl


def _merged_in_window(mode: str, merges: list[dict[str, Any]], fates: list[dict[str, Any]],
                      run: ModeRun, tokens_per_step: int, P: int) -> int:
    """Fragment-tokens that entered the model between the start and the end of the script."""
    if mode == "dp":
        # Committed DP steps: the final common checkpoint minus the step where the window
        # opened; a data-parallel step of M learners merges M batches into every fragment.
        first = [m for m in merges if m["t"] >= run.t0 and "dp_step" in m]
        last = [m for m in merges if m["t"] <= run.t_end and "dp_step" in m]
        if not last:
            return 0
        start = min((m["dp_step"] for m in first), default=0)
        by_frag: dict[int, int] = {}
        for m in last:
            by_frag[m["fragment"]] = max(by_frag.get(m["fragment"], -1), m["dp_step"])
        end = min(by_frag.values()) if len(by_frag) == P else max(by_frag.values())
        n_learners = len({f["learner"] for f in fates})
        return max(0, end - start) * tokens_per_step * P * n_learners
    total = 0
    for m in merges:
        if run.t0 <= m["t"] <= run.t_end:
            total += sum(int(c["tokens"]) for c in m.get("contributions", []))
    return total


def _stored_run(store: ParameterStore, mode: str) -> ModeRun:
    """The window of a stored chaos run, from its ``chaos_start``/``chaos_end`` events."""

    ev = {e["kind"]: e for _, e in store.events(kinds={"chaos_start", "chaos_end"})}
    if "chaos_start" not in ev or "chaos_end" not in ev:
        raise DDilocoError(f"run {store.run_id!r} has no complete chaos window in the store")
    restarts: dict[str, int] = {}
    for _, e in store.events(kinds={"worker_restart"}):
        restarts[e["worker"]] = restarts.get(e["worker"], 0) + 1
    return ModeRun(mode, store.run_id, float(ev["chaos_start"]["t"]),
                   float(ev["chaos_end"]["t"]), restarts)


def account_modes(report: dict[str, Any], client: Any, cfg: Config) -> None:
    """Fill the report's mode blocks from the store (fault-free references first: their step
    time is the goodput reference of the chaos runs)."""
    from ddiloco.chaos import accounting as acc
    from ddiloco.store.redis_store import RedisStore

    ref_step: dict[str, float | None] = {}
    for mode, info in report.get("fault_free", {}).items():
        mcfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"mode": mode})})
        store = RedisStore(client, info["run_id"])
        blk = mode_block(store, _stored_run(store, mode), mcfg)
        ref_step[mode] = blk["ref_step_s"]
        report["fault_free"][mode] = {"run_id": info["run_id"], **{k: blk[k] for k in (
            "final_val_loss", "goodput", "tokens_per_s", "wall_s", "ref_step_s",
            "invariants")}}
    for mode, info in list(report["modes"].items()):
        mcfg = cfg.model_copy(update={"run": cfg.run.model_copy(update={"mode": mode})})
        store = RedisStore(client, info["run_id"])
        extra = {k: info[k] for k in ("region_tx_bytes", "link_bytes") if k in info}
        report["modes"][mode] = {**mode_block(store, _stored_run(store, mode), mcfg,
                                              ref_step.get(mode)), **extra}
    # A mode that never reached a fault-free stretch borrows another mode's step time.
    report["modes"] = acc.complete_goodput(report["modes"])


def report_stored(out: Path) -> dict[str, Any]:
    """``ddiloco chaos report OUT``: recompute the accounting and the audit of a finished chaos
    run from its store (the embedded Redis in ``OUT/redis``, and with ``store.blobs =
    "embedded-s3"`` the object-store server again on ``OUT/s3``) and rewrite the report.

    Raises:
        DDilocoError: no ``OUT/chaos.json`` or no stored run.
        InvariantViolation: the audit failed (the report is written first).
    """
    from ddiloco.store.connect import connect
    from ddiloco.store.embedded import EmbeddedRedis

    path = out / "chaos.json"
    if not path.exists():
        raise DDilocoError(f"{path}: no chaos report there")
    report = json.loads(path.read_text())
    cfg = Config.model_validate(report["config"])
    with ExitStack() as stack:
        url = cfg.run.redis_url
        if not url:
            url = stack.enter_context(EmbeddedRedis(out / "redis", fsync="always")).url
        if cfg.store.blobs == EMBEDDED_S3:
            from ddiloco.store.embedded_s3 import embedded_s3_env

            stack.enter_context(embedded_s3_env(out / "s3"))
        account_modes(report, connect(url, attempts=1, timeout_s=5.0), cfg)
    return finish_report(report, cfg, out)


def finish_report(report: dict[str, Any], cfg: Config, out: Path) -> dict[str, Any]:
    from ddiloco.chaos.invariants import raise_if_failed
    from ddiloco.chaos.plot import plot_chaos

    report["ok"] = all(b["invariants"]["ok"] for b in report["modes"].values())
    report["simulator"] = predicted_goodput(report, cfg)
    (out / "chaos.json").write_text(json.dumps(report, indent=2, default=str))
    plot_chaos(report, out / "chaos.png")
    _summary(report)
    for b in report["modes"].values():
        raise_if_failed(b["invariants"])
    return report


def predicted_goodput(report: dict[str, Any], cfg: Config) -> dict[str, Any] | None:
    """The simulator's goodput for this run: its model fitted to the run's learner faults,
    detection, rejoin, restart and step times
    (:func:`ddiloco.chaos.calibration.calibrate_report`; the report carries the run's config).
    None when the report has no mode to predict."""
    from ddiloco.chaos.calibration import calibrate_report
    from ddiloco.pipeline.errors import ConfigError

    del cfg
    try:
        return calibrate_report(report).to_json()
    except ConfigError:
        return None


def _summary(report: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    t = Table(title=f"ddiloco chaos: {report['script']['name']} (seed {report['script']['seed']})")
    t.add_column("")
    modes = list(report["modes"])
    for m in modes:
        t.add_column(m)

    def row(label: str, fn: Any) -> None:
        t.add_row(label, *[str(fn(report["modes"][m])) for m in modes])

    row("goodput", lambda b: f"{b['goodput']:.1%}" if b["goodput"] is not None else "-")
    row("merged tokens/s", lambda b: f"{b['tokens_per_s']:,}")
    row("token fate (tokens)", lambda b: _fate_line(b["token_fate"]))
    row("global downtime s", lambda b: b["global_downtime_s"])
    row("recovery s p50/max", lambda b: f"{b['recovery_s']['p50']}/{b['recovery_s']['max']}")
    row("faults", lambda b: b["faults_injected"])
    row("final val loss", lambda b: b["final_val_loss"])
    row("invariants", lambda b: "pass" if b["invariants"]["ok"] else "FAIL")
    Console().print(t)
    if report.get("simulator"):
        Console().print(f"simulator: {report['simulator']['predicted']} "
                        f"measured: {report['simulator']['measured']}")


def _fate_line(f: dict[str, Any]) -> str:
    tok = f.get("tokens", f)
    return (f"processed {tok['processed']:,.0f} merged {tok['merged']:,.0f} "
            f"discarded {sum(tok['discarded'].values()):,.0f} "
            f"lost {sum(tok['lost'].values()):,.0f}")
