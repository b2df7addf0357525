"""Barrier EP baselines produce the reference decoder's tokens, and the streaming engine's."""
import pytest
import torch

from graph_ir.spec import load_spec
from lowering.plan import compile_plan
from models.reference import ReferenceDecoder
from models.weights import random_weights
from runtime.barrier import run_barrier
from runtime.cluster import RunOptions, run_workload
from runtime.executor import TorchExecutor
from runtime.interference import Bursts, LinkSchedule
from runtime.requests import Request
from runtime.routing_override import KeyedRoutingExecutor, ZipfRouting

MAX_NEW = 6


@pytest.fixture(scope="module")
def model():
    spec = load_spec("models/specs/tiny.yaml")
    w = random_weights(spec)
    g = torch.Generator().manual_seed(1)
    prompts = [torch.randint(3, spec.vocab_size, (n,), generator=g).tolist() for n in (5, 9, 3, 12, 1)]
    ref = ReferenceDecoder(spec, w)
    want = [ref.generate(p, MAX_NEW, ignore_eos=True) for p in prompts]
    return spec, w, prompts, want


def _requests(prompts, spread=1e-3):
    return [Request(i, f"r{i}", p, MAX_NEW, ignore_eos=True, arrival=spread * i) for i, p in enumerate(prompts)]


def _agree_up_to_near_tie(got, ref, tol=1e-4):
    """Tokens equal until the first step whose reference top-2 logit margin is below `tol`."""
    for step, (a, b) in enumerate(zip(got, ref.tokens)):
        top2 = torch.topk(ref.logits[step], 2).values
        if float(top2[0] - top2[1]) < tol:
            return True
        if a != b:
            return False
    return len(got) == len(ref.tokens)


@pytest.mark.parametrize("ranks", [1, 2, 4])
@pytest.mark.parametrize("mode", ["ag", "a2a"])
def test_barrier_tokens_equal_reference(model, ranks, mode):
    spec, w, prompts, want = model
    res = run_barrier(compile_plan(spec, ranks), TorchExecutor(spec, w), _requests(prompts), mode, kv_blocks=32)
    for req, ref in zip(res.requests, want):
        assert req.finish_reason == "length" and len(req.token_times) == MAX_NEW
        assert _agree_up_to_near_tie(req.output, ref), (req.name, req.output, ref.tokens)


@pytest.mark.parametrize("mode", ["ag", "a2a"])
def test_link_delays_change_time_not_tokens(model, mode):
    spec, w, prompts, want = model
    plan = compile_plan(spec, 3)
    clean = run_barrier(plan, TorchExecutor(spec, w), _requests(prompts), mode, kv_blocks=32)
    slow = LinkSchedule(latency_s=20e-6, effects=(Bursts(period_s=2e-3, duty=0.5, extra_delay_s=1e-3,
                                                         links=frozenset({(0, 1)})),))
    hit = run_barrier(plan, TorchExecutor(spec, w), _requests(prompts), mode, kv_blocks=32, link_delay=slow.delay)
    assert [r.output for r in hit.requests] == [r.output for r in clean.requests]
    # One slow link stalls every rank at every collective: the whole run is slower.
    assert hit.elapsed > 1.5 * clean.elapsed
    assert set(hit.link_bytes) == {f"{s}->{d}" for s in range(3) for d in range(3) if s != d}


def test_barrier_and_streaming_agree_under_synthetic_routing(model):
    spec, w, prompts, _ = model
    plan = compile_plan(spec, 4)
    router = ZipfRouting(spec.experts.num_experts, spec.experts.top_k, s=1.2, drift_every=3, seed=7)
    ex = KeyedRoutingExecutor(TorchExecutor(spec, w), router)
    a2a = run_barrier(plan, ex, _requests(prompts), "a2a", kv_blocks=32, router=router)
    ag = run_barrier(plan, ex, _requests(prompts), "ag", kv_blocks=32, router=router)
    streaming = run_workload(plan, _requests(prompts), RunOptions(clock="virtual", kv_blocks=32), weights=w)
    # The streaming run above used the model router; rerun it with the override for the comparison.
    from runtime.cluster import Cluster
    stream_z = Cluster(plan, ex, RunOptions(clock="virtual", kv_blocks=32)).run(_requests(prompts))
    assert [r.output for r in a2a.requests] == [r.output for r in stream_z.requests]
    assert [r.output for r in ag.requests] == [r.output for r in stream_z.requests]
    assert [r.output for r in stream_z.requests] != [r.output for r in streaming.requests]
