"""Barrier EP baselines with one process per rank: lab/barrier_rank.py's rank coroutines (the same code
the in-process driver runs) driven over the ZeroMQ + torch.distributed transport, with the same
chaos hook as the multi-process streaming runs, so `python -m lab bench` with `clock: process` compares
barrier and barrier-free decoding side by side on real sockets.

Collectives are the coroutines' own messages (ring or direct, runtime/executors/cost_model.py's
`collective_algo`) over the p2p transport, not torch.distributed collectives: every message of a
collective crosses the same lanes, and so the same injected delays, as the streaming engine's.

Rank 0 is the coordinator: it owns the request list and the arrival times, admits with the plan's
home policy over a mirror of every rank's free KV blocks (updated by finish notices), and collects
the finished requests. Control messages (meta["t"], plain values: runtime/transport/wire.py): "b_adm"
0 -> home, "b_fin" home -> 0, "b_go" 0 -> all (the common time base after every rank is ready),
"b_ready" rank -> 0. Barrier data messages carry
meta["t"] = "b" and their collective tag. Termination is agreed through the per-step all-gather of
token counts: rank 0 says "more" until it collected every request, so all ranks stop at one step.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Optional

import torch

_IDLE_S = 0.0005


@dataclass
class BarrierJob:
    plan: object
    mode: str                      # ag | a2a
    requests: list                 # runtime.core.requests.Request, arrival times relative to the start
    kv_blocks: Optional[int] = None
    algo: str = "direct"
    chaos: object = None           # transport chaos hook (lab.bench.WallLinkDelays)
    router: object = None          # keyed router replacing the model's (routing_override), as the streaming ranks
    slow: object = None            # slow ranks (lab.bench.WallSlowRanks), as the streaming ranks: stall after math
    peer_timeout_s: float = 10.0


class _Clock:
    def __init__(self, t0: float) -> None:
        self.t0 = t0

    def now(self) -> float:
        return time.perf_counter() - self.t0   # CLOCK_MONOTONIC: one time base for every process on a host


def barrier_rank_main(env, job: BarrierJob):
    from runtime.drivers.launch import set_rank_threads
    set_rank_threads(env, on_gpu=False)
    from runtime.transport.zmq_dist import ZmqDistTransport, init_distributed
    init_distributed(env.rank, env.world_size, "gloo")
    with ZmqDistTransport(env.rank, env.world_size, "cpu", peer_timeout_s=job.peer_timeout_s,
                          chaos=job.chaos) as transport:
        return _serve(env.rank, env.world_size, job, transport)


def _serve(me: int, R: int, job: BarrierJob, tr):
    from models.weights import load_weights
    from lab.barrier_rank import Compute, Gather, Idle, RankContext, Send, rank_loop
    from lab.static_replicas import static_owners
    from runtime.executors.torch_executor import TorchExecutor
    from runtime.core.kv_cache import BlockAllocator, PagedKVStore
    from runtime.observability.metrics import BatchRecord, RankMetrics
    from runtime.drivers.admission import Admission, request_from_wire, request_to_wire
    from runtime.transport.base import Arrival

    plan, spec = job.plan, job.plan.spec
    executor = TorchExecutor(spec, load_weights(spec, experts=plan.placement.held_by(me)))  # only its own experts
    nblocks = [job.kv_blocks if job.kv_blocks is not None else plan.kv.num_blocks[r] for r in range(R)]
    kv = PagedKVStore(spec.num_layers, BlockAllocator(nblocks[me], plan.kv.block_size))
    inbox: dict = {}
    state = {"t0": None, "ready": {me}}
    coord = me == 0
    total = len(job.requests)
    pending = sorted(job.requests, key=lambda r: (r.arrival, r.rid), reverse=True) if coord else []
    admission = Admission(plan.kv.block_size, nblocks, plan.placement.home_policy) if coord else None
    by_rid = {r.rid: r for r in job.requests}
    free = list(nblocks)
    done: list = []
    route = (lambda layer, x, s, p: executor.route(layer, x)) if job.router is None else job.router
    ctx = RankContext(me, R, spec, executor, route,
                      static_owners(plan.placement, R), kv, None, RankMetrics(me),
                      algo=job.algo)

    def start(req, now):
        if not kv.reserve(req.rid, req.kv_tokens):
            raise RuntimeError(f"rank {me}: no KV for {req.name!r} after admission placed it here")
        req.home, req.t_admit = me, now
        ctx.new.append(req)

    def handle(a: Arrival) -> None:
        t = a.meta.get("t")
        if t == "b":
            inbox.setdefault(a.meta["tag"], {})[a.src] = a
        elif t == "b_adm":
            start(request_from_wire(a.meta["req"]), ctx.clock.now())
        elif t == "b_fin":  # the finished request's results, into the coordinator's own Request
            req = by_rid[a.meta["rid"]]
            req.home, req.output, req.finish_reason = a.src, list(a.meta["output"]), a.meta["reason"]
            req.t_admit, req.t_finish, req.token_times = a.meta["t_admit"], a.meta["t_finish"], list(a.meta["times"])
            free[req.home] += admission.blocks_needed(req)
            done.append(req)
        elif t == "b_ready":
            state["ready"].add(a.src)
        elif t == "b_go":
            state["t0"] = a.meta["t0"]
            ctx.clock = _Clock(state["t0"])
        else:
            raise ValueError(f"rank {me}: unknown message {t!r} from rank {a.src}")

    def pump(timeout: float = 0.0) -> None:
        for a in tr.poll(timeout):
            if a.meta.get("_empty") is not None:
                shape, dtype = a.meta["_empty"]
                a = Arrival(a.src, a.meta, torch.empty(shape, dtype=getattr(torch, dtype)))
            handle(a)
        if ctx.clock is not None:
            for req in ctx.finished:
                if coord:
                    free[req.home] += admission.blocks_needed(req)
                    done.append(req)
                else:
                    tr.send(0, {"t": "b_fin", "rid": req.rid, "output": list(req.output), "reason": req.finish_reason,
                                "t_admit": req.t_admit, "t_finish": req.t_finish, "times": list(req.token_times)})
            ctx.finished.clear()
            if coord:
                now = ctx.clock.now()
                while pending and pending[-1].arrival <= now:
                    admission.submit(pending.pop())
                for req, home in admission.admit(free):
                    if home == me:
                        start(req, now)
                    else:
                        tr.send(home, {"t": "b_adm", "req": request_to_wire(req)})

    # startup: every rank ready (weights loaded), then one time base
    if coord:
        while len(state["ready"]) < R:
            pump(0.01)
        t0 = time.perf_counter()
        for p in range(1, R):
            tr.send(p, {"t": "b_go", "t0": t0})
        state["t0"] = t0
    else:
        tr.send(0, {"t": "b_ready"})
        while state["t0"] is None:
            pump(0.01)
    ctx.clock = _Clock(state["t0"])
    ctx.more_coming = (lambda: len(done) < total) if coord else (lambda: bool(ctx.new))

    gen = rank_loop(ctx, job.mode)
    value = None
    while True:
        pump()
        try:
            op = gen.send(value)
        except StopIteration:
            break
        value = None
        if isinstance(op, Send):
            meta = {"t": "b", **op.meta}
            tensor = op.tensor
            if tensor is not None and tensor.numel() == 0:
                meta["_empty"] = (tuple(tensor.shape), str(tensor.dtype).replace("torch.", ""))
                tensor = None
            tr.send(op.dst, meta, tensor)
        elif isinstance(op, Gather):
            need = op.srcs if op.srcs is not None else tuple(p for p in range(R) if p != me)
            while not all(p in inbox.get(op.tag, {}) for p in need):
                pump(0.001)
            value = inbox.pop(op.tag)
        elif isinstance(op, Idle):
            pump(_IDLE_S)
        elif isinstance(op, Compute) and not op.kind.startswith("coll:"):
            # wall clock: the math already took its time (a slow rank stalls on top of it); record the batch
            t_start = ctx.clock.now() - op.measured_s
            if job.slow is not None:
                job.slow.stall(me, t_start, op.measured_s)
            now = ctx.clock.now()
            ctx.metrics.on_batch(BatchRecord(me, -1, op.kind, op.layer, op.rows, t_start, now, 0.0), ())
    pump()
    if not coord:
        return {"metrics": ctx.metrics}
    return {"requests": sorted(done, key=lambda r: r.rid), "metrics": ctx.metrics}
