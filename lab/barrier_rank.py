"""One rank of synchronous EP (lab/barrier.py) as a coroutine.

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

The rank yields what it needs from the world (compute for a duration, a message sent, all messages of
one collective received), so the same rank code is driven by the in-process driver on a virtual clock
(cost model + injected link delays) or on the wall clock (lab/barrier.py run_barrier), and over our own
ZeroMQ + gloo transport (lab/barrier_mp.py).
"""
from __future__ import annotations

import time
from itertools import accumulate
from dataclasses import dataclass, field
from typing import Callable, Generator, Optional

import numpy as np
import torch

from runtime.core.kv_cache import PagedKVStore
from runtime.core.requests import Request
from runtime.observability.metrics import RankMetrics

MODES = ("ag", "a2a")


# ---- what a rank coroutine yields ------------------------------------------------------------------

@dataclass(slots=True)
class Compute:
    kind: str            # attn | expert | sample (cost-model kind)
    layer: int
    rows: int
    measured_s: float    # wall seconds the math took (used by the wall-clock driver)
    experts: int = 1     # distinct experts of an expert batch (the cost model's expert_per_expert)


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


@dataclass(slots=True)
class Collective:
    """A whole ring collective at once, for the closed-form driver (lab/barrier_closed.py): every rank yields it
    with the same tag; "ag" resumes with a Gathered of every rank's (meta, tensor), "rs" (reduce-scatter of
    `tensor` by `offsets`) with this rank's summed rows. Priced by lab/ring_collective.py."""
    kind: str
    tag: tuple
    meta: dict
    tensor: Optional[torch.Tensor]
    offsets: Optional[list] = None


class Gathered:
    """An all-gather's result, one object shared by every rank: each rank's meta and tensor by rank, and what ranks
    derive from them alike (the global batch, its counts) computed once (`shared`), not R times over R ranks."""

    def __init__(self, metas: list, tensors: list) -> None:
        self.metas, self.tensors, self._cache = metas, tensors, {}
        self.lockstep = False   # (the step's count all-gather) the driver runs this step's layers whole: Layers


    def __getitem__(self, p: int):
        from runtime.transport.base import Arrival
        return Arrival(p, self.metas[p], self.tensors[p])

    def shared(self, key: str, make: Callable):
        if key not in self._cache:
            self._cache[key] = make()
        return self._cache[key]


@dataclass(slots=True)
class Layers:
    """The closed-form driver's lockstep step (lab/barrier_closed.py run_layers): this rank's share of one decode step's
    whole layer stack, which the driver runs for every rank at once (the same ops, costs and collectives as the
    per-layer path below, in one pass over the ranks per layer instead of R coroutines per layer). Yielded only
    when the step's count all-gather says so (Gathered.lockstep); resumes with the rank's last hidden rows (None
    without rows)."""
    h: Optional[torch.Tensor]
    positions: list
    segments: list
    seq_of_row: list
    counts: list
    offsets: list


Op = Compute | Send | Gather | Idle | Collective | Layers


@dataclass
class RankContext:
    """What the driver gives one rank: its identity, the shared adapters, its KV and inbox of new requests."""

    rank: int
    world_size: int
    spec: object
    executor: object
    router: Callable
    owners: list  # per layer, int64 [R, E]: the rank home h sends expert e's rows to (lab/static_replicas.py)
    kv: PagedKVStore
    clock: object
    metrics: RankMetrics
    new: list[Request] = field(default_factory=list)      # admitted here, not yet started
    finished: list[Request] = field(default_factory=list)
    more_coming: Callable[[], bool] = lambda: False
    algo: str = "direct"            # collectives: "ring" (R-1 hops in sequence) or "direct" (one hop to all)
    decode_only: bool = False       # paper's throughput mode: random prompt KV, no prefill compute
    closed_form: bool = False       # collectives as one Collective op each (lab/barrier_closed.py)


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
        if isinstance(got, Gathered):   # (counts and offsets once for all ranks: O(R), not O(R^2) per rank)
            counts, offsets, more_any = got.shared("counts", lambda: (
                [m["n"] for m in got.metas], [0, *accumulate(m["n"] for m in got.metas)],
                any(m["more"] for m in got.metas)))
        else:
            counts = [T if p == me else got[p].meta["n"] for p in range(R)]
            offsets = [sum(counts[:p]) for p in range(R + 1)]
            more_any = any(got[p].meta["more"] for p in got)
        step += 1
        if sum(counts) == 0:
            if not more and not more_any:
                return
            yield Idle()
            continue
        for req in live:
            started.add(req.rid)
        # -- the layers -------------------------------------------------------------------------------
        h = ex.embed(tokens) if T else None
        lockstep = isinstance(got, Gathered) and got.lockstep
        if lockstep:
            h = yield Layers(h, positions, segments, seq_of_row, counts, offsets)
        for layer in range(0 if lockstep else spec.num_layers):
            if T:
                (h_res, x), dt = _timed(ex.attention, layer, h, positions, segments, ctx.kv)
            else:
                h_res = x = None
                dt = 0.0
            if not ctx.owners[layer].numel():
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
    if ctx.closed_form:
        return (yield Collective("ag", tag, meta, tensor))
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
    if ctx.closed_form:
        return (yield Collective("rs", tag, {}, partial, offsets))
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
    # (in process, the closed form moves the routing as tensors: the same values as the lists a wire carries)
    routing = {"ids": ids, "w": w} if ctx.closed_form else {"ids": ids.tolist(), "w": w.tolist()}
    got = yield from _allgather(ctx, ("ag",) + tag, routing, xr, "ag")
    if isinstance(got, Gathered):   # the global batch, assembled once for every rank
        x_all, ids_all, w_all = got.shared("batch", lambda: (
            torch.cat(got.tensors), torch.cat([m["ids"] for m in got.metas]), torch.cat([m["w"] for m in got.metas])))
    else:
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
    # The (token, slot) pairs each rank computes, row-major (= slot order within a token): each pair's rank is the
    # owner table of the token's home (static replicas: lab/static_replicas.py); one stable sort by rank serves every
    # rank a slice (in process, once per collective: a scan of the global batch per rank was 42% of a 1,024-rank
    # simulation's profile in session 24; this was not re-timed at 1,024 ranks, and at 256 x 10 steps both are ~15-20 s)
    def by_rank():
        # (each row's home rank; numpy's repeat: torch's repeat_interleave took ~4 ms a call in `lab bench`, whose
        # torch runs 2 threads on this loaded 2-core VM, ~40% of a 4-rank all-gather EP cell)
        home = torch.from_numpy(np.repeat(np.arange(R, dtype=np.int64), counts))
        own = ctx.owners[layer][home[:, None], ids_all]
        order = torch.sort(own.reshape(-1), stable=True)
        return order.indices, torch.searchsorted(order.values, torch.arange(R + 1))
    order, start = got.shared("by_rank", by_rank) if isinstance(got, Gathered) else by_rank()
    flat = order[start[me]:start[me + 1]]
    k = ids_all.shape[1]
    t_idx, s_idx = flat // k, flat % k
    dev = x_all.device  # rows stay on the executor's device; routing metadata is on the host
    t0 = time.perf_counter()
    t_dev = t_idx.to(dev)
    experts = ids_all[t_idx, s_idx].tolist()
    y = ex.experts(layer, x_all.index_select(0, t_dev), experts)
    partial = torch.zeros(x_all.shape[0], x_all.shape[1], dtype=torch.float32, device=dev)
    partial.index_add_(0, t_dev, y.float() * w_all[t_idx, s_idx, None].to(dev))
    yield Compute("expert", layer, int(t_idx.numel()), time.perf_counter() - t0, len(set(experts)))
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
    owner = ctx.owners[layer][me]
    ids = ids.cpu()  # routing is host metadata (a no-op for the executors' CPU tensors)
    k = ids.shape[1]
    own = owner[ids] if ids.numel() else torch.zeros(0, k, dtype=torch.int64)
    xr = _hidden(ctx, x)
    dev = xr.device  # rows move with index ops on the executor's device; routing lists stay on the host
    yield Compute("coll:a2a", layer, 0, 0.0)
    # Per destination p, its (token, slot) pairs row-major (slot order within a token) as
    # (msg row, home token, slot, expert), and its rows: the distinct tokens, sorted. One pass over the pairs,
    # not a scan of them per destination (R torch ops per rank per layer, most of them for no pair).
    by_dst: dict[int, list[int]] = {}
    for f, p in enumerate(own.reshape(-1).tolist()):
        by_dst.setdefault(p, []).append(f)
    ids_flat = ids.reshape(-1).tolist()
    empty = xr[:0]
    outgoing = [([], empty)] * R
    for p, fl in by_dst.items():
        toks = sorted({f // k for f in fl})
        row = {t: i for i, t in enumerate(toks)}
        meta = [(row[f // k], f // k, f % k, ids_flat[f]) for f in fl]
        outgoing[p] = (meta, xr.index_select(0, torch.tensor(toks, dtype=torch.long, device=dev)))
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
    yield Compute("expert", layer, len(experts), time.perf_counter() - t0, len(set(experts)))
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
