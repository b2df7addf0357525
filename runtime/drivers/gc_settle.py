"""Python's cyclic garbage collector kept out of the serving loop's way.

A rank process holds hundreds of thousands of container objects before it serves a token (215k after the imports
alone): torch, triton, numpy and their modules, the model's Python wrappers, the plan. CPython's full (generation 2)
collection walks all of them, and it runs inside whatever statement happened to allocate when the young generations
overflowed. On the H200 hosts a full collection took 208-292 ms (the `gc gen2` lines of the rank profiler's phase
report), the size of the 130-400 ms rank-wide stalls that put ITL p99 at 10x p50 in about half of the GPU launches;
freezing the heap removed those stalls.

`settle_heap()` runs just before each workload is served (after weights, graph capture and the engine exist; outside
every timed window): it unfreezes what an earlier call froze, so that garbage among it is found (the last workload's
engine, which can hold its KV pool through reference cycles), collects once, then `gc.freeze()`s the survivors into the
permanent generation that later collections skip. Collections during serving then walk only what the serving loop
itself created. Nothing is disabled: cycles made while serving are still found, and frozen objects that die are freed
by reference counting as usual (cyclic garbage among them waits for the next settle_heap() or thaw_heap()).
`thaw_heap()` undoes the freeze when serving ends, so that interpreter shutdown collects as usual (never-collected
objects make triton's bindings print "nanobind: leaked ..." at exit).
"""
from __future__ import annotations

import gc
import time


def settle_heap() -> float:
    """Unfreeze, collect, freeze the survivors (see the module doc). Returns the seconds it took."""
    t = time.perf_counter()
    gc.unfreeze()
    gc.collect()
    gc.freeze()
    return time.perf_counter() - t


def thaw_heap() -> None:
    """Back to one heap the collector walks whole (at the end of serving; harmless when nothing was frozen)."""
    gc.unfreeze()
