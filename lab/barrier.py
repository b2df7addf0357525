"""Synchronous expert parallelism: the barrier baselines StreamEP is measured against.

Same model math (the executor's stage functions), same placement (the plan's expert -> rank map),
same KV cache (PagedKVStore), same admission and home-rank policy, same sampling, same transport and
clocks as the streaming engine. What differs is the one thing under study: every decode step runs
in lockstep, and every MoE layer ends in collectives that a rank cannot leave before the messages
of *all* ranks arrived.

One step on every rank (DP attention, EP experts, as SGLang runs it):
  0. all-gather of token counts (SGLang syncs the global batch shape every step; idle ranks join
     with zero tokens so the collectives still match, and the step is skipped if all are zero);
  per layer l: attention on the rank's own requests (prefill prompts whole, decode one token each);
  dense layer: MLP locally; MoE layer, by mode:
    ag   dispatch = all-gather of the hidden rows (+ routing) to every rank; each rank runs its
         experts on every row routed to them and weights the outputs; combine = all-reduce (sum)
         of the [all tokens, H] partials: reduce-scatter to the home ranks, then all-gather of the
         reduced rows, the second half of an all-reduce that DP attention does not need but the
         portable path pays for;
    a2a  dispatch = all-to-all: each rank gets only the rows routed to its experts (a token sent
         once per destination, whatever its number of slots there); combine = all-to-all back of
         the unweighted slot rows, summed on the home by `moe_combine` in slot order.
  then final logits and sampling on the home rank.

Tokens: a2a hands `moe_combine` exactly what the streaming engine hands it. ag sums the weighted
partials across ranks as an all-reduce does, so when a token's experts span ranks the fp32 sum is
in another order: tokens then agree up to near-ties, as any batch-composition change does.

Each rank is a coroutine that yields what it needs from the world (compute for a duration, a
message sent, all messages of one collective received), so the same rank code is driven by the
in-process driver on a virtual clock (cost model + injected link delays) or on the wall clock.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Callable, Generator, Optional, Sequence

import torch

from runtime.core.clock import VirtualClock, WallClock
from runtime.executors.cost_model import CostModel
from runtime.core.kv_cache import BlockAllocator, PagedKVStore
from runtime.observability.metrics import BatchRecord, RankMetrics
from runtime.core.requests import Admission, Request
from runtime.transport.inproc import InprocHub

MODES = ("ag", "a2a")
SYSTEM_NAMES = {"ag": "ag-ep", "a2a": "a2a-ep"}


# ---- what a rank coroutine yields ------------------------------------------------------------------

@dataclass(slots=True)
class Compute:
    kind: str            # attn | expert | sample (cost-model kind)
    layer: int
    rows: int
    measured_s: float    # wall seconds the math took (used by the wall-clock driver)


@dataclass(slots=True)
class Send:
    dst: int
    meta: dict
    tensor: Optional[torch.Tensor]


@dataclass(slots=True)
class Gather:
    """Block until one message tagged `tag` arrived from every rank in `srcs` (None: every other
    rank); resumes with {src: Arrival}."""
    tag: tuple
    srcs: Optional[tuple] = None


@dataclass(slots=True)
class Idle:
    """Nothing to do anywhere: wait until new work may exist (the next arrival or admission)."""


Op = Compute | Send | Gather | Idle


@dataclass
class RankContext:
    """What the driver gives one rank: its identity, the shared adapters, its KV and inbox of new requests."""

    rank: int
    world_size: int
    spec: object
    executor: object
    router: Callable
    expert_rank: list[list[int]]
    kv: PagedKVStore
    clock: object
    metrics: RankMetrics
    new: list[Request] = field(default_factory=list)      # admitted here, not yet started
    finished: list[Request] = field(default_factory=list)
    more_coming: Callable[[], bool] = lambda: False
    algo: str = "direct"            # collectives: "ring" (R-1 hops in sequence) or "direct" (one hop to all)
    decode_only: bool = False       # paper's throughput mode: random prompt KV, no prefill compute


def step_batch(live: list, started: set, decode_only: bool, kv) -> tuple[list, list, list, list]:
    """One decode step's batch of a barrier rank: one segment per live request (its whole prompt the
    first time, or only its last prompt token in decode-only mode; its last output token after that).
    Returns (tokens, positions, segments, seq_of_row). Shared by every barrier driver."""
    tokens, positions, segments, seq_of_row = [], [], [], []
    for req in live:
        if req.rid in started:
            toks, pos0 = [req.output[-1]], len(req.prompt) + len(req.output) - 1
        elif decode_only and len(req.prompt) > 1:
            toks, pos0 = [req.prompt[-1]], len(req.prompt) - 1
            kv.prefix(req.rid, pos0)
        else:
            toks, pos0 = list(req.prompt), 0
        segments.append((req.rid, len(tokens), len(toks)))
        tokens.extend(toks)
        positions.extend(range(pos0, pos0 + len(toks)))
        seq_of_row.extend([req.rid] * len(toks))
    return tokens, positions, segments, seq_of_row

def _timed(fn, *args):
    t = time.perf_counter()
    out = fn(*args)
    return out, time.perf_counter() - t


def rank_loop(ctx: RankContext, mode: str) -> Generator[Op, object, None]:
    """The whole life of one rank under synchronous EP; returns when no work is left anywhere."""
    if mode not in MODES:
        raise ValueError(f"barrier mode {mode!r}; valid: {', '.join(MODES)}")
    ex, spec, R, me = ctx.executor, ctx.spec, ctx.world_size, ctx.rank
    eos = frozenset(spec.eos_token_ids)
    live: list[Request] = []
    started: set[int] = set()
    step = 0
    while True:
        live.extend(ctx.new)
        ctx.new.clear()
        # -- the batch of this step: one segment per live request --------------------------------
        tokens, positions, segments, seq_of_row = step_batch(live, started, ctx.decode_only, ctx.kv)
        T = len(tokens)
        # -- step 0: agree on the global batch shape (and on stopping) -------------------------------
        more = ctx.more_coming()
        got = yield from _allgather(ctx, ("cnt", step), {"n": T, "more": more}, None, "ag")
        counts = [T if p == me else got[p].meta["n"] for p in range(R)]
        step += 1
        if sum(counts) == 0:
            if not more and not any(got[p].meta["more"] for p in got):
                return
            yield Idle()
            continue
        offsets = [sum(counts[:p]) for p in range(R + 1)]
        for req in live:
            started.add(req.rid)
        # -- the layers -------------------------------------------------------------------------------
        h = ex.embed(tokens) if T else None
        for layer in range(spec.num_layers):
            if T:
                (h_res, x), dt = _timed(ex.attention, layer, h, positions, segments, ctx.kv)
            else:
                h_res = x = None
                dt = 0.0
            if not ctx.expert_rank[layer]:
                if T:
                    y, dt2 = _timed(ex.dense_mlp, layer, x)
                    h, dt = h_res + y, dt + dt2
                yield Compute("attn", layer, T, dt)
                continue
            if T:
                (ids, w), dt2 = _timed(ctx.router, layer, x, seq_of_row, positions)
                shared, dt3 = _timed(ex.shared_expert, layer, x)
                dt += dt2 + dt3
            else:
                ids = torch.zeros(0, spec.experts.top_k, dtype=torch.int64)
                w = torch.zeros(0, spec.experts.top_k, dtype=torch.float32)
                shared = None
            yield Compute("attn", layer, T, dt)
            tag = (step, layer)
            if mode == "ag":
                h = yield from _ag_layer(ctx, layer, tag, x, ids, w, h_res, shared, counts, offsets)
            else:
                h = yield from _a2a_layer(ctx, layer, tag, x, ids, w, h_res, shared, counts)
        # -- sample on the home rank -----------------------------------------------------------------
        if T:
            last = torch.tensor([start + n - 1 for _, start, n in segments], dtype=torch.long)
            t0 = time.perf_counter()
            logits = ex.logits(h[last])
            toks = [ex.sample(logits[i], req.params, len(req.output)) for i, req in enumerate(live)]
            yield Compute("sample", spec.num_layers, len(live), time.perf_counter() - t0)
            now = ctx.clock.now()
            keep = []
            for req, tok in zip(live, toks):
                req.output.append(tok)
                req.token_times.append(now)
                ctx.metrics.tokens += 1
                if tok in eos and not req.ignore_eos:
                    _finish(ctx, req, "eos", now)
                elif len(req.output) >= req.max_new_tokens or len(req.prompt) + len(req.output) - 1 >= spec.max_position:
                    _finish(ctx, req, "length", now)
                else:
                    keep.append(req)
            live = keep
        else:
            yield Compute("sample", spec.num_layers, 0, 0.0)


def _finish(ctx: RankContext, req: Request, reason: str, now: float) -> None:
    req.finish_reason, req.t_finish = reason, now
    ctx.kv.release(req.rid)
    ctx.finished.append(req)


def _hidden(ctx: RankContext, x: Optional[torch.Tensor]) -> torch.Tensor:
    # A rank with no tokens still joins the collectives, with an empty tensor of the executor's
    # row shape and dtype (embedding nothing gives exactly that, for the torch and sim executors).
    return x if x is not None else ctx.executor.embed([])


def _allgather(ctx: RankContext, tag: tuple, meta: dict, tensor, fixed: Optional[str]):
    """All-gather of (meta, tensor) from every rank; returns {src: Arrival} for every other rank.

    `fixed` names the collective whose fixed cost (launch/setup) the call pays first (None: it is
    the second half of a collective that paid already). Ring: R-1 steps, each forwarding the chunk
    received in the previous step to the next rank, so every step waits for its slowest link and a
    slow link delays every rank R-1 times over a step's worth. Direct: one hop to every peer.
    """
    from runtime.transport.base import Arrival
    R, me = ctx.world_size, ctx.rank
    if fixed is not None:
        yield Compute(f"coll:{fixed}", -1, 0, 0.0)
    if R == 1:
        return {}
    if ctx.algo == "direct":
        for p in range(R):
            if p != me:
                yield Send(p, {"tag": tag, **meta}, tensor)
        return (yield Gather(tag))
    nxt, prv = (me + 1) % R, (me - 1) % R
    held = {me: (meta, tensor)}
    for i in range(R - 1):
        origin = (me - i) % R
        m, t = held[origin]
        yield Send(nxt, {**m, "tag": tag + (i,), "origin": origin}, t)
        a = (yield Gather(tag + (i,), (prv,)))[prv]
        held[a.meta["origin"]] = (a.meta, a.tensor)
    return {p: Arrival(p, held[p][0], held[p][1]) for p in range(R) if p != me}


def _reduce_scatter(ctx: RankContext, tag: tuple, partial, offsets):
    """Sum of every rank's `partial` rows, each rank getting its own rows offsets[me]:offsets[me+1].
    Pays the all-reduce's fixed cost. Direct: each home gets every rank's chunk and sums in rank
    order. Ring: R-1 steps; chunk c is summed along the ring starting after c (another fp32 order)."""
    R, me = ctx.world_size, ctx.rank
    yield Compute("coll:ar", -1, 0, 0.0)
    chunk = lambda c: partial[offsets[c]:offsets[c + 1]]  # noqa: E731
    if R == 1:
        return chunk(me).clone()
    if ctx.algo == "direct":
        for p in range(R):
            if p != me:
                yield Send(p, {"tag": tag}, chunk(p))
        got = yield Gather(tag)
        acc = torch.zeros_like(chunk(me))
        for p in range(R):  # rank order: a deterministic sum
            acc = acc + (chunk(me) if p == me else got[p].tensor)
        return acc
    nxt, prv = (me + 1) % R, (me - 1) % R
    buf = None
    for i in range(R - 1):
        c_send = (me - i - 1) % R
        yield Send(nxt, {"tag": tag + (i,), "chunk": c_send}, chunk(c_send) if i == 0 else buf)
        a = (yield Gather(tag + (i,), (prv,)))[prv]
        c_recv = (me - i - 2) % R
        assert a.meta["chunk"] == c_recv
        buf = a.tensor + chunk(c_recv)
    return buf


def _ag_layer(ctx: RankContext, layer: int, tag: tuple, x, ids, w, h_res, shared, counts, offsets):
    """All-gather dispatch + all-reduce combine. Returns h_next of this rank's rows."""
    R, me, ex = ctx.world_size, ctx.rank, ctx.executor
    ids, w = ids.cpu(), w.cpu()  # routing is host metadata (a no-op for the executors' CPU tensors)
    xr = _hidden(ctx, x)
    got = yield from _allgather(ctx, ("ag",) + tag, {"ids": ids.tolist(), "w": w.tolist()}, xr, "ag")
    xs, idss, ws = [], [], []
    for p in range(R):  # rank order: every rank assembles the same global batch
        if p == me:
            xs.append(xr), idss.append(ids), ws.append(w)
        else:
            a = got[p]
            xs.append(a.tensor)
            idss.append(torch.tensor(a.meta["ids"], dtype=torch.int64).reshape(-1, ids.shape[1]))
            ws.append(torch.tensor(a.meta["w"], dtype=torch.float32).reshape(-1, ids.shape[1]))
    x_all, ids_all, w_all = torch.cat(xs), torch.cat(idss), torch.cat(ws)
    owner = torch.tensor(ctx.expert_rank[layer], dtype=torch.int64)
    mine = (owner[ids_all] == me).nonzero()              # (token, slot) pairs, row-major = slot order
    t_idx, s_idx = mine[:, 0], mine[:, 1]
    dev = x_all.device  # rows stay on the executor's device; routing metadata is on the host
    t0 = time.perf_counter()
    t_dev = t_idx.to(dev)
    y = ex.experts(layer, x_all.index_select(0, t_dev), ids_all[t_idx, s_idx].tolist())
    partial = torch.zeros(x_all.shape[0], x_all.shape[1], dtype=torch.float32, device=dev)
    partial.index_add_(0, t_dev, y.float() * w_all[t_idx, s_idx, None].to(dev))
    yield Compute("expert", layer, int(t_idx.numel()), time.perf_counter() - t0)
    # all-reduce, part 1: reduce-scatter to the home ranks
    acc = yield from _reduce_scatter(ctx, ("rs",) + tag, partial, offsets)
    # all-reduce, part 2: all-gather of the reduced rows (the half DP attention throws away)
    yield from _allgather(ctx, ("ar",) + tag, {}, acc, None)
    if not counts[me]:
        return None
    ones = torch.ones(counts[me], 1, dtype=torch.float32, device=acc.device)
    return ex.combine(h_res, shared, acc.to(h_res.dtype).unsqueeze(1), ones)


def _a2a_layer(ctx: RankContext, layer: int, tag: tuple, x, ids, w, h_res, shared, counts):
    """All-to-all dispatch and combine. Returns h_next of this rank's rows."""
    R, me, ex = ctx.world_size, ctx.rank, ctx.executor
    owner = torch.tensor(ctx.expert_rank[layer], dtype=torch.int64)
    ids = ids.cpu()  # routing is host metadata (a no-op for the executors' CPU tensors)
    k = ids.shape[1]
    own = owner[ids] if ids.numel() else torch.zeros(0, k, dtype=torch.int64)
    xr = _hidden(ctx, x)
    dev = xr.device  # rows move with index ops on the executor's device; routing lists stay on the host
    outgoing = {}
    yield Compute("coll:a2a", layer, 0, 0.0)
    for p in range(R):
        pairs = (own == p).nonzero()                       # (token, slot), slot order within a token
        toks, mrow = torch.unique(pairs[:, 0], sorted=True, return_inverse=True)
        meta = list(zip(mrow.tolist(), *pairs.t().tolist(), ids[pairs[:, 0], pairs[:, 1]].tolist())) \
            if len(pairs) else []                          # (msg row, home token, slot, expert)
        outgoing[p] = (meta, xr.index_select(0, toks.to(dev)) if len(toks) else xr[:0])
    for p in range(R):
        if p != me:
            yield Send(p, {"tag": ("d",) + tag, "rows": outgoing[p][0]}, outgoing[p][1])
    got = yield Gather(("d",) + tag)
    # Rows from every home in rank order, one per (token, slot) routed here: one gather per home.
    parts, experts, back, starts = [], [], [], [0]
    for p in range(R):
        meta, xp = outgoing[me] if p == me else (got[p].meta["rows"], got[p].tensor)
        if meta:
            parts.append(xp.index_select(0, torch.tensor([m[0] for m in meta], dtype=torch.long, device=dev)))
            experts.extend(m[3] for m in meta)
        back.append([(m[1], m[2]) for m in meta])
        starts.append(starts[-1] + len(meta))
    t0 = time.perf_counter()
    y = ex.experts(layer, torch.cat(parts) if parts else xr[:0], experts)
    yield Compute("expert", layer, len(experts), time.perf_counter() - t0)
    yield Compute("coll:a2a", layer, 0, 0.0)
    # Home p's rows are y[starts[p]:starts[p+1]] (rows were stacked in home order).
    for p in range(R):
        if p != me:
            yield Send(p, {"tag": ("c",) + tag, "rows": back[p]}, y[starts[p]:starts[p + 1]])
    got = yield Gather(("c",) + tag)
    if not counts[me]:
        return None
    H = y.shape[1] if y.dim() == 2 and y.shape[0] else xr.shape[1]
    Y = torch.zeros(counts[me] * k, H, dtype=h_res.dtype, device=h_res.device)
    for p in range(R):
        rows, part = (back[me], y[starts[me]:starts[me + 1]]) if p == me else (got[p].meta["rows"], got[p].tensor)
        if rows:
            flat = torch.tensor([t * k + s for t, s in rows], dtype=torch.long, device=Y.device)
            Y.index_copy_(0, flat, part.to(device=Y.device, dtype=Y.dtype))
    Y = Y.view(counts[me], k, H)
    return ex.combine(h_res, shared, Y, w)


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
                cost_model: Optional[CostModel] = None, router: Optional[Callable] = None,
                link_delay: Optional[Callable[[int, int, int, float], float]] = None,
                compute_scale: Optional[Callable[[int, float], float]] = None,
                kv_blocks: Optional[int] = None, home_policy: Optional[str] = None,
                stall_timeout_s: float = 60.0, decode_only: bool = False,
                row_bytes: Optional[int] = None) -> BarrierResult:
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
    """
    if clock not in ("virtual", "wall"):
        raise ValueError(f"clock {clock!r}; valid: virtual, wall")
    R, spec = plan.cluster.ranks, plan.spec
    cost = cost_model or CostModel()
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
        from runtime.core.decode_only import RandomPrefixKV
        kvs = [RandomPrefixKV(kv) for kv in kvs]
    admission = Admission(plan.kv.block_size, nblocks, home_policy or plan.placement.home_policy)
    pending = sorted(requests, key=lambda r: (r.arrival, r.rid), reverse=True)   # next due at the end
    ctxs = [RankContext(r, R, spec, executor, route, plan.placement.expert_rank, kvs[r], clk, RankMetrics(r),
                        algo=cost.collective_algo, decode_only=decode_only)
            for r in range(R)]

    def more_coming() -> bool:
        return bool(pending) or admission.waiting > 0 or any(c.new for c in ctxs)

    for c in ctxs:
        c.more_coming = more_coming
    states = [_RankState(rank_loop(c, mode)) for c in ctxs]
    inbox: list[dict] = [dict() for _ in range(R)]

    def admit(now: float) -> None:
        while pending and pending[-1].arrival <= now:
            admission.submit(pending.pop())
        free = [kv.allocator.free_blocks for kv in kvs]
        for req, home in admission.admit(free):
            if not kvs[home].reserve(req.rid, req.kv_tokens):
                raise RuntimeError(f"rank {home} has no KV for {req.name!r} after admission placed it there")
            req.home, req.t_admit = home, now
            ctxs[home].new.append(req)

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
                if not (any(c.new for c in ctxs) or inbox[r] or not more_coming()):
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
                    t_start, dur = now, cost.duration(op.kind, op.rows) * scale
                else:
                    t_start, dur = now - op.measured_s, op.measured_s * (scale - 1.0)  # math took its time already
                st.ready_at = now + dur
                ctxs[r].metrics.on_batch(BatchRecord(r, -1, op.kind, op.layer, op.rows, t_start, now + dur, 0.0), ())
            else:
                st.idle = True
        return moved

    t_first = min((q.arrival for q in requests), default=0.0)
    last_progress = time.perf_counter()
    while not all(s.done for s in states):
        moved = True
        while moved:
            admit(clk.now())
            for r in range(R):
                for a in transports[r].poll():
                    inbox[r].setdefault(a.meta["tag"], {})[a.src] = a
            moved = False
            for r in range(R):
                moved |= advance(r)
            if moved:
                last_progress = time.perf_counter()
        if all(s.done for s in states):
            break
        now = clk.now()
        events = [s.ready_at for s in states if not s.done and s.waiting is None and not s.idle]
        nd = hub.next_delivery()
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
