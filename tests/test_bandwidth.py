"""The bandwidth model with hand-computed numbers."""

from __future__ import annotations

import pytest

from ddiloco.chaos.wan.bandwidth import (
    busy_share_diloco,
    busy_share_dp,
    required_bps_diloco,
    required_bps_dp,
)


def test_dp_needs_the_step_bytes_in_a_nineteenth_of_the_step() -> None:
    # 1 MB per step, 0.1 s step: at 95 % busy comm may take 0.1 * (1/0.95 - 1) = 5.263 ms,
    # so 8e6 bit / 5.263e-3 s = 1.52 Gbit/s
    bps = required_bps_dp(1e6, 0.1)
    assert bps == pytest.approx(8e6 / (0.1 / 19))
    assert bps == pytest.approx(1.52e9)
    assert busy_share_dp(1e6, 0.1, bps) == pytest.approx(0.95)
    assert busy_share_dp(1e6, 0.1, 8e7) == pytest.approx(0.1 / (0.1 + 0.1))


def test_diloco_is_bound_by_the_average_rate_or_the_overlap_window() -> None:
    # 10 kB per step on average, t = 0.1 s, H = 24, P = 12, tau = 2: one fragment's exchange is
    # 10e3 * 24 / 12 = 20 kB; the window is 0.1 * (2 + 24 * (1/19) / 12) = 0.21053 s, so the
    # window asks 8 * 20e3 / 0.21053 = 760 kbit/s, the average 8 * 10e3 / 0.1 = 800 kbit/s
    assert required_bps_diloco(10e3, 0.1, H=24, P=12, tau=2) == pytest.approx(800e3)
    # tau = 0: the window is 0.1 * 24 / 19 / 12 = 10.526 ms: 8 * 20e3 / 0.010526 = 15.2 Mbit/s
    bps0 = required_bps_diloco(10e3, 0.1, H=24, P=12, tau=0)
    assert bps0 == pytest.approx(15.2e6)
    assert busy_share_diloco(10e3, 0.1, bps0, H=24, P=12, tau=0) == pytest.approx(0.95)
    # below the average rate the learners fall behind without bound
    assert busy_share_diloco(10e3, 0.1, 700e3, H=24, P=12, tau=2) == 0.0
    assert busy_share_diloco(10e3, 0.1, 900e3, H=24, P=12, tau=2) == 1.0


def test_the_same_traffic_needs_far_less_link_without_blocking() -> None:
    dp = required_bps_dp(1e6, 0.1)
    diloco = required_bps_diloco(1e6 / 60, 0.1, H=24, P=12, tau=2)  # 60x fewer bytes per step
    assert dp / diloco == pytest.approx(19 * 60)


@pytest.mark.parametrize(
    "args",
    [(0.0, 0.1, 0.95), (1e6, 0.0, 0.95), (1e6, 0.1, 1.0), (1e6, 0.1, 0.0), (float("nan"), 1, 0.5)],
)
def test_bad_inputs(args: tuple[float, float, float]) -> None:
    with pytest.raises(ValueError):
        required_bps_dp(*args)
    with pytest.raises(ValueError):
        required_bps_diloco(args[0], args[1], 24, 12, 2, args[2])


def test_bad_schedule() -> None:
    with pytest.raises(ValueError, match="H >= 1"):
        required_bps_diloco(1e3, 0.1, H=0, P=12, tau=2)
