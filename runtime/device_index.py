"""Host index arrays onto the device without stalling the host.

`torch.from_numpy(a).to("cuda")` copies from pageable memory with non_blocking=False, which torch
finishes with a cudaStreamSynchronize: the host waits for *all* GPU work queued on the stream, not
just the copy (measured on an H200: ~3 ms behind a queued 3 ms kernel at every size from 512 B to
1 MB, against 13-90 us through pinned memory; benchmarks/device/h2d_probe.py, NOTES section 16).
The engine ships small index arrays (merge tags, dispatch orders, row selections) to the device
several times per batch, so each such copy serialized the host with the GPU.

`to_device` goes through torch's caching pinned-memory allocator and a non-blocking copy on the
current stream: the allocator records the copy on the stream and does not reuse the pinned block
before it ran, and later work on the stream is ordered after the copy. On the CPU it is a view.
On 2 x H200 the change made no measurable throughput difference (run 21: the GPUs are ~10% busy, so
the waits were short); it matters once the host is no longer the bottleneck.
"""
from __future__ import annotations

import numpy as np
import torch


def to_device(a, device: torch.device) -> torch.Tensor:
    """`a` (numpy array or CPU tensor) on `device`, without a host synchronization on CUDA."""
    t = torch.from_numpy(np.ascontiguousarray(a)) if isinstance(a, np.ndarray) else a
    if t.device == device or device.type == "cpu":
        return t.to(device)
    return t.pin_memory().to(device, non_blocking=True)
