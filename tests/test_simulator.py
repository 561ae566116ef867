"""The goodput simulator: hand-computed traces, limits, ordering of the modes, seeding, errors."""

from __future__ import annotations

import itertools
import json
import math

import pytest
from rich.table import Table

from chaos.simulator import (
    MODES,
    SimParams,
    SimResult,
    calibrate,
    main,
    render_table,
    simulate,
    simulate_events,
    table,
)
from pipeline.errors import ConfigError

PAPER_CHIPS = (150_000, 300_000, 600_000, 1_200_000, 2_400_000)


def tiny(chips: int = 4, learners: int = 2) -> SimParams:
    """One chip per slice, round times: every number below is checked by hand."""
    return SimParams(chips=chips, learners=learners, chips_per_slice=1, slice_repair_s=10.0,
                     downscale_s=2.0, upscale_s=3.0, restart_s=5.0, checkpoint_interval_s=4.0,
                     step_s=1.0, horizon_s=100.0)


def by_mode(results: list[SimResult], chips: int) -> dict[tuple[str, int], SimResult]:
    return {(r.mode, r.learners): r for r in results if r.chips == chips}


# --------------------------------------------------------------------------------------------
# Hand-computed traces
# --------------------------------------------------------------------------------------------


def test_one_failure_by_hand() -> None:
    # Slice 0 of 4 fails at 21.5 and is back at 31.5.
    p = tiny()
    # DP: runs [0, 21.5) and keeps 5 checkpoints (20 s); all up at 31.5, restarted at 36.5,
    # then runs to the horizon (63.5 s kept). 83.5 / 100.
    dp = simulate_events(p, "dp", [(21.5, 0)])
    assert dp == SimResult(chips=4, mode="dp", learners=1, goodput=0.835, uptime=0.835,
                           failures=1)
    # Elastic: live slice-seconds 4*100 - 10 = 390; paused [21.5, 23.5] on 3 slices (6) and
    # [31.5, 34.5] on 4 (12); the half step in flight at 21.5 on 4 slices (2). 370 / 400.
    el = simulate_events(p, "elastic_dp", [(21.5, 0)])
    assert el.goodput == pytest.approx(370 / 400)
    assert el.uptime == pytest.approx(1 - 5 / 100)
    # DiLoCo M=2: learner 0 (slices 0, 1) loses 10 + 2 + 6 + 1 = 19 of its 200; learner 1
    # trains throughout, so the global model never stops.
    dl = simulate_events(p, "diloco", [(21.5, 0)])
    assert dl.goodput == pytest.approx(381 / 400)
    assert dl.uptime == 1.0
    assert dl.learners == 2


def test_overlapping_pauses_merge() -> None:
    # Slices 0 and 1 fail at 10.25 and 11.25 (back at 20.25 and 21.25): the downscale pauses
    # merge into [10.25, 13.25], the upscale pauses into [20.25, 24.25].
    p = tiny()
    failures = [(10.25, 0), (11.25, 1)]
    # Live slice-seconds 380; paused 1*3 + 2*2 + 1*3 + 3*4 = 22; step in flight 4 * 0.25 = 1.
    el = simulate_events(p, "elastic_dp", failures)
    assert el.goodput == pytest.approx(357 / 400)
    assert el.uptime == pytest.approx(1 - 7 / 100)
    # DP: keeps 8 of [0, 10.25); all up at 21.25, restarted at 26.25, keeps 73.75.
    assert simulate_events(p, "dp", failures).goodput == pytest.approx(81.75 / 100)
    # Both failures hit learner 0: 180 live - 8 paused - 0.5 in flight, plus learner 1's 200.
    assert simulate_events(p, "diloco", failures).goodput == pytest.approx(371.5 / 400)


def test_dp_failure_during_restart_aborts_it() -> None:
    p = tiny(chips=2)
    # All up in [0, 10), [20, 22), [32, 100): the restart at 20 never completes.
    res = simulate_events(p, "dp", [(10.0, 0), (22.0, 1)])
    assert res.goodput == pytest.approx((8 + 63) / 100)


def test_every_slice_down_and_absorbed_failure() -> None:
    p = tiny(chips=1, learners=1)
    # Down [50, 60), downscale [50, 52], upscale [60, 63]: idle 13 s; the failure at 55 hits a
    # slice already down and is absorbed.
    for failures in ([(50.0, 0)], [(50.0, 0), (55.0, 0)]):
        res = simulate_events(p, "elastic_dp", failures)
        assert res.goodput == pytest.approx(0.87)
        assert res.uptime == pytest.approx(0.87)
        assert res.failures == 1


def test_diloco_uptime_needs_every_learner_down() -> None:
    p = tiny(chips=2)
    # Learner 0 idle [50, 63], learner 1 idle [55, 68]: the model stops in [55, 63] only.
    res = simulate_events(p, "diloco", [(50.0, 0), (55.0, 1)])
    assert res.uptime == pytest.approx(0.92)
    assert res.goodput == pytest.approx(174 / 200)


def test_no_failures_is_full_goodput() -> None:
    p = SimParams(chips=1_200_000, learners=8, chip_mtbi_s=1e30)
    for mode in MODES:
        res = simulate(p, mode, seed=3)
        assert (res.goodput, res.uptime, res.failures) == (1.0, 1.0, 0)
        assert simulate_events(tiny(), mode, []).goodput == 1.0


def test_renewal_matches_its_mean_down_fraction() -> None:
    # One slice, up ~ Exp(100 s), down 50 s: down a third of the time; instant reconfiguration.
    p = SimParams(chips=1, chips_per_slice=1, chip_mtbi_s=100.0, slice_repair_s=50.0,
                  downscale_s=0.0, upscale_s=0.0, step_s=1e-6, horizon_s=2e6)
    res = simulate(p, "elastic_dp", seed=1)
    assert res.goodput == pytest.approx(2 / 3, abs=0.01)
    assert res.failures == pytest.approx(2e6 / 150, rel=0.03)


# --------------------------------------------------------------------------------------------
# Paper scale
# --------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def paper_table() -> list[SimResult]:
    return table(chips=PAPER_CHIPS, learners=(2, 8), seed=0)


def test_more_chips_lower_goodput(paper_table: list[SimResult]) -> None:
    for mode in ("dp", "elastic_dp"):
        goodputs = [r.goodput for r in paper_table if r.mode == mode]
        assert len(goodputs) == len(PAPER_CHIPS)
        assert all(a > b for a, b in itertools.pairwise(goodputs))
    failures = [r.failures for r in paper_table if r.mode == "dp"]
    assert failures == sorted(failures)


def test_mode_order_at_1_2m_chips(paper_table: list[SimResult]) -> None:
    res = by_mode(paper_table, 1_200_000)
    dp, el, d8 = res[("dp", 1)], res[("elastic_dp", 1)], res[("diloco", 8)]
    assert d8.goodput >= el.goodput >= dp.goodput
    assert d8.uptime >= res[("diloco", 2)].uptime >= el.uptime
    # Neighbourhood of the paper (27%, 58%, 88%; DESIGN §5) under the default assumptions.
    assert 0.2 < dp.goodput < 0.35
    assert 0.5 < el.goodput < 0.65
    assert d8.goodput > 0.85
    assert d8.uptime > 0.999


def test_all_modes_share_the_trace(paper_table: list[SimResult]) -> None:
    res = by_mode(paper_table, 600_000)
    assert len({r.failures for r in res.values()}) == 1
    p = SimParams(chips=600_000, learners=8)
    assert simulate(p, "diloco", seed=0) == res[("diloco", 8)]


def test_seed_determinism() -> None:
    p = SimParams(chips=300_000, learners=4, horizon_s=86_400.0)
    for mode in MODES:
        assert simulate(p, mode, seed=7) == simulate(p, mode, seed=7)
    assert simulate(p, "dp", seed=7) != simulate(p, "dp", seed=8)


# --------------------------------------------------------------------------------------------
# Calibration mode
# --------------------------------------------------------------------------------------------


def test_calibrate_frequent_failures() -> None:
    def run() -> dict[str, float]:
        return calibrate(step_s=0.5, mtbf_s=60.0, repair_s=10.0, learners=4, wall_s=600.0,
                         restart_s=5.0, checkpoint_interval_s=30.0, runs=50)

    out = run()
    assert set(out) == {"diloco", "dp"}
    assert all(0.0 <= v <= 1.0 for v in out.values())
    assert out["diloco"] > out["dp"]
    # A learner is up about 60 / (60 + 10 + 5) of the time.
    assert out["diloco"] == pytest.approx(0.8, abs=0.05)
    assert run() == out


def test_calibrate_rare_failures() -> None:
    out = calibrate(step_s=1.0, mtbf_s=1e12, repair_s=10.0, learners=2, wall_s=600.0,
                    restart_s=5.0, checkpoint_interval_s=30.0, runs=3)
    assert out == {"diloco": 1.0, "dp": 1.0}


# --------------------------------------------------------------------------------------------
# Errors
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs", [
    {"chips": 0},
    {"chips": 1_500},
    {"chips": 10_000, "learners": 11},
    {"chips": 10_000, "learners": 0},
    {"chips": 10_000, "chips_per_slice": -1},
    {"chips": 10_000, "chip_mtbi_s": 0.0},
    {"chips": 10_000, "slice_repair_s": math.nan},
    {"chips": 10_000, "downscale_s": -1.0},
    {"chips": 10_000, "step_s": 60.0},
    {"chips": 10_000, "horizon_s": math.inf},
    {"chips": True},
    {"chips": 2_400_000, "horizon_s": 1e10},
])
def test_bad_params(kwargs: dict[str, object]) -> None:
    with pytest.raises(ConfigError):
        SimParams(**kwargs)  # type: ignore[arg-type]


def test_bad_calls() -> None:
    with pytest.raises(ConfigError, match="mode"):
        simulate(SimParams(chips=10_000), "zero", seed=0)  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match="slice"):
        simulate_events(tiny(), "dp", [(1.0, 4)])
    with pytest.raises(ConfigError, match="horizon"):
        simulate_events(tiny(), "dp", [(100.0, 0)])
    with pytest.raises(ConfigError, match="unknown"):
        table(chips=(10_000,), learners=(2,), repair_s=3.0)
    with pytest.raises(ConfigError, match="runs"):
        calibrate(1.0, 60.0, 10.0, 2, 600.0, 5.0, 30.0, runs=0)


# --------------------------------------------------------------------------------------------
# Output
# --------------------------------------------------------------------------------------------


def test_main_json(capsys: pytest.CaptureFixture[str]) -> None:
    main(json_out=True, seed=0, chips=[150_000, 300_000], learners=[2, 8], horizon_s=86_400.0,
         upscale_s=None)
    rows = json.loads(capsys.readouterr().out)
    assert len(rows) == 2 * 4
    for row in rows:
        assert set(row) == {"chips", "mode", "learners", "goodput", "uptime"}
        assert 0.0 <= row["goodput"] <= 1.0
    assert {(r["mode"], r["learners"]) for r in rows} == {
        ("dp", 1), ("elastic_dp", 1), ("diloco", 2), ("diloco", 8)}


def test_main_table(capsys: pytest.CaptureFixture[str]) -> None:
    main(json_out=False, seed=0, chips=[150_000], learners=[4], horizon_s=86_400.0)
    out = capsys.readouterr().out
    assert "diloco M=4" in out and "150,000" in out


def test_render_table() -> None:
    results = table(chips=(150_000, 300_000), learners=(16, 2), horizon_s=86_400.0)
    rendered = render_table(results)
    assert isinstance(rendered, Table)
    assert [str(c.header) for c in rendered.columns] == [
        "chips", "dp", "elastic_dp", "diloco M=2", "diloco M=16"]
    assert rendered.row_count == 2
