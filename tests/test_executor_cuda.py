"""The CUDA executor's CPU twin, its parts: bucketing, pinned staging, the expert graphs (padding to the bucket,
sentinel rows, no dependence on the split), the combine, the sample graph and lazy logits, graph keys and prepare(),
all on the CPU (the same body code the GPU captures in graphs). Its attention: test_executor_cuda_attention.py; the
engine with it against the reference decoder: test_executor_cuda_twin.py; the in-place hand-over of static buffers:
test_executor_cuda_in_place.py (they share `model` from here).

Pure bookkeeping (bucket choice, padding, page slots, the merge, the routing ids) is exact; math is compared with the
TorchExecutor with a tight fp32 tolerance, tokens up to near-ties.
"""
from __future__ import annotations

import random
from functools import lru_cache

import pytest
import torch

from graph_ir.spec import load_spec
from lowering.plan import compile_plan
from models.sampling import SamplingParams, sample
from models.weights import random_weights
from runtime.executors.capture import bucket_for
from runtime.executors.torch_executor import TorchExecutor
from runtime.executors.cuda_executor import CudaExecutor
from runtime.executors.host_staging import HostStaging
from runtime.core.requests import Request

torch.set_num_threads(1)
SPECS = "models/specs"


@lru_cache(maxsize=None)
def model(name: str):
    spec = load_spec(f"{SPECS}/{name}.yaml")
    return spec, random_weights(spec)


@pytest.mark.parametrize("name,stacked", [("tiny-gpt-oss", True), ("tiny-mixtral", True), ("tiny-deepseek-v2", False)])
def test_stacked_qkv_leaves_the_callers_weights_as_they_were(name, stacked):
    """CudaExecutor stacks q/k/v for one GEMM (models.weights.stack_qkv) in its own layer dicts; the caller's dicts
    get row views of the stack (same values, one copy in memory), never the "qkv" keys, so a TorchExecutor over the
    same weights computes what it did. MLA's projections are left alone."""
    from models.attention import gqa_project
    spec = load_spec(f"{SPECS}/{name}.yaml")
    w = random_weights(spec)
    before = [{n: t.clone() for n, t in lw.items()} for lw in w.layers]
    ex = CudaExecutor(spec, w, device="cpu")
    for lw, own, old in zip(w.layers, ex.w.layers, before):
        assert "qkv.w" not in lw and ("qkv.w" in own) == stacked
        assert lw.keys() == old.keys() and all(torch.equal(lw[n], old[n]) for n in old)
        if stacked:
            assert lw["q.w"].data_ptr() == own["qkv.w"].data_ptr()  # a view of the stack: no second copy
            assert ("qkv.b" in own) == ("q.b" in lw)
    if stacked:
        x = torch.randn(5, spec.hidden_size, generator=torch.Generator().manual_seed(3))
        for got, want in zip(gqa_project(spec, ex.w.layers[0], x), gqa_project(spec, w.layers[0], x)):
            torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_bucket_for():
    b = [1, 8, 40, 256]
    assert [bucket_for(n, b) for n in (1, 2, 8, 9, 40, 41, 256)] == [1, 8, 8, 40, 40, 256, 256]
    assert bucket_for(257, b) is None


def test_host_staging_cpu_roundtrip():
    st = HostStaging(torch.device("cpu"), slots=2)
    dst = torch.zeros(2, 3, dtype=torch.int32)

    def fill(a):
        a[0, :] = [1, 2, 3]
        a[1, :] = -1
    st.h2d_array(dst, fill)
    assert dst.tolist() == [[1, 2, 3], [-1, -1, -1]]
    p = st.d2h(torch.arange(4.0))
    assert p.wait().tolist() == [0.0, 1.0, 2.0, 3.0]


# ---------------------------------------------------------------------------------------------
# experts: padding to the bucket, sentinel rows, no dependence on the split


def test_experts_padded_equals_unpadded_and_reference():
    ffn = "torch"
    spec, w = model("tiny-gpt-oss")
    E = spec.experts.num_experts
    g = torch.Generator().manual_seed(0)
    ref = TorchExecutor(spec, w)
    for N in (1, 5, 13):
        x = torch.randn(N, spec.hidden_size, generator=g)
        ids = torch.randint(0, E, (N,), generator=g).tolist()
        want = ref.experts(1, x, ids)
        padded = CudaExecutor(spec, w, device="cpu", ffn_impl=ffn, buckets={"attn": [8], "expert": [16]})
        exact = CudaExecutor(spec, w, device="cpu", ffn_impl=ffn, buckets={"attn": [8], "expert": [N]})
        got_p = padded.experts(1, x, ids)
        got_e = exact.experts(1, x, ids)
        # Padded rows never change real rows: per-expert GEMMs over the same real rows.
        torch.testing.assert_close(got_p, got_e, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(got_p, want, rtol=1e-5, atol=1e-5)
        assert padded.stats.expert_eager == 1 and "expert: batch above the largest bucket" not in padded.stats.eager_reasons


def test_experts_new_split_reuses_the_same_bucket_body():
    spec, w = model("tiny-gpt-oss")
    ex = CudaExecutor(spec, w, device="cpu", buckets={"attn": [8], "expert": [16]})
    ref = TorchExecutor(spec, w)
    g = torch.Generator().manual_seed(1)
    for _ in range(3):  # different expert splits, same (layer, bucket): one graph entry
        x = torch.randn(11, spec.hidden_size, generator=g)
        ids = torch.randint(0, spec.experts.num_experts, (11,), generator=g).tolist()
        torch.testing.assert_close(ex.experts(0, x, ids), ref.experts(0, x, ids), rtol=1e-5, atol=1e-5)
    assert len(ex.graphs._graphs) == 1


def test_experts_above_largest_bucket_runs_eagerly():
    spec, w = model("tiny-gpt-oss")
    ex = CudaExecutor(spec, w, device="cpu", buckets={"attn": [8], "expert": [4]})
    x = torch.randn(6, spec.hidden_size)
    ids = [0, 1, 2, 3, 4, 5]
    torch.testing.assert_close(ex.experts(0, x, ids), TorchExecutor(spec, w).experts(0, x, ids), rtol=1e-5, atol=1e-5)
    assert ex.stats.eager_reasons.get("expert: batch above the largest bucket") == 1


def test_permute_torch_puts_the_padding_sentinel_last():
    """The executor's torch permute (capturable: no host sync) with its padding expert id E: sorted last, in no
    expert's range."""
    from dataflow_kernels.permute import permute_to_experts_torch
    E = 4
    ids = torch.tensor([3, 1, E, 3, 0, E, 1], dtype=torch.int64)
    order, offsets = permute_to_experts_torch(ids, E)
    assert order.tolist() == [4, 1, 6, 0, 3, 2, 5]
    assert offsets.tolist() == [0, 1, 3, 3, 5]  # sentinel rows excluded: offsets[E] == 5 real rows


# ---------------------------------------------------------------------------------------------
# combine, sampling, graph keys, staging views, prepare()


def test_combine_bit_equal_and_greedy_sampling():
    spec, w = model("tiny-gpt-oss")
    ref, ex = TorchExecutor(spec, w), CudaExecutor(spec, w, device="cpu")
    g = torch.Generator().manual_seed(4)
    T, k, H = 5, spec.experts.top_k, spec.hidden_size
    h_res, y = torch.randn(T, H, generator=g), torch.randn(T, k, H, generator=g)
    wts = torch.rand(T, k, generator=g)
    assert torch.equal(ex.combine(h_res, None, y, wts), ref.combine(h_res, None, y, wts))
    sh = torch.randn(T, H, generator=g)
    assert torch.equal(ex.combine(h_res, sh, y, wts), ref.combine(h_res, sh, y, wts))
    # rows in arrival order, read through row_index (the merge buffer by dispatch position)
    perm = torch.randperm(T * k, generator=g)
    rows = y.reshape(T * k, H)[perm]
    row_index = torch.argsort(perm).view(T, k)
    assert torch.equal(ex.combine(h_res, sh, rows, wts, row_index), ref.combine(h_res, sh, y, wts))
    assert torch.equal(ref.combine(h_res, sh, rows, wts, row_index), ref.combine(h_res, sh, y, wts))
    lg, rl = ex.logits(h_res), ref.logits(h_res)
    assert [ex.sample(lg[i], None, 0) for i in range(T)] == [ref.sample(rl[i], None, 0) for i in range(T)]
    # the engine's asynchronous sampling, greedy or not: tokens equal the synchronous ones, and the reference's
    for params in ([None] * T, [None, SamplingParams(temperature=0.7, seed=1)] + [None] * (T - 3)
                   + [SamplingParams(temperature=1.3, top_p=0.8, top_k=20, seed=2)]):
        want = ref.sample_batch(rl, params, list(range(T)))
        assert want == [sample(rl[i], p or SamplingParams(), i) for i, p in enumerate(params)]
        pending = ex.sample_batch_start(ex.logits(h_res), params, list(range(T)))
        assert pending.ready() and pending.tokens() == want
        assert ex.sample_batch(ex.logits(h_res), params, list(range(T))) == want
        assert pending.device_ids().tolist() == want and pending.device_ids([T - 1, 0]).tolist() == [want[-1], want[0]]


def test_a_batch_that_samples_runs_its_lm_head_once(monkeypatch):
    """The sample graph (norm, LM head, argmax) replays only when the argmax is wanted: a batch with rows that sample
    reads the eager logits instead, so its 1.16 GB-at-GPT-OSS LM head runs once, not twice; a greedy batch replays."""
    from models import layers as model_layers
    spec, w = model("tiny-gpt-oss")
    ex = CudaExecutor(spec, w, device="cpu")
    heads = []
    real = model_layers.final_logits
    monkeypatch.setattr(model_layers, "final_logits", lambda *a: heads.append(1) or real(*a))
    h = torch.randn(5, spec.hidden_size, generator=torch.Generator().manual_seed(3))
    for params in ([None] * 5, [SamplingParams(temperature=0.7, seed=i) for i in range(5)]):
        heads.clear()
        pending = ex.sample_batch_start(ex.logits(h), params, list(range(5)))
        assert pending.tokens() and len(heads) == 1, (params[0], len(heads))


def test_sample_bucket_argmax_and_lazy_logits_equal_the_eager_head():
    """A sample batch that fits a bucket runs the bucket's body (norm, LM head, argmax into the static ids buffer,
    padded rows included); its greedy ids equal the eager logits' argmax, the logits are computed only if read and
    then equal the eager ones; stale rows of a previous, larger batch in the padding change nothing; above the
    largest bucket the head runs eagerly."""
    spec, w = model("tiny-gpt-oss")
    ex = CudaExecutor(spec, w, device="cpu", buckets={"attn": [8], "expert": [16], "sample": [4, 8]})
    ref = TorchExecutor(spec, w)
    g = torch.Generator().manual_seed(7)
    for T in (7, 3, 8, 1, 9):  # 8 after 7 and 1 after 3: the padding rows hold the earlier batch's rows
        h = torch.randn(T, spec.hidden_size, generator=g)
        lg = ex.logits(h)
        eager = ref.logits(h)
        assert len(lg) == T
        assert (lg._tensor is None) == (T <= 8)  # bucketed: no logits unless read
        pending = ex.sample_batch_start(lg, [None] * T, [0] * T)
        assert pending.tokens() == torch.argmax(eager, dim=-1).tolist()
        assert torch.equal(lg.tensor, eager)
    assert ex._sample_bufs(4)["ids"].shape == (4,)
    assert ("sample", -1, 4) in ex.graphs._graphs  # graph keys are (kind, layer, bucket, ...): GraphCache.drop reads them


def test_graph_keys_name_kind_layer_and_bucket():
    """GraphCache takes a graph's pool from its key (kind, layer, bucket, ...) and drop() reads the same fields of
    every captured key: a key of another shape is refused at once, on the CPU too (run 83: a 2-field sample key
    broke drop() only where graphs are captured)."""
    from runtime.executors.capture import GraphCache
    gc = GraphCache(torch.device("cpu"), True)
    with pytest.raises(ValueError, match="expected \\(kind, layer, bucket"):
        gc.get(("sample", 4), lambda: (lambda: None))
    gc.get(("sample", -1, 4), lambda: (lambda: None)).run()
    gc.drop(lambda k: k[0] == "attn")
    assert len(gc._graphs) == 1


def test_host_staging_typed_views_cached_per_slot_and_dropped_on_growth():
    st = HostStaging(torch.device("cpu"), slots=2, nbytes=64)
    i0, v0, a0 = st._acquire_typed((2, 4), torch.int32)
    i1, v1, _ = st._acquire_typed((2, 4), torch.int32)
    assert (i0, i1) == (0, 1) and v0.data_ptr() != v1.data_ptr()
    a0[:] = 7  # the numpy view is the tensor's memory
    assert v0.tolist() == [[7] * 4] * 2
    i2, v2, _ = st._acquire_typed((2, 4), torch.int32)  # ring wrapped: slot 0's cached view again
    assert i2 == 0 and v2 is v0
    i3, big, _ = st._acquire_typed((64,), torch.int64)  # slot 1 grows: its cache is dropped
    assert i3 == 1 and big.shape == (64,) and not any(k == ((2, 4), torch.int32) for k in st._typed[1])


def test_expert_ids_tensor_or_list_same_result():
    spec, w = model("tiny-gpt-oss")
    E = spec.experts.num_experts
    g = torch.Generator().manual_seed(3)
    x = torch.randn(11, spec.hidden_size, generator=g)
    ids = torch.randint(0, E, (11,), generator=g)
    ex = CudaExecutor(spec, w, device="cpu", buckets={"attn": [8], "expert": [16]})
    torch.testing.assert_close(ex.experts(1, x, ids), ex.experts(1, x, ids.tolist()), rtol=0, atol=0)


def fake_capture(monkeypatch) -> None:
    """CUDA-graph capture faked on the CPU twin: a 'graph' that runs its body (the keys and bodies are the real ones)."""
    from runtime.executors.capture import StepGraph

    class Replay:
        def __init__(self, body):
            self.replay = body

    def capture(self):
        self.body()
        self.graph = Replay(self.body)
    monkeypatch.setattr(StepGraph, "_capture", capture)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda *a: None)
    monkeypatch.setattr(torch.cuda, "graph_pool_handle", lambda: None)


def test_prepare_captures_every_expert_graph_a_device_routed_run_uses(use_options, monkeypatch):
    """prepare() with the engines' owned experts captures the device-routed expert graphs under the keys the run
    then replays (keyed by each engine's owned tensor), so a timed run captures no expert graph. Capture is faked
    on the CPU (a 'graph' that runs its body); the keys and the bodies are the real ones."""
    from runtime.drivers.cluster import Cluster, RunOptions
    use_options(dispatch="device")
    fake_capture(monkeypatch)
    spec, w = model("tiny-gpt-oss")
    plan = compile_plan(spec, 2)
    ex = CudaExecutor(spec, w, plan, torch.device("cpu"))
    ex.graphs.capture = ex.expert_graphs = True  # capture on the CPU twin (faked above)
    cl = Cluster(plan, ex, RunOptions(policy="defrag", kv_blocks=64))
    assert sum(ex.prepare(e.kv, owned=e.owned_experts) for e in cl.engines) > 0
    prepared = {k for k in ex.graphs._graphs if k[0] == "expert_routed"}
    assert len({k[3] for k in prepared}) == 2 * len(spec.moe_layers)  # one owned tensor per engine and layer
    g = random.Random(2)
    reqs = [Request(i, f"r{i}", [g.randrange(3, spec.vocab_size)], 4, ignore_eos=True, arrival=0.0) for i in range(6)]
    res = cl.run(reqs)
    assert res.metrics["finished"] == 6
    used = {k for k in ex.graphs._graphs if k[0] == "expert_routed"}
    assert used == prepared and ex.stats.expert_graph > 0
