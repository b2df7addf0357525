"""CUDA-graph capture per plan bucket: bucket choice, one memory pool per bucket.

The plan's capture pass (lowering/capture.py) lists, per stage kind, the batch-size buckets. A
batch of n rows runs padded to the smallest bucket >= n, by replaying the graph captured for
(kind, layer, bucket); above the largest bucket it runs eagerly (same code, no graph).

Memory: every graph of one (kind, bucket) reads its inputs from and writes its outputs to the same
static buffers (a dict of tensors the executor makes once per (kind, bucket)), and all of them are captured
into one private memory pool (`torch.cuda.graph(pool=...)`). Graphs of one rank never run concurrently (one stream), and
nothing inside a pool outlives a replay: the executor copies the outputs out of the static
buffers right after each replay. So sharing is safe in any replay order and graph memory grows
with the number of buckets, not layers x buckets.

The CPU twin: `StepGraph` runs the very same body function directly when graphs are off (CPU, or
an implementation that must synchronize with the host), so the bucketing / padding / masking code
is exercised by CPU tests; only the capture itself is GPU-only.
"""
from __future__ import annotations

import bisect
from typing import Callable, Optional

import torch


def bucket_for(n: int, buckets: list[int]) -> Optional[int]:
    """Smallest bucket >= n, or None above the largest (eager fallback). Buckets ascending."""
    i = bisect.bisect_left(buckets, n)
    return buckets[i] if i < len(buckets) else None


class StepGraph:
    """One captured body (a function of static buffers only), or the body itself when not capturing.

    `run()` replays the graph on CUDA (capturing it at the first call, after a warm-up run on a
    side stream that compiles Triton kernels and fills the allocator), or calls the body.
    """

    def __init__(self, body: Callable[[], None], capture: bool, pool=None, device=None) -> None:
        self.body = body
        self.capture = capture
        self.pool = pool
        self.device = device
        self.graph: Optional["torch.cuda.CUDAGraph"] = None

    def _capture(self) -> None:
        stream = torch.cuda.Stream(self.device)
        stream.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(stream):
            # Warm-up outside the capture: Triton compiles and cuBLAS picks its kernels here.
            # The body only writes static buffers, so running it once more is harmless.
            self.body()
        torch.cuda.current_stream(self.device).wait_stream(stream)
        g = torch.cuda.CUDAGraph()
        # thread_local: the transport's lane threads keep launching NCCL work on their own streams
        # while this thread captures; the default (global) mode turns any such call into
        # cudaErrorStreamCaptureUnsupported (seen on the 2 x H200 run with one process per GPU).
        with torch.cuda.graph(g, pool=self.pool, capture_error_mode="thread_local"):
            self.body()
        self.graph = g

    def run(self) -> None:
        if not self.capture:
            self.body()
            return
        if self.graph is None:
            self._capture()  # the capture does not execute the work: replay below does
        self.graph.replay()


class GraphCache:
    """Graphs keyed by (kind, layer, bucket, extra key), one pool per (kind, bucket)."""

    def __init__(self, device: torch.device, capture: bool) -> None:
        self.device = device
        self.capture = capture and device.type == "cuda"
        self._graphs: dict[tuple, StepGraph] = {}
        self._pools: dict[tuple, object] = {}
        self.captures = 0

    def get(self, key: tuple, make_body: Callable[[], Callable[[], None]], capture: bool = True) -> StepGraph:
        """The graph under `key` = (kind, layer, bucket, ...) (a kind without layers, e.g. sample, uses layer -1), made
        from `make_body()` at its first use; captured into the (kind, bucket) pool when `capture` and on CUDA."""
        g = self._graphs.get(key)
        if g is None:
            if len(key) < 3 or type(key[0]) is not str or type(key[2]) is not int:
                raise ValueError(f"graph key {key!r}: expected (kind, layer, bucket, ...)")
            cap = self.capture and capture
            pool = (key[0], key[2])
            if cap and pool not in self._pools:
                self._pools[pool] = torch.cuda.graph_pool_handle()
            g = StepGraph(make_body(), cap, self._pools[pool] if cap else None, self.device)
            self._graphs[key] = g
            self.captures += int(cap)
        return g

    def drop(self, pred: Callable[[tuple], bool]) -> None:
        """Forget the graphs whose key matches `pred`. A pool left with no graph is forgotten too:
        PyTorch frees a private pool when its last graph dies, and capturing into that freed
        pool's id again trips an allocator assert (seen on torch 2.11), so the next capture of
        that (kind, bucket) gets a fresh pool."""
        for key in [k for k in self._graphs if pred(k)]:
            del self._graphs[key]
        live = {(k[0], k[2]) for k, g in self._graphs.items() if g.capture}
        for pk in [pk for pk in self._pools if pk not in live]:
            del self._pools[pk]
