"""Straggler schedules: pure functions of (seed, link, time); same answers for every caller."""
import math

import pytest

from graph_ir.errors import UserError
from lab.interference import (BandwidthTrace, Bursts, Interference, LinkSchedule, LognormalJitter, SlowRank,
                                  from_config)


def test_clean_link_is_latency_plus_bytes_over_bandwidth():
    link = LinkSchedule(latency_s=50e-6, bandwidth_gbps=8.0)
    assert link.delay(0, 1, 1_000_000, t=3.0) == pytest.approx(50e-6 + 1e-3)
    assert link.delay(2, 2, 1_000_000, t=3.0) == 0.0          # self-sends stay local
    assert LinkSchedule().delay(0, 1, 10**9, 0.0) == 0.0


def test_bursts_hit_only_their_links_and_their_on_phase():
    b = Bursts(period_s=0.1, duty=0.3, extra_delay_s=2e-3, bandwidth_gbps=1.0, links=frozenset({(0, 1)}))
    link = LinkSchedule(latency_s=10e-6, bandwidth_gbps=100.0, effects=(b,))
    assert b.active(0.02) and b.active(0.12) and not b.active(0.05) and not b.active(0.35)
    nbytes = 125_000                                          # 1 Mbit
    assert link.delay(0, 1, nbytes, 0.02) == pytest.approx(10e-6 + 2e-3 + 1e-3)
    assert link.delay(0, 1, nbytes, 0.05) == pytest.approx(10e-6 + 1e-5)
    assert link.delay(1, 0, nbytes, 0.02) == pytest.approx(10e-6 + 1e-5)   # reverse direction untouched
    wild = Bursts(period_s=1.0, duty=1.0, extra_delay_s=1e-3, links=frozenset({(-1, 3)}))
    assert wild.effect(0, 3, 0.0)[0] == 1e-3 and wild.effect(3, 0, 0.0)[0] == 0.0


def test_jitter_is_lognormal_deterministic_and_windowed():
    j = LognormalJitter(median_s=1e-4, sigma=0.5, seed=3, window_s=1e-3)
    xs = sorted(j.effect(0, 1, i * 1e-3)[0] for i in range(4000))
    assert xs[len(xs) // 2] == pytest.approx(1e-4, rel=0.06)
    mean = sum(xs) / len(xs)
    assert mean == pytest.approx(1e-4 * math.exp(0.5**2 / 2), rel=0.06)
    assert j.effect(0, 1, 0.0101) == j.effect(0, 1, 0.0109)   # same window, same noise
    assert j.effect(0, 1, 0.0101) == LognormalJitter(1e-4, 0.5, seed=3).effect(0, 1, 0.0101)
    assert j.effect(0, 1, 0.0101) != LognormalJitter(1e-4, 0.5, seed=4).effect(0, 1, 0.0101)
    assert j.effect(1, 0, 0.0101) != j.effect(0, 1, 0.0101)   # links are independent


def test_bandwidth_trace_file(tmp_path):
    p = tmp_path / "bw.csv"
    p.write_text("t_start,src,dst,gbps\n0,0,1,8\n1.0,0,1,0.8\n0.5,*,*,4\n")
    tr = BandwidthTrace.load(p)
    link = LinkSchedule(bandwidth_gbps=100.0, effects=(tr,))
    mb = 1_000_000
    assert link.delay(0, 1, mb, 0.2) == pytest.approx(mb * 8 / 8e9)      # only the 0->1 row so far
    assert link.delay(0, 1, mb, 0.7) == pytest.approx(mb * 8 / 4e9)      # the wildcard cap is lower
    assert link.delay(0, 1, mb, 2.0) == pytest.approx(mb * 8 / 0.8e9)
    assert link.delay(2, 3, mb, 0.2) == pytest.approx(mb * 8 / 100e9)    # before the wildcard row
    bad = tmp_path / "bad.csv"
    bad.write_text("time,src,dst,gbps\n0,0,1,1\n")
    with pytest.raises(UserError, match="header"):
        BandwidthTrace.load(bad)


def test_slow_rank_multiplier():
    always = SlowRank(rank=2, factor=3.0)
    bursty = SlowRank(rank=1, factor=2.0, period_s=1.0, duty=0.5)
    inter = Interference(slow=(always, bursty))
    assert inter.compute_scale(2, 123.4) == 3.0
    assert inter.compute_scale(0, 0.0) == 1.0
    assert inter.compute_scale(1, 0.2) == 2.0 and inter.compute_scale(1, 0.7) == 1.0
    assert Interference().compute_scale(0, 0.0) == 1.0 and Interference().link.clean


def test_from_config_builds_every_kind_and_rejects_typos(tmp_path):
    (tmp_path / "bw.csv").write_text("t_start,src,dst,gbps\n0,*,*,10\n")
    inter = from_config({
        "latency_us": 20, "bandwidth_gbps": 100,
        "bursts": [{"period_ms": 10, "duty": 0.5, "extra_delay_us": 500, "links": [[0, 1]]}],
        "jitter": {"median_us": 5, "sigma": 0.3, "seed": 1},
        "trace": "bw.csv",
        "slow_ranks": [{"rank": 3, "factor": 1.5}],
    }, name="mix", base_dir=tmp_path)
    assert inter.name == "mix" and len(inter.link.effects) == 3
    assert inter.compute_scale(3, 0.0) == 1.5
    assert inter.delay(0, 1, 0, 0.001) > inter.delay(0, 1, 0, 0.006)
    with pytest.raises(UserError, match="unknown field"):
        from_config({"burst": []})
    with pytest.raises(UserError, match="unknown field"):
        from_config({"bursts": [{"period_ms": 1, "duty": 0.5, "delay_us": 3}]})
    with pytest.raises(UserError, match="duty"):
        from_config({"bursts": [{"period_ms": 1, "duty": 1.5}]})
