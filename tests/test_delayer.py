"""The delay line of the user-space link delayer, with an injected clock."""

from __future__ import annotations

import pytest

from ddiloco.chaos.wan.delayer import MAX_DELAY_S, DelayLine, _src_of, parse_delays


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def test_items_wait_their_peer_delay_and_leave_in_due_order() -> None:
    clock = Clock()
    line: DelayLine[str] = DelayLine({"10.0.0.1": 0.030, "10.0.0.2": 0.010}, clock)
    assert line.push("10.0.0.1", "a1") is None  # due 100.030
    clock.t = 100.005
    assert line.push("10.0.0.2", "b1") is None  # due 100.015
    assert line.push("10.0.0.9", "x") == "x"  # no delay for this peer: straight back
    assert line.wait_s() == pytest.approx(0.010)
    clock.t = 100.014
    assert line.pop_due() == []
    clock.t = 100.016
    assert line.pop_due() == ["b1"]
    assert line.wait_s() == pytest.approx(0.014)
    clock.t = 100.040  # 10 ms late for a1
    assert line.pop_due() == ["a1"]
    assert line.wait_s(0.5) == 0.5 and len(line) == 0
    s = line.stats
    assert (s.packets, s.passed, s.per_peer) == (2, 1, {"10.0.0.1": 1, "10.0.0.2": 1})
    assert s.late_max_s == pytest.approx(0.010)
    assert s.late_mean_s == pytest.approx((0.001 + 0.010) / 2)


def test_one_peer_keeps_its_order_and_drain_releases_everything() -> None:
    clock = Clock()
    line: DelayLine[int] = DelayLine({"p": 1.0}, clock)
    for i in range(5):
        line.push("p", i)
        clock.t += 0.001
    assert line.wait_s() == pytest.approx(1.0 - 0.005)
    clock.t += 0.9
    assert line.pop_due() == []
    assert line.drain() == [0, 1, 2, 3, 4]
    assert line.stats.packets == 5 and len(line) == 0


def test_zero_delay_passes_and_bad_delays_are_refused() -> None:
    line: DelayLine[str] = DelayLine({"p": 0.0}, Clock())
    assert line.push("p", "now") == "now"
    with pytest.raises(ValueError, match="must be in"):
        DelayLine({"p": -0.001})
    with pytest.raises(ValueError, match="must be in"):
        DelayLine({"p": MAX_DELAY_S + 1})
    with pytest.raises(ValueError, match="must be in"):
        DelayLine({"p": float("nan")})


def test_parse_delays() -> None:
    assert parse_delays(["10.1.2.3=0.025", "10.1.2.4=0"]) == {"10.1.2.3": 0.025, "10.1.2.4": 0.0}
    for bad in ("10.1.2.3", "host=0.1", "10.1.2.3=soon", "10.1.2.3=-1", "10.1.2.3=11"):
        with pytest.raises(ValueError):
            parse_delays([bad])


def test_source_address_of_an_ipv4_header() -> None:
    header = bytes([0x45, 0, 0, 40, 0, 0, 0, 0, 64, 6, 0, 0, 10, 1, 2, 3, 10, 4, 5, 6])
    assert _src_of(header) == "10.1.2.3"
    assert _src_of(header[:12]) == ""


def test_network_entries_delay_every_address_in_them() -> None:
    """A router delays a whole region's subnet: an address entry wins over a network."""
    clock = Clock()
    line: DelayLine[str] = DelayLine({"172.28.1.0/24": 0.025, "172.28.0.0/24": 0.040,
                                      "172.28.0.9": 0.0}, clock)
    assert line.delay_of("172.28.1.77") == 0.025
    assert line.delay_of("172.28.0.10") == 0.040
    assert line.delay_of("172.28.0.9") == 0.0  # its own entry
    assert line.delay_of("10.0.0.1") == 0.0 and line.delay_of("not-an-ip") == 0.0
    assert line.push("172.28.1.77", "up") is None
    clock.t = 100.026
    assert line.pop_due() == ["up"]
    assert parse_delays(["172.28.1.0/24=0.025"]) == {"172.28.1.0/24": 0.025}
    with pytest.raises(ValueError):
        parse_delays(["172.28.1.1/24=0.025"])  # host bits set: not a network
