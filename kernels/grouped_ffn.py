"""Grouped expert FFN over a batch whose rows are sorted by expert.

    for each expert e, rows r in expert_offsets[e]:expert_offsets[e+1]:
        g = x[r] @ w_gate[e].T + b_gate[e]          w_gate [E, I, H]
        u = x[r] @ w_up[e].T   + b_up[e]            w_up   [E, I, H]
        h = act(g, u)                               silu_glu:   silu(g) * u
                                                    gptoss_glu: g' = min(g, limit), u' = clamp(u, +-limit),
                                                                (u' + 1) * g' * sigmoid(alpha * g')
        y[r] = h @ w_down[e].T + b_down[e]          w_down [E, H, I]

`gptoss_glu` is transformers' GptOssExperts._apply_gate (after de-interleaving its fused
gate_up projection into w_gate / w_up, which models/checkpoint.py does).

Two implementations, same signature (the CUDA executor picks one: its `ffn_impl`):
- torch reference: a loop over the non-empty experts, op for op `models.moe.experts_rows` with its
  activation (`models.moe.glu`), so equal to it bit for bit; the loop needs the offsets on the host,
  i.e. one synchronization.
- Triton: two grouped GEMM launches (gate+up with the activation fused, then down). Each program
  owns one (row tile of one expert, column tile); programs find their expert from the offsets on
  the device, so the launch never reads data-dependent sizes on the host and can be captured in
  a CUDA graph. fp32 accumulation; bf16 in/out on the GPU. The activation is applied to the fp32
  accumulators (the reference rounds g and u to the input dtype first), so bf16 results differ
  from the reference by rounding only. (torch._grouped_mm reached 58% of the byte floor where
  this kernel reached 90% on an H200; it was deleted.)
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from dataflow_kernels.dispatch import LazyJit, cdiv, interpreting, kernel_store_dtype, next_power_of_2
from models.moe import glu  # the reference's activation is the model's own

tl = None  # triton.language, bound by LazyJit at the first launch (see kernels/dispatch.py)

ACTIVATIONS = ("silu_glu", "gptoss_glu")


def _check(x, expert_offsets, w_gate, w_up, w_down, activation) -> None:
    if activation not in ACTIVATIONS:
        raise ValueError(f"activation {activation!r}: expected one of {ACTIVATIONS}")
    E, I, H = w_gate.shape
    if x.dim() != 2 or x.shape[1] != H:
        raise ValueError(f"x_sorted {tuple(x.shape)}: expected [N, {H}]")
    if w_up.shape != (E, I, H) or w_down.shape != (E, H, I):
        raise ValueError(f"w_up {tuple(w_up.shape)} / w_down {tuple(w_down.shape)} do not match w_gate {(E, I, H)}")
    if expert_offsets.shape != (E + 1,):
        raise ValueError(f"expert_offsets {tuple(expert_offsets.shape)}: expected [{E + 1}]")


# ---------------------------------------------------------------------------------------------
# torch reference


def grouped_ffn_torch(
    x_sorted, expert_offsets, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None,
    activation: str = "silu_glu", alpha: float = 1.702, limit: float = 7.0,
) -> torch.Tensor:
    """Reference: per-expert F.linear calls over the non-empty experts."""
    _check(x_sorted, expert_offsets, w_gate, w_up, w_down, activation)
    y = x_sorted.new_zeros(x_sorted.shape)
    bounds = expert_offsets.tolist()
    for e in range(w_gate.shape[0]):
        lo, hi = bounds[e], bounds[e + 1]
        if hi == lo:
            continue
        xe = x_sorted[lo:hi]
        g = F.linear(xe, w_gate[e], b_gate[e] if b_gate is not None else None)
        u = F.linear(xe, w_up[e], b_up[e] if b_up is not None else None)
        h = glu(g, u, activation, alpha, limit)
        y[lo:hi] = F.linear(h, w_down[e], b_down[e] if b_down is not None else None)
    return y


# ---------------------------------------------------------------------------------------------
# Triton grouped GEMM


def _expert_tile(offsets_ptr, E, pid, BLOCK_M: tl.constexpr, BLOCK_E: tl.constexpr):
    # Map a row-tile program id to (expert, first row, end row). Expert e owns
    # ceil(count_e / BLOCK_M) consecutive tile ids; an inclusive cumsum of those counts, compared
    # with pid, gives the expert. Ids past the last tile get e >= E (the caller returns).
    experts = tl.arange(0, BLOCK_E)
    lo = tl.load(offsets_ptr + experts, mask=experts < E, other=0)
    hi = tl.load(offsets_ptr + experts + 1, mask=experts < E, other=0)
    tiles = (hi - lo + BLOCK_M - 1) // BLOCK_M
    ends = tl.cumsum(tiles, axis=0)
    e = tl.sum((ends <= pid).to(tl.int32), axis=0)
    sel = experts == e
    row_start = tl.sum(tl.where(sel, lo + (pid - (ends - tiles)) * BLOCK_M, 0), axis=0)
    row_end = tl.sum(tl.where(sel, hi, 0), axis=0)
    return e, row_start, row_end


def _dot(a, b, acc, UPCAST: tl.constexpr, IEEE: tl.constexpr):
    # acc + a @ b. UPCAST: the interpreter's bf16 dot is wrong, fp32 is exact enough to compare; IEEE: fp32 inputs
    # take no TF32, so fp32 runs match the fp32 reference closely.
    if UPCAST:
        a = a.to(tl.float32)
        b = b.to(tl.float32)
    if IEEE:
        acc = tl.dot(a, b, acc, input_precision="ieee")
    else:
        acc = tl.dot(a, b, acc)
    return acc


def _gate_up_kernel(
    x_ptr, offsets_ptr, wg_ptr, wu_ptr, bg_ptr, bu_ptr, h_ptr,
    E, H, I, alpha, limit,
    HAS_BIAS: tl.constexpr, GPTOSS: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
):
    # h[rows, cols] = act(x[rows] @ w_gate[e, cols].T, x[rows] @ w_up[e, cols].T): both GEMMs share
    # the x tile, and the activation runs on the fp32 accumulators before the single store.
    e, row_start, row_end = _expert_tile(offsets_ptr, E, tl.program_id(0), BLOCK_M, BLOCK_E)
    if e >= E:
        return
    rows = row_start + tl.arange(0, BLOCK_M)
    rmask = rows < row_end
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < I
    w_off = e.to(tl.int64) * I * H
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, H, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < H
        a = tl.load(x_ptr + rows[:, None] * H + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        # [BLOCK_K, BLOCK_N] tiles of w[e].T: element (k, n) of w_gate[e] is at n * H + k.
        wmask = kmask[:, None] & cmask[None, :]
        bg = tl.load(wg_ptr + w_off + cols[None, :] * H + ks[:, None], mask=wmask, other=0.0)
        bu = tl.load(wu_ptr + w_off + cols[None, :] * H + ks[:, None], mask=wmask, other=0.0)
        acc_g = _dot(a, bg, acc_g, UPCAST, IEEE)
        acc_u = _dot(a, bu, acc_u, UPCAST, IEEE)
    if HAS_BIAS:
        acc_g += tl.load(bg_ptr + e.to(tl.int64) * I + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(bu_ptr + e.to(tl.int64) * I + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    if GPTOSS:
        g = tl.minimum(acc_g, limit)
        u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        h = (u + 1.0) * (g * tl.sigmoid(g * alpha))
    else:
        h = acc_g * tl.sigmoid(acc_g) * acc_u
    tl.store(h_ptr + rows[:, None] * I + cols[None, :], h.to(h_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


def _down_kernel(
    h_ptr, offsets_ptr, wd_ptr, bd_ptr, y_ptr,
    E, H, I,
    HAS_BIAS: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_E: tl.constexpr,
):
    # y[rows, cols] = h[rows] @ w_down[e, cols].T (+ b_down[e, cols]).
    e, row_start, row_end = _expert_tile(offsets_ptr, E, tl.program_id(0), BLOCK_M, BLOCK_E)
    if e >= E:
        return
    rows = row_start + tl.arange(0, BLOCK_M)
    rmask = rows < row_end
    cols = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    cmask = cols < H
    w_off = e.to(tl.int64) * H * I
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, I, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        kmask = ks < I
        a = tl.load(h_ptr + rows[:, None] * I + ks[None, :], mask=rmask[:, None] & kmask[None, :], other=0.0)
        b = tl.load(wd_ptr + w_off + cols[None, :] * I + ks[:, None], mask=kmask[:, None] & cmask[None, :], other=0.0)
        acc = _dot(a, b, acc, UPCAST, IEEE)
    if HAS_BIAS:
        acc += tl.load(bd_ptr + e.to(tl.int64) * H + cols, mask=cmask, other=0.0).to(tl.float32)[None, :]
    tl.store(y_ptr + rows[:, None] * H + cols[None, :], acc.to(y_ptr.dtype.element_ty),
             mask=rmask[:, None] & cmask[None, :])


_GATE_UP = LazyJit(_gate_up_kernel, helpers=(_expert_tile, _dot))
_DOWN = LazyJit(_down_kernel, helpers=(_expert_tile, _dot))


def grouped_ffn_triton(
    x_sorted, expert_offsets, w_gate, w_up, w_down, b_gate=None, b_up=None, b_down=None,
    activation: str = "silu_glu", alpha: float = 1.702, limit: float = 7.0,
    *, block_m: int | None = None, block_n: int = 64, block_k: int = 64, num_warps: int = 4, num_stages: int = 3,
) -> torch.Tensor:
    """Triton grouped GEMM version (tile sizes are keyword-only knobs for the benchmark)."""
    _check(x_sorted, expert_offsets, w_gate, w_up, w_down, activation)
    N, H = x_sorted.shape
    E, I, _ = w_gate.shape
    for name, w in (("w_gate", w_gate), ("w_up", w_up), ("w_down", w_down)):
        if not w.is_contiguous():  # copying expert weights per call would cost more than the FFN
            raise ValueError(f"{name} must be contiguous")
    x = x_sorted.contiguous()
    offsets = expert_offsets.to(torch.int64).contiguous()
    store_dtype = kernel_store_dtype(x.dtype)
    h = torch.empty((N, I), dtype=store_dtype, device=x.device)
    y = torch.empty((N, H), dtype=store_dtype, device=x.device)
    if N == 0:
        return y.to(x.dtype)
    avg = N / max(E, 1)  # row tile: small when experts get few rows (decode), so padding rows waste little
    bm = block_m or (16 if avg <= 16 else 32 if avg <= 32 else 64)
    # Upper bound on row tiles: each expert adds at most one partial tile. Depends only on N and
    # E, never on the routing, so the launch is CUDA-graph safe; surplus programs exit at once.
    grid_m = min(cdiv(N, bm) + E, N)
    block_e = max(16, next_power_of_2(E))
    common = dict(UPCAST=interpreting(), IEEE=x.dtype == torch.float32 and not interpreting(),
                  BLOCK_M=bm, BLOCK_N=block_n, BLOCK_K=block_k, BLOCK_E=block_e,
                  num_warps=num_warps, num_stages=num_stages)
    has_bias = b_gate is not None
    if has_bias != (b_up is not None) or has_bias != (b_down is not None):
        raise ValueError("b_gate, b_up and b_down must be all given or all None")
    _GATE_UP[(grid_m, cdiv(I, block_n))](
        x, offsets, w_gate, w_up, b_gate if has_bias else x, b_up if has_bias else x, h,
        E, H, I, float(alpha), float(limit),
        HAS_BIAS=has_bias, GPTOSS=activation == "gptoss_glu", **common,
    )
    # Under the interpreter h was stored in fp32; round it like the GPU store would.
    h = h.to(x.dtype)
    _DOWN[(grid_m, cdiv(H, block_n))](
        h, offsets, w_down, b_down if has_bias else x, y, E, H, I, HAS_BIAS=has_bias, **common,
    )
    return y.to(x.dtype)
