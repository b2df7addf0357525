"""End to end on the CUDA executor's CPU twin: the engine with it produces the reference decoder's tokens (every
policy, host- and device-routed dispatch, step-ahead with EOS draining, prompts arriving during decode), and the
device-routed executor still hands its graph's routing to host callers (the barrier baselines).
"""
from __future__ import annotations

import random
import time

import pytest
import torch

from lowering.plan import compile_plan
from lab.reference import ReferenceDecoder
from models.sampling import SamplingParams
from runtime.drivers.cluster import RunOptions, run_workload
from runtime.executors.torch_executor import TorchExecutor
from runtime.executors.cuda_executor import PROMPT_PATHS, CudaExecutor
from runtime.core.requests import Request
from runtime.core.routed_rows import pack

from test_executor_cuda import model

torch.set_num_threads(1)


# ---------------------------------------------------------------------------------------------
# end to end: the engine with the CPU twin produces the reference tokens


def _margin(logits):
    v = torch.topk(logits.float(), 2).values
    return float(v[0] - v[1])


@pytest.mark.parametrize("policy", ["defrag", "mtfs", "flfs"])
def test_engine_with_twin_matches_reference(policy):
    _twin_matches_reference(policy)


@pytest.mark.parametrize("ranks", [1, 2])
def test_device_routed_dispatch_with_twin_matches_reference(use_options, monkeypatch, ranks):
    """dispatch=device through the CUDA executor's twin: the routing stays in a device copy (no host
    copy), owners select their slots through the expert graph's static buffers (padding id for the rest, zeroed
    after) and return per-token partial sums, which
    the home adds. An expert batch of the home's own item alone writes into its merge group's buffer (`out`): every
    batch on one rank (on two ranks here each batch holds both homes' waves)."""
    use_options(dispatch="device")
    calls = []
    real = CudaExecutor.experts_routed

    def spy(self, layer, payloads, owned, out=None):
        calls.append((len(payloads), out is not None))
        return real(self, layer, payloads, owned, out)
    monkeypatch.setattr(CudaExecutor, "experts_routed", spy)
    monkeypatch.setattr(CudaExecutor, "route_arrays", lambda *a: pytest.fail("the routing went to the host"))
    _twin_matches_reference("defrag:hold_fill=1,hold_us=2000", ranks)
    assert calls and (ranks > 1 or all(into for _, into in calls))


def test_attention_inputs_written_in_place_by_the_combine_with_twin_match_reference(use_options, monkeypatch):
    """One rank (one engine on its executor, as each process of a multi-GPU run has): the combine before an attention
    batch writes that batch's input in place (CudaExecutor._claim_attn_input), and tokens still equal the
    reference's. (In-process ranks sharing one executor take turns at a bucket and mostly back off.)"""
    use_options(dispatch="device")
    in_place = []  # per static attention batch: its input was already there (no copy)
    real_input = CudaExecutor._attn_input

    def spy_input(self, b, h):
        out = real_input(self, b, h)
        in_place.append(out is None)
        return out
    monkeypatch.setattr(CudaExecutor, "_attn_input", spy_input)
    _twin_matches_reference("defrag:hold_fill=1,hold_us=2000", ranks=1)
    assert sum(in_place) >= len(in_place) // 2, f"{sum(in_place)} of {len(in_place)} attention inputs in place"


@pytest.mark.parametrize("dispatch", ["host", "device"])
def test_a_decode_wave_hands_every_layer_the_same_segments_list(use_options, monkeypatch, dispatch):
    """A decode wave's (rids, pos) lists move through its layers as they are, so each layer's batch gets the list
    the layer before got (the executor's table-row lookup keys on it), and the tokens still equal the reference."""
    use_options(dispatch=dispatch)
    calls = []
    real = CudaExecutor.attention

    def spy(self, layer, h, positions, segments, kv):
        calls.append((layer, segments, positions))
        return real(self, layer, h, positions, segments, kv)
    monkeypatch.setattr(CudaExecutor, "attention", spy)
    _twin_matches_reference("defrag:hold_fill=1,hold_us=2000")
    layers_of: dict[int, list] = {}  # segments list (by identity; every one is kept alive in `calls`) -> layers
    for layer, segments, _ in calls:
        layers_of.setdefault(id(segments), []).append(layer)
    waves = [ls for ls in layers_of.values() if len(ls) > 1]
    # consecutive layers (from layer 0, or from the layer after one whose batch was made of separate one-row items)
    assert len(waves) >= 6 and all(ls == list(range(ls[0], ls[0] + len(ls))) for ls in waves)
    for layer, segments, positions in calls:  # the lists themselves as the general path makes them
        assert len(positions) == sum(n for _, _, n in segments)


def test_experts_routed_equals_the_torch_executors_host_side_selection(use_options, monkeypatch):
    """The CUDA executor's device-side selection (static buffers, the expert graph with not-owned slots as
    sentinels anywhere in the batch, zeroed after) equals TorchExecutor.experts_routed's host-side one, bit for bit,
    for several items, float or integer ids, and batches below and above the largest bucket."""
    use_options(dispatch="device")
    spec, w = model("tiny-gpt-oss")
    ce = CudaExecutor(spec, w, compile_plan(spec, 2), torch.device("cpu"))
    te = TorchExecutor(spec, w)
    E, k, H = spec.experts.num_experts, spec.experts.top_k, spec.hidden_size
    g = torch.Generator().manual_seed(0)
    layer = spec.moe_layers[0]
    owned = torch.zeros(E, dtype=torch.bool)
    owned[::2] = True
    for T in (1, 3, 7, 2, 300, 1):  # 300 tokens x k slots: above the largest expert bucket (eager)
        xs = [torch.randn(T, H, generator=g), torch.randn(2, H, generator=g)]
        ids = [torch.randint(0, E, (T, k), generator=g), torch.randint(0, E, (2, k), generator=g).float()]
        ids[0][0] = torch.arange(k) * 2 + 1  # token 0: experts this rank does not hold only
        payloads = [pack(x, i, torch.rand(i.shape, generator=g)) for x, i in zip(xs, ids)]
        got, want = ce.experts_routed(layer, payloads, owned), te.experts_routed(layer, payloads, owned)
        assert got.shape == (T + 2, H) and torch.equal(got, want)
        none_here = ~owned[torch.cat(ids).long()].any(dim=1)
        assert none_here[0] and not got[none_here].any()  # tokens with no expert held here: zero
        b, static = ce._expert_bucket((T + 2) * k)
        if static:  # the bucket's rows past this batch hold padding tails (the next graph replay computes none of them),
            # written again only after a longer batch (7 -> 2 tokens here)
            tails = ce._routed_bufs(b, True)["payload"][T + 2:, H:]
            assert torch.equal(tails, ce._padding_tail().expand_as(tails))


def _twin_matches_reference(policy, ranks: int = 2):
    name = "tiny-gpt-oss"
    spec, w = model(name)
    ref = ReferenceDecoder(spec, w)
    rng = random.Random(5)
    reqs = []
    for i in range(6):
        n = rng.choice([1, 1, 3, 12])  # one-token prompts run the decode (bucketed) path from step 0
        reqs.append(Request(i, f"r{i}", [rng.randrange(3, spec.vocab_size) for _ in range(n)], 6, ignore_eos=True,
                            arrival=0.0))
    plan = compile_plan(spec, ranks)
    res = run_workload(plan, reqs, RunOptions(policy=policy, executor="cuda", kv_blocks=64), weights=w)
    assert _tokens_equal_reference(ref, res.requests) >= 20


def _tokens_equal_reference(ref: ReferenceDecoder, requests) -> int:
    """Assert every request's tokens equal the reference decoder's, each up to the first step whose top two logits
    nearly tie; returns how many tokens were compared."""
    compared = 0
    for r in requests:
        want = ref.generate(r.prompt, r.max_new_tokens, ignore_eos=True)
        for s, tok in enumerate(want.tokens):
            if _margin(want.logits[s]) < 1e-3:
                break
            assert r.output[s] == tok, f"{r.name} step {s}: {r.output} vs {want.tokens}"
            compared += 1
    return compared


@pytest.mark.parametrize("ranks,slow", [(1, False), (2, False), (1, True), (2, True)])
def test_step_ahead_keeps_tokens_and_lets_eos_requests_drain(monkeypatch, ranks, slow):
    """Step-ahead (Engine.step_ahead) through the CUDA executor's twin, wall clock (asynchronous sampling): a sample
    batch's next step is queued at its launch with its ids on the device. With an EOS id that requests reach
    mid-run, a request that samples it while its next row is already queued drains: its output ends at the EOS as
    the reference's does, its extra row's token is dropped, its KV blocks come back, every request finishes. A third
    of the requests sample (temperature, top-p) on the device, stepped ahead too: their step index counts the
    samples not read yet.
    `slow`: each batch's tokens reach the host 30 ms after its launch (a device behind the host), so samples are still
    unread when the next step's are launched and when such a row, merged with a later prompt's rows, reaches the
    last layer (whether it is sampled is told by its position); every third sample batch is sampled synchronously
    (as with an executor without asynchronous sampling), after the unread ones are read (tokens in step order)."""
    from collections import Counter

    from runtime.core.engine import Engine
    from runtime.executors.cuda_sampling import DeviceLogits
    engines, queued, drained = [], [], []
    real_init, real_ahead, real_finish = Engine.__init__, Engine._step_ahead, Engine._finish

    def spy_init(self, *a, **k):
        real_init(self, *a, **k)
        engines.append(self)

    def spy_ahead(self, reqs, pending):
        ahead = real_ahead(self, reqs, pending)
        queued.append(sum(ahead or ()))
        return ahead

    def spy_finish(self, req, reason, now, row_queued=False):
        drained.append(row_queued)
        return real_finish(self, req, reason, now, row_queued)
    monkeypatch.setattr(Engine, "__init__", spy_init)
    monkeypatch.setattr(Engine, "_step_ahead", spy_ahead)
    monkeypatch.setattr(Engine, "_finish", spy_finish)
    if slow:
        real_init_logits, real_ready, real_wait = DeviceLogits.__init__, DeviceLogits.ready, DeviceLogits.wait

        def init_logits(self, *a, **k):
            real_init_logits(self, *a, **k)
            self._due = time.perf_counter() + 0.03

        def late_ready(self):
            return time.perf_counter() >= self._due and real_ready(self)

        def late_wait(self):
            time.sleep(max(0.0, self._due - time.perf_counter()))
            real_wait(self)
        monkeypatch.setattr(DeviceLogits, "__init__", init_logits)
        monkeypatch.setattr(DeviceLogits, "ready", late_ready)
        monkeypatch.setattr(DeviceLogits, "wait", late_wait)
        real_start, starts = CudaExecutor.sample_batch_start, []

        def start_or_not(self, logits, params, steps):  # every third batch sampled synchronously
            starts.append(len(starts))
            return None if len(starts) % 3 == 0 else real_start(self, logits, params, steps)
        monkeypatch.setattr(CudaExecutor, "sample_batch_start", start_or_not)
    spec, w = model("tiny-gpt-oss")
    ref = ReferenceDecoder(spec, w)
    rng = random.Random(11)
    prompts = [[rng.randrange(3, spec.vocab_size) for _ in range(rng.choice([1, 1, 3]))] for _ in range(10)]
    free = [ref.generate(p, 8, ignore_eos=True).tokens for p in prompts]
    eos = Counter(t for toks in free for t in set(toks[1:5])).most_common(1)[0][0]  # reached mid-run by several
    spec = spec.model_copy(update={"eos_token_ids": [eos]})
    arrivals = [0.0] * len(prompts)
    if slow:  # prompts of 3 arriving while others decode: their rows join blocks whose tokens are unread
        prompts += [[rng.randrange(3, spec.vocab_size) for _ in range(3)] for _ in range(8)]
        arrivals += [0.015 * i for i in range(1, 9)]
    params = [SamplingParams(temperature=0.9, top_p=0.95, seed=i) if i % 3 == 2 else None for i in range(len(prompts))]
    reqs = [Request(i, f"r{i}", p, 8, params=params[i], arrival=a) for i, (p, a) in enumerate(zip(prompts, arrivals))]
    res = run_workload(compile_plan(spec, ranks), reqs, RunOptions(policy="defrag", executor="cuda", kv_blocks=64),
                       weights=w)
    stopped = 0
    for r in res.requests:
        want = ref.generate(r.prompt, r.max_new_tokens, sampling=r.params, eos_ids=[eos])
        if r.params is None and min(_margin(x) for x in want.logits) < 1e-3:  # a near-tie: the twin may differ
            continue
        assert r.output == want.tokens and r.finish_reason == ("eos" if want.finish_reason == "eos" else "length"), \
            (r.name, r.output, want.tokens)
        stopped += r.finish_reason == "eos" and len(r.output) < r.max_new_tokens
    assert stopped >= 2 and all(r.done for r in res.requests)
    assert sum(queued) > 0 and any(drained), (queued, drained)
    for e in engines:
        assert not e.requests and e.kv.allocator.used_blocks == 0 and e._unread == 0


@pytest.mark.parametrize("prompts", PROMPT_PATHS)
def test_prompts_arriving_during_decode_mix_with_decode_rows_and_keep_the_reference_tokens(monkeypatch, prompts):
    """Prompts arriving while others decode share attention batches with the decode rows (the CUDA executor's twin,
    one rank, virtual clock); both of CudaExecutor's prompt paths (the paged kernels for the whole batch; all of it by
    models.attention) keep the reference's tokens."""
    kinds, made = [], []
    real, real_init = CudaExecutor.attention, CudaExecutor.__init__

    def spy(self, layer, h, positions, segments, kv):
        kinds.append({n == 1 for _, _, n in segments})
        return real(self, layer, h, positions, segments, kv)

    def init(self, *a, **kw):
        real_init(self, *a, **kw, prompts=prompts)
        made.append(self)
    monkeypatch.setattr(CudaExecutor, "attention", spy)
    monkeypatch.setattr(CudaExecutor, "__init__", init)
    spec, w = model("tiny-gpt-oss")
    ref = ReferenceDecoder(spec, w)
    rng = random.Random(21)
    reqs = [Request(i, f"r{i}", [rng.randrange(3, spec.vocab_size) for _ in range(1 if i < 4 else rng.randint(2, 9))],
                    8, ignore_eos=True, arrival=0.0 if i < 4 else 0.004 * i) for i in range(10)]
    # The virtual clock (batches timed by the cost model): prompts arrive mid-decode however loaded the machine is
    # (on the wall clock a slow host could finish the decodes first, and no batch would mix).
    res = run_workload(compile_plan(spec, 1), reqs, RunOptions(policy="defrag", executor="cuda", kv_blocks=64,
                                                               clock="virtual"), weights=w)
    assert _tokens_equal_reference(ref, res.requests) >= 40
    assert sum(len(k) > 1 for k in kinds) > 0, len(kinds)  # mixed batches happened
    (st,) = [e.stats for e in made]
    took = {"paged": st.attn_paged_prompt, "eager": st.attn_eager}
    assert took[prompts] > 0 and sum(took.values()) == took[prompts], took


def test_device_routed_mode_still_hands_the_graphs_routing_to_host_callers(use_options, monkeypatch):
    """With dispatch=device the executor keeps each batch's routing on the device; a caller that asks for
    it on the host (the barrier baselines' route()) must still get the graph's routing (here the keyed Zipf router
    inside the attention graph), not a fresh eager learned routing: the same barrier tokens in both modes. The
    executors the barrier baselines build read it on the host whatever the setting (route_on_device=False)."""
    from lab.barrier import run_barrier
    from lab.barrier_dist import ExecSpec, build_executor, cut_spec
    es = ExecSpec(model="tiny-gpt-oss", dtype="float32", executor="cuda", zipf_s=1.2)
    spec = cut_spec(es.model, None, es.dtype)
    plan = compile_plan(spec, 2)
    outs = {}
    for mode in ("host", "device"):
        use_options(dispatch=mode)
        assert not build_executor(es, plan, torch.device("cpu"), route_on_device=False)[1].route_on_device
        ex, inner = build_executor(es, plan, torch.device("cpu"))
        assert inner.route_on_device == (mode == "device")
        g = random.Random(1)
        reqs = [Request(i, f"r{i}", [g.randrange(3, spec.vocab_size - 8) for _ in range(3)], 4, ignore_eos=True,
                        arrival=0.0) for i in range(4)]
        run_barrier(plan, ex, reqs, "a2a", clock="wall", kv_blocks=64, decode_only=True)
        outs[mode] = [r.output for r in reqs]
    assert outs["host"] == outs["device"] and all(outs["host"])
