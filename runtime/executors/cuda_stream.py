"""The current CUDA stream, for the hot path's event records and stream waits.

`torch.cuda.current_stream(device)` builds a new Stream object per call (~7 us on the H200 host,
benchmarks/host_speed.py) and `Event.record()` without a stream calls it too; a streaming rank makes
~15 such calls per attention batch (staging slots, sends, arrivals). The engine thread's current stream
changes only inside `with torch.cuda.stream(...)` blocks, so the Stream object is cached per device and
checked against the raw handle of the current stream (one C call) before every use: a changed stream is
fetched again, so the answer is always torch's.
"""
from __future__ import annotations

import torch

_raw = getattr(torch._C, "_cuda_getCurrentRawStream", None)  # absent from CPU builds
_cache: dict[int, torch.cuda.Stream] = {}


def current_stream(device: torch.device) -> torch.cuda.Stream:
    """torch.cuda.current_stream(device) (a device without an index: the current device)."""
    i = device.index if device.index is not None else torch.cuda.current_device()
    s = _cache.get(i)
    if s is None or _raw is None or _raw(i) != s.cuda_stream:
        s = _cache[i] = torch.cuda.current_stream(device)
    return s
