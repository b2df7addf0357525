"""The barrier baselines' in-process driver with every collective priced in closed form (lab/ring_collective.py).

lab/barrier.py's driver sends a ring collective as its R x (R - 1) messages and visits every rank at every event:
~290k messages per decode step at 64 ranks, ~14 min for one 64-rank cell (session 23), hours at 1,024. Here a rank
yields each collective whole (barrier_rank.Collective); when the last rank joins, the ring's recursion gives the
time each rank leaves it (same network model, same floats) and the data is combined once for all ranks (the
all-gather's global batch, the reduce-scatter's sums in the ring's order). Ranks run from a heap of (time, rank),
so an event costs the ranks it concerns, not all R. Virtual clock, ring algorithm, all-gather EP (the mode whose
collectives are all rings), and link effects that are bursts only; lab/barrier.py decides and falls back to the
message-level driver otherwise. tests/test_barrier.py checks both drivers agree at 4 and 8 ranks.
"""
from __future__ import annotations

import heapq

import numpy as np

from lab.barrier_rank import Collective, Compute, Gathered, Idle
from lab.ring_collective import ring_reduce
from runtime.observability.metrics import BatchRecord


def run_closed(gens: list, ctxs: list, clk, cost, pricer, admit, pending: list, more_coming, compute_scale,
               row_bytes, link_bytes: dict) -> None:
    """Run every rank's coroutine (`gens`) to its end on the virtual clock `clk`."""
    R = len(gens)
    heap = [(0.0, r) for r in range(R)]
    values: list = [None] * R
    joined: dict = {}
    idle: set[int] = set()
    left, arrival_due = R, False
    while left:
        if pending and not arrival_due and (not heap or pending[-1].arrival < heap[0][0]):
            heapq.heappush(heap, (pending[-1].arrival, -1))   # an arrival is an event (admitted at its time)
            arrival_due = True
        if not heap:
            raise RuntimeError(f"barrier run stalled: ranks idle {sorted(idle)}, none computing, no arrival due")
        t, r = heapq.heappop(heap)
        arrival_due = arrival_due and r >= 0
        clk.advance_to(max(t, clk.now()))
        now = clk.now()
        admit(now)
        if idle and (any(c.new for c in ctxs) or not more_coming()):
            for q in sorted(idle):
                heapq.heappush(heap, (now, q))
            idle.clear()
        if r < 0:
            continue
        while True:
            try:
                op = gens[r].send(values[r])
            except StopIteration:
                left -= 1
                break
            values[r] = None
            if isinstance(op, Compute):
                scale = compute_scale(r, now) if compute_scale else 1.0
                if op.kind.startswith("coll:"):   # a collective's fixed cost: busy, no batch recorded
                    heapq.heappush(heap, (now + cost.duration(op.kind, 0), r))
                    break
                dur = cost.duration(op.kind, op.rows, op.experts) * scale
                ctxs[r].metrics.on_batch(BatchRecord(r, -1, op.kind, op.layer, op.rows, now, now + dur, 0.0), ())
                heapq.heappush(heap, (now + dur, r))
                break
            if isinstance(op, Collective):
                j = joined.setdefault(op.tag, {})
                j[r] = (now, op)
                if len(j) == R:
                    del joined[op.tag]
                    for q, (t_leave, value) in enumerate(_finish(j, pricer, row_bytes, link_bytes)):
                        values[q] = value
                        heapq.heappush(heap, (t_leave, q))
                break
            if isinstance(op, Idle):
                idle.add(r)
                break
            raise TypeError(f"rank {r}: {type(op).__name__} in a closed-form run (collectives only)")


def _finish(joined: dict, pricer, row_bytes, link_bytes: dict) -> list:
    """Every rank's (time it leaves, value it resumes with) for one collective all ranks have entered."""
    R = len(joined)
    ops: list[Collective] = [joined[r][1] for r in range(R)]
    start = np.array([joined[r][0] for r in range(R)], dtype=np.float64)
    if ops[0].kind == "ag":
        tensors = [op.tensor for op in ops]
        nbytes = [0 if x is None else (x.shape[0] * row_bytes if row_bytes is not None else x.numel() * x.element_size())
                  for x in tensors]
        shift, value = 0, Gathered([op.meta for op in ops], tensors)
        values = [value] * R
    else:
        offs = ops[0].offsets
        p0 = ops[0].tensor
        per_row = row_bytes if row_bytes is not None else p0[:1].numel() * p0.element_size()
        nbytes = [(offs[c + 1] - offs[c]) * per_row for c in range(R)]
        acc = ring_reduce([op.tensor for op in ops], offs)
        shift, values = 1, [acc[offs[r]:offs[r + 1]] for r in range(R)]
    chunk = np.array(nbytes, dtype=np.int64)
    leave = pricer.leave(start, chunk, shift)
    total = int(chunk.sum())
    for r in range(R):   # bytes on link r -> r+1: every chunk but the one r+1 (all-gather) or r (reduce-scatter) holds
        key = f"{r}->{(r + 1) % R}"
        link_bytes[key] = link_bytes.get(key, 0) + total - int(chunk[(r + 1 - shift) % R])
    return list(zip(leave.tolist(), values))
