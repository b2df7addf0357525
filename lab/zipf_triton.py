"""ZipfRouting's draw as one Triton kernel: the in-graph router at about a learned router's cost.

zipf_torch.py draws the benches' synthetic routing with torch ops inside the attention graph, bit for
bit the host router's: ~50 small kernels, 81-91 us of device time per 192-row batch on an H200. This
kernel draws the same in one launch, 11 us (a learned router's linear + top-k + softmax: 21 us; run 51,
benchmarks/NOTES.md §22 item 1). It did not change streaming's result under a compute hog, which the
kernel count had been blamed for: §22 item 2 traces that to the routing round trip every in-graph router costs.

Same draw, same bits as `zipf_torch.zipf_route` (its docstring has the formulas): uint64 SplitMix64
natively (Triton has unsigned 64-bit integers), Gumbel scores in float64, top-k by repeated argmax
(ties go to the lower expert id; a tie of two float64 Gumbel scores has probability ~2^-50), weights
exp(chosen - chosen[0]) summed left to right and divided in float64, rounded once to float32.
`zipf_torch.zipf_route` is the CPU twin; the tests run this kernel in Triton's CPU interpreter against
it (tests/test_keyed_router_graph.py), and benchmarks/device/keyed_router_check.py counts differing
tokens on the GPU.
"""
from __future__ import annotations

from typing import Optional

import torch

from dataflow_kernels.dispatch import LazyJit, cdiv, next_power_of_2

tl = None  # triton.language, bound by LazyJit at the first launch (kernels/dispatch.py)


def _splitmix64(z):
    z = z + 0x9E3779B97F4A7C15
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9
    z = (z ^ (z >> 27)) * 0x94D049BB133111EB
    return z ^ (z >> 31)


def _floor_div_nonneg_divisor(a, d):
    # Floor division for any sign of a (d > 0), from divisions of non-negative operands only, so it
    # means the same on the GPU (truncating) and in the interpreter (numpy, flooring).
    pos_q = tl.maximum(a, 0) // d
    neg_q = -((tl.maximum(-a, 0) + d - 1) // d)
    return tl.where(a >= 0, pos_q, neg_q)


def _zipf_route_kernel(base0_ptr, pos_ptr, table_ptr, ids_ptr, w_ptr, T, layer, drift_every, drift_stride,
                       E: tl.constexpr, K: tl.constexpr, DRIFT: tl.constexpr,
                       BLOCK_T: tl.constexpr, BLOCK_E: tl.constexpr, BLOCK_K: tl.constexpr):
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    rmask = rows < T
    e = tl.arange(0, BLOCK_E)
    emask = e < E
    pos = tl.load(pos_ptr + rows, mask=rmask, other=0)
    z = tl.load(base0_ptr + rows, mask=rmask, other=0).to(tl.uint64, bitcast=True)
    z = _splitmix64(z ^ pos.to(tl.uint64, bitcast=True))
    z = _splitmix64(z ^ layer.to(tl.uint64))
    h = _splitmix64(z[:, None] ^ e.to(tl.uint64)[None, :])
    u = ((h >> 11).to(tl.float64) + 0.5) * 1.1102230246251565e-16  # 2^-53, exact
    if DRIFT:  # the popularity rotation of the row's step: ((pos // every) * stride) mod E
        r = _floor_div_nonneg_divisor(pos, drift_every) * drift_stride
        shift = r - _floor_div_nonneg_divisor(r, E) * E
    else:
        shift = pos * 0
    logp = tl.load(table_ptr + shift[:, None] * E + e[None, :], mask=rmask[:, None] & emask[None, :], other=0.0)
    score = tl.where(emask[None, :], logp - tl.log(-tl.log(u)), float("-inf"))
    kk = tl.arange(0, BLOCK_K)
    chosen = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.float64)
    ids = tl.zeros([BLOCK_T, BLOCK_K], dtype=tl.int64)
    for j in tl.static_range(K):  # descending, as torch.topk(sorted=True)
        best = tl.max(score, axis=1)
        arg = tl.min(tl.where(score == best[:, None], e[None, :], BLOCK_E), axis=1)
        chosen = tl.where(kk[None, :] == j, best[:, None], chosen)
        ids = tl.where(kk[None, :] == j, arg.to(tl.int64)[:, None], ids)
        score = tl.where(e[None, :] == arg[:, None], float("-inf"), score)
    c0 = tl.sum(tl.where(kk[None, :] == 0, chosen, 0.0), axis=1)
    v = tl.exp(chosen - c0[:, None])
    total = tl.zeros([BLOCK_T], dtype=tl.float64)
    for j in tl.static_range(K):  # left to right, as the host loop sums (adding the zeros is exact)
        total = total + tl.sum(tl.where(kk[None, :] == j, v, 0.0), axis=1)
    w = (v / total[:, None]).to(tl.float32)
    out = rows[:, None] * K + kk[None, :]
    omask = rmask[:, None] & (kk[None, :] < K)
    tl.store(ids_ptr + out, ids, mask=omask)
    tl.store(w_ptr + out, w, mask=omask)


# One compile per model shape: Triton would otherwise specialize the row count and the layer on their values
# (1, multiples of 16), a compile in each rank for each new class while the first graphs are captured.
_ZIPF_ROUTE = LazyJit(_zipf_route_kernel, helpers=(_splitmix64, _floor_div_nonneg_divisor),
                      do_not_specialize=("T", "layer", "drift_every", "drift_stride"))


def zipf_route_triton(base0: torch.Tensor, pos: torch.Tensor, layer: int, table: torch.Tensor, k: int,
                      steps: Optional[torch.Tensor] = None, drift_every: int = 0, drift_stride: int = 1
                      ) -> tuple[torch.Tensor, torch.Tensor]:
    """`zipf_torch.zipf_route`'s answer from one kernel launch (same arguments, same bits). Capturable:
    no host synchronization, shapes fixed by T."""
    if steps is not None:
        raise NotImplementedError("zipf_route_triton draws the rotation from the position (steps=None)")
    T, E = base0.shape[0], table.shape[1]
    ids = torch.empty((T, k), dtype=torch.int64, device=base0.device)
    w = torch.empty((T, k), dtype=torch.float32, device=base0.device)
    if T == 0:
        return ids, w
    block_e = next_power_of_2(E)
    block_t = max(1, min(64, 2048 // block_e))  # a [BLOCK_T, BLOCK_E] float64 tile of ~2k scores
    _ZIPF_ROUTE[(cdiv(T, block_t),)](
        base0.contiguous(), pos.contiguous(), table.contiguous(), ids, w, T, layer, max(drift_every, 1), drift_stride,
        E=E, K=k, DRIFT=bool(drift_every), BLOCK_T=block_t, BLOCK_E=block_e, BLOCK_K=next_power_of_2(k),
        num_warps=4)
    return ids, w
