"""The CUDA executor's CPU twin: bucketing, padding masks, device page tables, paged KV layout, and
equality with the TorchExecutor, all on the CPU (the same body code the GPU captures in graphs).

Attention differs from the TorchExecutor only in rounding (the paged decode kernel computes the
softmax in fp32 over the cache, the eager path in the activation dtype over a gathered copy), so
hidden states are compared with a tight fp32 tolerance and tokens up to near-ties; everything
that is pure bookkeeping (bucket choice, padding, page slots, the merge, the routing ids) is exact.
"""
from __future__ import annotations

import copy
import random
import time
from functools import lru_cache

import pytest
import torch

from graph_ir.spec import load_spec
from lowering.plan import compile_plan
from models.reference import ReferenceDecoder
from models.sampling import SamplingParams, sample
from models.weights import random_weights
from runtime.executors.capture import bucket_for
from runtime.drivers.cluster import RunOptions, run_workload
from runtime.executors.torch_executor import TorchExecutor
from runtime.executors.cuda_executor import PROMPT_PATHS, CudaExecutor, HostStaging
from lab.routing_override import ZipfRouting
from runtime.core.kv_cache import BlockAllocator, PagedKVStore
from runtime.core.requests import Request
from runtime.core.routed_rows import pack

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
    assert len(ex.graphs) == 1


def test_experts_above_largest_bucket_runs_eagerly():
    spec, w = model("tiny-gpt-oss")
    ex = CudaExecutor(spec, w, device="cpu", buckets={"attn": [8], "expert": [4]})
    x = torch.randn(6, spec.hidden_size)
    ids = [0, 1, 2, 3, 4, 5]
    torch.testing.assert_close(ex.experts(0, x, ids), TorchExecutor(spec, w).experts(0, x, ids), rtol=1e-5, atol=1e-5)
    assert ex.stats.eager_reasons.get("expert: batch above the largest bucket") == 1


def test_permute_torch_capturable_matches_reference():
    from dataflow_kernels.permute import permute_to_experts_torch
    spec, w = model("tiny-gpt-oss")
    ex = CudaExecutor(spec, w, device="cpu")
    E = spec.experts.num_experts
    ids = torch.tensor([3, 1, E, 3, 0, E, 1], dtype=torch.int64)
    order, offsets = ex._permute(ids)
    ro, roff = permute_to_experts_torch(ids[:, None], E)
    assert order.tolist() == ro.tolist()
    assert offsets.tolist() == roff.tolist()  # sentinel rows excluded: offsets[E] == 5 real rows
    assert offsets[-1].item() == 5


# ---------------------------------------------------------------------------------------------
# attention: decode path over device page tables vs the eager torch path


def _prefilled(spec, w, lens: list[int], num_blocks=64, block_size=4, seed=0):
    """A paged store with sequences 0..n-1 prefilled (eager torch path); returns (kv, h rows, tokens)."""
    kv = PagedKVStore(spec.num_layers, BlockAllocator(num_blocks, block_size))
    ref = TorchExecutor(spec, w)
    rng = random.Random(seed)
    for sid, n in enumerate(lens):
        assert kv.reserve(sid, n + 8)
        toks = [rng.randrange(3, spec.vocab_size) for _ in range(n)]
        h = ref.embed(toks)
        for layer in range(spec.num_layers):
            h_res, x = ref.attention(layer, h, list(range(n)), [(sid, 0, n)], kv)
            h = h_res + x  # any rows: only the K/V history matters here
    return kv


def _decode_pair(lens: list[int], seed: int, rows: int = 3):
    """tiny-gpt-oss, two equal prefilled stores (one per executor under test), hidden rows and one-row segments
    of sequences 0..rows-1: the setting of the decode-batch tests below."""
    spec, w = model("tiny-gpt-oss")
    kv_a = _prefilled(spec, w, lens)
    h = torch.randn(rows, spec.hidden_size, generator=torch.Generator().manual_seed(seed))
    return spec, w, kv_a, copy.deepcopy(kv_a), h, [(i, i, 1) for i in range(rows)]


@pytest.mark.parametrize("name", ["tiny-gpt-oss", "tiny-deepseek-v2", "tiny-deepseek-v3", "tiny-qwen2-moe"])
def test_decode_attention_matches_torch_executor(name):
    spec, w = model(name)
    lens = [3, 9, 1, 14, 6]
    kv_a = _prefilled(spec, w, lens)
    kv_b = copy.deepcopy(kv_a)
    T = len(lens)
    g = torch.Generator().manual_seed(2)
    h = torch.randn(T, spec.hidden_size, generator=g)
    positions = list(lens)  # next position of each sequence
    segments = [(sid, i, 1) for i, sid in enumerate(range(T))]
    ref = TorchExecutor(spec, w)
    ex = CudaExecutor(spec, w, device="cpu", buckets={"attn": [8], "expert": [64]})
    layer = spec.num_layers - 1
    want_res, want_x = ref.attention(layer, h, positions, segments, kv_a)
    got_res, got_x = ex.attention(layer, h, positions, segments, kv_b)
    assert ex.stats.attn_eager == 0 and ex.stats.attn_paged_eager == 1
    torch.testing.assert_close(got_res, want_res, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(got_x, want_x, rtol=1e-4, atol=1e-4)
    if spec.is_moe_layer(layer):
        ids, wts = ex.route(layer, got_x)
        rids, rwts = ref.route(layer, want_x)
        assert ids.device.type == "cpu" and ids.dtype == torch.int64 and wts.dtype == torch.float32
        assert ids.tolist() == rids.tolist()
        torch.testing.assert_close(wts, rwts, rtol=1e-4, atol=1e-5)
        sh, rsh = ex.shared_expert(layer, got_x), ref.shared_expert(layer, want_x)
        if rsh is None:
            assert sh is None
        else:
            torch.testing.assert_close(sh, rsh, rtol=1e-4, atol=1e-4)
    # Paged layout: the decode path wrote this batch's K/V where the torch path did, and the
    # padded rows (8 - 5 of them) touched only the trash page.
    for sid, n in enumerate(lens):
        ka, va = kv_a.read(layer, sid, n + 1)
        kb, vb = kv_b.read(layer, sid, n + 1)
        torch.testing.assert_close(kb, ka, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(vb, va, rtol=1e-5, atol=1e-6)
    ka_all, _ = kv_a.storage(layer)
    kb_all, _ = kv_b.storage(layer)
    na = ka_all.shape[0]  # the torch path's storage grew lazily; the rest of the pool is untouched
    torch.testing.assert_close(kb_all[:na], ka_all, rtol=1e-5, atol=1e-6)
    assert not kb_all[na:kv_a.allocator.num_blocks].any()


@pytest.mark.parametrize("name,route_on_device,keyed", [("tiny-gpt-oss", False, False), ("tiny-gpt-oss", True, False),
                                                        ("tiny-qwen2-moe", False, False), ("tiny-deepseek-v2", True, False),
                                                        ("tiny-gpt-oss", False, True), ("tiny-gpt-oss", True, True)])
def test_a_batch_with_a_prompt_chunk_through_the_paged_kernels_equals_it_by_models_attention(
        name, route_on_device, keyed):
    """A batch with a new prompt's chunk, decode rows on both sides of it and a sequence with two one-row segments.
    By default (prompts="paged") the whole batch goes through the paged kernels like a decode batch (each row attends
    its sequence up to its own position, the batch's K/V written first; padded to bucket 16). Everything it leaves
    (h_res, x, routing or payload, shared expert, the K/V written) equals the whole batch run by models.attention
    (prompts="eager") within the paged kernel's fp32 rounding.
    `keyed`: routed by a router keyed by (request, position, layer) inside the attention (the GPU benches' Zipf
    routing): each row is keyed by its own sequence."""
    spec, w = model(name)
    lens = [3, 9, 1, 14, 6]
    kv = {"eager": _prefilled(spec, w, lens)}
    assert kv["eager"].reserve(5, 14)
    kv["paged"] = copy.deepcopy(kv["eager"])
    # rows: seq 0 decode, seq 5's 6-row chunk, seq 1 decode, seq 2 twice (positions 1 and 2), seq 3 decode
    segments = [(0, 0, 1), (5, 1, 6), (1, 7, 1), (2, 8, 1), (2, 9, 1), (3, 10, 1)]
    positions = [3, 0, 1, 2, 3, 4, 5, 9, 1, 2, 14]
    h = torch.randn(len(positions), spec.hidden_size, generator=torch.Generator().manual_seed(4))
    layer = next(l for l in range(spec.num_layers) if spec.is_moe_layer(l))
    out, ex = {}, {}
    for path in ("eager", "paged"):
        ex[path] = e = CudaExecutor(spec, w, device="cpu", buckets={"attn": [4, 16], "expert": [64]},
                                    route_on_device=route_on_device, prompts=path)
        if keyed:
            e.use_keyed_router(ZipfRouting(spec.experts.num_experts, spec.experts.top_k, s=1.2, seed=3))
        h_res, x = e.attention(layer, h, positions, segments, kv[path])
        extra = (e.routed_payload(layer, x),) if route_on_device else e.route(layer, x)
        out[path] = (h_res, x, e.shared_expert(layer, x)) + extra
    st = ex["paged"].stats
    assert (st.attn_paged_prompt, st.attn_eager) == (1, 0)
    assert (ex["eager"].stats.attn_paged_prompt, ex["eager"].stats.attn_eager) == (0, 1)
    for got, want in zip(out["paged"], out["eager"]):
        if want is None:
            assert got is None
        elif want.dtype == torch.int64:  # the routing's expert ids
            assert got.tolist() == want.tolist()
        else:
            torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    for sid, n in enumerate(lens + [0]):
        m = n + (2 if sid == 2 else 1) if sid < 5 else 6
        for a, b in zip(kv["paged"].read(layer, sid, m), kv["eager"].read(layer, sid, m)):
            torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_decode_padding_does_not_change_results():
    lens = [5, 2, 7]
    spec, w, kv_a, kv_b, h, seg = _decode_pair(lens, seed=3)
    padded = CudaExecutor(spec, w, device="cpu", buckets={"attn": [8], "expert": [16]})
    exact = CudaExecutor(spec, w, device="cpu", buckets={"attn": [3], "expert": [16]})
    a = padded.attention(1, h, lens, seg, kv_a)
    b = exact.attention(1, h, lens, seg, kv_b)
    for u, v in zip(a, b):
        torch.testing.assert_close(u, v, rtol=1e-6, atol=1e-6)
    assert padded.route(1, a[1])[0].tolist() == exact.route(1, b[1])[0].tolist()


def test_a_decode_waves_next_layer_reuses_the_uploaded_positions_and_rows(monkeypatch):
    """The bucket's meta buffer keeps the last upload: the same rows at the next layer (a decode wave) skip the
    upload and still give the outputs of an executor that uploads every time; other positions, other rows or
    another bucket's batch in between upload again."""
    lens = [5, 2, 7]
    spec, w, kv_a, kv_b, h, seg = _decode_pair(lens, seed=4)
    ex = CudaExecutor(spec, w, device="cpu", buckets={"attn": [4, 8], "expert": [16]})
    fresh = CudaExecutor(spec, w, device="cpu", buckets={"attn": [4, 8], "expert": [16]})
    uploads = []
    real = ex.staging.h2d_array
    monkeypatch.setattr(ex.staging, "h2d_array", lambda dst, fill: (uploads.append(dst.shape), real(dst, fill)))
    for layer in range(spec.num_layers):
        got = ex.attention(layer, h, list(lens), seg, kv_a)
        fresh._meta_last.clear()  # the reference uploads every time
        want = fresh.attention(layer, h, list(lens), seg, kv_b)
        for u, v in zip(got, want):
            assert torch.equal(u, v)
    assert len(uploads) == 1  # one upload for the whole wave
    ex.attention(0, h[:2], lens[:2], seg[:2], kv_a)  # another batch of the same bucket (4) in between: uploads
    ex.attention(0, h, [n + 1 for n in lens], seg, kv_a)  # the next step: positions moved
    ex.attention(1, h, [n + 1 for n in lens], seg, kv_a)  # ... and its next layer reuses them
    assert len(uploads) == 3


def test_a_decode_waves_table_rows_are_looked_up_once_until_a_release(monkeypatch):
    """The same segments list at every layer of a step (the engine's decode wave) looks its table rows up once;
    a release of any row, or another list, looks them up again, and the outputs equal a fresh executor's."""
    lens = [5, 2, 7, 3]
    spec, w, kv_a, kv_b, h, seg = _decode_pair(lens, seed=4)
    ex = CudaExecutor(spec, w, device="cpu", buckets={"attn": [4], "expert": [16]})
    fresh = CudaExecutor(spec, w, device="cpu", buckets={"attn": [4], "expert": [16]})
    lookups = []
    dv = ex._view(kv_a)
    real = dv.rows_of
    monkeypatch.setattr(dv, "rows_of", lambda sids: (lookups.append(len(sids)), real(sids))[1])
    for layer in range(spec.num_layers):
        got = ex.attention(layer, h, lens[:3], seg, kv_a)
        fresh._view(kv_b)._rows_memo = None
        want = fresh.attention(layer, h, lens[:3], list(seg), kv_b)
        for u, v in zip(got, want):
            assert torch.equal(u, v)
    assert lookups == [3]
    seg2 = list(seg)
    ex.attention(0, h, lens[:3], seg2, kv_a)  # an equal list, not the same one: looked up
    ex.attention(1, h, lens[:3], seg2, kv_a)
    assert lookups == [3, 3]
    kv_a.release(3)  # a sequence outside the batch gave its row back: looked up again
    ex.attention(0, h, lens[:3], seg2, kv_a)
    ex.attention(1, h, lens[:3], seg2, kv_a)
    assert lookups == [3, 3, 3]
    # another store (another rank in this process) in between: each store keeps its own lookup
    kv_c = _prefilled(spec, w, lens)
    dv_c = ex._view(kv_c)
    real_c = dv_c.rows_of
    monkeypatch.setattr(dv_c, "rows_of", lambda sids: (lookups.append(-len(sids)), real_c(sids))[1])
    seg_c = list(seg)
    for layer in range(spec.num_layers):
        ex.attention(layer, h, lens[:3], seg2, kv_a)
        ex.attention(layer, h, lens[:3], seg_c, kv_c)
    assert lookups == [3, 3, 3, -3]


def test_device_tables_follow_reserve_and_release():
    spec, w = model("tiny-gpt-oss")
    kv = PagedKVStore(spec.num_layers, BlockAllocator(16, 4))
    kv.reserve(7, 10)  # before attachment
    ex = CudaExecutor(spec, w, device="cpu", max_context=16, table_rows=2)
    dv = ex._view(kv)
    r7 = dv.row_of(7)
    assert dv.table[r7, :3].tolist() == kv.table(7)
    kv.reserve(8, 4)
    assert dv.table[dv.row_of(8), :1].tolist() != kv.table(8)  # noted, written by the next batch's flush ...
    assert ex._view(kv) is dv  # (the executor flushes before every attention batch)
    assert dv.table[dv.row_of(8)].tolist() == kv.table(8) + [16] * 3  # ... the whole row: its pages, then trash
    kv.reserve(9, 4)  # no row left: eager path for it
    assert dv.row_of(9) is None and dv.overflow == 1
    kv.release(7)
    assert dv.row_of(7) is None
    kv.reserve(10, 20)  # 5 pages > width 4: no row
    assert dv.row_of(10) is None
    assert dv.table[dv.trash_row].tolist() == [16] * 4  # trash row -> trash page (num_blocks)
    ex.detach(kv)
    assert kv.device_view is None


def test_device_table_rows_and_keys_are_written_together_at_the_next_flush():
    """Rows admitted between two batches go to the device in one flush, keys with them; a row given back and taken
    by another sequence before the flush gets the last owner's pages and key."""
    spec, w = model("tiny-gpt-oss")
    kv = PagedKVStore(spec.num_layers, BlockAllocator(32, 4))
    kv.reserve(1, 8)  # before attachment
    ex = CudaExecutor(spec, w, device="cpu", max_context=16, table_rows=4)
    dv = ex._view(kv)
    dv.track_keys(lambda seq: 100 + seq)  # rows written before get their keys at the next flush
    kv.reserve(2, 4)
    kv.reserve(3, 12)
    kv.release(2)
    kv.reserve(4, 16)  # takes rank 2's row before any flush
    uploads = []
    real = dv._upload
    dv._upload = lambda a: (uploads.append(a.shape), real(a))[1]
    ex._view(kv)
    ex._view(kv)  # nothing new: no upload
    assert uploads == [(3, 2 + dv.width)]  # rows of 1 (its key), 3 and 4 (2's row, now 4's): one upload
    for seq in (1, 3, 4):
        r = dv.row_of(seq)
        pages = kv.table(seq)
        assert dv.table[r].tolist() == pages + [dv.trash_page] * (dv.width - len(pages))
        assert int(dv.keys[r]) == 100 + seq
    assert int(dv.keys[dv.trash_row]) == 0


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
        assert torch.equal(lg.tensor, eager) and lg.shape == eager.shape
    assert ex.graphs.buffers("sample", 4)._t["ids"].shape == (4,)
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
    assert len(gc) == 1


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
            tails = ce._routed_bufs(b, True)._t["payload"][T + 2:, H:]
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
    from runtime.executors.cuda_executor import DeviceLogits
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


def test_a_combine_for_attention_writes_that_batchs_input_and_other_batches_move_it_out_first():
    """combine(feeds_attention=True) writes its rows into the static input of the attention bucket they fit, and
    that attention batch replays without copying them in; a batch of the same bucket that runs first (rows sliced
    from the waiting ones, or another wave) moves the waiting rows out, so every input keeps its values, and the
    bucket's next _CLAIM_BACKOFF combines do not write in place. Outputs equal an executor that never writes in
    place, call for call."""
    from runtime.executors.cuda_executor import _CLAIM_BACKOFF
    lens = [5, 2, 7]
    spec, w, kv_a, kv_b, h, seg = _decode_pair(lens, seed=4)
    ex = CudaExecutor(spec, w, device="cpu", buckets={"attn": [8], "expert": [16]})
    plain = CudaExecutor(spec, w, device="cpu", buckets={"attn": [8], "expert": [16]})
    T, H = 3, spec.hidden_size
    g = torch.Generator().manual_seed(5)
    h_res, y, wts = torch.randn(T, H, generator=g), torch.randn(T, 2, H, generator=g), torch.rand(T, 2, generator=g)
    static_h = ex._attn_bufs(8, True)._t["h"]

    def both(h_ex, h_plain, rows=(0, 1, 2)):
        pos, segs = [lens[i] for i in rows], [(i, j, 1) for j, i in enumerate(rows)]
        got = ex.attention(1, h_ex, pos, segs, kv_a)
        want = plain.attention(1, h_plain, list(pos), list(segs), kv_b)
        for u, v in zip(got, want):
            assert torch.equal(u, v)

    def combine(scale):
        return ex.combine(h_res, None, scale * y, wts, feeds_attention=True)

    a = combine(1.0)  # 1. in place, then read in place
    assert torch.equal(a, plain.combine(h_res, None, y, wts)) and a.data_ptr() == static_h.data_ptr()
    both(a, a.clone())
    assert (ex.stats.attn_claims_used, ex.stats.attn_claims_moved) == (1, 0)
    c = combine(3.0)  # 2. rows sliced from the waiting ones run first
    c_then = c.clone()
    both(c[1:3], c_then[1:3], rows=(1, 2))
    assert ex.stats.attn_claims_moved == 1 and torch.equal(c, c_then) and c.data_ptr() != static_h.data_ptr()
    both(c, c_then)
    for _ in range(_CLAIM_BACKOFF):  # the bucket backs off ...
        assert combine(1.0).data_ptr() != static_h.data_ptr()
    b = combine(2.0)  # ... then writes in place again; 3. another wave's batch runs first
    assert b.data_ptr() == static_h.data_ptr()
    b_then = b.clone()
    assert combine(1.0).data_ptr() != static_h.data_ptr()  # (the bucket is taken)
    both(h, h.clone())
    assert ex.stats.attn_claims_moved == 2 and torch.equal(b, b_then) and b.data_ptr() != static_h.data_ptr()
    both(b, b_then)
    assert ex.stats.attn_claims_used == 1


def test_embedding_rows_go_into_the_attention_input_and_an_eager_batch_spends_the_claim():
    """embed() uploads the ids into a buffer kept for them and gathers the rows straight into the static input of the
    attention bucket they fit (the same values as layers.embed); a decode batch then reads them in place, and a batch
    that runs by models.attention (here a prompt's rows with prompts="eager"; by default, one with a sequence without a
    device table row) reads them where they are and spends the claim, so the bucket's next combine or embedding claims
    it again instead of a later batch moving stale rows out."""
    from models import layers
    lens = [5, 2, 7]
    spec, w, kv_a, _, _, seg = _decode_pair(lens, seed=6)
    ex = CudaExecutor(spec, w, device="cpu", buckets={"attn": [8], "expert": [16]}, prompts="eager")
    static_h = ex._attn_bufs(8, True)._t["h"]
    toks = [11, 12, 13]
    e = ex.embed(toks)
    assert torch.equal(e, layers.embed(w, torch.tensor(toks))) and e.data_ptr() == static_h.data_ptr()
    ex.attention(1, e, lens, seg, kv_a)  # decode-shaped: in place
    assert ex.stats.attn_claims_used == 1 and 8 not in ex._claims
    e = ex.embed(toks)
    assert e.data_ptr() == static_h.data_ptr()
    assert kv_a.reserve(7, 3 + 8)
    ex.attention(1, e, [0, 1, 2], [(7, 0, 3)], kv_a)  # one 3-row segment: eager
    assert ex.stats.attn_eager == 1 and 8 not in ex._claims and ex.stats.attn_claims_moved == 0
    assert ex.embed(toks).data_ptr() == static_h.data_ptr()  # claimed again: no back-off
    assert ex.embed([]).shape == (0, spec.hidden_size)


def test_attention_outputs_are_views_until_the_bucket_replays_and_held_ones_move_out_first():
    """A static attention batch hands out its outputs where the graph wrote them (no clone). When the bucket replays
    while some are still held (another wave's merge group not combined yet), they move to tensors of their own first
    and keep their values, and the bucket clones its outputs for the next _CLAIM_BACKOFF batches; outputs dropped
    before the next replay move nowhere."""
    from runtime.executors.cuda_executor import _CLAIM_BACKOFF
    lens = [5, 2, 7]
    spec, w, kv_a, _, h, seg = _decode_pair(lens, seed=7)
    ex = CudaExecutor(spec, w, device="cpu", buckets={"attn": [8], "expert": [16]})
    static_out = ex._attn_bufs(8, True)._t["out"]

    def attend(rows):
        return ex.attention(1, rows, list(lens), list(seg), kv_a)

    first = attend(h)
    assert first[0].data_ptr() == static_out[0].data_ptr() and first[1].data_ptr() == static_out[1].data_ptr()
    kept = [t.clone() for t in first]
    second = attend(2 * h)  # the bucket replays while `first` is held
    assert ex.stats.attn_outputs_moved == 1
    assert all(torch.equal(t, k) for t, k in zip(first, kept)) and first[0].data_ptr() != static_out[0].data_ptr()
    assert second[0].data_ptr() != static_out[0].data_ptr()  # backing off from this batch on: copies
    del first, second
    for _ in range(_CLAIM_BACKOFF - 1):
        assert attend(h)[0].data_ptr() != static_out[0].data_ptr()
    out = attend(h)
    assert out[0].data_ptr() == static_out[0].data_ptr()
    del out  # dropped before the next replay: nothing to move
    attend(h)
    assert ex.stats.attn_outputs_moved == 1


@pytest.mark.parametrize("dispatch,prompts", [("device", "paged"), ("host", "paged"), ("device", "eager")])
def test_in_place_inputs_and_outputs_keep_tokens_with_chunked_prompts_and_ranks_sharing_the_executor(use_options, monkeypatch,
                                                                                                    dispatch, prompts):
    """The hard case for the in-place attention inputs and outputs: three in-process ranks sharing one executor (they
    take turns at every bucket), an attention cap of 8 with prompts up to 30 tokens (chunked prefill through the
    bucketed path, or with prompts="eager" as eager batches that spend claims; capped waves), every request against
    the reference; claims and held outputs are moved out on the way (the counts say the moves happened)."""
    use_options(dispatch=dispatch)
    made = []
    real = CudaExecutor.__init__

    def spy(self, *a, **k):
        real(self, *a, **k, prompts=prompts)
        made.append(self)
    monkeypatch.setattr(CudaExecutor, "__init__", spy)
    spec, w = model("tiny-gpt-oss")
    ref = ReferenceDecoder(spec, w)
    rng = random.Random(308)
    reqs = [Request(i, f"r{i}", [rng.randrange(3, spec.vocab_size) for _ in range(rng.choice([1, 2, 5, 13, 30]))], 8,
                    ignore_eos=True, arrival=rng.random() * 0.01) for i in range(14)]
    res = run_workload(compile_plan(spec, 3, attn_cap=8), reqs,
                       RunOptions(policy="flfs", executor="cuda", kv_blocks=128, clock="virtual"), weights=w)
    compared = _tokens_equal_reference(ref, res.requests)
    stats = made[-1].stats
    assert compared >= 60 and stats.attn_claims_moved and stats.attn_outputs_moved
    assert (stats.attn_eager if prompts == "eager" else stats.attn_paged_prompt) > 0
