"""A disaggregated placement (dataflow compile --attention-ranks K): ranks 0..K-1 run attention and home the
requests, the others hold the experts only; the tokens are the reference's."""
from __future__ import annotations

import pytest

from lab.chaos import ChaosDelays
from lowering.plan import compile_plan
from runtime.drivers.cluster import RunOptions, run_workload
from runtime.drivers.multiproc import run_workloads_multiprocess
from test_runtime import assert_matches_reference, jitter, make_requests, model

NAME = "tiny-mixtral"


@pytest.mark.parametrize("ranks, attention", [(2, 1), (3, 1), (4, 2)])
def test_attention_ranks_home_every_request_and_keep_the_reference_tokens(ranks, attention):
    spec, w, _ = model(NAME)
    plan = compile_plan(spec, ranks, attn_cap=16, block_size=4, attention_ranks=attention)
    reqs = make_requests(spec.vocab_size, 8, seed=ranks)
    res = run_workload(plan, reqs, RunOptions(kv_blocks=128, clock="virtual", delay=jitter(2e-4)), weights=w)
    assert assert_matches_reference(NAME, res.requests) > 10
    assert {r.home for r in reqs} == set(range(attention))


def test_attention_ranks_in_rank_processes_with_replicas_under_chaos():
    spec, _, _ = model(NAME)
    plan = compile_plan(spec, 4, attn_cap=16, block_size=4, attention_ranks=2, replicas=4)
    reqs = make_requests(spec.vocab_size, 8, seed=9)
    [res] = run_workloads_multiprocess(plan, [(reqs, RunOptions(kv_blocks=128, home_policy="round_robin"))],
                                       chaos=ChaosDelays(seed=2, max_delay_s=0.003, probability=0.5), timeout=80)
    assert assert_matches_reference(NAME, res.requests) > 10
    assert {r.home for r in reqs} == {0, 1}
