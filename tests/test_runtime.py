"""The runtime produces the reference decoder's tokens, on 1-4 in-process ranks, for every policy.

Batch composition changes fp32 rounding (a 7-row matmul does not round like a 1-row one), so each
request is compared token by token up to the first step where the reference's top-2 logit margin is
under TOL: past a near-tie both answers are right. The tiny models' margins are mostly ~5e-2.
"""
from __future__ import annotations

import random
from functools import lru_cache

import pytest
import torch

from graph_ir.errors import UserError
from graph_ir.spec import load_spec
from lowering.plan import compile_plan
from lab.reference import ReferenceDecoder
from models.sampling import SamplingParams
from models.weights import random_weights
from runtime.drivers.cluster import Cluster, RunOptions, run_workload
from runtime.core.requests import Request
from runtime.core.scheduler import POLICIES

torch.set_num_threads(1)  # tiny matmuls: threads only contend (and other jobs share the 2 cores)

TOL = 1e-3
SPECS = "models/specs"


@lru_cache(maxsize=None)
def model(name: str):
    spec = load_spec(f"{SPECS}/{name}.yaml")
    w = random_weights(spec)
    return spec, w, ReferenceDecoder(spec, w)


@lru_cache(maxsize=None)
def reference(name: str, prompt: tuple, max_new: int, params: SamplingParams | None = None, ignore_eos=True,
              eos: tuple | None = None):
    _, _, ref = model(name)
    return ref.generate(list(prompt), max_new, params, eos_ids=list(eos) if eos is not None else None,
                        ignore_eos=ignore_eos)


def make_requests(vocab: int, n: int, seed: int, max_new: int = 6, max_prompt: int = 40, spread: float = 2e-3,
                  params: SamplingParams | None = None, ignore_eos: bool = True) -> list[Request]:
    """Mixed prompt lengths (1..max_prompt, long ones get chunked) arriving at staggered times."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        length = rng.choice([1, 2, rng.randint(3, max_prompt), max_prompt])
        prompt = [rng.randrange(3, vocab) for _ in range(length)]
        out.append(Request(i, f"req-{i}", prompt, max_new, params=params, ignore_eos=ignore_eos,
                           arrival=rng.uniform(0, spread) if i else 0.0))
    return out


def top2_margin(logits: torch.Tensor) -> float:
    v = torch.topk(logits.float(), 2).values
    return float(v[0] - v[1])


def assert_matches_reference(name: str, reqs: list[Request], ignore_eos=True, eos=None) -> int:
    """Returns how many tokens were compared (so a test can check it compared something)."""
    compared = 0
    for r in reqs:
        assert r.done, f"{r.name} did not finish"
        ref = reference(name, tuple(r.prompt), r.max_new_tokens, r.params, ignore_eos, eos)
        for s, tok in enumerate(ref.tokens):
            if r.params is None or r.params.greedy:
                if top2_margin(ref.logits[s]) < TOL:
                    break  # near-tie: either token is correct, and the rest may diverge
            assert s < len(r.output), f"{r.name}: stopped after {len(r.output)} tokens, reference has {ref.tokens}"
            assert r.output[s] == tok, f"{r.name} step {s}: runtime {r.output} vs reference {ref.tokens}"
            compared += 1
        else:
            assert len(r.output) == len(ref.tokens), f"{r.name}: {r.output} vs reference {ref.tokens}"
    return compared


def jitter(max_delay: float):
    def delay(src, dst, meta, nbytes, rng):
        return rng.uniform(0.0, max_delay)
    return delay


def run(name: str, ranks: int, reqs: list[Request], **opts):
    spec, w, _ = model(name)
    plan = compile_plan(spec, ranks, attn_cap=opts.pop("attn_cap", 16), block_size=opts.pop("block_size", 4))
    options = RunOptions(kv_blocks=opts.pop("kv_blocks", 128), **opts)
    return run_workload(plan, reqs, options, weights=w)


# Policies with the wave hold on (runtime/core/scheduler.py): holding changes when batches run, never tokens.
HELD = ["defrag:hold_fill=0.9,hold_us=1000", "mtfs:hold_fill=1,hold_us=500", "defrag:hold_fill=1,hold_us=1000,hold_ahead=1"]


@pytest.mark.parametrize("policy", sorted(POLICIES) + HELD)
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_exact_tokens_virtual_clock_with_link_jitter(ranks, policy):
    spec, _, _ = model("tiny-mixtral")
    reqs = make_requests(spec.vocab_size, 6, seed=ranks * 10 + len(policy))
    res = run("tiny-mixtral", ranks, reqs, policy=policy, clock="virtual", delay=jitter(400e-6), delay_seed=ranks)
    assert assert_matches_reference("tiny-mixtral", res.requests) > 20
    assert res.metrics["tokens"] == sum(len(r.output) for r in reqs)


@pytest.mark.parametrize("policy", sorted(POLICIES) + HELD[:1])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_exact_tokens_wall_clock(ranks, policy):
    spec, _, _ = model("tiny-mixtral")
    reqs = make_requests(spec.vocab_size, 5, seed=100 + ranks, spread=1e-3)
    res = run("tiny-mixtral", ranks, reqs, policy=policy, clock="wall")
    assert assert_matches_reference("tiny-mixtral", res.requests) > 15


@pytest.mark.parametrize("name,ranks", [("tiny-glm4-moe", 2), ("tiny-qwen2-moe", 3), ("tiny-deepseek-v2", 2),
                                        ("tiny-olmoe", 4), ("tiny-gpt-oss", 3), ("tiny-qwen3-moe", 2),
                                        ("tiny-deepseek-v3", 3), ("tiny-glm4-moe-lite", 2), ("tiny-dots1", 3),
                                        ("tiny-minimax-m2", 4), ("tiny-granitemoe", 2), ("tiny-ernie4-5-moe", 3),
                                        ("tiny-hunyuan-moe", 4)])
def test_exact_tokens_other_families(name, ranks):
    """Dense first layers, shared experts (gated too), MLA (latent cache), sinks + sliding windows, QK-norm,
    a sigmoid router with correction bias and group-limited top-k; GLM-4.7-Flash's MLA with v wider than nope, dense
    layers that are not a prefix (ERNIE), softmax routing with a correction bias, the q/k norm after RoPE (Hunyuan),
    Granite's embedding / residual / logits multipliers."""
    spec, _, _ = model(name)
    reqs = make_requests(spec.vocab_size, 4, seed=7, max_prompt=24)
    res = run(name, ranks, reqs, policy="aging", clock="virtual", delay=jitter(200e-6))
    assert assert_matches_reference(name, res.requests) > 10


@pytest.mark.parametrize("policy", ["defrag", "flfs"])
def test_one_row_prefill_remainders_wait_for_their_chunk_inside_decode_blocks(policy):
    """Prompts of cap + 1 tokens end in a one-row chunk: after a merge it travels in a block of one-row
    segments (AttnBlock) with decode tokens of other requests, and may only run once its previous chunk
    passed the layer. Many such prompts, arriving together with short ones: tokens equal the reference."""
    spec, _, _ = model("tiny-mixtral")
    rng = random.Random(5)
    reqs = [Request(i, f"req-{i}", [rng.randrange(3, spec.vocab_size) for _ in range(17 if i % 2 else 2)], 5,
                    ignore_eos=True, arrival=0.0) for i in range(10)]
    res = run("tiny-mixtral", 2, reqs, policy=policy, clock="virtual", delay=jitter(300e-6), delay_seed=3)
    assert assert_matches_reference("tiny-mixtral", res.requests) > 20


def test_chunked_prompts_arriving_into_decode_that_kept_no_kv_order():
    """While no chunked prompt is live, the engine neither records nor checks any row's K/V order (Request.kv_next:
    a request with one segment in flight cannot overtake itself). Prompts of cap + 1 tokens (two chunks, the second
    one row) arrive while short requests are decoding with that order unrecorded (their kv_next is stale): the chunks
    wait for each other, the decoding rows are not held up forever (the rule itself:
    test_kv_order_is_checked_only_for_chunked_requests). Tokens equal the reference; the engines' count of chunked
    requests is back to zero once every first token is sampled."""
    spec, w, _ = model("tiny-mixtral")
    rng = random.Random(8)
    reqs = [Request(i, f"req-{i}", [rng.randrange(3, spec.vocab_size) for _ in range(17 if i >= 6 else 2)], 12,
                    ignore_eos=True, arrival=0.0 if i < 6 else 4e-3) for i in range(10)]
    plan = compile_plan(spec, 2, attn_cap=16, block_size=4)
    cluster = Cluster(plan, __import__("runtime.executors.torch_executor", fromlist=["TorchExecutor"]).TorchExecutor(spec, w),
                      RunOptions(kv_blocks=128, clock="virtual", policy="defrag", delay=jitter(300e-6), delay_seed=4))
    res = cluster.run(reqs)
    assert assert_matches_reference("tiny-mixtral", res.requests) > 40
    short_end = min(r.t_finish for r in reqs[:6])
    assert all(r.t_admit < short_end for r in reqs[6:])  # the chunked prompts came in during decode
    assert [e._chunked for e in cluster.engines] == [0, 0] and not any(r.chunked for r in reqs)


def test_kv_order_is_checked_only_for_chunked_requests():
    """The eligibility rule itself: with no chunked request live every row may run; with one, only that request's
    rows wait for their K/V position, and a decoding request's stale kv_next holds nothing up (without this, its
    rows would sit out every other request's chunked prefill)."""
    from runtime.core.queues import AttnBlock, AttnItem
    spec, w, _ = model("tiny-mixtral")
    cluster = Cluster(compile_plan(spec, 1, attn_cap=16, block_size=4),
                      __import__("runtime.executors.torch_executor", fromlist=["TorchExecutor"]).TorchExecutor(spec, w),
                      RunOptions(kv_blocks=32, clock="virtual"))
    e = cluster.engines[0]
    decoding = Request(1, "decoding", [5, 6], 8, kv_next=[2] * spec.num_layers)  # stale: it is at position 7 now
    chunked = Request(2, "chunked", [5] * 20, 8, kv_next=[16] * spec.num_layers, chunked=True)
    e.requests.update({1: decoding, 2: chunked})
    eligible = e._attn_eligible(1)
    block = lambda: AttnBlock([1], [7], None, None, 0.0, 1)  # noqa: E731
    assert eligible(block()) and eligible(AttnItem(1, 7, 1, None, None, 0.0))  # nothing chunked live
    e._chunked = 1
    assert eligible(block()) and eligible(AttnItem(1, 7, 1, None, None, 0.0))
    assert eligible(AttnItem(2, 16, 4, None, None, 0.0)) and not eligible(AttnItem(2, 17, 3, None, None, 0.0))
    assert not eligible(AttnBlock([1, 2], [7, 19], None, None, 0.0, 2))


def test_sampling_with_seeds_matches_reference():
    spec, _, _ = model("tiny-mixtral")
    params = [SamplingParams(temperature=0.8, seed=1), SamplingParams(temperature=1.0, top_p=0.9, seed=2),
              SamplingParams(temperature=0.7, top_k=20, seed=3), None]
    reqs = make_requests(spec.vocab_size, 4, seed=3)
    for r, p in zip(reqs, params):
        r.params = p
    res = run("tiny-mixtral", 3, reqs, policy="defrag", clock="virtual", delay=jitter(300e-6))
    assert assert_matches_reference("tiny-mixtral", res.requests) > 15


def test_eos_stops_like_the_reference():
    spec, _, _ = model("tiny-mixtral")
    reqs = make_requests(spec.vocab_size, 4, seed=5, max_new=8, ignore_eos=False)
    # Make a token the reference emits mid-way through request 0 an EOS id, so stopping is exercised.
    eos_tok = reference("tiny-mixtral", tuple(reqs[0].prompt), 8, None, True, None).tokens[3]
    spec_eos = spec.model_copy(update={"eos_token_ids": [eos_tok]})
    _, w, _ = model("tiny-mixtral")
    plan = compile_plan(spec_eos, 2, attn_cap=16, block_size=4)
    res = run_workload(plan, reqs, RunOptions(kv_blocks=128, clock="virtual"), weights=w)
    assert reqs[0].finish_reason == "eos" and reqs[0].output[-1] == eos_tok
    assert assert_matches_reference("tiny-mixtral", res.requests, ignore_eos=False, eos=(eos_tok,)) > 5


def test_full_kv_makes_requests_wait_not_fail():
    """A pool that fits ~one request per rank at a time: all still finish, exactly, and nothing leaks."""
    spec, w, _ = model("tiny-mixtral")
    reqs = make_requests(spec.vocab_size, 8, seed=11, max_new=5, max_prompt=30, spread=0.0)
    plan = compile_plan(spec, 2, attn_cap=16, block_size=4)
    cluster = Cluster(plan, __import__("runtime.executors.torch_executor", fromlist=["TorchExecutor"]).TorchExecutor(spec, w),
                      RunOptions(kv_blocks=10, clock="virtual"))
    res = cluster.run(reqs)
    assert all(r.done for r in res.requests)
    assert assert_matches_reference("tiny-mixtral", res.requests) > 15
    for e in cluster.engines:
        assert e.kv.allocator.used_blocks == 0 and e.kv.sequences == 0 and len(e.merge) == 0
    # the pool was short: some requests had to wait for others to finish before admission
    assert sum(r.t_admit > r.arrival for r in reqs) >= 2


def test_policy_switch_mid_run_keeps_tokens_exact():
    spec, w, _ = model("tiny-mixtral")
    reqs = make_requests(spec.vocab_size, 6, seed=21)
    plan = compile_plan(spec, 3, attn_cap=16, block_size=4)
    from runtime.executors.torch_executor import TorchExecutor
    cycle = ["flfs", "aging", "mtfs", "defrag"]
    options = RunOptions(kv_blocks=128, clock="virtual", policy="defrag", trace=True)
    cluster = Cluster(plan, TorchExecutor(spec, w), options)
    options.progress = lambda done, total, tokens: [e.set_policy(cycle[done % len(cycle)]) for e in cluster.engines]
    res = cluster.run(reqs)
    assert assert_matches_reference("tiny-mixtral", res.requests) > 20
    used = {d["policy"] for d in res.trace.decisions}
    assert len(used) >= 3, used


def test_adaptive_wave_hold_learns_the_token_step_and_keeps_tokens_exact():
    """hold_step: each engine reports the time between consecutive tokens of the requests it samples
    to its policy, whose hold bound becomes hold_step x that step; the tokens stay the reference's."""
    spec, w, _ = model("tiny-mixtral")
    reqs = make_requests(spec.vocab_size, 6, seed=23)
    plan = compile_plan(spec, 2, attn_cap=16, block_size=4)
    from runtime.executors.torch_executor import TorchExecutor
    cluster = Cluster(plan, TorchExecutor(spec, w),
                      RunOptions(kv_blocks=128, clock="virtual", policy="defrag:hold_fill=1,hold_us=100,hold_step=0.5"))
    res = cluster.run(reqs)
    assert assert_matches_reference("tiny-mixtral", res.requests) > 20
    for e in cluster.engines:
        steps = [b - a for r in res.requests if r.home == e.rank for a, b in zip(r.token_times, r.token_times[1:])]
        assert steps and e.policy._step_s is not None
        assert min(steps) <= e.policy._step_s <= max(steps)
        assert e.policy.hold_bound_s() == 0.5 * e.policy._step_s != 100e-6


def test_trace_is_valid_chrome_json(tmp_path):
    import json
    spec, _, _ = model("tiny-mixtral")
    reqs = make_requests(spec.vocab_size, 3, seed=1)
    res = run("tiny-mixtral", 2, reqs, clock="virtual", trace=True)
    path = tmp_path / "t.json"
    res.trace.write(path, res.world_size)
    data = json.loads(path.read_text())
    batches = [e for e in data["traceEvents"] if e["ph"] == "X"]
    decisions = [e for e in data["traceEvents"] if e["ph"] == "i"]
    assert len(batches) == len(decisions) == res.metrics["batches"]
    d = decisions[0]["args"]
    assert {"t", "rank", "policy", "stage", "scores", "batch_rows"} <= set(d)
    assert {e["pid"] for e in batches} == {0, 1}


def test_wall_clock_with_link_delays():
    """Wall-clock driver waiting on delayed in-process deliveries (bounded sleeps, no hang)."""
    spec, _, _ = model("tiny-mixtral")
    reqs = make_requests(spec.vocab_size, 4, seed=31, max_new=4, max_prompt=20)
    res = run("tiny-mixtral", 3, reqs, policy="aging", clock="wall", delay=jitter(2e-3), delay_seed=5)
    assert assert_matches_reference("tiny-mixtral", res.requests) > 10


class _TokensLater:
    """A sample batch's tokens (an argmax copy in flight): on the host only after a few looks at ready(); their ids
    are "on the device" at once (step-ahead embeds them before the host reads them)."""

    def __init__(self, owner, value: list[int], looks: int) -> None:
        self.owner, self._value, self.looks = owner, value, looks

    def ready(self) -> bool:
        self.looks -= 1
        if self.looks >= 0:
            self.owner.not_ready += 1
        return self.looks < 0

    def wait(self) -> None:
        self.looks = -1

    def tokens(self) -> list[int]:
        assert self.looks < 0, "tokens read before they were ready"
        return self._value

    def device_ids(self, rows=None) -> torch.Tensor:
        self.owner.ahead += 1
        ids = torch.tensor(self._value, dtype=torch.long)
        return ids if rows is None else ids[rows]


class _AsyncSampleExecutor:
    """The CPU executor plus `sample_batch_start`, whose tokens are 'not yet on the host' for 3 looks."""

    def __init__(self, inner) -> None:
        self._inner, self.not_ready, self.ahead = inner, 0, 0

    def __getattr__(self, name):
        return getattr(self._inner, name)

    def sample_batch_start(self, logits, params, steps):
        return _TokensLater(self, self._inner.sample_batch(logits, params, steps), 3)


def _served_wall(wrapper, policy):
    """(the wrapped CPU executor, the result, the requests) of a 2-rank wall-clock run of tiny-mixtral."""
    from runtime.drivers.cluster import build_executor
    spec, w, _ = model("tiny-mixtral")
    plan = compile_plan(spec, 2, attn_cap=16, block_size=4)
    options = RunOptions(kv_blocks=128, clock="wall", policy=policy)
    ex = wrapper(build_executor(plan, options, weights=w))
    reqs = make_requests(spec.vocab_size, 5, seed=7, spread=1e-3)
    return ex, Cluster(plan, ex, options).run(reqs), reqs


@pytest.mark.parametrize("policy", ["defrag", HELD[0]])
def test_async_sampling_defers_sample_batches_and_keeps_tokens_exact(policy):
    """Asynchronous sampling: a sample batch whose tokens are not on the host yet is completed later (by
    next_batch), the rank keeps working meanwhile (the next step's rows queued with their ids still on the
    device: step-ahead), no request or token is lost."""
    ex, res, reqs = _served_wall(_AsyncSampleExecutor, policy)
    assert ex.not_ready > 0 and ex.ahead > 0  # batches really were deferred, and steps queued ahead of their tokens
    assert assert_matches_reference("tiny-mixtral", res.requests) > 15
    assert res.metrics["tokens"] == sum(len(r.output) for r in reqs)


def test_wait_deferred_blocks_on_the_oldest_deferred_batch():
    """Engine.wait_deferred (a driver's idle path): waits on the oldest deferred batch's tokens; False when
    nothing is deferred."""
    import types
    from collections import deque

    from runtime.core.engine import Engine
    waited = []
    first = types.SimpleNamespace(wait=lambda: waited.append("first"))
    second = types.SimpleNamespace(wait=lambda: waited.append("second"))
    e = types.SimpleNamespace(deferred=deque([types.SimpleNamespace(out={"pending": first}),
                                              types.SimpleNamespace(out={"pending": second})]))
    assert Engine.wait_deferred(e) is True and waited == ["first"]
    e.deferred.clear()
    assert Engine.wait_deferred(e) is False and waited == ["first"]


# ------------------------------------------------------------------ device-routed dispatch
@pytest.mark.parametrize("policy", ["defrag", "flfs", HELD[0]])
@pytest.mark.parametrize("ranks", [1, 2, 3, 4])
def test_device_routed_dispatch_matches_reference(use_options, ranks, policy):
    """dispatch=device (runtime/core/routed_rows.py): every owner gets the whole batch with its expert ids,
    returns all slots (zero where it holds none) and the home sums them: the same tokens as the reference."""
    use_options(dispatch="device")
    spec, _, _ = model("tiny-mixtral")
    reqs = make_requests(spec.vocab_size, 6, seed=ranks * 10 + len(policy))
    res = run("tiny-mixtral", ranks, reqs, policy=policy, clock="virtual", delay=jitter(400e-6), delay_seed=ranks)
    assert assert_matches_reference("tiny-mixtral", res.requests) > 20
    assert res.metrics["tokens"] == sum(len(r.output) for r in reqs)


@pytest.mark.parametrize("name,ranks", [("tiny-qwen2-moe", 3), ("tiny-deepseek-v2", 2), ("tiny-gpt-oss", 3)])
def test_device_routed_dispatch_other_families_and_wall_clock(use_options, name, ranks):
    """Shared experts (gated), MLA, sinks + windows; prompts longer than the attention cap (chunked prefill
    segments in the holder merge groups); the wall clock."""
    use_options(dispatch="device")
    spec, _, _ = model(name)
    reqs = make_requests(spec.vocab_size, 4, seed=7, max_prompt=24)
    res = run(name, ranks, reqs, policy="defrag", clock="wall")
    assert assert_matches_reference(name, res.requests) > 10


def test_dispatch_default_is_the_plans_and_the_option_overrides_it(use_options):
    """dispatch=auto (the default) takes the caller's default (the plan's dispatch); an explicit value wins."""
    from runtime.core.routed_rows import use_device_routing
    assert use_device_routing(True) and not use_device_routing(False)
    use_options(dispatch="host")
    assert not use_device_routing(True)
    use_options(dispatch="device")
    assert use_device_routing(False)


def test_plan_records_its_dispatch_and_the_engines_follow_it():
    """compile's --dispatch auto is device on cuda and host on cpu; the routes describe what that dispatch sends;
    ranks of a device-dispatch plan run the device-routed dispatch (here on the CPU twin) and still give the
    reference's tokens."""
    from lowering.plan import compile_plan
    from runtime.drivers.cluster import Cluster, RunOptions, build_executor
    spec, w, _ = model("tiny-gpt-oss")
    assert compile_plan(spec, 2, "cuda").cluster.dispatch == "device"
    assert compile_plan(spec, 2).cluster.dispatch == "host"
    with pytest.raises(UserError, match="option 'dispatch': got 'gpu'"):
        compile_plan(spec, 2, dispatch="gpu")
    host, dev = compile_plan(spec, 2, dispatch="host"), compile_plan(spec, 2, dispatch="device")
    H, k, b = spec.hidden_size, spec.experts.top_k, 4  # fp32 tiny model
    r_host = next(r for r in host.routes if r.kind == "dispatch")
    r_dev = next(r for r in dev.routes if r.kind == "dispatch")
    assert r_host.row_bytes == H * b and r_dev.row_bytes == H * b + 8 * k  # int32 ids and fp32 weights behind
    c_host = next(r for r in host.routes if r.kind == "combine")
    c_dev = next(r for r in dev.routes if r.kind == "combine")
    assert c_host.max_rows == host.caps.expert_rows and c_dev.max_rows == -(-dev.caps.expert_rows // k)  # a row per token
    assert r_dev.max_rows == dev.caps.attn_tokens and "whole attention batches" in r_dev.carries
    opts = RunOptions(policy="defrag")
    engines = Cluster(dev, build_executor(dev, opts, w), opts).engines
    assert all(e.device_routed for e in engines)
    assert not any(e.device_routed for e in Cluster(host, build_executor(host, opts, w), opts).engines)
    reqs = make_requests(spec.vocab_size, 4, seed=3, max_prompt=12)
    res = run_workload(dev, reqs, opts, weights=w)
    assert res.metrics["dispatch"] == "device-routed"
    assert assert_matches_reference("tiny-gpt-oss", res.requests) > 10


def test_dispatch_option_is_validated_and_device_needs_an_executor_that_selects(use_options):
    """A dispatch the options do not know is refused naming the valid ones; dispatch=device with an executor that
    runs no device-routed expert batch (the simulated one) is refused when the engine is built."""
    spec, _, _ = model("tiny-mixtral")
    with pytest.raises(UserError, match="dispatch='gpu'.*'auto', 'host' or 'device'"):
        use_options(dispatch="gpu")
    use_options(dispatch="device")
    with pytest.raises(ValueError, match="dispatch=device needs an executor that runs experts_routed"):
        run("tiny-mixtral", 2, make_requests(spec.vocab_size, 1, seed=1), policy="defrag", clock="virtual",
            executor="sim")
