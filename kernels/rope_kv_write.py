"""RoPE on q and k, and this step's K/V written into the paged cache, in one launch per attention layer.

In the captured decode attention graph this is the span between the q/k/v projections and the attention kernel.
As torch ops it is ~30 small kernels per layer ("(other)" in a profile: ~30 launches, ~45 us of the 194-224 us replay at
B=256 on an H200): cos/sin from the positions (cast, multiply, cos, sin, two scalings), the
rotation of q and of k (two casts, four products, a difference, a sum, a concatenation each), the page/slot index
math (a division, a gather, a cast, a product, a remainder, a sum) and two index copies, then the context lengths.
Here one program per batch row does all of it; cos/sin are read from a per-position table made once with the same
torch ops (`rope_table`), so the values are bitwise the ones the per-batch computation gives.

Semantics (`rope_kv_write_torch` is the reference, the CPU twin runs it):

    posc = max(pos, 0)                                  padded rows (pos -1) rotate at position 0, write the trash page
    q, k = apply_rope(q|k, cos[posc], sin[posc])        rotate-half pairs (i, i + r/2), the rest of a head passes through
    slot = table[rows, posc // bs] * bs + posc % bs
    kc[slot], vc[slot] = k, v                           (flattened [pages * bs, heads, dim] views of the cache)
    returns q, ctx = pos + 1 (int32)

Rounding follows torch's elementwise ops step by step: cos/sin are cast to the activation dtype first, and each
product, difference and sum is rounded to it (computed in fp32, as torch's opmath does; no FP contraction). So on
the GPU the result is bit-identical to the reference in fp32 and bf16. The interpreter truncates where the GPU rounds
(see dataflow_kernels.dispatch.kernel_store_dtype), at each of those roundings: within a few bf16 ulps there.

Only the rotate-half form of GQA families (not DeepSeek's interleaved pairs, which MLA uses: that stays torch).
"""

from __future__ import annotations

import torch
from torch import Tensor

from dataflow_kernels.dispatch import LazyJit, backend_for, kernel_store_dtype, next_power_of_2
from models.rope import apply_rope, rotation

tl = None  # triton.language, bound by LazyJit at the first launch (see kernels/dispatch.py)


def rope_table(inv_freq: Tensor, scaling: float, positions: int) -> tuple[Tensor, Tensor]:
    """cos, sin [positions, r/2] fp32 on inv_freq's device: models.rope.rotation over 0..positions-1 (the model's own
    function on the same inputs, so a row equals what cos_sin gives for that position)."""
    cos, sin = rotation(inv_freq, scaling, torch.arange(positions, dtype=torch.float32, device=inv_freq.device))
    return cos.contiguous(), sin.contiguous()


def cache_write(posc: Tensor, rows: Tensor, table: Tensor, block_size: int, *writes: tuple[Tensor, Tensor]) -> None:
    """For each (x, cache) of `writes`: row i of x into the paged cache at position posc[i] (int64, >= 0) of table row
    rows[i]: slot = table[rows, posc // bs] * bs + posc % bs of the flattened [pages * bs, heads, dim] cache (the
    reference's K and V writes; MLA's latent rows, which have no V)."""
    page = table[rows.to(torch.int64), torch.div(posc, block_size, rounding_mode="floor")].to(torch.int64)
    slot = page * block_size + posc % block_size
    for x, cache in writes:
        cache.view(-1, *cache.shape[2:]).index_copy_(0, slot, x.to(cache.dtype))


def rope_kv_write_torch(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, rows: Tensor, table: Tensor, block_size: int,
                        cos_tab: Tensor, sin_tab: Tensor, kc: Tensor, vc: Tensor) -> tuple[Tensor, Tensor]:
    """Reference (module docstring). q [b, nh, d], k [b, nkv, d], v [b, nkv, dv]; pos, rows [b] (int); table [R, W]
    int32 page ids; cos_tab/sin_tab [P, r/2] fp32 (`rope_table`); kc [pages, bs, nkv, d], vc [pages, bs, nkv, dv].
    Returns (rotated q, ctx int32 [b])."""
    posc = pos.to(torch.int64).clamp(min=0)
    cos, sin = cos_tab.index_select(0, posc), sin_tab.index_select(0, posc)
    q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
    cache_write(posc, rows, table, block_size, (k, kc), (v, vc))
    return q, (pos.to(torch.int64) + 1).to(torch.int32)


def _rotate(x_ptr, stride_h, heads, HALF: tl.constexpr, R: tl.constexpr, D: tl.constexpr,
            NH: tl.constexpr, BLOCK_D: tl.constexpr, c, s):
    # [NH, BLOCK_D] tile of one row's heads. Channel d < HALF pairs with d + HALF (x1*c - x2*s), HALF <= d < R with
    # d - HALF (x2*c + x1*s), d >= R passes through. Each product and the sum rounded to the activation dtype.
    dt = x_ptr.dtype.element_ty
    h = tl.arange(0, NH)[:, None]
    d = tl.arange(0, BLOCK_D)[None, :]
    mask = (h < heads) & (d < D)
    first = d < HALF
    rot = d < R
    partner = tl.where(first, d + HALF, d - HALF)
    x = tl.load(x_ptr + h * stride_h + d, mask=mask, other=0.0)
    xp = tl.load(x_ptr + h * stride_h + partner, mask=mask & rot, other=0.0).to(tl.float32)
    xc = (x.to(tl.float32) * c).to(dt).to(tl.float32)
    ps = (xp * s).to(dt).to(tl.float32)
    out = tl.where(first, xc - ps, xc + ps).to(dt)
    return tl.where(rot, out, x), h, d, mask


def _rope_kv_write_kernel(q_ptr, k_ptr, v_ptr, pos_ptr, rows_ptr, table_ptr, cos_ptr, sin_ptr, kc_ptr, vc_ptr,
                          q_out_ptr, ctx_ptr, nh, nkv, stride_qb, stride_qh, stride_kb, stride_kh, stride_vb,
                          stride_vh, stride_t, block_size, stride_kc_slot, stride_kc_h, stride_vc_slot, stride_vc_h,
                          HALF: tl.constexpr, R: tl.constexpr, D: tl.constexpr, DV: tl.constexpr,
                          NH: tl.constexpr, NKV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr):
    r = tl.program_id(0).to(tl.int64)
    p = tl.load(pos_ptr + r).to(tl.int64)
    pc = tl.maximum(p, 0)
    row = tl.load(rows_ptr + r).to(tl.int64)
    page = tl.load(table_ptr + row * stride_t + pc // block_size).to(tl.int64)
    slot = page * block_size + pc % block_size
    tl.store(ctx_ptr + r, (p + 1).to(tl.int32))
    # cos/sin of channel d's pair, cast to the activation dtype as apply_rope does, then used in fp32
    d = tl.arange(0, BLOCK_D)[None, :]
    j = tl.where(d < HALF, d, d - HALF)
    cs_mask = d < R
    dt = q_ptr.dtype.element_ty
    c = tl.load(cos_ptr + pc * HALF + j, mask=cs_mask, other=0.0).to(dt).to(tl.float32)
    s = tl.load(sin_ptr + pc * HALF + j, mask=cs_mask, other=0.0).to(dt).to(tl.float32)
    q, h, dq, mq = _rotate(q_ptr + r * stride_qb, stride_qh, nh, HALF, R, D, NH, BLOCK_D, c, s)
    tl.store(q_out_ptr + r * nh * D + h * D + dq, q.to(q_out_ptr.dtype.element_ty), mask=mq)
    k, hk, dk, mk = _rotate(k_ptr + r * stride_kb, stride_kh, nkv, HALF, R, D, NKV, BLOCK_D, c, s)
    tl.store(kc_ptr + slot * stride_kc_slot + hk * stride_kc_h + dk, k.to(kc_ptr.dtype.element_ty), mask=mk)
    hv = tl.arange(0, NKV)[:, None]
    dv = tl.arange(0, BLOCK_DV)[None, :]
    mv = (hv < nkv) & (dv < DV)
    v = tl.load(v_ptr + r * stride_vb + hv * stride_vh + dv, mask=mv, other=0.0)
    tl.store(vc_ptr + slot * stride_vc_slot + hv * stride_vc_h + dv, v.to(vc_ptr.dtype.element_ty), mask=mv)


_ROPE_KV_WRITE = LazyJit(_rope_kv_write_kernel, helpers=(_rotate,))


def _triton_ok(q: Tensor, k: Tensor, v: Tensor, kc: Tensor, vc: Tensor) -> bool:
    """The kernel's layout assumptions: unit channel stride everywhere, q/k of the same dtype, a cache row per slot of
    contiguous [heads, dim]."""
    return (q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1 and q.dtype == k.dtype
            and kc.is_contiguous() and vc.is_contiguous() and q.shape[-1] == k.shape[-1])


def rope_kv_write_triton(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, rows: Tensor, table: Tensor, block_size: int,
                         cos_tab: Tensor, sin_tab: Tensor, kc: Tensor, vc: Tensor) -> tuple[Tensor, Tensor]:
    """Triton version: one program per batch row (other layouts go to the reference, see `_triton_ok`)."""
    if not _triton_ok(q, k, v, kc, vc):
        return rope_kv_write_torch(q, k, v, pos, rows, table, block_size, cos_tab, sin_tab, kc, vc)
    b, nh, D = q.shape
    nkv, DV = k.shape[1], v.shape[2]
    half = cos_tab.shape[1]
    q_out = torch.empty((b, nh, D), dtype=kernel_store_dtype(q.dtype), device=q.device)
    ctx = torch.empty(b, dtype=torch.int32, device=q.device)
    if b == 0:
        return q_out.to(q.dtype), ctx
    kf, vf = kc.view(-1, *kc.shape[2:]), vc.view(-1, *vc.shape[2:])
    _ROPE_KV_WRITE[(b,)](q, k, v, pos, rows, table, cos_tab, sin_tab, kf, vf, q_out, ctx, nh, nkv,
                         q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1), table.stride(0),
                         block_size, kf.stride(0), kf.stride(1), vf.stride(0), vf.stride(1),
                         HALF=half, R=2 * half, D=D, DV=DV, NH=next_power_of_2(nh), NKV=next_power_of_2(nkv),
                         BLOCK_D=next_power_of_2(D), BLOCK_DV=next_power_of_2(DV), num_warps=4,
                         enable_fp_fusion=False)
    return q_out.to(q.dtype), ctx


def rope_kv_write(q: Tensor, k: Tensor, v: Tensor, pos: Tensor, rows: Tensor, table: Tensor, block_size: int,
                  cos_tab: Tensor, sin_tab: Tensor, kc: Tensor, vc: Tensor) -> tuple[Tensor, Tensor]:
    """RoPE on q and k, K/V into the paged cache, the context lengths (module docstring); Triton or torch via
    `dataflow_kernels.dispatch.backend_for`."""
    if backend_for(q, k, v, kc) == "triton":
        return rope_kv_write_triton(q, k, v, pos, rows, table, block_size, cos_tab, sin_tab, kc, vc)
    return rope_kv_write_torch(q, k, v, pos, rows, table, block_size, cos_tab, sin_tab, kc, vc)
