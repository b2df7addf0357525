"""Permute: put the (token, slot) rows of a routed batch into expert order, and gather them.

The grouped expert FFN wants the rows of one expert contiguous. `permute_to_experts` computes the
order (a stable counting sort by expert id) and the per-expert offsets; `gather_rows` then copies
token rows into that order (`x_sorted = gather_rows(x, order // k)`).

Row numbering: the flat row `r = t * k + j` is slot j of token t. `order[i]` is the flat row that
lands at sorted position i. Stability (equal experts keep flat order, i.e. by token then slot) is
part of the contract: it makes the sorted batch, hence its floating point results, deterministic.
Expert ids must lie in [0, num_experts); the kernels do not check (a check would need a host
synchronization), out-of-range rows are simply not placed.
"""

from __future__ import annotations

import torch

from dataflow_kernels.dispatch import LazyJit, cdiv, kernel_store_dtype, next_power_of_2

tl = None  # triton.language, bound by LazyJit at the first launch (see kernels/dispatch.py)


# ---------------------------------------------------------------------------------------------
# permute_to_experts


def permute_to_experts_torch(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference: stable argsort of the flat expert ids + bincount offsets."""
    flat = expert_ids.reshape(-1).to(torch.int64)
    order = torch.argsort(flat, stable=True)
    counts = torch.bincount(flat, minlength=num_experts)[:num_experts]
    offsets = torch.zeros(num_experts + 1, dtype=torch.int64, device=flat.device)
    offsets[1:] = torch.cumsum(counts, dim=0)
    return order, offsets


def _permute_kernel(
    ids_ptr, order_ptr, offsets_ptr, N, E,
    BLOCK_N: tl.constexpr, BLOCK_E: tl.constexpr,
):
    # One program per chunk of BLOCK_N rows; no program waits for another. Each one histograms every chunk (cheap:
    # column sums of a one-hot [rows, experts] tile), which gives the experts' starts and the rows of each expert in
    # the chunks before its own, then ranks its own chunk (the one scan). A single program doing every chunk's scan in
    # turn took 44 us at 1,024 rows and 79 us at 2,048 on an H200: the scans were serial.
    chunk = tl.program_id(0)
    mine = chunk * BLOCK_N
    experts = tl.arange(0, BLOCK_E)
    counts = tl.zeros([BLOCK_E], dtype=tl.int64)
    before = tl.zeros([BLOCK_E], dtype=tl.int64)
    for start in range(0, N, BLOCK_N):
        rows = start + tl.arange(0, BLOCK_N)
        ids = tl.load(ids_ptr + rows, mask=rows < N, other=-1)
        c = tl.sum((ids[:, None] == experts[None, :]).to(tl.int64), axis=0)
        counts += c
        before += c * (start < mine).to(tl.int64)
    ends = tl.cumsum(counts, axis=0)
    starts = ends - counts
    # Program 0 writes the offsets, [0, ends...]: starts at 0..E-1 and ends at 1..E (equal where they overlap).
    first = (experts * 0 + chunk) == 0  # (a tensor mask: every backend takes it)
    tl.store(offsets_ptr + experts, starts, mask=(experts < E) & first)
    tl.store(offsets_ptr + experts + 1, ends, mask=(experts < E) & first)
    # Destination = start of the expert + rows of that expert in earlier chunks + rank within this chunk (inclusive
    # cumsum down the one-hot column, minus one). Ranking in flat row order is what makes the sort stable.
    rows = mine + tl.arange(0, BLOCK_N)
    ids = tl.load(ids_ptr + rows, mask=rows < N, other=-1)
    onehot = (ids[:, None] == experts[None, :]).to(tl.int64)
    rank = tl.cumsum(onehot, axis=0) - 1 + (starts + before)[None, :]
    dest = tl.sum(onehot * rank, axis=1)
    placed = tl.sum(onehot, axis=1) > 0
    tl.store(order_ptr + dest, rows.to(tl.int64), mask=placed & (rows < N))


_PERMUTE = LazyJit(_permute_kernel)


def permute_to_experts_triton(expert_ids: torch.Tensor, num_experts: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version: a counting sort, one program per chunk of rows (see `_permute_kernel`)."""
    flat = expert_ids.reshape(-1).contiguous()
    n = flat.numel()
    order = torch.empty(n, dtype=torch.int64, device=flat.device)
    offsets = torch.empty(num_experts + 1, dtype=torch.int64, device=flat.device)
    block_e = max(16, next_power_of_2(num_experts))
    # Keep the one-hot tile around 8k elements so it stays in registers.
    block_n = max(16, min(next_power_of_2(max(n, 1)), 8192 // block_e))
    _PERMUTE[(max(1, cdiv(n, block_n)),)](flat, order, offsets, n, num_experts, BLOCK_N=block_n, BLOCK_E=block_e,
                                          num_warps=4)
    return order, offsets


# ---------------------------------------------------------------------------------------------
# gather_rows


def gather_rows_torch(x: torch.Tensor, src_token: torch.Tensor) -> torch.Tensor:
    """Reference: out[i] = x[src_token[i]]."""
    return x[src_token]


def _gather_kernel(x_ptr, src_ptr, out_ptr, H, stride_x, stride_out, BLOCK_H: tl.constexpr):
    # One program per (output row, block of columns): a pure copy, bandwidth bound.
    i = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    mask = cols < H
    src = tl.load(src_ptr + i).to(tl.int64)
    row = tl.load(x_ptr + src * stride_x + cols, mask=mask)
    tl.store(out_ptr + i * stride_out + cols, row.to(out_ptr.dtype.element_ty), mask=mask)


_GATHER = LazyJit(_gather_kernel)


def gather_rows_triton(x: torch.Tensor, src_token: torch.Tensor) -> torch.Tensor:
    """Triton version of `x[src_token]`."""
    n, H = src_token.shape[0], x.shape[1]
    # A copy never rounds, so the interpreter's broken downcast does not matter here; the store
    # dtype helper is used anyway so that every kernel follows the same rule.
    out = torch.empty((n, H), dtype=kernel_store_dtype(x.dtype), device=x.device)
    if n == 0 or H == 0:
        return out.to(x.dtype)
    if x.stride(-1) != 1:
        x = x.contiguous()
    block_h = min(1024, next_power_of_2(H))
    _GATHER[(n, cdiv(H, block_h))](x, src_token.contiguous(), out, H, x.stride(0), out.stride(0),
                                   BLOCK_H=block_h, num_warps=4)
    return out.to(x.dtype)

