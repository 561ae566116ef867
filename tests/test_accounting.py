"""Token fate, goodput, downtime and recoveries (chaos/accounting.py) on hand-computed logs."""

from __future__ import annotations

from typing import Any

import pytest

from ddiloco.chaos.accounting import (
    TokenFate,
    availability,
    complete_goodput,
    dp_token_fate,
    global_downtime,
    goodput,
    payloads,
    step_time_fallback,
    token_fate,
)
from ddiloco.chaos.recoveries import (
    Recovery,
    fault_counts,
    merges_per_fragment,
    participation,
    percentile_summary,
    recoveries,
    rejoin_summary,
    timeline,
)

P = 4  # fragments in the DiLoCo examples


def contrib(learner: str, inc: int, tokens: int, seqs: list[int]) -> dict[str, Any]:
    return {"learner": learner, "inc": inc, "seqs": seqs, "tokens": tokens}


def merge(fragment: int, version: int, *contribs: dict[str, Any], shard: str = "shard-0",
          t: float = 0.0) -> dict[str, Any]:
    return {"kind": "merge", "t": t, "shard": shard, "fragment": fragment, "version": version,
            "contributors": [c["learner"] for c in contribs],
            "tokens": sum(c["tokens"] for c in contribs), "contributions": list(contribs)}


def fate(learner: str, inc: int, ended: str, processed: int, sent: int, overwritten: int = 0,
         drain: int = 0, start_step: int = 0, step: int = 0,
         committed_step: int | None = None) -> dict[str, Any]:
    return {"learner": learner, "incarnation": inc, "ended": ended, "processed": processed,
            "sent": sent, "discarded": {"overwritten": overwritten, "drain": drain},
            "start_step": start_step, "step": step, "committed_step": committed_step}


# Two learners, P = 4, all in fragment-tokens:
#   learner-1#1 drained: processed 4000 = sent 3600 + overwritten 240 + drain 160 (unsent 0);
#       shards received 3600: merged 1600 + 1800, dropped stale 120, shard_lost 80.
#   learner-2#1 killed:  processed 2400 = sent 2000 + overwritten 100 + 300 unsent (killed);
#       received 1900 (in_flight 100), all merged (1000 + 900).
#   learner-2#2 running: processed 800, sent 400 (unsent_at_exit 400), received and merged 400.
# Totals: processed 7200 = merged 5700 + discarded 620 (340 + 160 + 120)
#                                       + lost 880 (300 + 100 + 80 + 400).
FATES: list[dict[str, Any]] = [
    fate("learner-1", 1, "drained", 4000, 3600, overwritten=240, drain=160),
    fate("learner-2", 1, "killed", 2400, 2000, overwritten=100),
    fate("learner-2", 2, "running", 800, 400),
]
MERGES: list[dict[str, Any]] = [
    merge(0, 1, contrib("learner-1", 1, 1600, [1]), contrib("learner-2", 1, 1000, [1])),
    merge(1, 1, contrib("learner-1", 1, 1800, [2, 3]), contrib("learner-2", 1, 900, [2])),
    merge(0, 2, contrib("learner-2", 2, 400, [1])),
    {"kind": "merge", "shard": "shard-0", "fragment": 0, "version": 3, "dp_step": 9,
     "contributors": [], "tokens": 0},
]
DROPS: list[dict[str, Any]] = [
    {"kind": "drop", "shard": "shard-0", "reason": "stale", "detail": "", "learner": "learner-1",
     "inc": 1, "seq": 4, "fragment": 2, "tokens": 120},
    {"kind": "drop", "shard": "shard-0", "reason": "corrupt", "detail": "bad frame"},
]
RECEIVED = {("learner-1", 1): 3600, ("learner-2", 1): 1900, ("learner-2", 2): 400}


def test_token_fate_exact_numbers() -> None:
    tf = token_fate(FATES, MERGES, DROPS, RECEIVED, P)
    assert tf.processed == 7200
    assert tf.merged == 5700
    assert tf.discarded == {"dropped:stale": 120, "drain": 160, "overwritten": 340}
    assert tf.lost == {"in_flight": 100, "learner_killed": 300, "shard_lost": 80,
                       "unsent_at_exit": 400}
    assert tf.balance == 0
    assert tf.anomalies == [] and tf.excess == {}
    per = tf.per_incarnation
    assert per["learner-1#1"]["lost"] == {"unsent_at_exit": 0, "in_flight": 0, "shard_lost": 80}
    assert per["learner-1#1"]["discarded"]["dropped:stale"] == 120
    assert per["learner-2#1"]["lost"] == {"learner_killed": 300, "in_flight": 100,
                                          "shard_lost": 0}
    assert per["learner-2#2"]["lost"]["unsent_at_exit"] == 400


def test_token_fate_json_in_tokens_and_fragment_tokens() -> None:
    js = token_fate(FATES, MERGES, DROPS, RECEIVED, P).to_json()
    assert js["n_fragments"] == 4
    assert js["fragment_tokens"]["merged"] == 5700
    assert js["fragment_tokens"]["balance"] == 0
    assert js["tokens"]["processed"] == 1800.0
    assert js["tokens"]["merged"] == 1425.0
    assert js["tokens"]["lost"]["shard_lost"] == 20.0
    assert js["tokens"]["discarded"]["dropped:stale"] == 30.0
    assert js["shares"] == {"merged": round(5700 / 7200, 4), "discarded": round(620 / 7200, 4),
                            "lost": round(880 / 7200, 4)}


def test_double_counted_merge_makes_balance_negative() -> None:
    # The fragment-1 merge logged twice: learner-1#1 now "merged" 5200 of the 3600 it sent
    # (shard_lost residual 3600 - 5200 - 120 = -1720), learner-2#1 2800 of 1900 (-900).
    merges = [*MERGES, MERGES[1]]
    tf = token_fate(FATES, merges, DROPS, RECEIVED, P)
    assert tf.merged == 5700 + 2700
    assert tf.excess == {"shard_lost": 1720 + 900}
    assert tf.balance == -2620
    assert tf.lost["shard_lost"] == 0  # clipped; the excess keeps the truth
    assert len(tf.anomalies) == 2 and "shard_lost residual -1720" in tf.anomalies[0]


def test_received_twice_is_an_in_flight_anomaly() -> None:
    received = {**RECEIVED, ("learner-2", 2): 500}  # 100 more than learner-2#2 sent
    tf = token_fate(FATES, MERGES, DROPS, received, P)
    # in_flight 400 - 500 = -100 (excess); shard_lost 500 - 400 = 100 (lost): they cancel in
    # the raw sum, but the clip makes the balance show the double count.
    assert tf.excess == {"in_flight": 100}
    assert tf.balance == -100
    assert any("in_flight residual -100" in a for a in tf.anomalies)


def test_records_without_a_fate_are_anomalies() -> None:
    merges = [*MERGES, merge(2, 1, contrib("learner-9", 1, 50, [1]))]
    drops = [*DROPS, {"kind": "drop", "reason": "fenced", "tokens": 30}]
    received = {**RECEIVED, ("learner-8", 1): 10}
    tf = token_fate(FATES, merges, drops, received, P)
    assert tf.merged == 5750
    assert tf.excess == {"no_fate_record": 50}
    assert tf.balance == -50
    assert len(tf.anomalies) == 3
    assert any("learner-9#1" in a for a in tf.anomalies)
    assert any("learner-8#1" in a for a in tf.anomalies)
    assert any("without a known sender" in a for a in tf.anomalies)


def test_dp_token_fate_rollback() -> None:
    # tokens_per_step 100, P = 2: one step is 200 fragment-tokens.
    fates = [
        # killed at step 15, checkpoint at 10: 2000 merged, 5 steps (1000) rolled back
        fate("learner-0", 1, "killed", 3000, 0, start_step=0, step=15, committed_step=10),
        # resumed at 10, drained at 20 with a checkpoint: all 2000 merged
        fate("learner-0", 2, "drained", 2000, 0, start_step=10, step=20, committed_step=20),
        # killed before its first checkpoint: all 800 rolled back
        fate("learner-1", 1, "killed", 800, 0, start_step=0, step=4, committed_step=None),
        # committed step ahead of the processed counter: merged is clipped to processed
        fate("learner-1", 2, "running", 1000, 0, start_step=0, step=5, committed_step=30),
    ]
    tf = dp_token_fate(fates, tokens_per_step=100, n_fragments=2)
    assert tf.processed == 6800
    assert tf.merged == 2000 + 2000 + 0 + 1000
    assert tf.lost == {"rollback": 1800, "unsent_at_exit": 0}
    assert tf.discarded == {}
    assert tf.balance == 0 and tf.anomalies == []
    assert tf.to_json()["tokens"]["lost"]["rollback"] == 900.0
    with pytest.raises(ValueError, match="tokens_per_step"):
        dp_token_fate(fates, tokens_per_step=0, n_fragments=2)


def test_token_fate_validates_fragments() -> None:
    with pytest.raises(ValueError, match="n_fragments"):
        token_fate([], [], [], {}, 0)
    empty = token_fate([], [], [], {}, 3)
    assert isinstance(empty, TokenFate)
    assert empty.balance == 0 and empty.to_json()["shares"]["merged"] is None


def test_goodput_hand_computed() -> None:
    # 2_400_000 fragment-tokens / P 4 = 600_000 tokens = 600 steps of 1000 tokens; at 0.5 s a
    # step that is 300 learner-seconds, over 2 learners x 200 s = 400: goodput 0.75.
    assert goodput(2_400_000, 4, 1000, 0.5, 2, 200.0) == pytest.approx(0.75)
    # Not clipped: 1600 steps x 0.5 s = 800 s over 400 s reads 2.0 (a bug signal, no ceiling).
    assert goodput(6_400_000, 4, 1000, 0.5, 2, 200.0) == pytest.approx(2.0)
    assert goodput(0, 4, 1000, 0.5, 2, 200.0) == 0.0
    for bad in ({"wall_s": 0.0}, {"learners": 0}, {"ref_step_s": 0.0}, {"tokens_per_step": 0},
                {"n_fragments": 0}, {"merged_fragment_tokens": -1}):
        args: dict[str, Any] = {"merged_fragment_tokens": 1, "n_fragments": 4,
                                "tokens_per_step": 1000, "ref_step_s": 0.5, "learners": 2,
                                "wall_s": 200.0, **bad}
        with pytest.raises(ValueError):
            goodput(**args)


def test_availability_hand_computed() -> None:
    # Merged 300, discarded 100 (overwritten): goodput 0.6 scaled by 400 / 300.
    assert availability(0.6, 300, 100, 4, 1000, 0.5, 2, 200.0) == pytest.approx(0.8)
    # Nothing merged: the discarded 800_000 fragment-tokens are 200 steps = 100 learner-s of
    # 400, added to the goodput.
    assert availability(0.0, 0, 800_000, 4, 1000, 0.5, 2, 200.0) == pytest.approx(0.25)
    assert availability(0.0, 0, 0, 4, 1000, 0.5, 2, 200.0) == 0.0
    with pytest.raises(ValueError):
        availability(0.5, -1, 0, 4, 1000, 0.5, 2, 200.0)


def mode_block(goodput_: float | None, step: float | None, source: str | None,
               merged_window_tokens: float, merged: int, discarded: int = 0) -> dict[str, Any]:
    """The fields of a chaos.json mode block that goodput and availability come from."""
    return {
        "learners": 2, "wall_s": 200.0, "tokens_per_step": 1000,
        "merged_tokens_in_window": merged_window_tokens, "ref_step_s": step,
        "step_time_source": source, "goodput": goodput_,
        "availability": None if goodput_ is None else goodput_,
        "token_fate": {"n_fragments": 4, "fragment_tokens": {
            "merged": merged, "discarded": {"overwritten": discarded}}},
    }


def test_mode_without_step_time_borrows_the_other_modes() -> None:
    blocks = {
        "diloco": mode_block(0.75, 0.5, "own", 600_000.0, 2_400_000),
        # DP never reached a fault-free stretch: no step time, no goodput.
        "dp": mode_block(None, None, None, 160_000.0, 640_000),
    }
    assert step_time_fallback("dp", blocks) == (0.5, "diloco:own")
    assert step_time_fallback("diloco", {"diloco": blocks["diloco"]}) == (None, None)
    out = complete_goodput(blocks)
    # 160_000 tokens = 160 steps of 1000 at 0.5 s = 80 learner-s of 2 x 200: 0.2.
    assert out["dp"]["goodput"] == pytest.approx(0.2)
    assert out["dp"]["availability"] == pytest.approx(0.2)
    assert (out["dp"]["ref_step_s"], out["dp"]["step_time_source"]) == (0.5, "diloco:own")
    assert out["diloco"] == blocks["diloco"]
    assert blocks["dp"]["goodput"] is None  # copies, not changed in place
    # A reference-run step time is named as such.
    blocks["diloco"]["step_time_source"] = "reference"
    assert complete_goodput(blocks)["dp"]["step_time_source"] == "diloco:reference"


def test_availability_filled_when_nothing_was_merged() -> None:
    blk = mode_block(0.0, 0.5, "own", 0.0, 0, discarded=800_000)
    blk["availability"] = None
    out = complete_goodput({"diloco": blk})
    assert out["diloco"]["availability"] == pytest.approx(0.25)
    # No mode measured a step time: goodput stays unknown.
    lone = complete_goodput({"dp": mode_block(None, None, None, 1.0, 4)})
    assert lone["dp"]["goodput"] is None and lone["dp"]["step_time_source"] is None


def test_global_downtime_including_edges() -> None:
    # gaps: 10->12 (2), 12->15 (3), 15->31 (16), 31->33 (2), 33->40 (7)
    assert global_downtime([31.0, 12.0, 33.0, 15.0], 10.0, 40.0) == (16.0, 15.0, 31.0)
    assert global_downtime([30.0], 0.0, 35.0) == (30.0, 0.0, 30.0)  # leading edge
    assert global_downtime([1.0, 2.0], 0.0, 20.0) == (18.0, 2.0, 20.0)  # trailing edge
    assert global_downtime([], 5.0, 9.0) == (4.0, 5.0, 9.0)  # never merged
    assert global_downtime([-3.0, 50.0, 4.0], 0.0, 10.0) == (6.0, 4.0, 10.0)  # outside: ignored
    assert global_downtime([], 5.0, 5.0) == (0.0, 5.0, 5.0)
    with pytest.raises(ValueError):
        global_downtime([], 2.0, 1.0)


def ev(kind: str, t: float, **fields: Any) -> dict[str, Any]:
    return {"kind": kind, "t": 1000.0 + t, **fields}


def fault(fid: str, kind: str, target: str, phase: str, t: float,
          duration_s: float | None = None, **extra: Any) -> dict[str, Any]:
    return ev("fault", t, id=fid, fault=kind, target=target, phase=phase,
              duration_s=duration_s, **extra)


def chaos_log() -> list[dict[str, Any]]:
    c1 = contrib("learner-1", 2, 10, [1])
    c2 = contrib("learner-2", 1, 10, [1])
    return [
        ev("chaos_start", 0.0, mode="diloco"),
        ev("shard_start", 0.2, shard="shard-0", epoch=1, versions={"0": 0}),
        ev("join", 0.5, learner="learner-1", incarnation=1),
        ev("join", 0.6, learner="learner-2", incarnation=1),
        ev("first_step", 1.0, learner="learner-1", incarnation=1, step=1, versions=[0, 0]),
        merge(0, 1, contrib("learner-1", 1, 10, [1]), t=1002.0),
        # f1: learner-1 killed at 10, detected at 12, restarted at 13, first step of inc 2 at 20
        fault("f1", "kill", "learner-1", "inject", 10.0),
        ev("first_step", 11.0, learner="learner-1", incarnation=1, step=1, versions=[0, 0]),
        ev("detected", 12.0, id="f1", target="learner-1"),
        fault("f1", "kill", "learner-1", "restart", 13.0),
        ev("join", 14.0, learner="learner-1", incarnation=2),
        ev("first_step", 20.0, learner="learner-1", incarnation=2, step=5, versions=[1, 0]),
        # f2: shard-0 killed at 30; a late merge event of the dead shard does not count
        fault("f2", "kill", "shard-0", "inject", 30.0),
        merge(0, 2, c1, t=1030.5),
        ev("detected", 33.0, id="f2", target="shard-0"),
        fault("f2", "kill", "shard-0", "restart", 34.0),
        ev("shard_start", 35.0, shard="shard-0", epoch=2, versions={"0": 2}),
        merge(1, 1, c1, shard="shard-1", t=1036.0),
        merge(0, 3, c1, t=1038.0),
        # f3: Redis killed at 40, restarted at 45, first merge after that at 47
        fault("f3", "kill", "redis", "inject", 40.0),
        merge(0, 4, c1, t=1041.0),
        fault("f3", "kill", "redis", "restart", 45.0),
        merge(1, 2, c1, shard="shard-1", t=1047.0),
        # f4: learner-2 paused 50..55; its first merged contribution after that at 58
        fault("f4", "pause", "learner-2", "inject", 50.0, duration_s=5.0),
        fault("f4", "pause", "learner-2", "heal", 55.0),
        merge(0, 5, c1, t=1056.0),
        merge(0, 6, c1, c2, t=1058.0),
        # f5: learner-1 partitioned from the syncers 60..64 (merge with `contributors` only)
        fault("f5", "partition", "learner-1", "inject", 60.0, peer="syncers"),
        fault("f5", "partition", "learner-1", "heal", 64.0),
        ev("merge", 65.0, shard="shard-0", fragment=0, version=7, contributors=["learner-1"]),
        # f6: shard-1 paused 70..72; its next merge at 74
        fault("f6", "pause", "shard-1", "inject", 70.0),
        fault("f6", "pause", "shard-1", "heal", 72.0),
        merge(0, 8, c1, t=1073.0),
        merge(1, 3, c1, shard="shard-1", t=1074.0),
        # f7: learner-2 slowed for 10 s: no recovery by definition
        fault("f7", "slow", "learner-2", "inject", 80.0, duration_s=10.0, factor=3.0),
        # f8: Redis paused 85..87; next merge at 90
        fault("f8", "pause", "redis", "inject", 85.0),
        fault("f8", "pause", "redis", "heal", 87.0),
        merge(0, 9, c1, t=1090.0),
        # f9: learner-2 killed at 95 and never back
        fault("f9", "kill", "learner-2", "inject", 95.0),
        ev("chaos_end", 100.0, mode="diloco"),
    ]


def test_recoveries_for_each_fault_kind() -> None:
    got = {r.id: r for r in recoveries(chaos_log())}
    assert got["f1"] == Recovery("f1", "kill", "learner-1", 1010.0, 2.0, 10.0)
    assert got["f2"] == Recovery("f2", "kill", "shard-0", 1030.0, 3.0, 8.0)
    assert got["f3"].recover_s == pytest.approx(7.0) and got["f3"].detect_s is None
    assert got["f4"].recover_s == pytest.approx(8.0)
    assert got["f5"].recover_s == pytest.approx(5.0)
    assert got["f6"].recover_s == pytest.approx(4.0)
    assert got["f7"].recover_s is None and got["f7"].kind == "slow"
    assert got["f8"].recover_s == pytest.approx(5.0)
    assert got["f9"].recover_s is None  # the run ended first
    assert list(got) == [f"f{i}" for i in range(1, 10)]


def test_a_kill_before_the_restarted_learner_trains_interrupts_the_first_rejoin() -> None:
    # learner-1 killed at 10 (back at 15), killed again at 17 while its incarnation 2 was
    # still starting (back at 20); incarnation 3 trains at 22.5
    log = [
        ev("chaos_start", 0.0, mode="diloco"),
        ev("join", 0.5, learner="learner-1", incarnation=1),
        ev("first_step", 1.0, learner="learner-1", incarnation=1, step=1, versions=[0]),
        fault("k1", "kill", "learner-1", "inject", 10.0, duration_s=5.0),
        fault("k1", "kill", "learner-1", "restart", 15.0),
        ev("join", 15.5, learner="learner-1", incarnation=2),
        fault("k2", "kill", "learner-1", "inject", 17.0, duration_s=3.0),
        fault("k2", "kill", "learner-1", "restart", 20.0),
        ev("join", 20.5, learner="learner-1", incarnation=3),
        ev("first_step", 22.5, learner="learner-1", incarnation=3, step=2, versions=[1]),
        # a third kill after the recovery interrupts nothing
        fault("k3", "kill", "learner-1", "inject", 30.0, duration_s=2.0),
        ev("chaos_end", 40.0, mode="diloco"),
    ]
    got = {r.id: r for r in recoveries(log)}
    assert got["k1"].recover_s == pytest.approx(12.5)
    assert got["k1"].interrupted_by == "k2"
    assert got["k2"].recover_s == pytest.approx(5.5) and got["k2"].interrupted_by is None
    assert got["k3"].recover_s is None and got["k3"].interrupted_by is None
    summary = rejoin_summary(got.values(), {"k1": 5.0, "k2": 3.0, "k3": 2.0})
    assert summary["n"] == 1 and summary["p50"] == pytest.approx(2.5)
    assert summary["interrupted"] == 1 and summary["missing"] == 0


def test_recoveries_accept_stream_pairs() -> None:
    pairs = [(f"{i}-0", e) for i, e in enumerate(chaos_log())]
    assert recoveries(pairs) == recoveries(chaos_log())
    assert payloads(pairs) == chaos_log()


def test_fault_counts() -> None:
    assert fault_counts(chaos_log()) == {
        "kill:learner": 2, "kill:redis": 1, "kill:shard": 1, "partition:learner": 1,
        "pause:learner": 1, "pause:redis": 1, "pause:shard": 1, "slow:learner": 1,
    }


def test_timeline() -> None:
    assert timeline(chaos_log(), 1000.0) == {
        "learner-1": [(10.0, 13.0, "down"), (60.0, 64.0, "partitioned")],
        # slow has no heal event: injection + duration_s; f9 runs to chaos_end
        "learner-2": [(50.0, 55.0, "paused"), (80.0, 90.0, "slow"), (95.0, 100.0, "down")],
        "redis": [(40.0, 45.0, "down"), (85.0, 87.0, "paused")],
        "shard-0": [(30.0, 34.0, "down")],
        "shard-1": [(70.0, 72.0, "paused")],
    }


def test_percentile_summary() -> None:
    # sorted 1, 2, 3, 4: p50 at rank 1.5 -> 2.5; p90 at rank 2.7 -> 3.7
    s = percentile_summary([4.0, 1.0, None, 3.0, 2.0])
    assert s == {"n": 4, "missing": 1, "p50": 2.5, "p90": pytest.approx(3.7), "max": 4.0}
    assert percentile_summary([]) == {"n": 0, "missing": 0, "p50": None, "p90": None,
                                      "max": None}
    assert percentile_summary(iter([5.0]))["p50"] == 5.0


def test_merges_per_fragment_and_participation() -> None:
    assert merges_per_fragment(MERGES) == {0: 3, 1: 1}
    part = participation(MERGES)  # 2, 2 and 1 contributors; the DP merge is left out
    assert part["histogram"] == {1: 1, 2: 2}
    assert part["mean"] == pytest.approx(5 / 3)
    assert participation([]) == {"histogram": {}, "mean": None}


def test_wire_snapshots_and_record_received() -> None:
    # learner-2#1 was killed before its record caught up: the record says sent 1500, but the
    # last delta header a shard saw said processed 2400, sent 2000, overwritten 100. The store
    # reports received with the record; the mapping has no entry for it.
    stale = {**fate("learner-2", 1, "killed", 1800, 1500, overwritten=60),
             "wire": [[2200, 1800, 100, 0], [2400, 2000, 80, 0]], "received": 1900}
    fates = [FATES[0], stale, FATES[2]]
    received = {k: v for k, v in RECEIVED.items() if k != ("learner-2", 1)}
    tf = token_fate(fates, MERGES, DROPS, received, P)
    assert tf.balance == 0 and tf.anomalies == []
    assert tf.per_incarnation["learner-2#1"]["lost"] == {"learner_killed": 300, "in_flight": 100,
                                                         "shard_lost": 0}
    assert tf == token_fate(FATES, MERGES, DROPS, RECEIVED, P)
