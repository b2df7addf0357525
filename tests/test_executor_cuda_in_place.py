"""The CUDA executor's in-place hand-over on its CPU twin (runtime/executors/cuda_buffers.py): a combine writes
the next attention batch's static input (a claim), attention outputs are views of the static output until the bucket
replays, and a tensor still held is moved out first; tokens stay the reference's with chunked prompts and ranks
sharing the executor.
"""
from __future__ import annotations

import random

import pytest
import torch

from lowering.plan import compile_plan
from lab.reference import ReferenceDecoder
from runtime.drivers.cluster import RunOptions, run_workload
from runtime.executors.cuda_executor import CudaExecutor
from runtime.core.requests import Request

from test_executor_cuda import model
from test_executor_cuda_attention import _decode_pair
from test_executor_cuda_twin import _tokens_equal_reference

torch.set_num_threads(1)


def test_a_combine_for_attention_writes_that_batchs_input_and_other_batches_move_it_out_first():
    """combine(feeds_attention=True) writes its rows into the static input of the attention bucket they fit, and
    that attention batch replays without copying them in; a batch of the same bucket that runs first (rows sliced
    from the waiting ones, or another wave) moves the waiting rows out, so every input keeps its values, and the
    bucket's next _CLAIM_BACKOFF combines do not write in place. Outputs equal an executor that never writes in
    place, call for call."""
    from runtime.executors.cuda_buffers import _CLAIM_BACKOFF
    lens = [5, 2, 7]
    spec, w, kv_a, kv_b, h, seg = _decode_pair(lens, seed=4)
    ex = CudaExecutor(spec, w, device="cpu", buckets={"attn": [8], "expert": [16]})
    plain = CudaExecutor(spec, w, device="cpu", buckets={"attn": [8], "expert": [16]})
    T, H = 3, spec.hidden_size
    g = torch.Generator().manual_seed(5)
    h_res, y, wts = torch.randn(T, H, generator=g), torch.randn(T, 2, H, generator=g), torch.rand(T, 2, generator=g)
    static_h = ex._attn_bufs(8, True)["h"]

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
    static_h = ex._attn_bufs(8, True)["h"]
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
    from runtime.executors.cuda_buffers import _CLAIM_BACKOFF
    lens = [5, 2, 7]
    spec, w, kv_a, _, h, seg = _decode_pair(lens, seed=7)
    ex = CudaExecutor(spec, w, device="cpu", buckets={"attn": [8], "expert": [16]})
    static_out = ex._attn_bufs(8, True)["out"]

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
