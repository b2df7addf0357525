"""RMSNorm in one launch: the attention graph's two norms per layer (attn_norm, mlp_norm).

`models.attention.rms_norm` is the reference: fp32 statistics over the last dimension, then either the weight
multiplied in fp32 and one cast (GPT-OSS, `weight_in_fp32`) or a cast and the weight multiplied in the input dtype
(Llama-style families). As torch ops that is ~8 elementwise kernels and a reduction per norm; inside a captured
decode attention graph at B=256 each is a ~2 us node (77 launches per attention layer, ~140 us of its
243-272 us in such small kernels). Here: one program per row.

Not bit-identical to the reference: the sum of squares adds in another order (fp32), so results can differ in the
last fp32 bit, and in bf16 rarely by one ulp after rounding.
"""

from __future__ import annotations

import torch

from dataflow_kernels.dispatch import LazyJit, backend_for, kernel_store_dtype, next_power_of_2
from models.attention import rms_norm as rms_norm_torch  # the reference (the model code's own norm)

tl = None  # triton.language, bound by LazyJit at the first launch (see kernels/dispatch.py)


def _rms_norm_kernel(x_ptr, w_ptr, out_ptr, H, stride_x, stride_out, eps,
                     WEIGHT_FP32: tl.constexpr, BLOCK_H: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    cols = tl.arange(0, BLOCK_H)
    mask = cols < H
    x = tl.load(x_ptr + row * stride_x + cols, mask=mask, other=0.0).to(tl.float32)
    r = 1.0 / tl.sqrt(tl.sum(x * x, axis=0) / H + eps)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    if WEIGHT_FP32:
        y = w.to(tl.float32) * (x * r)
    else:  # the normalized row in the input dtype first, then the weight in that dtype
        y = (x * r).to(x_ptr.dtype.element_ty).to(tl.float32) * w.to(tl.float32)
    tl.store(out_ptr + row * stride_out + cols, y.to(out_ptr.dtype.element_ty), mask=mask)


_RMS_NORM = LazyJit(_rms_norm_kernel)


def rms_norm_triton(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool = False) -> torch.Tensor:
    """Triton version: one program per row of x [T, H] (a 2-D x; other shapes go to the reference)."""
    if x.dim() != 2 or x.stride(-1) != 1:
        return rms_norm_torch(x, weight, eps, weight_in_fp32)
    T, H = x.shape
    out = torch.empty((T, H), dtype=kernel_store_dtype(x.dtype), device=x.device)
    if T == 0 or H == 0:
        return out.to(x.dtype)
    _RMS_NORM[(T,)](x, weight.contiguous(), out, H, x.stride(0), out.stride(0), float(eps),
                    WEIGHT_FP32=bool(weight_in_fp32), BLOCK_H=next_power_of_2(H), num_warps=8,
                    enable_fp_fusion=False)
    return out.to(x.dtype)


def rms_norm_fused(x: torch.Tensor, weight: torch.Tensor, eps: float, weight_in_fp32: bool = False) -> torch.Tensor:
    """RMSNorm of x [T, H] with `weight` [H]; Triton or torch via `dataflow_kernels.dispatch.backend_for`."""
    if backend_for(x, weight) == "triton":
        return rms_norm_triton(x, weight, eps, weight_in_fp32)
    return rms_norm_torch(x, weight, eps, weight_in_fp32)
