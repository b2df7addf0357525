"""Run-time check of the plan's KV pool against the memory the device really has free.

The plan sizes each rank's KV pool from a nominal device size (`dataflow compile --device-memory`);
the CUDA executor preallocates that pool whole (CUDA graphs bake its address in). On the device the
free memory is less than the nominal size: the CUDA context, NCCL's channel buffers, cuBLAS
workspaces, the graphs' private pools and allocator rounding all take some. So before an engine is
built, the rank asks the device (`torch.cuda.mem_get_info`, injectable for tests) how many pages
fit and clamps the pool to that; the engine's BlockAllocator, the device pool and the coordinator's
free-block mirror all use the clamped count. When not even a minimal pool fits, it fails at once
with a UserError that names the plan, the pages wanted and the pages that fit, and the flag to
change, instead of an out-of-memory error deep inside the first attention batch.
"""
from __future__ import annotations

import math
import sys
from typing import Callable, Optional

import torch

from graph_ir.errors import UserError

GIB = 1024 ** 3
# Left free after the KV pool, on top of the plan's own graph + workspace estimates: NCCL's
# per-peer channel buffers (created lazily at the first send, ~0.1-0.5 GiB for a few peers with NVLS
# off), cuBLAS/cuBLASLt workspaces per stream, Triton's launch scratch, the caching allocator's
# rounding and fragmentation, and the eager (prefill / above-bucket) batches' activations.
RUNTIME_HEADROOM_BYTES = 2 * GIB
# A pool smaller than this many tokens (or than what was asked, or than the model's max_position,
# if less) cannot serve a real request; better to refuse than to run a cluster that admits nothing
# (lowering/plan.py's default --min-kv-tokens).
MIN_FIT_TOKENS = 2048

MemGetInfo = Callable[[torch.device], tuple[int, int]]  # device -> (free bytes, total bytes)


def host_mem_get_info(_device=None) -> tuple[int, int]:
    """(available, total) bytes of host memory, for the CUDA executor's CPU twin, whose preallocated pool lives
    there (lowering/memory.py host_memory_bytes)."""
    from lowering.memory import host_memory_bytes
    return host_memory_bytes()


def kv_bytes_per_block(num_layers: int, block_size: int, k_row: tuple, v_row: tuple, dtype: torch.dtype) -> int:
    """Bytes one page takes over all layers (K and V)."""
    return num_layers * block_size * (math.prod(k_row) + math.prod(v_row)) * dtype.itemsize


def blocks_that_fit(free_bytes: int, reserve_bytes: int, bytes_per_block: int, pools: int = 1,
                    extra_blocks: int = 1) -> int:
    """Pages per pool when `pools` pools (one per rank sharing the device) share `free_bytes`, after
    `reserve_bytes`; each pool also holds `extra_blocks` pages that are never handed out (the
    CUDA executor's trash page)."""
    per_pool = max(free_bytes - reserve_bytes, 0) // max(pools, 1)
    return max(per_pool // max(bytes_per_block, 1) - extra_blocks, 0)


def clamp_kv_blocks(wanted: int, fit: int, block_size: int, *, what: str, max_tokens: Optional[int] = None) -> int:
    """min(wanted, fit), or a UserError when `fit` is below a usable pool. `what` names the plan
    and rank for the message; `max_tokens`: the longest sequence the model can have."""
    floor_tokens = MIN_FIT_TOKENS if max_tokens is None else min(MIN_FIT_TOKENS, max_tokens)
    need = min(wanted, -(-floor_tokens // block_size))
    if fit >= wanted:
        return wanted
    if fit < max(need, 1):
        raise UserError(
            f"{what}: the KV pool does not fit the device: the plan wants {wanted} pages of {block_size} tokens, "
            f"only {fit} fit in the free device memory (fewer than the {need} pages a {floor_tokens}-token "
            f"request needs). Recompile with a smaller `dataflow compile --device-memory GiB` or a "
            f"`--max-kv-tokens` cap, run with a smaller pool (`dataflow run --kv-blocks N`, at most {fit} "
            f"fit), or free the device (other processes on it?).")
    print(f"note: {what}: KV pool clamped to the free device memory: {fit} of the plan's {wanted} pages "
          f"({fit * block_size} tokens); `dataflow run --kv-blocks N` or `dataflow compile --max-kv-tokens` "
          f"sets it explicitly", file=sys.stderr)
    return fit


def executor_kv_fit(executor, plan, rank: int, wanted: int, *, pools: int = 1,
                    mem_get_info: Optional[MemGetInfo] = None) -> int:
    """The KV pages rank `rank` may use on `executor`'s device: `wanted` (the plan's or --kv-blocks)
    clamped to the device's free memory. Executors without a preallocated pool (the torch and sim
    executors) keep `wanted`. The CUDA executor's CPU twin preallocates its pool in host memory: it is
    clamped to the host's available memory, shared by every rank of the plan (a `dataflow run` starts
    them on this host; a cuda plan sized for 132 GiB GPUs would otherwise be killed by the kernel's
    OOM killer with no word of why). `mem_get_info` fakes a device (tests; a CPU twin then takes the
    device's path)."""
    row = executor.kv_rows()
    if row is None:
        return wanted
    device = executor.device
    on_host = device.type != "cuda" and mem_get_info is None
    if on_host:
        mem_get_info, pools = host_mem_get_info, max(pools, plan.cluster.ranks)
    free, _total = (mem_get_info or torch.cuda.mem_get_info)(device)
    per_block = kv_bytes_per_block(plan.spec.num_layers, plan.kv.block_size, *row)  # (K row, V row, dtype)
    m = plan.memory[rank] if rank < len(plan.memory) and not on_host else None  # (GPU graphs and workspaces)
    reserve = RUNTIME_HEADROOM_BYTES + ((m.graph_bytes + m.workspace_bytes) * pools if m is not None else 0)
    fit = blocks_that_fit(free, reserve, per_block, pools)
    where = f"plan '{plan.spec.name}' ({plan.cluster.ranks} x {plan.cluster.device}, " \
            f"{plan.cluster.device_memory_gib:g} GiB) rank {rank} on {device} ({free / GIB:.1f} GiB free, " \
            f"{per_block} bytes per page)"
    return clamp_kv_blocks(wanted, fit, plan.kv.block_size, what=where, max_tokens=plan.spec.max_position)
