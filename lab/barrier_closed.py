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
from typing import Optional

import numpy as np
import torch

from lab.barrier_rank import Collective, Compute, Gathered, Idle, Layers
from lab.ring_collective import ring_reduce
from runtime.observability.metrics import BatchRecord


def run_closed(gens: list, ctxs: list, clk, cost, pricer, admit, pending: list, more_coming, compute_scale,
               row_bytes, link_bytes: dict, lockstep: Optional["Lockstep"] = None, quiet=None, any_new=None) -> None:
    """Run every rank's coroutine (`gens`) to its end on the virtual clock `clk`. `lockstep`: run a decode step's
    layers for all ranks at once (Lockstep.run) whenever `quiet()` says no admission can happen any more. `any_new()`:
    whether a rank has admitted requests it has not taken yet (None: asks every rank)."""
    if any_new is None:
        any_new = lambda: any(c.new for c in ctxs)  # noqa: E731
    R = len(gens)
    heap = [(0.0, r) for r in range(R)]
    values: list = [None] * R
    joined: dict = {}
    layers_joined: dict = {}
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
        if idle and (any_new() or not more_coming()):
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
                    done = _finish(j, pricer, row_bytes, link_bytes)
                    if lockstep is not None and op.tag[0] == "cnt" and quiet():
                        done[0][1].lockstep = True    # (one Gathered, shared by every rank)
                    for q, (t_leave, value) in enumerate(done):
                        values[q] = value
                        heapq.heappush(heap, (t_leave, q))
                break
            if isinstance(op, Layers):
                layers_joined[r] = (now, op)
                if len(layers_joined) == R:
                    for q, (t_end, value) in enumerate(lockstep.run(layers_joined)):
                        values[q] = value
                        heapq.heappush(heap, (t_end, q))
                    layers_joined = {}
                break
            if isinstance(op, Idle):
                idle.add(r)
                break
            raise TypeError(f"rank {r}: {type(op).__name__} in a closed-form run (collectives only)")
    pricer.bytes_into(link_bytes)


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
    leave = _price(pricer, start, chunk, shift, link_bytes, stall=ops[0].tag[0] in ("ag", "rs"))
    return list(zip(leave.tolist(), values))


def _price(pricer, start: np.ndarray, chunk: np.ndarray, shift: int, link_bytes: dict, stall: bool = False
           ) -> np.ndarray:
    """Leave times of one ring collective, and its bytes added to `link_bytes`. `stall`: it is a dispatch all-gather
    or an all-reduce (its reduce-scatter half), which "stall" bursts hold up at entry (Bursts.collectives)."""
    leave = pricer.leave(pricer.stall(start) if stall and pricer.stalls else start, chunk, shift)
    pricer.count_bytes(chunk, shift)   # (added to `link_bytes` at the end of the run: pricer.bytes_into)
    return leave


def lockstep_fits(executor) -> bool:
    """Lockstep.run batches the layers' math over every rank's rows: exact for the simulated executor, whose
    attention, routing, experts and combine act row by row with no KV (runtime/executors/sim_executor.py), plain or
    behind a keyed router (lab/routing_override.py KeyedRoutingExecutor)."""
    from lab.routing_override import KeyedRoutingExecutor
    from runtime.executors.sim_executor import SimExecutor
    inner = executor._inner if type(executor) is KeyedRoutingExecutor else executor
    return type(inner) is SimExecutor


class Lockstep:
    """One decode step's layer stack for every rank at once (all-gather EP, the simulated executor): per layer, the
    attention of every rank's rows in one call, the routing in one call, the expert pairs of every rank from one
    stable sort, then per rank its costs on its own clock, and the three ring collectives priced whole. The same
    BatchRecords, collective start times, bytes and hidden rows as lab/barrier_rank.py's per-layer path (`_ag_layer`),
    which the coroutines run when this does not apply; tests/test_barrier.py checks both agree."""

    def __init__(self, spec, executor, router, owners: list, ctxs: list, cost, compute_scale, pricer, row_bytes,
                 link_bytes: dict) -> None:
        self.spec, self.ex, self.router, self.owners, self.ctxs = spec, executor, router, owners, ctxs
        self.cost, self.compute_scale, self.pricer = cost, compute_scale, pricer
        self.row_bytes, self.link_bytes = row_bytes, link_bytes
        self._dur: dict = {}
        self.fixed_ag, self.fixed_ar = cost.duration("coll:ag", 0), cost.duration("coll:ar", 0)

    def _duration(self, kind: str, rows: int, experts: int = 1) -> float:
        # (the cost models are frozen dataclasses: a duration is a function of its arguments, worth remembering)
        key = (kind, rows, experts)
        d = self._dur.get(key)
        if d is None:
            d = self._dur[key] = self.cost.duration(kind, rows, experts)
        return d

    def _compute(self, kind: str, layer: int, t: list, rows: list, experts: Optional[list] = None) -> None:
        """Every rank's batch of `kind` at its time t[r] (updated to the batch's end), as run_closed prices one."""
        scale_of, ctxs, dur = self.compute_scale, self.ctxs, self._duration
        for r, now in enumerate(t):
            scale = scale_of(r, now) if scale_of else 1.0
            d = (dur(kind, rows[r]) if experts is None else dur(kind, rows[r], experts[r])) * scale
            ctxs[r].metrics.on_batch(BatchRecord(r, -1, kind, layer, rows[r], now, now + d, 0.0), ())
            t[r] = now + d

    def run(self, joined: dict) -> list:
        """Every rank's (time it leaves the layers, its last hidden rows) from its Layers op and the time it yielded
        it."""
        R = len(joined)
        ex, spec = self.ex, self.spec
        ops: list[Layers] = [joined[r][1] for r in range(R)]
        t = [joined[r][0] for r in range(R)]
        counts, offsets = ops[0].counts, ops[0].offsets
        counts_np = np.asarray(counts, dtype=np.int64)
        live = [r for r in range(R) if counts[r]]
        h = torch.cat([ops[r].h for r in live])
        positions = [p for r in live for p in ops[r].positions]
        seq_of_row = [s for r in live for s in ops[r].seq_of_row]
        segments = [(rid, offsets[r] + start, n) for r in live for rid, start, n in ops[r].segments]
        home = torch.from_numpy(np.repeat(np.arange(R, dtype=np.int64), counts_np))
        k = spec.experts.top_k
        N = offsets[-1]
        for layer in range(spec.num_layers):
            h_res, x = ex.attention(layer, h, positions, segments, None)
            owners = self.owners[layer]
            if not owners.numel():
                h = h_res + ex.dense_mlp(layer, x)
                self._compute("attn", layer, t, counts)
                continue
            ids, w = self.router(layer, x, seq_of_row, positions)
            ids, w = ids.cpu(), w.cpu()
            shared = ex.shared_expert(layer, x)
            self._compute("attn", layer, t, counts)
            # dispatch: all-gather of every rank's rows and routing
            per_row = self.row_bytes if self.row_bytes is not None else x.shape[1] * x.element_size()
            t_np = np.array(t) + self.fixed_ag
            leave = _price(self.pricer, t_np, counts_np * per_row, 0, self.link_bytes, stall=True)
            # every rank's (token, slot) pairs, row-major, grouped by rank (one stable sort, as _ag_layer's by_rank)
            own = owners[home[:, None], ids].reshape(-1)
            order = torch.sort(own, stable=True)
            flat = order.indices
            pairs = np.bincount(order.values.numpy(), minlength=R)
            e_flat = ids.reshape(-1)[flat]
            distinct = np.bincount(np.unique(order.values.numpy() * spec.experts.num_experts + e_flat.numpy())
                                   // spec.experts.num_experts, minlength=R)
            t_idx, s_idx = flat // k, flat % k
            y = ex.experts(layer, x.index_select(0, t_idx), e_flat.tolist())
            yw = y.float() * w[t_idx, s_idx, None]
            t = leave.tolist()
            self._compute("expert", layer, t, pairs.tolist(), distinct.tolist())
            # combine, part 1: reduce-scatter of every rank's partial sums to the home ranks
            if not yw.any() and not torch.signbit(yw).any():
                acc = torch.zeros(N, x.shape[1], dtype=torch.float32)   # every partial +0: ring_reduce's shortcut
            else:
                P = torch.zeros(R * N, x.shape[1], dtype=torch.float32)
                P.index_add_(0, order.values * N + t_idx, yw)
                acc = ring_reduce(list(P.view(R, N, x.shape[1])), offsets)
            per_row = self.row_bytes if self.row_bytes is not None else acc.shape[1] * acc.element_size()
            leave = _price(self.pricer, np.array(t) + self.fixed_ar, counts_np * per_row, 1, self.link_bytes,
                           stall=True)
            # part 2: all-gather of the reduced rows
            leave = _price(self.pricer, leave, counts_np * per_row, 0, self.link_bytes)
            t = leave.tolist()
            h = ex.combine(h_res, shared, acc.to(h_res.dtype).unsqueeze(1),
                           torch.ones(N, 1, dtype=torch.float32))
        return [(t[r], h[offsets[r]:offsets[r + 1]] if counts[r] else None) for r in range(R)]
