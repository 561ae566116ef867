"""The goodput model (chaos/simulator.py): hand-computed traces and closed forms, agreement of
the two evaluations, the paper's Table 1, sensitivity, calibration on a chaos report, errors."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st
from rich.table import Table
from typer.testing import CliRunner

import ddiloco.chaos.simulator as sim
import ddiloco.chaos.simulator_table as sim_table
from ddiloco.chaos.calibration import calibrate, calibrate_report
from ddiloco.chaos.simulator import (
    MODES,
    Failure,
    SimParams,
    SimResult,
    expected,
    simulate,
    simulate_events,
)
from ddiloco.chaos.simulator_cli import (
    main,
    parse_params,
    render_calibration,
    render_sensitivity,
    render_table,
)
from ddiloco.chaos.simulator_table import (
    PUBLISHED_GOODPUT,
    SENSITIVITY_PARAMS,
    compare_published,
    sensitivity,
    table,
)
from ddiloco.pipeline.errors import ConfigError

PAPER_ROWS = (150_000, 1_200_000, 2_400_000)


def tiny(chips: int = 4, learners: int = 2, **kw: Any) -> SimParams:
    """One chip per slice and round times: every number below is checked by hand."""
    args: dict[str, Any] = {
        "chips": chips, "learners": learners, "chips_per_slice": 1, "slice_repair_s": 10.0,
        "detect_s": 1.0, "downscale_s": 1.0, "upscale_s": 3.0, "upscale_wait_s": 5.0,
        "restart_s": 4.0, "checkpoint_interval_s": 4.0, "checkpoint_cost_s": 0.0, "step_s": 1.0,
        "rejoin_s": 6.0, "sync_period_s": 8.0, "horizon_s": 100.0, **kw}
    return SimParams(**args)


# --------------------------------------------------------------------------------------------
# Event rules, by hand
# --------------------------------------------------------------------------------------------


def test_dp_one_failure_by_hand() -> None:
    # Runs [0, 21.5): 5 checkpoint intervals of 4 s kept (20 s). Back detect 1 + restart 4 later,
    # at 26.5; [26.5, 100) = 73.5 s holds 18 committed intervals (72 s). 92 / 100.
    assert simulate_events(tiny(), "dp", [(21.5, 0)]) == SimResult(4, "dp", 1, 0.92, 0.92, 1)
    # Each checkpoint blocks 1 s: periods of 5 s, 4 of them kept (16 s), then 14 (56 s).
    assert simulate_events(tiny(checkpoint_cost_s=1.0), "dp", [(21.5, 0)]).goodput == 0.72
    # Hot spares: a failure during the restart is handled by it.
    assert simulate_events(tiny(), "dp", [(21.5, 0), (24.0, 1)]).goodput == 0.92
    # A pause stops the clock for 3 s and loses nothing: 97 s of training, 24 intervals.
    assert simulate_events(tiny(), "dp", [Failure(21.5, 0, 3.0, restart=False)]).goodput == 0.96


def test_dp_without_spares_waits_for_the_slice() -> None:
    p = tiny(hot_spares=False)
    # The slice is back at 31.5, restart until 35.5: 20 + 64 kept.
    assert simulate_events(p, "dp", [(21.5, 0)]).goodput == pytest.approx(0.84)
    # A failure during that restart (back at 43): restart again until 47: 20 + 52.
    assert simulate_events(p, "dp", [(21.5, 0), (33.0, 1)]).goodput == pytest.approx(0.72)


def test_elastic_one_failure_by_hand() -> None:
    # 4 slices. Slice 0 fails at 21.5: the half step in flight on 4 slices (2) is lost, stall
    # [21.5, 23.5) (detect 1 + downscale 1), then 3 slices. It is back at 31.5; no stall takes it
    # within 5 s, so an upscale stall [36.5, 39.5), then 4 slices again.
    # 4 * 21.5 - 2 + 3 * 13 + 4 * 60.5 = 365 of 400 slice-seconds; trains 95 s of 100.
    res = simulate_events(tiny(), "elastic_dp", [(21.5, 0)])
    assert (res.goodput, res.uptime) == (pytest.approx(365 / 400), pytest.approx(0.95))


def test_returned_slice_rides_the_next_stall() -> None:
    # As above, but slice 1 fails at 33.25, before the upscale is due: 0.75 of a step on 3
    # slices lost, stall [33.25, 35.25) takes slice 0 back; slice 1 is back at 43.25 and gets
    # its own upscale [48.25, 51.25). 84 + (29.25 - 2.25) + 3 * 13 + 4 * 48.75 = 345.
    res = simulate_events(tiny(), "elastic_dp", [(21.5, 0), (33.25, 1)])
    assert (res.goodput, res.uptime) == (pytest.approx(345 / 400), pytest.approx(0.93))


def test_failure_during_a_stall_is_left_out_by_it() -> None:
    # Slice 1 fails at 22.0, inside [21.5, 23.5): no new stall, no step lost; 2 slices train
    # [23.5, 36.5), one upscale takes both back. 84 + 26 + 242 = 352.
    res = simulate_events(tiny(), "elastic_dp", [(21.5, 0), (22.0, 1)])
    assert (res.goodput, res.uptime, res.failures) == (pytest.approx(0.88), 0.95, 2)


def test_diloco_learner_crash_loses_its_unsent_work() -> None:
    p = tiny(chips=2)  # two learners of one slice; sync period 8 s
    # Learner 0 crashes at 16 after 16 s of training: unsent share 8 / (2 * 16), 4 s lost.
    # Back at 26, rejoined at 32; [32, 100) less the 4 s unsent at the end: 12 + 64 = 76.
    # Learner 1 trains throughout, 4 s unsent at the end: 96. (76 + 96) / 200.
    res = simulate_events(p, "diloco", [Failure(16.0, 0, 10.0)])
    assert (res.goodput, res.uptime) == (pytest.approx(0.86), 1.0)
    # Paused instead: no rejoin, nothing lost but the 10 s and the end's 4 s: 86 + 96.
    assert simulate_events(p, "diloco", [Failure(16.0, 0, 10.0, restart=False)]).goodput == (
        pytest.approx(0.91))
    assert simulate_events(p, "diloco", []).goodput == pytest.approx(0.96)
    # Syncer available 90 % of the time: outer gradients sent meanwhile are lost.
    assert simulate_events(tiny(chips=2, syncer_availability=0.9), "diloco", []).goodput == (
        pytest.approx(0.864))


def test_unsent_share() -> None:
    # 4 s of training, period 8 s: 4 - 16 / 16 = 3 s unsent, a share of 0.75; past the period,
    # half a period.
    assert sim._unsent_share(4.0, 8.0) == 0.75
    assert sim._unsent_share(8.0, 8.0) == 0.5
    assert sim._unsent_share(40.0, 8.0) == 0.1
    assert sim._unsent_share(0.0, 8.0) == 0.0


def test_diloco_uptime_needs_every_learner_down() -> None:
    p = tiny(chips=2, rejoin_s=0.0)
    # Learner 0 down [50, 60), learner 1 down [55, 65): the global model stops in [55, 60).
    assert simulate_events(p, "diloco", [(50.0, 0), (55.0, 1)]).uptime == pytest.approx(0.95)


def test_no_failures() -> None:
    for mode in ("dp", "elastic_dp"):
        assert simulate_events(tiny(), mode, []).goodput == 1.0
        assert expected(SimParams(chips=1_200_000, chip_mtbi_s=1e30), mode).goodput == (
            pytest.approx(1.0 if mode == "elastic_dp" else 1 / 1.1))


# --------------------------------------------------------------------------------------------
# Closed form, by hand, and against the event rules
# --------------------------------------------------------------------------------------------


def test_closed_form_by_hand() -> None:
    # DP, one chip failing every 100 s on average: a 1 s interval keeps 1 / (e^0.01 - 1) =
    # 99.5008 s per up stretch, and each costs 100 + 10 s: 0.904553.
    dp = SimParams(chips=1, chips_per_slice=1, chip_mtbi_s=100.0, detect_s=0.0,
                   restart_s=10.0, checkpoint_cost_s=0.0)
    assert expected(dp, "dp").goodput == pytest.approx(0.904553, abs=1e-6)
    # A job of one slice: trains e^-0.05 / 1.1 of the time, less half a step per failure.
    one = SimParams(chips=1, chips_per_slice=1, chip_mtbi_s=100.0, slice_repair_s=10.0,
                    rejoin_s=5.0)
    assert expected(one, "elastic_dp").uptime == pytest.approx(math.exp(-0.05) / 1.1)
    assert expected(one, "elastic_dp").goodput == pytest.approx(math.exp(-0.05) / 1.1 * 0.995)
    # 10 slices of 10 chips, failures every 10 s, no wait for returns: stalls 2 + 3 s per
    # failure, trains 1 / 1.5; loses 1 % to repair (10 chips x 10 s / 1000 s) and 5 % to steps.
    el = SimParams(chips=100, chips_per_slice=10, chip_mtbi_s=1000.0, slice_repair_s=10.0,
                   detect_s=1.0, downscale_s=1.0, upscale_s=3.0, upscale_wait_s=0.0)
    assert expected(el, "elastic_dp").goodput == pytest.approx(0.85 / 1.5)
    # Waiting forever: returns ride the failures' stalls, and wait one failure (S / n = 10 %).
    el_wait = SimParams(chips=100, chips_per_slice=10, chip_mtbi_s=1000.0,
                        slice_repair_s=10.0, detect_s=1.0, downscale_s=1.0, upscale_s=3.0,
                        upscale_wait_s=1e9)
    assert expected(el_wait, "elastic_dp").goodput == pytest.approx(0.75 / 1.2)


@pytest.mark.parametrize(("chips", "mode", "learners"), [
    (1_200_000, "dp", 1), (300_000, "elastic_dp", 1), (2_400_000, "diloco", 16)])
def test_event_rules_agree_with_the_closed_form(chips: int, mode: str, learners: int) -> None:
    p = SimParams(chips=chips, learners=learners)  # one week
    got = simulate(p, mode, seed=1)  # type: ignore[arg-type]
    want = expected(p, mode)  # type: ignore[arg-type]
    assert got.goodput == pytest.approx(want.goodput, abs=0.006)
    assert got.uptime == pytest.approx(want.uptime, abs=0.006)
    assert got.failures == pytest.approx(want.failures, rel=0.05)


@settings(max_examples=30, deadline=None)
@given(chips=st.sampled_from([10_000, 150_000, 1_200_000, 2_400_000]),
       learners=st.sampled_from([1, 2, 8, 16]),
       detect=st.floats(0.0, 60.0), down=st.floats(0.0, 60.0), up=st.floats(0.0, 60.0),
       wait=st.floats(0.0, 600.0), repair=st.floats(0.0, 3_600.0),
       mtbi=st.floats(1e6, 1e9))
def test_closed_form_properties(chips: int, learners: int, detect: float, down: float,
                                up: float, wait: float, repair: float, mtbi: float) -> None:
    # A failure's stall at least as long as an upscale: else more failures can mean fewer
    # upscale stalls (returns ride them), and goodput need not fall with the failure rate.
    assume(up <= detect + down)
    kw: dict[str, Any] = {"chips": chips, "learners": learners, "detect_s": detect,
                          "downscale_s": down, "upscale_s": up, "upscale_wait_s": wait,
                          "slice_repair_s": repair, "chip_mtbi_s": mtbi}
    p, sturdier = SimParams(**kw), SimParams(**{**kw, "chip_mtbi_s": 2 * mtbi})
    for mode in MODES:
        r = expected(p, mode)
        assert 0.0 <= r.goodput <= r.uptime + 1e-12 <= 1.0 + 1e-12
        assert expected(sturdier, mode).goodput >= r.goodput - 1e-12


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.floats(0.0, 99.0), st.integers(0, 3), st.floats(0.0, 30.0),
                          st.booleans()), max_size=8))
def test_event_rules_properties(events: list[tuple[float, int, float, bool]]) -> None:
    failures = [Failure(t, s, d, r) for t, s, d, r in events]
    for mode in MODES:
        r = simulate_events(tiny(), mode, failures)
        assert 0.0 <= r.goodput <= r.uptime + 1e-12 <= 1.0 + 1e-12
    # Failures only cost: never above the failure-free run.
    for mode in ("dp", "elastic_dp"):
        assert (simulate_events(tiny(), mode, failures).goodput
                <= simulate_events(tiny(), mode, []).goodput)


# --------------------------------------------------------------------------------------------
# The paper's Table 1
# --------------------------------------------------------------------------------------------


def test_every_published_cell_within_3_points() -> None:
    cells = compare_published(table(chips=PAPER_ROWS))
    assert len(cells) == sum(len(row) for row in PUBLISHED_GOODPUT.values()) == 18
    worst = max(cells, key=lambda c: abs(c.error))
    assert abs(worst.error) <= 3.0, worst


def test_published_table_never_feeds_a_prediction(monkeypatch: pytest.MonkeyPatch) -> None:
    before = table()
    monkeypatch.setattr(sim_table, "PUBLISHED_GOODPUT", {n: {} for n in PUBLISHED_GOODPUT})
    assert table() == before
    assert compare_published(before) == []


def test_table_shape() -> None:
    results = table()
    assert len(results) == 5 * 6
    by = {(r.chips, r.mode, r.learners): r for r in results}
    for n in (150_000, 300_000, 600_000, 1_200_000, 2_400_000):
        g = [by[(n, "dp", 1)].goodput, by[(n, "elastic_dp", 1)].goodput,
             *(by[(n, "diloco", m)].goodput for m in (2, 4, 8, 16))]
        assert g == sorted(g)  # more learners, more goodput; DP last
    # A learner is an elastic job on N / M chips: M = 8 at 1.2M is elastic DP at 150K.
    assert by[(1_200_000, "diloco", 8)].goodput == pytest.approx(
        by[(150_000, "elastic_dp", 1)].goodput)
    # DP falls like 1 / (1 + c N): doubling N nearly doubles 1 / goodput - 1.
    lost = [1 / by[(n, "dp", 1)].goodput - 1 for n in (1_200_000, 2_400_000)]
    assert 1.8 < lost[1] / lost[0] < 2.2


def test_monte_carlo_table_is_seeded() -> None:
    kw: dict[str, Any] = {"chips": (150_000,), "learners": (8,), "monte_carlo": True,
                          "horizon_s": 86_400.0}
    a, b = table(seed=3, **kw), table(seed=3, **kw)
    assert a == b
    assert len({r.failures for r in a}) == 1  # every mode sees the same trace


# --------------------------------------------------------------------------------------------
# Sensitivity
# --------------------------------------------------------------------------------------------


def test_sensitivity_of_m8_at_1_2m() -> None:
    rows = {r.name: r for r in sensitivity(SimParams(chips=1_200_000, learners=8), "diloco")}
    assert set(rows) == set(SENSITIVITY_PARAMS)
    base = rows["detect_s"].base
    assert base == pytest.approx(100 * expected(SimParams(chips=1_200_000, learners=8),
                                                "diloco").goodput)
    for name in ("detect_s", "downscale_s", "upscale_s", "slice_repair_s", "step_s"):
        r = rows[name]
        assert r.half is not None and r.double is not None
        assert r.half >= base >= r.double, r
    m = rows["chip_mtbi_s"]
    assert m.half is not None and m.double is not None and m.half < base < m.double
    for name in ("restart_s", "checkpoint_interval_s", "checkpoint_cost_s", "rejoin_s",
                 "syncer_availability"):  # DP's, never reached, and the paper's 1
        assert rows[name].half == rows[name].double == base
    assert isinstance(render_sensitivity(list(rows.values()), "t"), Table)


def test_sensitivity_invalid_value_and_unknown_name() -> None:
    p = SimParams(chips=1_000, chips_per_slice=1_000)
    rows = sensitivity(p, "elastic_dp", ["chips_per_slice"])
    assert rows[0].double is None  # 2000 chips per slice do not divide 1000 chips
    with pytest.raises(ConfigError, match="unknown"):
        sensitivity(p, "dp", ["nope"])


# --------------------------------------------------------------------------------------------
# Calibration on a chaos report
# --------------------------------------------------------------------------------------------


def chaos_report(**over: Any) -> dict[str, Any]:
    """Two learners, 100 s, learner-1 killed at 20 s for 10 s; DP back 18 s after the kill."""
    kill = {"at_s": 20.0, "kind": "kill", "target": "learner-1"}
    report: dict[str, Any] = {
        "script": {"name": "hand", "duration_s": 100.0},
        "config": {"run": {"learners": 2, "shards": 2, "dp_publish_every": 2},
                   "sync": {"H": 4}},
        "actions": [{**kill, "duration_s": 10.0},
                    {"at_s": 50.0, "kind": "slow", "target": "learner-0", "duration_s": 5.0}],
        "modes": {
            "diloco": {"learners": 2, "wall_s": 100.0, "ref_step_s": 1.0, "goodput": 0.9,
                       "availability": 0.91, "rejoin_s": {"p50": 5.0},
                       "detect_s": {"p50": 1.0}},
            "dp": {"learners": 2, "wall_s": 100.0, "ref_step_s": 1.0, "goodput": 0.8,
                   "availability": 0.8, "detect_s": {"p50": 1.0}, "faults": [kill],
                   "recoveries": [{"kind": "kill", "target": "learner-1", "recover_s": 18.0}]},
        },
    }
    report.update(over)
    return report


def test_calibrate_report_by_hand() -> None:
    cal = calibrate_report(chaos_report(), runs=20)
    # DiLoCo (sync period 4 steps of 1 s): learner 1 keeps 20 - 2 unsent, is back at 30,
    # rejoined at 35, keeps 65 - 2; learner 0 keeps 100 - 2. 179 / 200.
    assert cal.predicted["diloco"] == pytest.approx(0.895)
    # DP: restart = ran again at 38 - back at 30 = 8 s. Keeps [0, 20) and [38, 100): 82 / 100.
    assert cal.inputs["dp_restart_s"] == 8.0
    assert cal.predicted["dp"] == pytest.approx(0.82)
    assert cal.errors() == {"diloco": pytest.approx(-0.5), "dp": pytest.approx(2.0)}
    assert cal.inputs["mtbf_s"] == 200.0
    assert cal.unmodelled == ["slow:learner-0@50s"]
    assert all(0.0 <= v <= 1.0 for v in cal.poisson.values())
    out = cal.to_json()
    assert out["measured"] == {"diloco": 0.9, "dp": 0.8}
    assert out["predicted"] == {"diloco": 0.895, "dp": 0.82}
    json.dumps(out)
    assert isinstance(render_calibration(cal), Table)


def test_calibrate_report_speed_efficiency_and_syncer() -> None:
    report = chaos_report(fault_free={"diloco": {"goodput": 0.8, "wall_s": 100.0}})
    report["actions"].append({"at_s": 60.0, "kind": "kill", "target": "shard-0",
                              "duration_s": 10.0})
    report["modes"]["diloco"]["own_step_s"] = 2.0
    cal = calibrate_report(report, runs=5)
    # Steps took 2 s (speed 0.5), so the sync period is 8 s: learner 1 keeps 16 + 61, learner
    # 0 keeps 96; 173 / 200. The reference run got 0.8 where the model gives 0.98: x 0.8163.
    # One of two shards down 10 s of 100: syncer available 95 %.
    assert cal.inputs["speed"]["diloco"] == 0.5
    assert cal.inputs["efficiency"]["diloco"] == pytest.approx(0.8 / 0.98, abs=1e-4)
    assert cal.inputs["syncer_availability"] == 0.95
    assert cal.predicted["diloco"] == pytest.approx(0.95 * 0.865 * 0.5 * 0.8 / 0.98)


def test_calibrate_poisson_and_errors() -> None:
    p = tiny(chips=4, learners=4, chip_mtbi_s=60.0, rejoin_s=5.0, hot_spares=False,
             horizon_s=6_000.0)
    out = calibrate(p, runs=20)
    assert set(out) == {"diloco", "dp"} and out["diloco"] > out["dp"]
    assert calibrate(p, runs=20) == out
    # A learner trains e^(-5/60) / (1 + 10/60) = 0.79 of the time, less half a step and its
    # unsent work (1 - (1 - e^(-8/60)) / (8/60) = 6.4 %) per crash.
    assert out["diloco"] == pytest.approx(expected(p, "diloco").goodput, abs=0.01)
    assert expected(p, "diloco").goodput == pytest.approx(
        math.exp(-5 / 60) / (1 + 10 / 60) * (1 - 1 / 120 - 1 + (1 - math.exp(-8 / 60)) * 7.5))
    with pytest.raises(ConfigError, match="runs"):
        calibrate(p, runs=0)
    with pytest.raises(ConfigError, match="no diloco or dp"):
        calibrate_report({"modes": {}})


# --------------------------------------------------------------------------------------------
# Errors and output
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    {"chips": 0},
    {"chips": 150},
    {"chips": 1_000, "learners": 11},
    {"chips": 1_000, "learners": 0},
    {"chips": 1_000, "chips_per_slice": -1},
    {"chips": 1_000, "chip_mtbi_s": 0.0},
    {"chips": 1_000, "slice_repair_s": math.nan},
    {"chips": 1_000, "downscale_s": -1.0},
    {"chips": 1_000, "sync_period_s": 0.0},
    {"chips": 1_000, "syncer_availability": 0.0},
    {"chips": 1_000, "hot_spares": 1},
    {"chips": 1_000, "horizon_s": math.inf},
    {"chips": True},
    {"chips": 2_400_000, "horizon_s": 1e10},
])
def test_bad_params(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        SimParams(**kwargs)  # type: ignore[arg-type]


def test_bad_calls() -> None:
    with pytest.raises(ConfigError, match="mode"):
        simulate(SimParams(chips=1_000), "zero", seed=0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="mode"):
        expected(SimParams(chips=1_000), "zero")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="closed form"):
        expected(SimParams(chips=1_000, hot_spares=False), "dp")
    with pytest.raises(ConfigError, match="slice"):
        simulate_events(tiny(), "dp", [(1.0, 4)])
    with pytest.raises(ConfigError, match="horizon"):
        simulate_events(tiny(), "dp", [(100.0, 0)])
    with pytest.raises(ConfigError, match="unknown"):
        table(chips=(10_000,), learners=(2,), repair_s=3.0)
    assert parse_params(["detect_s=10", "hot-spares=false", "chips_per_slice=50"]) == {
        "detect_s": 10.0, "hot_spares": False, "chips_per_slice": 50}
    for bad in (["detect_s"], ["chips=5"], ["nope=1"], ["detect_s=x"], ["hot_spares=2"]):
        with pytest.raises(ConfigError, match="--param"):
            parse_params(bad)


def test_render_table() -> None:
    results = table(chips=(150_000, 300_000), learners=(16, 2))
    rendered = render_table(results)
    assert [str(c.header) for c in rendered.columns] == [
        "chips", "DP", "elastic DP", "M=2", "M=16"]
    assert rendered.row_count == 2
    assert "largest gap" in str(rendered.caption)
    assert render_table(results, "uptime").row_count == 2


def test_main_json(capsys: pytest.CaptureFixture[str]) -> None:
    main(json_out=True, seed=0, chips=[150_000, 300_000], learners=[2, 8], upscale_s=None)
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 2 * 4
    for row in rows:
        assert set(row) == {"chips", "mode", "learners", "goodput", "uptime", "published"}
        assert 0.0 <= row["goodput"] <= 1.0
    assert {(r["chips"], r["mode"], r["learners"]): r["published"] for r in rows}[
        (150_000, "diloco", 2)] == 0.94
    main(json_out=True, seed=0, chips=None, learners=None, show_sensitivity=True)
    doc = json.loads(capsys.readouterr().out)
    assert doc["max_abs_error_points"] <= 3.0
    assert len(doc["sensitivity"]) == len(SENSITIVITY_PARAMS)


def test_cli(tmp_path: Path) -> None:
    from ddiloco.cli import app

    runner = CliRunner()
    res = runner.invoke(app, ["simulate", "--chips", "150000", "-M", "4", "--sensitivity",
                              "--param", "detect_s=4"])
    assert res.exit_code == 0, res.output
    assert "150,000" in res.output and "largest" in res.output and "upscale_wait_s" in res.output
    path = tmp_path / "chaos.json"
    path.write_text(json.dumps(chaos_report()))
    res = runner.invoke(app, ["simulate", "--calibrate", str(path), "--json"])
    assert res.exit_code == 0, res.output
    assert json.loads(res.output)["predicted"]["dp"] == 0.82
    res = runner.invoke(app, ["simulate", "--calibrate", str(path)])
    assert res.exit_code == 0 and "measured" in res.output, res.output
    assert runner.invoke(app, ["simulate", "--param", "nope=1"]).exit_code == 2
    assert runner.invoke(app, ["simulate", "--calibrate", str(tmp_path / "no.json")]
                         ).exit_code == 2
