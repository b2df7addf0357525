"""Python's cyclic garbage collector kept out of the serving loop's way.

A rank process holds hundreds of thousands of container objects (215k here after the imports alone) before it serves a token: torch, triton, numpy and their
modules, the model's Python wrappers, the plan. CPython's full (generation 2) collection walks all of them, and it runs
inside whatever statement happened to allocate when the young generations overflowed. On the H200 hosts those
collections took 208-292 ms each (the phase profiles of runs 20 and 22: `gc gen2` lines), the size of the 120-250 ms
rank-wide stalls that put ITL p99 at 10x p50 in about a third of the GPU launches (benchmarks/NOTES.md §22 item 13,
§30).

`settle_heap()` runs just before serving starts (after weights, graph capture and the engine exist; outside every
timed window): one full collection for the garbage setup left, then `gc.freeze()`, which moves every surviving object
into the permanent generation that later collections skip. Collections during serving then walk only what the serving
loop itself created. Nothing is disabled: cycles made while serving are still found, and objects alive at the freeze
that die later are freed by reference counting as usual (only cyclic garbage among them would stay).
`thaw_heap()` undoes the freeze when serving ends, so that interpreter shutdown collects as usual (frozen objects
are never collected: triton's bindings then print "nanobind: leaked ..." at exit). DATAFLOW_GC_FREEZE=0 leaves the
collector as Python set it (the A/B switch).
"""
from __future__ import annotations

import gc
import os
import time


def settle_heap() -> float:
    """Collect, then freeze the survivors (see the module doc). Returns the seconds it took (0 when switched off)."""
    value = os.environ.get("DATAFLOW_GC_FREEZE", "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"DATAFLOW_GC_FREEZE={value!r}: expected 1 (freeze the heap before serving) or 0")
    if value == "0":
        return 0.0
    t = time.perf_counter()
    gc.collect()
    gc.freeze()
    return time.perf_counter() - t


def thaw_heap() -> None:
    """Back to one heap the collector walks whole (at the end of serving; harmless when nothing was frozen)."""
    gc.unfreeze()
