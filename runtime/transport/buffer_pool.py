"""Receive buffers keyed by (device, dtype, element count), reused instead of allocated per message.

The receiver learns a message's shape from its metadata and must post a receive into a buffer of
exactly that size; batch sizes repeat (capture buckets), so a few sizes cover most traffic. A buffer
is handed to the engine with the arrival and comes back only when the engine calls `release` (it
alone knows when it stopped reading it); buffers never released are simply garbage collected, so
forgetting to release costs allocations, never correctness. `per_key` bounds what the pool keeps.
"""
from __future__ import annotations

import math
from typing import Optional

import torch


class BufferPool:
    def __init__(self, device: torch.device, per_key: int = 8):
        self.device = torch.device(device)
        self.per_key = per_key
        # (dtype, numel) -> [(flat tensor, CUDA event marking the end of its last use, or None)]
        self._free: dict[tuple, list[tuple[torch.Tensor, object]]] = {}
        self.hits = 0

    def take(self, shape: tuple, dtype: torch.dtype, stream: Optional["torch.cuda.Stream"] = None) -> torch.Tensor:
        """A buffer for a receive that will run on `stream` (default: the current stream). A reused one is
        fenced there behind the engine's last read of it; a new one is allocated on that stream."""
        free = self._free.get((dtype, math.prod(shape)))
        if free:
            self.hits += 1
            buf, done_reading = free.pop()
            if done_reading is not None:
                # The new receive must not overwrite the buffer before the engine's last kernel
                # reading it finished. No host wait.
                (stream or torch.cuda.current_stream(self.device)).wait_event(done_reading)
            return buf.view(shape)
        if stream is None:
            return torch.empty(shape, dtype=dtype, device=self.device)
        with torch.cuda.stream(stream):  # the caching allocator hands out blocks free in that stream's order
            return torch.empty(shape, dtype=dtype, device=self.device)

    def release(self, tensor: torch.Tensor) -> None:
        """Give a received tensor back. The caller promises it enqueues no more reads of it (on CUDA,
        reads already enqueued on the current stream are fenced by an event the next receive waits on)."""
        if tensor.device != self.device or not tensor.is_contiguous() or tensor.storage_offset() != 0:
            return  # a view of something else: not ours to recycle
        free = self._free.setdefault((tensor.dtype, tensor.numel()), [])
        if len(free) < self.per_key:
            done_reading = None
            if tensor.is_cuda:
                done_reading = torch.cuda.Event()
                done_reading.record(torch.cuda.current_stream(self.device))
            free.append((tensor.view(-1), done_reading))
