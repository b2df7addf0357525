"""Synchronous expert parallelism: the barrier baselines StreamEP is measured against.

Same model math (the executor's stage functions), same placement (the plan's expert -> rank map),
same KV cache (PagedKVStore), same admission and home-rank policy, same sampling, same transport and
clocks as the streaming engine. What differs is the one thing under study: every decode step runs
in lockstep, and every MoE layer ends in collectives that a rank cannot leave before the messages
of *all* ranks arrived.

Every decode step, every rank runs its own requests' attention (DP attention) and every MoE layer's
experts on their owners (EP), then a collective per dispatch and per combine: all-gather + all-reduce
(`ag`) or all-to-all both ways (`a2a`). The rank's step is a coroutine (lab/barrier_rank.py, where the
step and the tokens each mode gives are described); here is the in-process driver that runs every rank's
coroutine on a virtual clock (cost model + injected link delays) or on the wall clock. lab/barrier_mp.py
runs them in rank processes over our transport, lab/barrier_dist.py over real torch.distributed collectives.
"""
from __future__ import annotations

import heapq
import time
from dataclasses import dataclass, field
from typing import Callable, Generator, Optional, Sequence

from graph_ir.errors import UserError
from lab.barrier_rank import Compute, Gather, RankContext, Send, rank_loop
from lab.static_replicas import static_owners
from runtime.core.clock import VirtualClock, WallClock
from runtime.core.kv_cache import BlockAllocator, PagedKVStore
from runtime.core.requests import Request
from runtime.drivers.admission import Admission
from runtime.executors.cost_model import CostModel
from runtime.observability.metrics import BatchRecord, RankMetrics
from runtime.transport.inproc import InprocHub


@dataclass(frozen=True)
class BarrierCostModel(CostModel):
    """The cost model plus what a barrier baseline's collectives cost on the virtual clock (the streaming engine
    runs none):
    - `collective_fixed`: per collective call (all-gather, all-reduce, all-to-all), the fixed cost every
      participant pays before its data moves (launch + NCCL/gloo setup). The data then moves over the links: a
      ring collective is R-1 (all-gather, reduce-scatter) link hops in sequence, each hop waiting for the slowest
      message of the step; a direct one is one hop to every peer;
    - `collective_send_cpu`: host seconds per message *inside* a collective (0 on NCCL, where one call issues the
      whole collective; ~`send_cpu` on gloo, where every step is a host send);
    - `collective_algo`: "ring" (NCCL's and gloo's default for all-gather/all-reduce) or "direct"."""

    collective_fixed: dict = field(default_factory=lambda: {"ag": 0.0, "ar": 0.0, "a2a": 0.0})
    collective_send_cpu: float = 0.0
    collective_algo: str = "direct"

    def __post_init__(self) -> None:
        if self.collective_algo not in ("ring", "direct"):
            raise ValueError(f"collective_algo {self.collective_algo!r}; valid: ring, direct")

    def duration(self, kind: str, rows: int, experts: int = 1) -> float:
        if kind.startswith("coll:"):
            return self.collective_fixed.get(kind[5:], 0.0)
        return super().duration(kind, rows, experts)


# ---- the in-process driver ----------------------------------------------------------------------------

@dataclass
class BarrierResult:
    requests: list[Request]
    ranks: list[RankMetrics]
    link_bytes: dict[str, int]
    elapsed: float
    world_size: int


@dataclass
class _RankState:
    gen: Generator
    ready_at: float = 0.0
    waiting: Optional[tuple] = None     # tag of the collective it blocks on
    expect: int = 0                     # how many messages of that tag it needs
    idle: bool = False
    done: bool = False


def run_barrier(plan, executor, requests: Sequence[Request], mode: str = "ag", *, clock: str = "virtual",
                cost_model: Optional[BarrierCostModel] = None, router: Optional[Callable] = None,
                link_delay: Optional[Callable[[int, int, int, float], float]] = None,
                compute_scale: Optional[Callable[[int, float], float]] = None,
                kv_blocks: Optional[int] = None, home_policy: Optional[str] = None,
                stall_timeout_s: float = 60.0, decode_only: bool = False,
                row_bytes: Optional[int] = None, closed_form: Optional[bool] = None,
                lockstep: Optional[bool] = None) -> BarrierResult:
    """Serve `requests` (arriving at their `arrival` times) with synchronous EP on `plan`'s ranks,
    all in this process.

    `link_delay(src, dst, nbytes, t)` and `compute_scale(rank, t)` inject stragglers (see
    lab/interference.py); `router(layer, x, seq_ids, positions)` replaces the model's router.
    On the virtual clock a compute costs `cost_model.duration(kind, rows) * compute_scale`; on the
    wall clock it costs what the math took, plus (scale - 1) times that as an injected stall.
    Collectives follow `cost_model.collective_algo` (ring or direct), pay its `collective_fixed` per
    call and `collective_send_cpu` per message on the virtual clock. `row_bytes`: bytes the link
    model charges per tensor row (to model a model's hidden size with a small or simulated one);
    None charges the tensor's real bytes. `decode_only`: random prompt KV, no prefill compute.
    `closed_form`: price each collective whole (lab/barrier_closed.py) instead of message by message; None: where
    it applies (virtual clock, `ag`, ring, a lab/network.py Network whose effects are bursts). `lockstep` (closed form
    only): once no request can be admitted any more, run each decode step's layers for every rank at once
    (lab/barrier_closed.py Lockstep; same results); None: with the simulated executor.
    """
    if clock not in ("virtual", "wall"):
        raise ValueError(f"clock {clock!r}; valid: virtual, wall")
    R, spec = plan.cluster.ranks, plan.spec
    cost = cost_model or BarrierCostModel()
    clk = VirtualClock() if clock == "virtual" else WallClock()
    link_bytes: dict[str, int] = {}

    def delay(src, dst, meta, nbytes, rng):
        if row_bytes is not None:
            nbytes = meta.get("_rows", 0) * row_bytes
        key = f"{src}->{dst}"
        link_bytes[key] = link_bytes.get(key, 0) + nbytes
        return link_delay(src, dst, nbytes, clk.now()) if link_delay else 0.0

    hub = InprocHub(R, clk, delay)
    transports = hub.transports()
    route = router or (lambda layer, x, seq_ids, positions: executor.route(layer, x))
    nblocks = [kv_blocks if kv_blocks is not None else plan.kv.num_blocks[r] for r in range(R)]
    kvs = [PagedKVStore(spec.num_layers, BlockAllocator(nblocks[r], plan.kv.block_size)) for r in range(R)]
    if decode_only:
        from lab.decode_only import RandomPrefixKV
        kvs = [RandomPrefixKV(kv) for kv in kvs]
    admission = Admission(plan.kv.block_size, nblocks, home_policy or plan.placement.home_policy)
    pending = sorted(requests, key=lambda r: (r.arrival, r.rid), reverse=True)   # next due at the end
    owners = static_owners(plan.placement, R)
    ctxs = [RankContext(r, R, spec, executor, route, owners, kvs[r], clk, RankMetrics(r),
                        algo=cost.collective_algo, decode_only=decode_only)
            for r in range(R)]

    has_new: set[int] = set()   # ranks admitted to since they last took their new requests (a superset: pruned here)

    def any_new() -> bool:
        """any(c.new for c in ctxs), asking only the ranks admitted to (every rank asks at every step: a scan of all R
        ranks each time was O(R^2) a step at 1,024 ranks)."""
        for r in list(has_new):
            if ctxs[r].new:
                return True
            has_new.discard(r)
        return False

    def more_coming() -> bool:
        return bool(pending) or admission.waiting > 0 or any_new()

    for c in ctxs:
        c.more_coming = more_coming
    from lab.network import Network
    from lab.ring_collective import RingPricer
    net = getattr(link_delay, "__self__", None)
    fits = (clock == "virtual" and mode == "ag" and cost.collective_algo == "ring" and isinstance(net, Network)
            and net.send_free and link_delay.__func__ is Network.delay and RingPricer.supports(net))
    if closed_form and not fits:
        raise ValueError("closed_form needs the virtual clock, mode ag, ring collectives and a Network of bursts")
    effects = getattr(getattr(net, "link", net), "effects", ())   # (a Network's or a flat LinkSchedule's)
    if not (fits and closed_form is not False) and any(getattr(e, "collectives", "hops") == "stall" for e in effects):
        raise UserError("bursts with `collectives: stall` are priced for all-gather EP's ring collectives on a "
                        "network of nodes only (the closed form, lab/barrier_closed.py); use hops here")
    states = [_RankState(rank_loop(c, mode)) for c in ctxs]
    inbox: list[dict] = [dict() for _ in range(R)]

    def admit(now: float) -> None:
        while pending and pending[-1].arrival <= now:
            admission.submit(pending.pop())
        if not admission.waiting:
            return  # (called at every event: no list of every rank's free pages then, as Cluster._release)
        free = [kv.allocator.free_blocks for kv in kvs]
        for req, home in admission.admit(free):
            if not kvs[home].reserve(req.rid, req.kv_tokens):
                raise RuntimeError(f"rank {home} has no KV for {req.name!r} after admission placed it there")
            req.home, req.t_admit = home, now
            ctxs[home].new.append(req)
            has_new.add(home)

    def advance(r: int) -> bool:
        """Run rank r's coroutine until it blocks; True if it moved."""
        st, moved, value = states[r], False, None
        while not st.done:
            now = clk.now()
            if st.waiting is not None:
                box = inbox[r].get(st.waiting, {})
                if len(box) < st.expect:
                    return moved
                inbox[r].pop(st.waiting, None)
                st.waiting, value = None, box
            elif st.idle:
                # Wake when work exists somewhere, a peer already moved on, or nothing can come.
                if not (any_new() or inbox[r] or not more_coming()):
                    return moved
                st.idle = False
            elif st.ready_at > now:
                return moved
            moved = True
            try:
                op = st.gen.send(value)
            except StopIteration:
                st.done = True
                return moved
            value = None
            if isinstance(op, Send):
                if row_bytes is not None:
                    op.meta["_rows"] = int(op.tensor.shape[0]) if op.tensor is not None else 0
                transports[r].send(op.dst, op.meta, op.tensor)
                if clock == "virtual" and cost.collective_send_cpu:
                    st.ready_at = now + cost.collective_send_cpu   # the host issues messages one by one
            elif isinstance(op, Gather):
                st.waiting = op.tag
                st.expect = len(op.srcs) if op.srcs is not None else R - 1
            elif isinstance(op, Compute):
                scale = compute_scale(r, now) if compute_scale else 1.0
                if op.kind.startswith("coll:"):
                    # A collective's fixed cost: the rank is busy (launch/setup), no batch is recorded.
                    if clock == "virtual":
                        st.ready_at = now + cost.duration(op.kind, 0)
                    continue
                if clock == "virtual":
                    t_start, dur = now, cost.duration(op.kind, op.rows, op.experts) * scale
                else:
                    t_start, dur = now - op.measured_s, op.measured_s * (scale - 1.0)  # math took its time already
                st.ready_at = now + dur
                ctxs[r].metrics.on_batch(BatchRecord(r, -1, op.kind, op.layer, op.rows, t_start, now + dur, 0.0), ())
            else:
                st.idle = True
        return moved

    t_first = min((q.arrival for q in requests), default=0.0)
    if fits and closed_form is not False:
        from lab.barrier_closed import Lockstep, lockstep_fits, run_closed
        for c in ctxs:
            c.closed_form = True
        pricer = RingPricer(net, R)
        if lockstep is None:
            lockstep = lockstep_fits(executor)
        elif lockstep and not lockstep_fits(executor):
            raise ValueError("lockstep needs the simulated executor (runtime/executors/sim_executor.py)")
        steps = Lockstep(spec, executor, route, owners, ctxs, cost, compute_scale, pricer, row_bytes,
                         link_bytes) if lockstep else None
        run_closed([rank_loop(c, mode) for c in ctxs], ctxs, clk, cost, pricer, admit, pending,
                   more_coming, compute_scale, row_bytes, link_bytes, steps,
                   lambda: not pending and not admission.waiting, any_new)
        states = []
    last_progress = time.perf_counter()
    # On the virtual clock a pass visits only the ranks that can move: those with mail delivered now (the hub's heap
    # of arrivals says which), and those not blocked on a collective (computing or idle); a rank waiting for
    # messages that did not come returns from advance() untouched, so skipping it changes nothing. Same passes,
    # same ranks moving in the same (rank) order as visiting all R ranks at every event, at O(ranks that move).
    virtual = clock == "virtual"
    if virtual:
        hub.arrivals = []
    alive = {r for r, s in enumerate(states) if not s.done}
    free = set(alive)   # alive and not waiting for a collective's messages
    while alive:
        moved = True
        while moved:
            admit(clk.now())
            if virtual:
                now, mail = clk.now(), set()
                while hub.arrivals and hub.arrivals[0][0] <= now:
                    mail.add(heapq.heappop(hub.arrivals)[2])
                visit = sorted(free | mail)
            else:
                mail, visit = range(R), range(R)
            for r in sorted(mail) if virtual else mail:
                for a in transports[r].poll():
                    inbox[r].setdefault(a.meta["tag"], {})[a.src] = a
            moved = False
            for r in visit:
                moved |= advance(r)
                st = states[r]
                if st.done:
                    alive.discard(r)
                    free.discard(r)
                elif st.waiting is None:
                    free.add(r)
                else:
                    free.discard(r)
            if moved:
                last_progress = time.perf_counter()
        if not alive:
            break
        now = clk.now()
        events = [states[r].ready_at for r in free if not states[r].idle]
        nd = (hub.arrivals[0][0] if hub.arrivals else None) if virtual else hub.next_delivery()
        if nd is not None:
            events.append(nd)
        if pending:
            events.append(pending[-1].arrival)
        if not events:
            raise RuntimeError("barrier run stalled: nothing computing, nothing in flight, no arrival due; "
                               + "; ".join(f"rank {r}: waiting={s.waiting} idle={s.idle}" for r, s in enumerate(states)))
        if clock == "virtual":
            clk.advance_to(max(min(events), now))
        else:
            time.sleep(min(max(min(events) - now, 0.0), 0.001))
            if time.perf_counter() - last_progress > stall_timeout_s:
                raise RuntimeError(f"barrier run: no progress for {stall_timeout_s} s")
    ends = [q.t_finish for q in requests if q.done]
    elapsed = (max(ends) if ends else clk.now()) - t_first
    return BarrierResult(list(requests), [c.metrics for c in ctxs], link_bytes, elapsed, R)
