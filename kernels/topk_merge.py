"""Top-k merge: gather scattered expert output rows, weight them, add shared expert and residual.

After the expert stage, the k output rows of a token sit wherever their experts wrote them (a
receive buffer filled in arrival order). The merge reads them through `row_index` instead of
first copying them into a [T, k, H] tensor: that copy would read and write every row once more
(the "fuse gather with top-k merge" trick of the StreamEP design).

Semantics (`models.layers.moe_combine(h_res, shared, rows[row_index], weights)`, which the torch reference calls:
its gather is the copy the Triton kernel avoids), in this exact order, because the distributed runtime must reproduce
the reference bit for bit (products and sums commute in IEEE arithmetic, so w * y and y * w round alike):

    acc = 0 (fp32)
    for j in 0..k-1:              slot order, the order `route` returned
        acc = acc + weights[:, j] * float(rows[row_index[:, j]])
    acc = acc + float(shared)     when there is a shared expert
    acc = acc + float(h_res)
    h_next = acc.to(h_res.dtype)

Each multiply and add rounds separately (no fused multiply-add): the Triton launch disables FP
contraction so the GPU kernel rounds like torch's separate elementwise ops.
"""

from __future__ import annotations

import torch

from dataflow_kernels.dispatch import LazyJit, backend_for, cdiv, kernel_store_dtype, next_power_of_2
from models.moe import combine  # the reference (models.layers.moe_combine)

tl = None  # triton.language, bound by LazyJit at the first launch (see kernels/dispatch.py)


def topk_merge_torch(h_res: torch.Tensor, shared: torch.Tensor | None, rows: torch.Tensor, row_index: torch.Tensor,
                     weights: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Reference: the model's own combine over the gathered rows (module docstring: the exact operation order)."""
    _check(h_res, shared, rows, row_index, weights, out)
    h_next = combine(h_res, shared, rows[row_index], weights)
    return h_next if out is None else out.copy_(h_next)


def _topk_merge_kernel(
    h_res_ptr, shared_ptr, rows_ptr, index_ptr, weights_ptr, out_ptr,
    H, stride_res, stride_shared, stride_rows, stride_out,
    K: tl.constexpr, HAS_SHARED: tl.constexpr, BLOCK_H: tl.constexpr,
):
    # One program per (token, block of hidden columns). The k slots are unrolled in slot order so
    # the fp32 accumulation order equals the reference's.
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(K):
        r = tl.load(index_ptr + t * K + j)
        w = tl.load(weights_ptr + t * K + j).to(tl.float32)
        y = tl.load(rows_ptr + r * stride_rows + cols, mask=mask, other=0.0).to(tl.float32)
        acc = acc + w * y
    if HAS_SHARED:
        acc = acc + tl.load(shared_ptr + t * stride_shared + cols, mask=mask, other=0.0).to(tl.float32)
    acc = acc + tl.load(h_res_ptr + t * stride_res + cols, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + t * stride_out + cols, acc.to(out_ptr.dtype.element_ty), mask=mask)


_TOPK_MERGE = LazyJit(_topk_merge_kernel)


def topk_merge_triton(h_res: torch.Tensor, shared: torch.Tensor | None, rows: torch.Tensor, row_index: torch.Tensor,
                      weights: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """Triton version: one pass over the k gathered rows, shared and residual."""
    _check(h_res, shared, rows, row_index, weights, out)
    T, H = h_res.shape
    dest = out
    store = kernel_store_dtype(h_res.dtype)
    if out is None or store != out.dtype or out.stride(-1) != 1:  # (the interpreter stores fp32: rounded below)
        out = torch.empty((T, H), dtype=store, device=h_res.device)
    if T == 0 or H == 0:
        return out.to(h_res.dtype) if dest is None else dest
    # Only the last dimension has to be dense; row strides are passed through so views of a larger
    # receive buffer need no copy.
    h_res, rows = _last_dim_dense(h_res), _last_dim_dense(rows)
    shared = _last_dim_dense(shared) if shared is not None else None
    row_index = row_index.contiguous()
    weights = weights.contiguous()
    block_h = min(1024, next_power_of_2(H))
    _TOPK_MERGE[(T, cdiv(H, block_h))](
        h_res, shared if shared is not None else h_res, rows, row_index, weights, out,
        H, h_res.stride(0), shared.stride(0) if shared is not None else 0, rows.stride(0), out.stride(0),
        K=row_index.shape[1], HAS_SHARED=shared is not None, BLOCK_H=block_h,
        num_warps=4,
        # No FMA contraction: keep the reference's separate rounding of multiply and add.
        enable_fp_fusion=False,
    )
    if dest is None:
        return out.to(h_res.dtype)
    return dest if out is dest else dest.copy_(out)


def topk_merge(h_res: torch.Tensor, shared: torch.Tensor | None, rows: torch.Tensor, row_index: torch.Tensor,
               weights: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """h_next[T,H] from the residual, optional shared-expert output and k scattered expert rows.

    h_res [T,H]; shared [T,H] or None; rows [N,H] (any order); row_index [T,k] int64 (row of slot
    j of token t); weights [T,k] fp32. Output dtype = h_res dtype; `out` [T,H] of that dtype: written there
    (and returned) instead of into a new tensor. Picks Triton or torch via `dataflow_kernels.dispatch.backend_for`.
    """
    if backend_for(h_res, shared, rows, row_index, weights) == "triton":
        return topk_merge_triton(h_res, shared, rows, row_index, weights, out)
    return topk_merge_torch(h_res, shared, rows, row_index, weights, out)


def _check(h_res, shared, rows, row_index, weights, out=None) -> None:
    T, H = h_res.shape
    if out is not None and (out.shape != (T, H) or out.dtype != h_res.dtype or out.device != h_res.device):
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} on {out.device}: expected {(T, H)} {h_res.dtype} "
                         f"on {h_res.device}")
    if shared is not None and shared.shape != (T, H):
        raise ValueError(f"shared {tuple(shared.shape)} != h_res {(T, H)}")
    if rows.dim() != 2 or rows.shape[1] != H:
        raise ValueError(f"rows {tuple(rows.shape)}: expected [N, {H}]")
    if row_index.dim() != 2 or row_index.shape[0] != T or row_index.dtype != torch.int64:
        raise ValueError(f"row_index {tuple(row_index.shape)} {row_index.dtype}: expected [{T}, k] int64")
    if weights.shape != row_index.shape:
        raise ValueError(f"weights {tuple(weights.shape)} != row_index {tuple(row_index.shape)}")


def _last_dim_dense(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()
