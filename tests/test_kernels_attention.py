"""kernels/: the attention graph's kernels (paged decode attention, the row-block schedule for prompt chunks,
RMSNorm, RoPE + the KV write), torch references against naive loops and the models' math, Triton kernels against the
references; and the CUDA executor's attention body with them. tests/test_kernels.py has the MoE layer's kernels.

Shapes are odd on purpose (6 query heads on 2 kv heads, block size 4, ragged contexts including 0 and 1) so nothing
passes by symmetry. Without a GPU the Triton kernels run in Triton's CPU interpreter (tests/triton_interpreter.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from dataflow_kernels.paged_attention import (block_rows_for, clear_block_rows, paged_decode_attention_torch,
                                              paged_decode_attention_triton, paged_row_block_attention_triton,
                                              row_blocks)
from triton_interpreter import DTYPES, gen, run_triton_tests_in_subprocess
from triton_interpreter import triton_device  # noqa: F401  (a fixture)

# ------------------------------------------------------------------------------------------
# paged decode attention

NH, NKV, DK, DV, BLOCK = 6, 2, 24, 20, 4
LENS = [1, 7, 0, 30, 13, 4]  # ragged, one empty (a padding slot), one exactly one block


def _paged_inputs(dtype, device, seed: int = 0):
    g = gen(seed)
    B, max_blocks = len(LENS), math.ceil(max(LENS) / BLOCK) + 1
    num_blocks = B * max_blocks + 3
    q = torch.randn(B, NH, DK, generator=g)
    k_cache = torch.randn(num_blocks, BLOCK, NKV, DK, generator=g)
    v_cache = torch.randn(num_blocks, BLOCK, NKV, DV, generator=g)
    # Physical blocks scattered and out of order.
    table = torch.randperm(num_blocks, generator=g)[: B * max_blocks].view(B, max_blocks).to(torch.int32)
    sinks = torch.randn(NH, generator=g)
    cast = lambda t: t.to(dtype).to(device)  # noqa: E731
    return cast(q), cast(k_cache), cast(v_cache), table.to(device), torch.tensor(LENS, dtype=torch.int32, device=device), cast(sinks)


def _contiguous_kv(k_cache, v_cache, table, b, length):
    pos = torch.arange(length)
    blocks, slots = table[b, pos // BLOCK].long(), pos % BLOCK
    return k_cache[blocks, slots], v_cache[blocks, slots]


def _paged_naive(q, k_cache, v_cache, table, lens, scale, sinks, window):
    out = torch.zeros(q.shape[0], NH, DV, dtype=torch.float64)
    for b, length in enumerate(lens.tolist()):
        Kc, Vc = _contiguous_kv(k_cache, v_cache, table, b, length)
        for h in range(NH):
            kvh = h // (NH // NKV)
            keys = [p for p in range(length) if window is None or (length - 1) - p < window]
            logits = [float(q[b, h].double() @ Kc[p, kvh].double()) * scale for p in keys]
            extra = [float(sinks[h])] if sinks is not None else []
            if not logits:
                continue
            mx = max(logits + extra)
            den = sum(math.exp(x - mx) for x in logits + extra)
            for p, x in zip(keys, logits):
                out[b, h] += math.exp(x - mx) / den * Vc[p, kvh].double()
    return out


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("with_sinks", [True, False])
def test_paged_attention_reference(window, with_sinks):
    q, k_cache, v_cache, table, lens, sinks = _paged_inputs(torch.float32, "cpu")
    sinks = sinks if with_sinks else None
    ref = paged_decode_attention_torch(q, k_cache, v_cache, table, lens, 0.3, sinks, window)
    torch.testing.assert_close(ref.double(), _paged_naive(q, k_cache, v_cache, table, lens, 0.3, sinks, window),
                               rtol=1e-5, atol=1e-5)
    attention = pytest.importorskip("models.attention")
    for b, length in enumerate(LENS):
        if length == 0:
            continue
        Kc, Vc = _contiguous_kv(k_cache, v_cache, table, b, length)
        expected = attention.attend(q[b : b + 1], Kc, Vc, torch.tensor([length - 1]), 0.3, window, sinks)
        torch.testing.assert_close(ref[b], expected[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("with_sinks", [True, False])
def test_paged_attention_triton(triton_device, dtype, window, with_sinks):
    q, k_cache, v_cache, table, lens, sinks = _paged_inputs(dtype, triton_device, seed=1)
    sinks = sinks if with_sinks else None
    ref = paged_decode_attention_torch(q, k_cache, v_cache, table, lens, 0.3, sinks, window).float()
    # bf16 on the GPU: probabilities are rounded to bf16 for the P @ V tensor-core dot.
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for splits in (1, 3):  # 3 splits: chunks of 16 positions, some of them empty
        got = paged_decode_attention_triton(q, k_cache, v_cache, table, lens, 0.3, sinks, window,
                                            num_splits=splits, block_t=16).float()
        torch.testing.assert_close(got, ref, **tol)
        assert torch.all(got[2] == 0)  # empty context


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("with_sinks", [True, False])
def test_paged_row_block_attention_equals_the_decode_kernel_row_by_row(triton_device, dtype, window, with_sinks):
    """A batch of prompt chunks and decode rows (rows of one sequence share its page-table row; a 40-row chunk spans
    two blocks; a padding row of context 0) through the row-block schedule, the chunks' rows by blocks and the others
    through the decode kernel: each row's result is paged_decode_attention's for that row."""
    q0, k_cache, v_cache, table, _, sinks = _paged_inputs(dtype, triton_device, seed=2)
    sinks = sinks if with_sinks else None
    # (table row, first position, rows): a 6-row chunk at 3.., a decode row at 29, a 40-row chunk at 0.., padding
    segs = [(1, 3, 6), (3, 29, 1), (0, 0, 40), (2, -1, 1)]
    T = sum(n for *_, n in segs)
    big = torch.cat([table] * 6, dim=1)[:, : math.ceil(41 / BLOCK)]  # room for 40 positions (pages reused: reads only)
    rows = [t for t, _, n in segs for _ in range(n)]
    lens = torch.tensor([p + i + 1 for _, p, n in segs for i in range(n)], dtype=torch.int32, device=triton_device)
    bt = big[torch.tensor(rows)].to(triton_device)
    q = torch.randn(T, NH, DK, generator=gen(5)).to(dtype).to(triton_device)
    ref = paged_decode_attention_torch(q, k_cache, v_cache, bt, lens, 0.3, sinks, window).float()
    per = block_rows_for(NH, NKV)
    first, count = row_blocks([(t, sum(n for *_, n in segs[:i]), n) for i, (t, _, n) in enumerate(segs)], per)
    assert count == [6, per, 40 - per]  # the one-row segments are left to the decode kernel
    solo = clear_block_rows(lens.clone(), first, count)
    solo[-1] = 0  # the padding row, as the executor writes it
    assert solo.count_nonzero() == 1  # the decode row
    pad = 3  # unused blocks (count 0), as a captured bucket has
    as_t = lambda v: torch.tensor(v + [0] * pad, dtype=torch.int32, device=triton_device)  # noqa: E731
    got = paged_row_block_attention_triton(q, k_cache, v_cache, bt, lens, 0.3, sinks, window,
                                           first=as_t(first), count=as_t(count), solo_lens=solo, rows_per_block=per,
                                           block_t=16).float()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, ref, **tol)
    assert torch.all(got[-1] == 0)  # the padding row: empty context


# ------------------------------------------------------------------------------------------
# RMSNorm, RoPE + the KV write


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_in_fp32", [True, False])
def test_rms_norm_triton_matches_the_reference(triton_device, dtype, weight_in_fp32):
    """One program per row (kernels/rms_norm.py) against models.attention.rms_norm: equal up to the order of the fp32
    sum of squares (fp32), within one bf16 ulp (bf16; the interpreter also truncates where the GPU rounds, see
    dataflow_kernels.dispatch.kernel_store_dtype); a hidden size that is not a power of two; rows of a larger buffer."""
    from dataflow_kernels.rms_norm import rms_norm_torch, rms_norm_triton
    g = gen(11)
    for T, Hn in ((5, 72), (1, 64), (0, 72)):
        x = (torch.randn(T, Hn + 8, generator=g) * 3).to(dtype)[:, :Hn]  # rows of a wider buffer: a row stride
        w = (torch.rand(Hn, generator=g) + 0.5).to(dtype)
        got = rms_norm_triton(x.to(triton_device), w.to(triton_device), 1e-5, weight_in_fp32).cpu()
        ref = rms_norm_torch(x, w, 1e-5, weight_in_fp32)
        assert got.dtype == ref.dtype and got.shape == ref.shape
        tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
        torch.testing.assert_close(got.float(), ref.float(), **tol)


def _rope_kv_inputs(dtype, nh: int, nkv: int, D: int, rdim: int, seed: int):
    """A decode batch over a paged cache: q/k/v as strided views of one projection output (the layout a fused
    projection gives), ragged positions incl. a padded row (-1 -> the trash row and page), a partial rotary width."""
    from dataflow_kernels.rope_kv_write import rope_table
    g = gen(seed)
    bs, pages, width = 4, 24, 5
    pos = torch.tensor([0, 5, 17, 3, -1], dtype=torch.int32)
    b = pos.shape[0]
    table = torch.randperm(pages, generator=g)[: 4 * width].view(4, width).to(torch.int32)
    table = torch.cat([table, torch.full((1, width), pages, dtype=torch.int32)])  # trash row -> trash page
    rows = torch.tensor([2, 0, 3, 1, 4], dtype=torch.int32)
    qkv = (torch.randn(b, (nh + 2 * nkv) * D + 3, generator=g) * 2).to(dtype)
    q = qkv[:, : nh * D].view(b, nh, D)
    k = qkv[:, nh * D: (nh + nkv) * D].view(b, nkv, D)
    v = qkv[:, (nh + nkv) * D: (nh + 2 * nkv) * D].view(b, nkv, D)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rdim, 2, dtype=torch.float32) / rdim))
    cos_t, sin_t = rope_table(inv_freq, 1.3, width * bs)
    kc = torch.randn(pages + 1, bs, nkv, D, generator=g).to(dtype)
    vc = torch.randn(pages + 1, bs, nkv, D, generator=g).to(dtype)
    return q, k, v, pos, rows, table, bs, cos_t, sin_t, kc, vc


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nh,nkv,D,rdim", [(6, 2, 16, 16), (4, 4, 16, 8), (8, 1, 12, 12)])
def test_rope_kv_write_triton_matches_the_reference(triton_device, dtype, nh, nkv, D, rdim):
    """One program per row (kernels/rope_kv_write.py) against its torch reference: the rotated q, the whole K/V cache
    after the write (untouched pages included) and the context lengths. Bit for bit in fp32, and in bf16 on a GPU; the
    interpreter truncates each of the kernel's bf16 roundings where the GPU rounds to nearest (cos/sin, two products,
    the sum: a few ulps of the largest input). Shapes: odd head counts, a partial rotary width, a head dim that is not a
    power of two, strided q/k/v."""
    from dataflow_kernels.rope_kv_write import rope_kv_write_torch, rope_kv_write_triton
    args = _rope_kv_inputs(dtype, nh, nkv, D, rdim, seed=21)
    ref_kc, ref_vc = args[9].clone(), args[10].clone()
    got_kc, got_vc = args[9].clone().to(triton_device), args[10].clone().to(triton_device)
    dev = [a.to(triton_device) if isinstance(a, torch.Tensor) else a for a in args[:9]]
    q_ref, ctx_ref = rope_kv_write_torch(*args[:9], ref_kc, ref_vc)
    q_got, ctx_got = rope_kv_write_triton(*dev, got_kc, got_vc)
    assert ctx_got.dtype == torch.int32 and ctx_got.cpu().tolist() == ctx_ref.tolist() == [1, 6, 18, 4, 0]
    assert q_got.dtype == dtype and q_got.shape == q_ref.shape
    exact = dtype == torch.float32 or triton_device == "cuda"
    tol = dict(rtol=0, atol=0 if exact else 2 ** -5 * float(args[0].abs().max()))
    for got, ref in ((q_got, q_ref), (got_kc, ref_kc), (got_vc, ref_vc)):
        torch.testing.assert_close(got.cpu().float(), ref.float(), **tol)
    assert not torch.equal(ref_kc, args[9]) and not torch.equal(ref_vc, args[10])  # the write happened


def test_rope_kv_write_reference_is_the_model_math():
    """The reference against the model's own pieces: models.rope.cos_sin / apply_rope for q and k, and each row's K/V
    at the page its table names (the padded row's at the trash page)."""
    from dataflow_kernels.rope_kv_write import rope_kv_write_torch
    from models.rope import apply_rope
    q, k, v, pos, rows, table, bs, cos_t, sin_t, kc, vc = _rope_kv_inputs(torch.float32, 6, 2, 16, 8, seed=22)
    q_out, _ = rope_kv_write_torch(q, k, v, pos, rows, table, bs, cos_t, sin_t, kc, vc)
    posc = pos.long().clamp(min=0)
    freqs = posc.float()[:, None] * (1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8)))[None, :]
    cos, sin = freqs.cos() * 1.3, freqs.sin() * 1.3
    assert torch.equal(q_out, apply_rope(q, cos, sin))
    k_rot = apply_rope(k, cos, sin)
    for i, (p, r) in enumerate(zip(posc.tolist(), rows.tolist())):
        page = int(table[r, p // bs])
        assert torch.equal(kc[page, p % bs], k_rot[i]) and torch.equal(vc[page, p % bs], v[i])
    assert int(table[rows[4], 0]) == kc.shape[0] - 1  # the padded row went to the trash page


# ------------------------------------------------------------------------------------------
# the CUDA executor's attention body


@pytest.mark.parametrize("name", ["tiny-gpt-oss", "tiny-glm4-moe", "tiny-olmoe", "tiny-qwen3-moe", "tiny-deepseek-v2"])
def test_cuda_executor_attention_body_with_the_triton_kernels(triton_device, use_options, name):
    """The attention graph's body as the GPU runs it (attn_impl="triton": the paged decode kernel, the fused RMSNorm,
    one q/k/v GEMM, RoPE and the KV write in one kernel), here through the interpreter, against the torch executor:
    the same hidden rows up to fp32 rounding. Families: sinks and windows (GPT-OSS), a partial rotary width (GLM),
    q/k norms over all heads (OLMoE) and per head (Qwen3), and MLA (DeepSeek: interleaved RoPE, the torch ops).
    Then a batch with a new prompt's 3-row chunk between the decode rows, padded to bucket 8: the row-block attention
    (dataflow_kernels.paged_attention.paged_row_block_attention_triton: the chunk by row blocks, the decode and padding rows
    through the decode kernel)."""
    import copy

    from graph_ir.spec import load_spec
    from models.weights import random_weights
    from runtime.executors.torch_executor import TorchExecutor
    from runtime.executors.cuda_executor import CudaExecutor
    from runtime.core.kv_cache import BlockAllocator, PagedKVStore
    if triton_device != "cpu":  # (on a GPU host the CPU tensors below would need the interpreter)
        pytest.skip("the interpreter's check of the attention body over a CPU KV store; on a GPU, "
                    "benchmarks/gpu_bench.py's correctness section checks the body against the torch executor")
    use_options(kernels="triton")
    spec = load_spec(f"models/specs/{name}.yaml")
    w = random_weights(spec)
    ref = TorchExecutor(spec, w)
    kv_a = PagedKVStore(spec.num_layers, BlockAllocator(32, 4))
    lens = [3, 6]
    for sid, n in enumerate(lens):
        assert kv_a.reserve(sid, n + 8)
        h = ref.embed([5 + i for i in range(n)])
        for layer in range(spec.num_layers):
            h_res, x = ref.attention(layer, h, list(range(n)), [(sid, 0, n)], kv_a)
            h = h_res + x
    kv_b = copy.deepcopy(kv_a)
    h = torch.randn(2, spec.hidden_size, generator=gen(12))
    ex = CudaExecutor(spec, w, device="cpu", attn_impl="triton", buckets={"attn": [4, 8], "expert": [16]})
    segs = [(0, 0, 1), (1, 1, 1)]
    want = ref.attention(1, h, lens, segs, kv_a)
    got = ex.attention(1, h, lens, segs, kv_b)
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_, rtol=1e-4, atol=1e-4)
    for kv_ in (kv_a, kv_b):
        assert kv_.reserve(2, 8)
    segs, pos = [(0, 0, 1), (2, 1, 3), (1, 4, 1)], [4, 0, 1, 2, 7]
    h = torch.randn(5, spec.hidden_size, generator=gen(13))
    want = ref.attention(1, h, pos, segs, kv_a)
    got = ex.attention(1, h, pos, segs, kv_b)
    assert ex.stats.attn_paged_prompt == 1 and ex.block_rows > 0 and ex.stats.attn_eager == 0
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_, rtol=1e-4, atol=1e-4)


def test_triton_kernels_in_subprocess():
    """Fallback when triton was imported in compiled mode before this file could ask for the interpreter."""
    run_triton_tests_in_subprocess(__file__)
