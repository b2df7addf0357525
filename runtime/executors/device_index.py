"""Host index arrays onto the device without stalling the host.

`torch.from_numpy(a).to("cuda")` copies from pageable memory with non_blocking=False, which torch
finishes with a cudaStreamSynchronize: the host waits for *all* GPU work queued on the stream, not
just the copy (measured on an H200: ~3 ms behind a queued 3 ms kernel at every size from 512 B to
1 MB, against 13-90 us through pinned memory; benchmarks/device/h2d_probe.py).
The engine ships small index arrays (merge tags, dispatch orders, row selections) to the device
several times per batch, so each such copy serialized the host with the GPU.

`to_device` copies through a ring of pinned buffers (runtime/executors/host_staging.py, one ring per device, events
guard each slot's reuse) with a non-blocking copy on the current stream: later work on the stream is
ordered after the copy, and the host never waits for the GPU. On the CPU it is a view.
On 2 x H200 the change made no measurable throughput difference (the GPUs were ~10% busy, so
the waits were short); it matters once the host is no longer the bottleneck. It used to use
`pin_memory()` (torch's caching pinned allocator) per call: py-spy put 5-7% of a streaming rank's loop
on that one line (by our count of calls ~50-70 us each on that host); a ring slot is
~4 torch calls (predicted ~20-30 us there).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch

from runtime.executors.host_staging import HostStaging


_RINGS: dict[torch.device, HostStaging] = {}


def to_device(a, device: torch.device) -> torch.Tensor:
    """`a` (numpy array or CPU tensor) on `device`, without a host synchronization on CUDA."""
    return to_device_marked(a, device)[0]


def to_device_marked(a, device: torch.device) -> tuple[torch.Tensor, Optional[torch.cuda.Event]]:
    """to_device and the CUDA event recorded on the current stream right after the copy was queued (None on
    the CPU): it marks everything queued before the copy too, e.g. a buffer's allocation (runtime/core/merge.py
    hands it to receives on other streams)."""
    if isinstance(a, torch.Tensor):
        a = a.numpy()
    if device.type == "cpu":
        return torch.from_numpy(np.ascontiguousarray(a)), None
    ring = _RINGS.get(device)
    if ring is None:
        ring = _RINGS[device] = HostStaging(device, slots=64, nbytes=1 << 15)
    return ring.upload(a)
