"""The CUDA executor's attention on its CPU twin: the decode and mixed batches over the device page tables
(paged kernels, padding to the bucket, the positions and table rows a decode wave uploads once) against the
TorchExecutor's eager path, and the device tables' rows and keys following the KV store.

Attention differs from the TorchExecutor only in rounding (the paged decode kernel computes the softmax in fp32 over
the cache, the eager path in the activation dtype over a gathered copy), so hidden states are compared with a tight
fp32 tolerance; page slots, table rows and routing ids are exact.
"""
from __future__ import annotations

import copy
import random

import pytest
import torch

from runtime.executors.torch_executor import TorchExecutor
from runtime.executors.cuda_executor import CudaExecutor
from lab.routing_override import ZipfRouting
from runtime.core.kv_cache import BlockAllocator, PagedKVStore

from test_executor_cuda import model

torch.set_num_threads(1)


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
    r7 = dv.rows_of([7])[0]
    assert dv.table[r7, :3].tolist() == kv.table(7)
    kv.reserve(8, 4)
    assert dv.table[dv.rows_of([8])[0], :1].tolist() != kv.table(8)  # noted, written by the next batch's flush ...
    assert ex._view(kv) is dv  # (the executor flushes before every attention batch)
    assert dv.table[dv.rows_of([8])[0]].tolist() == kv.table(8) + [16] * 3  # ... the whole row: its pages, then trash
    kv.reserve(9, 4)  # no row left: eager path for it
    assert dv.rows_of([9])[0] is None and dv.overflow == 1
    kv.release(7)
    assert dv.rows_of([7])[0] is None
    kv.reserve(10, 20)  # 5 pages > width 4: no row
    assert dv.rows_of([10])[0] is None
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
        r = dv.rows_of([seq])[0]
        pages = kv.table(seq)
        assert dv.table[r].tolist() == pages + [dv.trash_page] * (dv.width - len(pages))
        assert int(dv.keys[r]) == 100 + seq
    assert int(dv.keys[dv.trash_row]) == 0
