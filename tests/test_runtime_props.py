"""Property tests: whatever the arrival order, message delays, rank count, policy and KV pressure,
no token is lost or duplicated, every request finishes, and the KV allocator ends empty.

The simulated executor makes every request's tokens a pure function of its own prompt (rows never
mix), so a run under any schedule must reproduce the canonical run's tokens exactly; the torch
executor runs fewer examples and is checked against the reference decoder.
"""
from __future__ import annotations

import random

import torch
from hypothesis import HealthCheck, given, settings, strategies as st

from graph_ir.spec import load_spec
from lowering.plan import compile_plan
from runtime.drivers.cluster import Cluster, RunOptions
from runtime.executors.sim_executor import SimExecutor
from runtime.core.requests import Request
from runtime.core.scheduler import POLICIES

torch.set_num_threads(1)

SPEC = load_spec("models/specs/tiny-mixtral.yaml")


def make(prompts, max_new, arrivals):
    return [Request(i, f"r{i}", list(p), m, ignore_eos=True, arrival=a)
            for i, (p, m, a) in enumerate(zip(prompts, max_new, arrivals))]


def run_cluster(reqs, ranks, executor, clock="virtual", policy="defrag", max_delay=0.0, seed=0, kv_blocks=256,
                attn_cap=8):
    plan = compile_plan(SPEC, ranks, attn_cap=attn_cap, block_size=4)
    delay = (lambda s, d, m, n, rng: rng.uniform(0.0, max_delay) if rng.random() < 0.7 else 0.0) if max_delay else None
    cluster = Cluster(plan, executor, RunOptions(policy=policy, clock=clock, kv_blocks=kv_blocks, delay=delay,
                                                 delay_seed=seed))
    return cluster, cluster.run(reqs)


def assert_clean(cluster, reqs):
    for r in reqs:
        assert r.done and r.finish_reason == "length", r.name
        assert len(r.output) == r.max_new_tokens == len(r.token_times), r.name
        assert r.token_times == sorted(r.token_times)
    for e in cluster.engines:
        assert e.idle(), e.state()
        assert not e.requests
        assert e.kv.allocator.used_blocks == 0 and e.kv.sequences == 0
    assert cluster.hub.in_flight() == 0
    assert sum(e.metrics.tokens for e in cluster.engines) == sum(len(r.output) for r in reqs)


workloads = st.integers(1, 8).flatmap(lambda n: st.tuples(
    st.lists(st.lists(st.integers(3, SPEC.vocab_size - 1), min_size=1, max_size=30), min_size=n, max_size=n),
    st.lists(st.integers(1, 6), min_size=n, max_size=n),
    st.lists(st.floats(0.0, 2e-3), min_size=n, max_size=n)))


@given(work=workloads, ranks=st.integers(1, 4), policy=st.sampled_from(sorted(POLICIES)),
       max_delay=st.sampled_from([0.0, 50e-6, 1e-3]), seed=st.integers(0, 2 ** 16),
       kv_blocks=st.sampled_from([9, 16, 256]))
@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_any_schedule_loses_and_duplicates_nothing(work, ranks, policy, max_delay, seed, kv_blocks):
    prompts, max_new, arrivals = work
    sim = SimExecutor.for_spec(SPEC, seed=1)
    canon = make(prompts, max_new, [0.0] * len(prompts))
    run_cluster(canon, 1, sim, policy="flfs")
    reqs = make(prompts, max_new, arrivals)
    cluster, _ = run_cluster(reqs, ranks, sim, policy=policy, max_delay=max_delay, seed=seed, kv_blocks=kv_blocks)
    assert_clean(cluster, reqs)
    assert [r.output for r in reqs] == [r.output for r in canon]


@given(seed=st.integers(0, 2 ** 16), ranks=st.integers(2, 4), policy=st.sampled_from(sorted(POLICIES)))
@settings(max_examples=8, deadline=None, suppress_health_check=[HealthCheck.too_slow])
def test_torch_executor_under_random_delays_matches_reference(seed, ranks, policy):
    from test_runtime import assert_matches_reference, make_requests, model
    from runtime.executors.torch_executor import TorchExecutor
    spec, w, _ = model("tiny-mixtral")
    rng = random.Random(seed)
    reqs = make_requests(spec.vocab_size, 4, seed=seed, max_new=4, max_prompt=20)
    rng.shuffle(reqs)  # submission order differs from rid order
    cluster, res = run_cluster(reqs, ranks, TorchExecutor(spec, w), policy=policy, max_delay=1e-3, seed=seed,
                               kv_blocks=24)
    assert_clean(cluster, reqs)
    assert assert_matches_reference("tiny-mixtral", res.requests) > 0
