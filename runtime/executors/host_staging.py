"""Pinned host staging: a ring of pinned host buffers for the small host -> device (and device -> host)
copies of the hot path (batch metadata in the CUDA executor, index arrays in the engine).

A non-blocking copy from pinned memory returns before the DMA ran, so a buffer may only be refilled once
the copy that read it finished: each slot carries the event recorded after its copy, and `_next`
waits on it (normally long complete: ~2 us query). On CPU there is no DMA and no event: plain tensors.

Every wait for the device is bounded (`wait_event`): a copy that has not completed after the device_wait_s
option's seconds (runtime/settings.py, default 300) raises TimeoutError naming what it was, instead of hanging
the rank on a wedged GPU.
"""
from __future__ import annotations

import math
import threading
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from runtime import settings
from runtime.executors.cuda_stream import current_stream

# numpy dtype -> torch dtype, for the arrays `upload` ships (index arrays, fp32 weights, masks); keyed by dtype
# objects, which compare equal across aliases ('l' and 'q' are both int64)
_TORCH_DTYPES = {np.dtype(t): getattr(torch, t) for t in ("int64", "int32", "float32", "float64", "bool", "uint8")}


def wait_event(ev, what: str, timeout_s: Optional[float] = None) -> float:
    """Block until CUDA event `ev` has completed; returns the seconds waited. Polls it, yielding the GIL
    between looks (as cudaEventSynchronize's default spin does, but with a bound): after `timeout_s`
    (default: the device_wait_s option) raises TimeoutError naming `what` it waited for."""
    if ev.query():
        return 0.0
    t0 = time.perf_counter()
    deadline = t0 + (timeout_s if timeout_s is not None else settings.current().device_wait_s)
    while not ev.query():
        now = time.perf_counter()
        if now > deadline:
            raise TimeoutError(f"waited {now - t0:.0f} s for {what} to complete on the device: the GPU is wedged or "
                               f"far behind (the device_wait_s option bounds this wait)")
        time.sleep(0)  # lets the transport's threads run
    return time.perf_counter() - t0


class StreamOrder:
    """What the host already knows has run on each CUDA stream. Work on one stream runs in the order it was queued,
    so once an event is seen complete, every event recorded before it on that stream is complete too. Marks get a
    process-wide sequence number and are keyed by (device, raw stream handle); `seen` raises the stream's
    watermark. A staging slot whose last mark is at or below its stream's watermark is known free without asking
    the device: the routing copy each attention batch waits for anyway is recorded after the batch's uploads, so
    reusing a slot usually costs no event query (~1.5-2 us in-process on a fast GPU's host)."""

    def __init__(self) -> None:
        self.seq = 0
        self.done: dict[tuple, int] = {}
        self.lock = threading.Lock()  # a record and its number are one step (two threads may share a stream)

    def record(self, ev, stream) -> int:
        """Record `ev` on `stream` and number it: on one stream, a larger number was recorded later."""
        with self.lock:
            ev.record(stream)
            self.seq += 1
            return self.seq

    def seen(self, key: tuple, seq: int) -> None:
        """Mark `seq` on stream `key` complete (so every earlier mark on it). Unlocked: a lost race can only
        lower the watermark, which is safe (a query more)."""
        if seq > self.done.get(key, 0):
            self.done[key] = seq

    def known_done(self, key: tuple, seq: int) -> bool:
        return seq <= self.done.get(key, 0)


STREAM_ORDER = StreamOrder()  # one per process: every ring's marks on a stream share its order


class HostStaging:
    """`slots` pinned buffers used round robin, each guarded by the event of the copy that last read it."""

    def __init__(self, device: torch.device, slots: int = 16, nbytes: int = 1 << 16) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.slots = slots
        self._bufs = [self._alloc(nbytes) for _ in range(slots)]
        self._events: list[Optional[torch.cuda.Event]] = [None] * slots
        self._marks: list[tuple] = [((), 0)] * slots  # slot -> (stream key, sequence number) of its last mark
        self._dev = device.index if device.index is not None else (torch.cuda.current_device() if self.cuda else -1)
        self._typed: list[dict] = [{} for _ in range(slots)]  # slot -> {(shape, dtype): (tensor, ndarray)}
        self._i = 0
        self._held = [False] * slots  # a device -> host result not read yet (PendingHost.hold): skipped
        self.wait_s = 0.0  # host time spent blocked on a slot (should stay ~0)

    def _alloc(self, nbytes: int) -> Tensor:
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.cuda)

    def _next(self) -> int:
        """The next slot of the ring that no reader holds, once the copy that last used it has run."""
        for _ in range(self.slots):
            i = self._i
            self._i = (i + 1) % self.slots
            if not self._held[i]:
                break
        else:
            raise RuntimeError(f"all {self.slots} pinned staging slots are held by unread device -> host results")
        ev = self._events[i]
        if ev is not None:
            key, seq = self._marks[i]
            if not STREAM_ORDER.known_done(key, seq):  # else a later mark on its stream was seen complete
                if not ev.query():  # (the label is only built when there is a wait)
                    self.wait_s += wait_event(ev, f"the copy through pinned staging slot {i} (its reuse waits for it)")
                STREAM_ORDER.seen(key, seq)
        return i

    def _slot(self, nbytes: int) -> int:
        """The next free slot, grown to `nbytes` if smaller (no view made: a slice is a torch call)."""
        i = self._next()
        if self._bufs[i].numel() < nbytes:
            self._bufs[i] = self._alloc(max(nbytes, 2 * self._bufs[i].numel()))
            self._typed[i].clear()
        return i

    def _acquire_typed(self, shape: tuple, dtype: torch.dtype) -> tuple[int, Tensor, np.ndarray]:
        """The next free slot viewed as a [shape] dtype tensor (+ its numpy view), the views cached
        per slot: the hot path's few (shape, dtype) pairs cost no view creation per batch."""
        key = (shape, dtype)
        i = self._i
        hit = self._typed[i].get(key) if not self._held[i] else None
        if hit is not None:  # the slot is large enough: the cache is cleared when a slot grows
            return self._next(), hit[0], hit[1]
        nbytes = math.prod(shape) * dtype.itemsize
        i = self._slot(nbytes)
        view = self._bufs[i][:nbytes].view(dtype).view(shape)
        arr = view.numpy() if dtype != torch.bfloat16 else None
        if len(self._typed[i]) < 16:
            self._typed[i][key] = (view, arr)
        return i, view, arr

    def upload(self, a: np.ndarray) -> tuple[Tensor, Optional[torch.cuda.Event]]:
        """A device copy of host array `a` through a slot, non-blocking: (the tensor, the slot's event, recorded
        on the current stream right after the copy was queued, so it also marks all work queued before it).
        The slot is viewed as a flat array of a's dtype (cached per slot): a numpy fill, a slice, one copy, one
        event: 3 torch calls where `h2d` of a tensor makes 6. On CPU: the array itself as a tensor, no event."""
        a = np.ascontiguousarray(a)
        if not self.cuda:
            return torch.from_numpy(a), None
        dtype = _TORCH_DTYPES[a.dtype]
        n = a.size
        i = self._slot(n * a.itemsize)
        key = ("flat", dtype)
        flat = self._typed[i].get(key)
        if flat is None:  # cleared by _slot() when the slot grew
            t = self._bufs[i][: self._bufs[i].numel() // a.itemsize * a.itemsize].view(dtype)
            flat = self._typed[i][key] = (t, t.numpy())
        flat[1][:n] = a.reshape(-1)
        src = flat[0][:n]
        # allocation and copy in one call (`.to` of a pinned view stays non-blocking)
        out = (src if a.ndim == 1 else src.view(a.shape)).to(self.device, non_blocking=True)
        return out, self.mark(i)

    def mark(self, i: int) -> Optional[torch.cuda.Event]:
        """Record (on the current stream) the event that frees slot i once the queued copy ran."""
        if not self.cuda:
            return None
        ev = self._events[i]
        if ev is None:
            ev = self._events[i] = torch.cuda.Event()
        stream = current_stream(self.device)
        key = (self._dev, stream.cuda_stream)
        self._marks[i] = (key, STREAM_ORDER.record(ev, stream))
        return ev

    def h2d(self, dst: Tensor, src: Tensor) -> None:
        """dst (device) <- src (host), through a pinned slot, non-blocking (on CPU: a plain slot, a plain copy)."""
        i, view, _ = self._acquire_typed(tuple(src.shape), src.dtype)
        view.copy_(src)
        dst.copy_(view, non_blocking=True)
        self.mark(i)

    def h2d_array(self, dst: Tensor, fill) -> None:
        """dst (device, int32/int64/float32) <- an array `fill(np_view)` writes in place (on CPU too through a slot,
        with no event)."""
        i, view, arr = self._acquire_typed(tuple(dst.shape), dst.dtype)
        fill(arr)
        dst.copy_(view, non_blocking=True)
        self.mark(i)

    def d2h(self, src: Tensor) -> "PendingHost":
        """Start a copy of src (device) into a pinned slot; the result is read after `wait()`."""
        if not self.cuda:
            return PendingHost(src.detach().to("cpu").clone(), None, self, -1)
        i, view, _ = self._acquire_typed(tuple(src.shape), src.dtype)
        view.copy_(src, non_blocking=True)
        ev = self.mark(i)
        return PendingHost(view, ev, self, i, self._marks[i])


@dataclass
class PendingHost:
    view: Tensor  # pinned host tensor (valid after wait; copy out before the ring wraps, or hold() it)
    event: Optional[torch.cuda.Event]
    staging: HostStaging
    slot: int  # -1 on the CPU (a plain tensor)
    mark: tuple = ((), 0)  # (stream key, sequence number) of the copy's event (StreamOrder)

    def ready(self) -> bool:
        """The copy has landed (never blocks)."""
        if self.event is None:
            return True
        if self.event.query():
            STREAM_ORDER.seen(*self.mark)
            return True
        return False

    def hold(self) -> None:
        """Keep the ring from reusing this slot until release(): for a result read much later."""
        if self.slot >= 0:
            self.staging._held[self.slot] = True

    def release(self) -> None:
        if self.slot >= 0:
            self.staging._held[self.slot] = False

    def wait(self) -> Tensor:
        if self.event is not None:
            if not self.event.query():  # (the label is only built when there is a wait)
                self.staging.wait_s += wait_event(self.event, f"a device -> host copy of {tuple(self.view.shape)} "
                                                              f"{self.view.dtype} (a batch's routing or tokens)")
            STREAM_ORDER.seen(*self.mark)
        return self.view
