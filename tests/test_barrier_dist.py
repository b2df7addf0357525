"""lab/barrier_dist.py: barrier EP over real torch.distributed collectives (gloo here), 2 processes,
tiny model in fp32, tokens vs the streaming engine (in-process, same executor recipe and routing).
ag and a2a run in one launch (spawning ranks is the expensive part). Also the bench's interference
(lab/dist_scenarios.py), hogs and host probes."""
from __future__ import annotations

import random

import pytest

from lab.barrier_dist import ExecSpec, cut_spec
from lab.decode_only import decode_only
from lab.dist_job import DistJob, Workload, run_dist
from lab.dist_scenarios import BurstDelays

pytestmark = pytest.mark.timeout(120) if hasattr(pytest.mark, "timeout") else []


def _requests(spec, n=6, prompt=5, new=4):
    from runtime.core.requests import Request
    g = random.Random(0)
    return [Request(i, f"r{i}", [g.randrange(3, spec.vocab_size - 8) for _ in range(prompt + i % 3)], new,
                    ignore_eos=True, arrival=0.0) for i in range(n)]


def _first_divergence(a, b):
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None


@pytest.mark.parametrize("executor", ["torch", "cuda"])
def test_barrier_dist_tokens_match_streaming(executor):
    """The barrier baselines' tokens equal the streaming engine's, with the torch executor and the CUDA executor's
    CPU twin (whose combines write the next attention batch's input in place, in both systems)."""
    from lowering.plan import compile_plan
    from lab.barrier_dist import build_executor
    from runtime.drivers.cluster import Cluster, RunOptions
    import torch
    es = ExecSpec(model="tiny-gpt-oss", dtype="float32", executor=executor, zipf_s=1.2)
    spec = cut_spec(es.model, None, es.dtype)
    plan = compile_plan(spec, 2)
    reqs = _requests(spec)
    # reference: the streaming engine in-process, same executor recipe (weights, Zipf routing)
    ex, _ = build_executor(es, plan, torch.device("cpu"))
    ref = [type(q)(q.rid, q.name, list(q.prompt), q.max_new_tokens, ignore_eos=True, arrival=0.0) for q in reqs]
    Cluster(plan, ex, RunOptions(policy="defrag", kv_blocks=64, engine_setup=decode_only)).run(ref)
    want = {q.rid: list(q.output) for q in ref}
    works = [Workload(f"{m}", m, reqs, 64) for m in ("a2a-ep", "ag-ep")]
    job = DistJob(plan, es, works, delays=BurstDelays(period_ms=10, duty=0.5, extra_us=500), decode_only=True,
                  peer_timeout_s=10.0)
    out = run_dist("barrier", job, 2, timeout=90.0)
    assert [w["system"] for w in out["workloads"]] == ["a2a-ep", "ag-ep"]
    for w in out["workloads"]:
        got = {r["rid"]: r["output"] for r in w["requests"]}
        assert sorted(got) == sorted(want)
        assert {r["home"] for r in w["requests"]} == {0, 1}
        assert all(len(got[r]) == len(want[r]) for r in want)
        if w["system"] == "a2a-ep":  # the same fp32 operations in the same order as the streaming engine
            assert got == want, {r: (got[r], want[r]) for r in want if got[r] != want[r]}
        else:  # all-reduce sums weighted partials in another order: equal up to near-ties
            same = sum(got[r] == want[r] for r in want)
            assert same >= len(want) - 1, {r: _first_divergence(got[r], want[r]) for r in want}
        assert w["batches"]["attn"]["batches"] > 0 and w["batches"]["expert"]["batches"] > 0


def test_burst_delays_schedule():
    import lab.dist_scenarios as bd
    d = BurstDelays(period_ms=20, duty=0.3, extra_us=2000, links=[(0, 1)], epoch=0.0)
    bd.ACTIVE["delay"] = 0.0
    assert d.collective(0, 2) == 0.0
    bd.ACTIVE["delay"] = d.extra_s  # what scenario_on sets for plain `delay`
    try:
        seen = {d.delay(0, 1) for _ in range(2000)}
        assert seen <= {0.0, 0.002}
        assert d.delay(1, 0) == 0.0 and d.delay(0, 0) == 0.0
        assert d.lane("send", 0, 1)() in (0.0, 0.002) and d.lane("send", 1, 0)() == 0.0
    finally:
        bd.ACTIVE["delay"] = 0.0


def test_delay_of_scenario_parses_sizes():
    from lab.dist_scenarios import delay_of_scenario
    assert delay_of_scenario("delay", 2000.0) == 2000.0 * 1e-6
    assert delay_of_scenario("delay-5ms", 2000.0) == 5e-3
    assert delay_of_scenario("delay-10ms", 2000.0) == 10e-3
    assert abs(delay_of_scenario("delay-0.5ms", 2000.0) - 0.5e-3) < 1e-15
    for other in ("clean", "compute-hog", "nvlink-hog", "delay-0ms", "delay-0.0ms", "delay-5", "delay-5us",
                  "delay-ms", "delay--5ms", "delay-5.ms", "delay-5ms#2", "delay-5ms.r2", "xdelay-5ms", "Delay-5ms"):
        assert delay_of_scenario(other, 2000.0) is None, other


def test_burst_delays_honor_the_scenario_size():
    """scenario_on sets the running workload's burst size; BurstDelays.delay returns it during a burst
    (plain `delay`: the BurstDelays' own extra_us), the lanes and the barrier's collective stall too."""
    import time

    import lab.dist_scenarios as bd
    period_ms = 1e9  # ~11.6 days: the phase set through `epoch` below holds for the whole test
    d = BurstDelays(period_ms=period_ms, duty=0.5, extra_us=2000, epoch=time.time())
    job = DistJob(plan=None, exec=None, workloads=[], delays=d)
    try:
        for scenario, want in (("delay-5ms", 5e-3), ("delay-0.5ms", 0.5e-3), ("delay-10ms", 10e-3),
                               ("delay", 2e-3), ("clean", 0.0), ("compute-hog", 0.0)):
            bd.scenario_on(job, Workload("w", "ag-ep", [], 8, scenario), {}, rank=1)
            assert bool(bd.ACTIVE["delay"]) == (want > 0), scenario
            d.epoch = time.time()                          # inside the burst (first half of the period)
            assert abs(d.delay(0, 1) - want) < 1e-15, scenario
            assert abs(d.lane("recv", 1, 0)() - want) < 1e-15 and d.lane("send", 0, 1)() == 0.0
            assert abs(d.collective(0, 2) - want) < 1e-15 and d.delay(1, 1) == 0.0
            d.epoch = time.time() - 0.75 * period_ms * 1e-3  # between bursts
            assert d.delay(0, 1) == 0.0 and d.collective(0, 2) == 0.0
        # no BurstDelays on the job: plain `delay` has no size, off
        bd.scenario_on(DistJob(plan=None, exec=None, workloads=[]), Workload("w", "ag-ep", [], 8, "delay"), {}, 1)
        assert bd.ACTIVE["delay"] == 0.0
    finally:
        bd.ACTIVE["delay"] = 0.0


def test_hog_start_stop_cpu():
    from lab.hogs import Hog
    import time
    for kind in ("compute", "nvlink"):
        h = Hog(kind, device="cpu", devices=("cpu", "cpu"), mb=1, n=32).start()
        time.sleep(0.2)
        info = h.stop()
        assert info["returncode"] == 0 and info["iters"] > 0, info


def test_busy_timeline_merges_intervals_and_measures_spans():
    from lab.busy_timeline import BusyTimeline
    tl = BusyTimeline([(5.0, 7.0), (0.0, 2.0), (1.0, 3.0), (3.0, 4.0), (9.0, 9.0), (8.0, 10.0)])
    assert (tl.starts, tl.ends) == ([0.0, 5.0, 8.0], [4.0, 7.0, 10.0])  # overlapping and touching merged, empty dropped
    assert tl.busy(-1.0, 11.0) == 8.0 and tl.busy(4.0, 5.0) == 0.0 and tl.busy(3.5, 8.5) == 3.0
    assert tl.busy(6.0, 6.5) == 0.5 and tl.busy(7.0, 3.0) == 0.0 and BusyTimeline([]).busy(0.0, 1.0) == 0.0


def test_host_probe_credits_host_time_behind_any_device_work():
    """The paper's definition (busy_share): a batch's host time is hidden while the GPU runs anything of the
    rank, e.g. the batch before it; the own-work definition (hidden_share) credits only its own graphs."""
    import types

    import torch

    from lab.host_probe import HostProbe, merge_probes

    class Ev:  # CUDA event stand-in: a device timestamp in ms
        def __init__(self, ms):
            self.ms = ms

        def elapsed_time(self, end):
            return end.ms - self.ms

    inner = types.SimpleNamespace(device=torch.device("cuda"))
    probe = HostProbe(inner)
    probe._make_anchor = lambda: (Ev(0.0), 100.0)  # device time 0 ms == host time 100 s
    clock = iter([100.000, 100.010, 100.010, 100.020, 100.020, 100.025])
    import lab.host_probe as bd
    real = bd.time.perf_counter
    bd.time.perf_counter = lambda: next(clock)
    try:
        t = probe.start()
        inner.profile.append(("expert", Ev(4.0), Ev(12.0)))   # runs on past the batch's host span
        probe.add("expert", 8, t)
        t = probe.start()
        inner.profile.append(("attn", Ev(19.5), Ev(20.0)))    # 0.5 ms of its own work at the end
        probe.add("attn", 4, t)
        t = probe.start()                                      # its deferred completion: 5 ms, GPU idle
        probe.add("attn", 4, t, first=False)
    finally:
        bd.time.perf_counter = real
    m = merge_probes([probe.summary()])
    # attn, 15 ms of host time in two parts: own work hides 0.5 ms; any work: the expert graph until 12 ms and
    # its own 0.5 ms: 2.5 ms; one batch of 4 rows
    assert m["attn"]["batches"] == 1 and m["attn"]["mean_rows"] == 4 and abs(m["attn"]["host_us"] - 15_000) < 1e-6
    assert abs(m["attn"]["hidden_share"] - 0.5 / 15) < 1e-9 and abs(m["attn"]["busy_share"] - 2.5 / 15) < 1e-9
    # expert: own work 8 ms against 10 ms of wall; any work: busy 4..10 ms of its span
    assert abs(m["expert"]["hidden_share"] - 0.8) < 1e-9 and abs(m["expert"]["busy_share"] - 0.6) < 1e-9
    # the GPU ran 8 + 0.5 ms of the batches' 25 ms span (host 100.000-100.025 s), the same figure in every kind
    assert abs(m["attn"]["gpu_busy_share"] - 8.5 / 25) < 1e-9 and m["expert"]["gpu_busy_share"] == m["attn"]["gpu_busy_share"]


def test_host_probe_subtracts_a_routing_wait_once():
    """CudaExecutor counts a wait for the routing copy in staging.wait_s (PendingHost.wait) and again in
    stats.route_wait_s: a batch's host time is its wall minus that wait once (it was subtracted twice)."""
    import types

    import lab.host_probe as bd
    from lab.host_probe import HostProbe
    inner = types.SimpleNamespace(stats=types.SimpleNamespace(route_wait_s=0.0), staging=types.SimpleNamespace(wait_s=0.0))
    probe = HostProbe(inner)
    clock = iter([0.0, 0.010])
    real = bd.time.perf_counter
    bd.time.perf_counter = lambda: next(clock)
    try:
        t = probe.start()
        inner.stats.route_wait_s += 0.004   # route() timing its PendingHost.wait() ...
        inner.staging.wait_s += 0.004       # ... which counts the same 4 ms itself
        probe.add("attn", 8, t)
    finally:
        bd.time.perf_counter = real
    assert abs(probe.summary()["attn"]["host_s"] - 0.006) < 1e-12


def test_host_probe_hidden_share_and_expert_bandwidth():
    """The GPU bench's columns from a probe fed known times: a batch whose wall time is covered by its
    device time is fully hidden, one with no device work fully exposed; expert GB/s = the floor bytes
    of its distinct experts / device time, against the copy ceiling."""
    import types

    import numpy as np
    import torch

    from lab.host_probe import HostProbe, merge_probes
    from lab.floors import expert_batch_bytes

    class Ev:  # a CUDA event pair stand-in: elapsed_time in ms
        def __init__(self, ms):
            self.ms = ms

        def elapsed_time(self, end):
            return end.ms - self.ms

    inner = types.SimpleNamespace(device=torch.device("cuda"))  # a CUDA executor turns its event list on
    probe = HostProbe(inner, lambda active, rows: expert_batch_bytes(active, rows, 8, 4, 2))
    probe._make_anchor = lambda: (Ev(0.0), 0.0)
    assert inner.profile == []
    clock = iter([0.0, 0.010, 1.0, 1.010])  # two batches of 10 ms wall each
    import lab.host_probe as bd
    real = bd.time.perf_counter
    bd.time.perf_counter = lambda: next(clock)
    try:
        t = probe.start()
        inner.profile.append(("expert", Ev(0.0), Ev(10.0)))  # 10 ms of device work: all hidden
        probe.add("expert", 6, t, [np.array([1, 1, 2]), np.array([3, 2, 1])])
        t = probe.start()
        probe.add("attn", 4, t)  # no device events: its host time is not credited either way
    finally:
        bd.time.perf_counter = real
    s = probe.summary()
    assert s["expert"]["batches"] == 1 and s["expert"]["timed"] == 1 and s["expert"]["exposed_s"] == 0.0
    assert s["expert"]["expert_bytes"] == 3 * (3 * 8 * 4 + 2 * 4 + 8) * 2 + 2 * 6 * 8 * 2
    m = merge_probes([s, s], copy_bps=1e9)
    assert m["expert"]["batches"] == 2 and m["expert"]["hidden_share"] == 1.0
    assert abs(m["expert"]["GBps"] - s["expert"]["expert_bytes"] / 0.010 / 1e9) < 1e-12
    assert abs(m["expert"]["pct_copy"] - 100 * m["expert"]["GBps"]) < 1e-9
    assert m["attn"]["hidden_share"] is None and m["attn"]["device_us"] is None
    assert abs(m["attn"]["host_us"] - 10_000) < 1e-6


def test_probe_counts_a_device_routed_expert_batch_by_its_owned_slots():
    """A device-routed item carries every slot's id: the probe's bytes count the distinct experts this rank owns
    among them and only the owned slots as rows, from a copy taken after the batch's wall."""
    import types

    import numpy as np
    import torch

    from lab.host_probe import HostProbe
    from lab.floors import expert_batch_bytes

    class Ev:
        def __init__(self, ms):
            self.ms = ms

        def elapsed_time(self, end):
            return end.ms - self.ms

    inner = types.SimpleNamespace(device=torch.device("cuda"))
    probe = HostProbe(inner, lambda active, rows: expert_batch_bytes(active, rows, 8, 4, 2))
    probe._make_anchor = lambda: (Ev(0.0), 0.0)
    owned = torch.tensor([True, False, True, False])
    ids = torch.tensor([[0, 1], [2, 3], [0, 2]], dtype=torch.int32)  # owned slots: 0, 2, 0, 2 -> 2 experts, 4 rows
    copied = []
    t = probe.start()
    inner.profile.append(("expert", Ev(0.0), Ev(1.0)))
    probe.add("expert", 6, t, lambda: copied.append(1) or [(ids.float(), owned)])
    assert copied == [1]
    s = probe.summary()
    assert s["expert"]["rows"] == 6 and s["expert"]["expert_bytes"] == expert_batch_bytes(2, 4, 8, 4, 2)
    assert np.isclose(s["expert"]["expert_device_s"], 1e-3)


def test_itl_tail_tells_a_rank_wide_stall_from_scattered_slow_steps():
    from lab.itl_tail import describe, itl_tail
    # 10 requests homed on rank 0 stall together once (1.0 -> 1.3 s); rank 1's requests are steady
    reqs = []
    for i in range(10):
        tt = [0.1 * s for s in range(10)] + [1.3 + 0.1 * s for s in range(10)]
        reqs.append({"home": 0, "token_times": tt})
    for i in range(10):
        reqs.append({"home": 1, "token_times": [0.1 * s for s in range(20)]})
    t = itl_tail(reqs)  # the 10 stall gaps are the top 2.6%: the p99 is one of them
    assert t["gaps"] == 10 and t["windows"] == 1 and abs(t["threshold_ms"] - 400) < 1e-6
    w = t["top"][0]
    assert abs(w["t_s"] - 0.9) < 1e-9 and abs(w["ms"] - 400) < 1e-6 and w["homes"] == {0: 1.0}
    assert describe(t) == "10 gaps >= 400 ms in 1 window(s); longest 400 ms at 0.9 s (10 gaps, home 0: 100%)"
    # scattered: each request slow at its own time -> as many windows as gaps
    reqs = [{"home": i % 2, "token_times": [10.0 * i, 10.0 * i + 0.1, 10.0 * i + 0.6]} for i in range(6)]
    t = itl_tail(reqs, q=60)
    assert t["gaps"] == t["windows"] == 6 and itl_tail([]) == {} and describe({}) == "no gaps"
