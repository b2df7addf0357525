"""Expert replicas at run time: the copy a home sends its rows to is chosen per batch from live state
(runtime/core/replica_choice.py), and any choice keeps the reference tokens."""
from __future__ import annotations

import numpy as np
import pytest

from lab.barrier import run_barrier
from lab.chaos import ChaosDelays
from lab.static_replicas import static_owners
from lowering.plan import Placement, compile_plan
from runtime.core.replica_choice import HALF_LIFE_S, ReplicaChoice
from runtime.core.scheduler import POLICIES
from runtime.drivers.cluster import RunOptions, run_workload
from runtime.drivers.multiproc import run_workloads_multiprocess
from runtime.executors.torch_executor import TorchExecutor
from test_runtime import HELD, assert_matches_reference, jitter, make_requests, model

NAME = "tiny-mixtral"


def replicated(ranks: int, every: bool, **compile_kw):
    """A plan whose experts all have a copy on every rank (every=True) or with E/2 copies per layer (a partial
    replication: some rows must still cross)."""
    spec, _, _ = model(NAME)
    kw = dict(attn_cap=16, block_size=4) | compile_kw
    E = spec.experts.num_experts
    plan = compile_plan(spec, ranks, replicas=E * (ranks - 1) if every else E // 2, **kw)
    for layer in spec.moe_layers:
        for e in range(spec.experts.num_experts):
            copies = plan.placement.copies(layer, e)
            assert len(copies) == len(set(copies))
            assert not every or sorted(copies) == list(range(ranks))
    return plan


def test_the_rule_sends_rows_to_the_copy_that_turns_them_around_soonest():
    T = 1 << 32  # merge group g's rows have tags g << 32 ... (runtime/core/merge.py TAG_SHIFT)
    # 3 ranks, layer 0: expert 0 on rank 1 with a copy on 2; expert 1 on rank 0, not replicated
    rc = ReplicaChoice([[1, 0]], [[[2], []]], rank=0, world=3)
    assert rc.owners(0, 0.0).tolist() == [1, 0]  # nothing measured: a tie, to the lower rank
    rc.sent(gid=7, now=0.0)
    rc.returned(1, (7 * T, 2), now=0.010)  # rank 1 took 10 ms
    rc.returned(2, np.array([7 * T + 2]), now=0.001)  # rank 2 took 1 ms (the array form of tags)
    assert rc.owners(0, 0.001).tolist() == [2, 0]
    rc.sent(gid=8, now=0.002)
    for _ in range(20):  # rank 2 becomes slow, rank 1 recovered
        rc.returned(2, (8 * T, 1), now=0.050)
        rc.returned(1, (8 * T, 1), now=0.0021)
    assert rc.owners(0, 0.050).tolist() == [1, 0]
    # an estimate not refreshed decays (HALF_LIFE_S), so a rank once slow gets rows again
    rc = ReplicaChoice([[1]], [[[2]]], rank=0, world=3)
    rc.sent(0, 0.0)
    rc.returned(1, (0, 1), 0.010)
    rc.returned(2, (0, 1), 0.002)
    assert rc.owners(0, 0.010).tolist() == [2]
    later = 0.010 + 10 * HALF_LIFE_S
    rc.sent(1, later - 0.002)
    rc.returned(2, (1 << 32, 1), later)  # rank 2 measured again; rank 1's old estimate has decayed 1,000-fold
    assert rc.owners(0, later).tolist() == [1]
    # ties go to this rank (no link), and a layer without copies keeps its owner table as it is
    rc = ReplicaChoice([[1], [1]], [[[0]], []], rank=0, world=2)
    assert rc.owners(0, 0.0).tolist() == [0]
    assert rc.owners(1, 0.0) is rc.owner[1]


@pytest.mark.parametrize("policy", sorted(POLICIES) + HELD[:1])
@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_replicas_keep_the_reference_tokens_in_process(ranks, policy):
    spec, w, _ = model(NAME)
    for every in (True, False):
        reqs = make_requests(spec.vocab_size, 8, seed=ranks * 7 + len(policy))
        res = run_workload(replicated(ranks, every), reqs,
                           RunOptions(policy=policy, kv_blocks=128, clock="virtual", delay=jitter(2e-4)),
                           weights=w)
        assert assert_matches_reference(NAME, res.requests) > 10


def test_live_choice_routes_around_a_slow_link():
    """2 ranks, every expert on both: with the link 1 -> 0 slow, home 1 keeps its rows at home, and so sends fewer
    rows over it than without replicas (where half of them must cross)."""
    spec, w, _ = model(NAME)

    def slow(src, dst, meta, nbytes, rng):
        return 5e-3 if src == 1 else 1e-5

    sent = {}
    for name, plan in (("plain", compile_plan(spec, 2, attn_cap=16, block_size=4)), ("replicas", replicated(2, True))):
        res = run_workload(plan, make_requests(spec.vocab_size, 8, seed=5), RunOptions(kv_blocks=128, clock="virtual",
                                                                       delay=slow), weights=w)
        assert assert_matches_reference(NAME, res.requests) > 10
        sent[name] = res.metrics["messages"]
    assert sent["replicas"] < sent["plain"]


@pytest.mark.parametrize("ranks", [2, 3, 4])
def test_replicas_keep_the_reference_tokens_in_rank_processes_under_chaos(ranks):
    spec, _, _ = model(NAME)
    plan = replicated(ranks, ranks == 2)
    wl = [(make_requests(spec.vocab_size, 6, seed=40 * ranks + i), RunOptions(policy=p, kv_blocks=128))
          for i, p in enumerate(sorted(POLICIES))]
    results = run_workloads_multiprocess(plan, wl, chaos=ChaosDelays(seed=4, max_delay_s=0.003, probability=0.5),
                                         timeout=80)
    for res, (reqs, _) in zip(results, wl):
        assert all(r.done for r in reqs)
        assert assert_matches_reference(NAME, res.requests) > 10


def test_replicas_refuse_the_device_routed_dispatch():
    spec, _, _ = model(NAME)
    with pytest.raises(Exception, match="dispatch"):
        compile_plan(spec, 2, replicas=2, dispatch="device")


@pytest.mark.parametrize("mode", ["ag", "a2a"])
@pytest.mark.parametrize("ranks", [2, 3])
def test_barrier_baselines_with_static_replicas_keep_the_reference_tokens(ranks, mode):
    """The barrier baselines get the same replicas, chosen statically (lab/static_replicas.py)."""
    spec, w, _ = model(NAME)
    for every in (True, False):
        reqs = make_requests(spec.vocab_size, 6, seed=ranks, max_prompt=8)
        res = run_barrier(replicated(ranks, every), TorchExecutor(spec, w), reqs, mode, kv_blocks=128)
        assert assert_matches_reference(NAME, res.requests) > 10


def test_static_replicas_prefer_the_homes_own_copy_then_spread():
    # 3 ranks, one layer: expert 0 on rank 0 with a copy on 1, expert 1 on rank 2 alone
    table = static_owners(Placement(expert_rank=[[0, 2]], replicas=[[[1], []]]), 3)[0]
    assert table.tolist() == [[0, 2], [1, 2], [0, 2]]  # home 2 holds no copy of expert 0: copy 2 mod 2 = rank 0


def test_barrier_baselines_refuse_a_disaggregated_placement():
    spec, w, _ = model(NAME)
    plan = compile_plan(spec, 3, attention_ranks=1)
    with pytest.raises(ValueError, match="attention on every rank"):
        run_barrier(plan, TorchExecutor(spec, w), make_requests(spec.vocab_size, 2, seed=1), "ag", kv_blocks=32)


def test_the_cost_model_charges_each_further_distinct_expert():
    from runtime.executors.cost_model import CostModel
    c = CostModel(expert_fixed=100e-6, expert_per_row=1e-6, expert_per_expert=10e-6)
    assert c.duration("expert", 4, experts=3) == pytest.approx(100e-6 + 4e-6 + 20e-6)
    assert c.duration("expert", 4) == c.duration("expert", 4, experts=1) == pytest.approx(104e-6)
    assert c.duration("attn", 4, experts=3) == CostModel().duration("attn", 4)  # attention: no experts


def test_bench_runs_every_system_on_its_own_replicas_side_by_side(tmp_path):
    """`NAME+rN` systems run on the plan compiled with N replicas, `streaming+rNs` with the static choice; every cell
    finishes every request and the systems without a suffix run on the plain plan."""
    from graph_ir.spec import load_spec
    from lab.bench import run_bench
    from lab.bench_config import BenchConfig
    cfg = BenchConfig.model_validate({
        "ranks": 3, "clock": "virtual", "executor": "sim", "peak_window_s": 0.05,
        "workload": {"lengths": "fixed:8:6", "requests": 12, "rate": 2000},
        "cost": {"expert_per_expert_us": 10},
        "systems": ["streaming", "streaming+r8", "streaming+r8s", "ag-ep+r8"], "policies": ["defrag"],
        "baseline": "ag-ep+r8",
        "scenarios": {"clean": {"latency_us": 40},
                      "slow-link": {"latency_us": 40, "bursts": [{"period_ms": 2, "duty": 1.0, "extra_delay_us": 2000,
                                                                   "links": [[0, 1], [1, 0]]}]}},
    })
    doc = run_bench(cfg, load_spec("models/specs/tiny.yaml"), tmp_path)
    by = {(r["label"], r["scenario"]): r for r in doc["results"]}
    assert sorted({label for label, _ in by}) == ["ag-ep+r8", "streaming+r8/defrag", "streaming+r8s/defrag",
                                                  "streaming/defrag"]
    assert all(r["output_tokens"] == 12 * 6 and r["unfinished"] == 0 for r in doc["results"])
    # the link 0 <-> 1 is slow all the time: live choice stops sending rows over it, static choice cannot
    assert by["streaming+r8/defrag", "slow-link"]["tokens_per_s"] > by["streaming+r8s/defrag", "slow-link"]["tokens_per_s"]
    with pytest.raises(Exception, match="unknown system"):
        run_bench(cfg.model_copy(update={"systems": ["ag-ep+r8s"], "baseline": "ag-ep+r8s"}),
                  load_spec("models/specs/tiny.yaml"), tmp_path / "x")
