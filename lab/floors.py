"""What a batch cannot avoid moving, and what the device can move: the denominators of the GPU benches.

`expert_batch_bytes` is the byte floor of an expert batch (benchmarks/NOTES.md "Floors"): every active
expert's weights read once (gate+up [2I, H], down [H, I], their biases) plus the rows in and out.
Decode expert batches are weight-bandwidth bound, so bytes / device time against the measured copy
ceiling is how far an expert batch is from its floor.
"""
from __future__ import annotations

import functools
from typing import Optional

import torch


def expert_batch_bytes(active: int, rows: int, hidden: int, intermediate: int, elem_bytes: int) -> int:
    """Bytes an expert batch of `rows` rows over `active` distinct experts must read and write."""
    H, I = hidden, intermediate
    return active * (3 * H * I + 2 * I + H) * elem_bytes + 2 * rows * H * elem_bytes


@functools.lru_cache(maxsize=None)
def measure_copy_bps(device: torch.device, nbytes: int = 1 << 30, iters: int = 5) -> Optional[float]:
    """Device-to-device copy bandwidth (read + write bytes / s) of an `nbytes` buffer; None off CUDA.
    Measured once per process and device (gpu_bench's sections both ask for it)."""
    if device.type != "cuda":
        return None
    src = torch.empty(nbytes, dtype=torch.uint8, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)  # first touch
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        dst.copy_(src)
    end.record()
    end.synchronize()
    seconds = start.elapsed_time(end) / 1e3 / iters
    del src, dst
    return 2 * nbytes / seconds
