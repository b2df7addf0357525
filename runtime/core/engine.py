"""The per-rank engine: a deterministic state machine over mu-queues (receptor -> queues ->
scheduler -> batch assembly -> executor -> dispatcher).

Events in:   `admit(request)`, `on_message(src, meta, tensor)` (what `poll()` feeds from the
             transport), and the batch life cycle `next_batch()` -> `execute(batch)` -> `complete(batch)`.
Decisions out: which stage batch to run (`next_batch`, via the pluggable policy) and what to send
             where (`complete`, through the transport; sends to this rank stay local).

Time comes only from the clock adapter, tensors only from the executor adapter, wires only from the
transport adapter; there are no globals and no sleeps. A wall-clock driver calls execute and
complete back to back; a virtual-clock driver executes at the batch start and completes at
start + cost, so the same engine serves tests, in-process and multi-process runs and the simulator.

Data path of one token at a MoE layer l (home rank h):
  attn(l) on h: attention_stage -> route + shared_expert -> merge entry opened on h ->
  k routed copies grouped per destination rank, one message per destination per batch ->
  expert(l) on the owner: experts_forward -> each row back to h ->
  merge on h: all k parts in -> moe_combine (slot order) -> attn(l+1), or sample after the last layer.

The hot path works on blocks of rows, never on single rows in Python: routing is dispatched with
array ops (destination of every (row, slot) from a per-layer expert->rank table, one stable sort by
destination, one index_select into that order, a slice per destination), a routed message is one
expert-queue item (its rows, expert ids and merge tags as arrays), decode tokens queue for attention
as blocks (queues.AttnBlock), expert outputs land in the home's per-batch merge
buffer at their dispatch positions (runtime/core/merge.py: a slice copy, or received in place through
the transport's `recv_into` hook), and sample items are blocks too. Wire metadata: routed rows
{"t": "x", "layer", "home", "rows": int64 tags [n], "e": int64 experts [n]}; expert outputs
{"t": "y", "layer", "rows": int64 tags [n]} (numpy arrays: small and picklable).
Dense layers run their MLP inside the attention stage. Sample: final_logits + sample (per-request
seed, step index) -> append -> stop on EOS / max tokens, else the new token enters attn(0).
"""
from __future__ import annotations

import atexit
import os
import sys
from collections import deque
from dataclasses import dataclass, field
from functools import partial
from itertools import repeat
from typing import Optional

import numpy as np
import torch

from runtime.executors.device_index import to_device
from runtime.core.dispatch_plan import plan_dispatch, warm_up as warm_up_dispatch
from runtime.core.expert_wire import decode_ids, decode_tags, encode_ids, encode_tags, id_dtype
from runtime.core.kv_cache import BlockAllocator, PagedKVStore
from runtime.core.merge import TAG_SHIFT, MergeGroup, MergeTable
from runtime.observability.metrics import BATCH_LOG, BatchRecord, RankMetrics
from runtime.core.queues import AttnBlock, AttnItem, ExpertItem, MuQueue, RoutedItem, SampleItem, is_decode
from runtime.core.requests import Request
from runtime.core.routed_rows import device_routed_from_env, pack as pack_routed
from runtime.core.scheduler import HOLD, Decision, StageView, make_policy
from runtime.observability.step_timer import StepTimer

_EMPTY_VIEW = StageView(0.0, False, 0.0)  # every empty stage's view (shared: nothing writes to it)

# Message kinds on the wire (meta["t"]).
MSG_EXPERT_IN = "x"  # home -> expert owner: routed rows
MSG_EXPERT_OUT = "y"  # expert owner -> home: expert output rows
MSG_EXPERT_ROUTED = "r"  # home -> expert owner: a whole attention batch's payload (DATAFLOW_DISPATCH=device)


@dataclass(slots=True)
class StageInfo:
    id: int
    kind: str  # attn | expert | sample
    layer: int
    next: int
    cap: int  # rows per batch

    @property
    def name(self) -> str:
        return "sample" if self.kind == "sample" else f"{self.kind}({self.layer})"


@dataclass
class EngineConfig:
    """Everything one rank needs from the plan, as plain data."""

    rank: int
    world_size: int
    num_layers: int
    top_k: int
    stages: list[StageInfo]
    expert_rank: list[list[int]]  # [layer][expert] -> rank; [] for dense layers
    block_size: int
    num_blocks: int
    eos_token_ids: frozenset = frozenset()
    max_position: int = 1 << 30
    dispatch: Optional[str] = None  # the plan's ("host" / "device"; None: not recorded), DATAFLOW_DISPATCH overrides


def config_from_plan(plan, rank: int, num_blocks: Optional[int] = None) -> EngineConfig:
    """Read rank `rank`'s view of a lowering.plan.Plan. `num_blocks` overrides the KV pool size
    (e.g. to model a smaller memory, or to keep a GPU-sized plan small on a CPU)."""
    caps = {q.stage_id: q.batch_cap for q in plan.ranks[rank].queues}
    stages = [StageInfo(s.id, s.kind, s.layer, s.next, caps[s.id]) for s in plan.stages]
    spec = plan.spec
    return EngineConfig(rank=rank, world_size=plan.cluster.ranks, num_layers=spec.num_layers,
                        top_k=spec.experts.top_k, stages=stages, expert_rank=plan.placement.expert_rank,
                        block_size=plan.kv.block_size,
                        num_blocks=num_blocks if num_blocks is not None else plan.kv.num_blocks[rank],
                        eos_token_ids=frozenset(spec.eos_token_ids), max_position=spec.max_position,
                        dispatch=plan.cluster.dispatch)


@dataclass
class Batch:
    stage: StageInfo
    items: list
    rows: int
    t_start: float
    decision: Optional[Decision] = None
    out: dict = field(default_factory=dict)  # executor results, filled by execute()


def _holds_decode(batch: "Batch") -> bool:
    """Whether an attention batch holds decode rows (a block, a one-row segment): its expert rows then queue in the
    decode lane (runtime/queues.MuQueue)."""
    return any(map(is_decode, batch.items))


def _waiting_on(batch: "Batch"):
    """A deferred batch's handle: its sample tokens ("pending") or its attention routing ("routing")."""
    handle = batch.out.get("pending")
    return handle if handle is not None else batch.out["routing"]


def _flag_from_env(name: str, on: str, default: str) -> bool:
    v = os.environ.get(name, default)
    if v not in ("0", "1"):
        raise ValueError(f"{name}={v!r}: valid values are 1 ({on}) and 0 (wait for them); default {default}")
    return v == "1"


def _async_sample_from_env() -> bool:
    return _flag_from_env("DATAFLOW_ASYNC_SAMPLE", "complete a sample batch when its tokens arrive", "1")


def _step_ahead_from_env() -> bool:
    return _flag_from_env("DATAFLOW_STEP_AHEAD", "queue a request's next step when its sample batch is launched", "1")


def _decode_wait_bound_from_env() -> float:
    v = os.environ.get("DATAFLOW_DECODE_WAIT_MS", "2")
    try:
        ms = float(v)
    except ValueError:
        ms = -1.0
    if not ms >= 0:
        raise ValueError(f"DATAFLOW_DECODE_WAIT_MS={v!r}: valid values are milliseconds >= 0 (0: off); default 2")
    return ms * 1e-3


def _async_route_from_env() -> bool:
    return _flag_from_env("DATAFLOW_ASYNC_ROUTE", "dispatch an attention batch when its routing arrives", "0")


class Engine:
    def __init__(self, cfg: EngineConfig, executor, transport, clock, policy=None,
                 trace=None, batch_log: Optional[int] = BATCH_LOG) -> None:
        self.cfg = cfg
        self.rank = cfg.rank
        self.executor = executor
        self.transport = transport
        self.clock = clock
        self.trace = trace
        self.policy = policy if policy is not None else make_policy("defrag")
        self.stages = cfg.stages
        self.next_of = [s.next for s in cfg.stages]
        k = cfg.top_k
        # Pushes to any queue, and completed batches (they move K/V positions, which decides an attention item's
        # eligibility, and end deferrals): after a decision found no stage runnable, nothing can be runnable until
        # this counts on, so next_batch answers None again without the views and the policy (NOTES §32).
        self._changes = [0]
        self._idle_at = -1  # self._changes when the last decision found nothing runnable
        self.queues = [MuQueue(s.id, s.kind, s.layer, s.cap, 1.0 / k if s.kind == "expert" else 1.0, self._changes)
                       for s in cfg.stages]
        self.attn_stage = {s.layer: s.id for s in cfg.stages if s.kind == "attn"}
        self.expert_stage = {s.layer: s.id for s in cfg.stages if s.kind == "expert"}
        self.sample_stage = next(s.id for s in cfg.stages if s.kind == "sample")
        self.kv = PagedKVStore(cfg.num_layers, BlockAllocator(cfg.num_blocks, cfg.block_size))
        self.merge = MergeTable(k, self._whole_groups())
        # expert -> rank per layer as an array, for dispatching a whole batch at once
        self._expert_rank = [np.asarray(er, dtype=np.int64) for er in cfg.expert_rank]
        self._owners = [np.unique(er).tolist() for er in self._expert_rank]  # ranks holding each layer's experts
        warm_up_dispatch()  # numba: load (or compile) now, not in the first timed batch
        self._id_dtype = id_dtype(max((len(er) for er in cfg.expert_rank), default=1))  # expert ids on the wire
        self.requests: dict[int, Request] = {}  # live requests homed here
        self.sampled: Optional[list[Request]] = None  # a list: requests of every sample batch go here (streaming)
        self.finished: list[Request] = []  # done, not yet collected by the driver (take_finished)
        # Totals over every batch, records of the latest `batch_log` only (runtime/observability/metrics.py): flat memory over a long run
        self.metrics = RankMetrics(cfg.rank, batch_log=batch_log)
        # Messages of kinds the engine does not own (a multi-process driver's admissions, finish
        # notices, stop) go here, so drivers share the transport instead of opening a second one.
        self.on_control = None
        self._eligible = {sid: self._attn_eligible(s.layer) for sid, s in enumerate(cfg.stages) if s.kind == "attn"}
        # Live requests with `chunked` set: while there are none (decode, prompts of one chunk), no row's K/V order
        # is checked or recorded (a per-row Python loop per attention batch and another per block; 10-25 us per
        # 256-row attention batch on the H200 host, NOTES §29 item 5)
        self._chunked = 0
        self._unread = 0  # rows of sample batches launched whose tokens are not read yet (Request.unread summed)
        self.decode_only = False
        # Wave hold (runtime/core/scheduler.py): rows each home announced it will still send to this rank's
        # expert(l) ([layer] -> {home: rows}), and how long the last HOLD decision may wait.
        self._announced: list[dict[int, float]] = [{} for _ in range(cfg.num_layers)]
        self.hold_s = 0.0
        # Asynchronous sampling (an executor with `sample_batch_start`, i.e. the CUDA one; DATAFLOW_ASYNC_SAMPLE=0
        # turns it off): a sample batch whose tokens are still being copied to the host is completed later,
        # when they are there, instead of the host waiting for the copy (and the GPU work queued before it) in
        # `execute`; +15% tok/s on 2 x H200 (run 42, benchmarks/NOTES.md §20). Deferred batches complete at the
        # next `next_batch()` that finds them ready, in any driver.
        self.async_sample = _async_sample_from_env()
        # Prompts yield to overdue decode rows (DATAFLOW_DECODE_WAIT_MS, default 2, 0 turns it off): when the policy
        # picks a batch of prompt rows alone while decode rows somewhere have waited this long at their stage, the most
        # overdue of those stages runs instead (`_decode_overdue`), so a token waits at most about this bound per stage
        # (2 x layers + 1 stages) behind prompts. Why: a policy that scores queue depth (defrag) sweeps the prompts
        # queued at a layer before the decode wave behind them moves on (ITL p99 0.5-1.1 s on the H200 with 2-8k-token
        # prompts arriving, run 154; benchmarks/prefill_flood_sim.py, NOTES §36 item 2). Decode-only serving never
        # picks a prompt-only batch, so it decides as before.
        self.decode_wait_bound = _decode_wait_bound_from_env()
        # Step-ahead (with asynchronous sampling; DATAFLOW_STEP_AHEAD=0 turns it off): when a
        # sample batch is launched, the next step's layer-0 rows of its requests that go on whatever token they get
        # (not at their length limit) are queued at once, their ids left on the device for the embedding. The host
        # reads the tokens later, while the device runs that next step: without it the device drained at every step
        # boundary, waiting for the host to read the tokens, complete the batch, embed and launch layer 0. A request
        # whose token turns out to be EOS "drains": it is finished then, and its extra row runs to the sample, whose
        # token is dropped, before its KV blocks are released and its finish is reported (the coordinator's free
        # blocks mirror the release).
        self.step_ahead = _step_ahead_from_env()
        # Asynchronous dispatch, the same for attention batches (an executor with `route_start`: the CUDA one
        # routing inside its attention graph; DATAFLOW_ASYNC_ROUTE=1, off by default): the host needs the routing
        # (which ranks get how many rows) before it can dispatch, and a router inside the graph answers only
        # once the device ran the batch. Instead of waiting for that, the rank runs other batches and
        # dispatches this one when its routing has arrived. Measured off by default (run 51, benchmarks/NOTES.md
        # §22): the expert batches run meanwhile are smaller (385 rows against 440), 0.88x against 1.07x clean.
        self.async_route = _async_route_from_env()
        # The executor's choice where it makes one (the CUDA executor keeps the routing on the device or brings it
        # to the host); else the plan's, for an executor that can select on its own (runtime/core/routed_rows.py).
        routed = getattr(executor, "route_on_device", None)
        self.device_routed = routed if isinstance(routed, bool) else device_routed_from_env(
            cfg.dispatch == "device" and hasattr(executor, "experts_routed"))
        self.dispatch_name = "device-routed" if self.device_routed else "host-routed"  # (run summaries say which)
        if self.device_routed and self.async_route:
            raise ValueError("DATAFLOW_ASYNC_ROUTE=1 and DATAFLOW_DISPATCH=device together: the device-routed dispatch "
                             "never waits for the routing, so there is nothing to defer; set one of them")
        if self.device_routed and not hasattr(executor, "experts_routed"):
            raise ValueError(f"DATAFLOW_DISPATCH=device needs an executor with experts_routed(); "
                             f"{type(executor).__name__} has none (use DATAFLOW_DISPATCH=host)")
        self._owned: dict = {}  # (layer, device) -> bool tensor [E]: experts this rank holds (device-routed dispatch)
        self.deferred: deque = deque()
        # A decode wave keeps its (rids, pos) lists through every layer of a step (_complete_attn, _merged pass them
        # on as they are), so the batch lists derived from them are made once per step: (rids, pos, segments).
        self._wave_segments: Optional[tuple] = None
        self._deferred_attn_rows = [0] * cfg.num_layers  # rows of deferred attention batches per layer (_incoming)
        if hasattr(transport, "recv_into"):  # a transport that can receive expert outputs in place
            transport.recv_into = self._landing
        # DATAFLOW_PROFILE_EXEC=1: wall time per step of an attention batch's dispatch, printed at exit
        profile = os.environ.get("DATAFLOW_PROFILE_EXEC") == "1"
        self._dispatch_timer = StepTimer(f"rank {self.rank} attention dispatch", profile)
        # ... and of its execute (NOTES §29 item 4: the executor call, layer 0's embedding, the lists around them)
        self._exec_timer = StepTimer(f"rank {self.rank} attention execute", profile)
        # ... and of every decision that ran a batch (next_batch: deferred completions, the views, the policy, the take)
        self._decide_timer = StepTimer(f"rank {self.rank} decision", profile)
        if profile:
            atexit.register(lambda: print(f"{self._dispatch_timer.report()}\n{self._exec_timer.report()}\n"
                                          f"{self._decide_timer.report()}", file=sys.stderr))

    def enable_decode_only(self, seed: int = 0) -> None:
        """The paper's throughput mode (runtime/core/decode_only.py): no prefill compute; an admitted request's
        prompt K/V is random and it enters attn(0) at its last prompt token. Set before any admission."""
        from runtime.core.decode_only import RandomPrefixKV
        self.kv = RandomPrefixKV(self.kv, seed)
        self.decode_only = True

    # ------------------------------------------------------------------ policy / introspection
    def set_policy(self, policy, **params) -> None:
        """Switch the scheduling policy between any two decisions (a name or a policy object)."""
        self.policy = make_policy(policy, **params) if isinstance(policy, str) else policy
        self.merge.whole_groups = self._whole_groups()

    def _whole_groups(self) -> bool:
        """Merge whole attention batches (MergeTable.whole_groups) under the wave hold, where a token
        finished early waits at the next attention stage for its wave anyway; each segment on its own
        otherwise (the paper's per-token dataflow). DATAFLOW_MERGE=whole|segments overrides (A/B runs)."""
        mode = os.environ.get("DATAFLOW_MERGE", "")
        if mode not in ("", "whole", "segments"):
            raise ValueError(f"DATAFLOW_MERGE={mode!r}: valid values are whole, segments (or unset)")
        return mode == "whole" or (not mode and getattr(self.policy, "hold_fill", 0.0) > 0)

    def free_blocks(self) -> int:
        return self.kv.allocator.free_blocks

    def queued_items(self) -> int:
        return sum(len(q) for q in self.queues)

    def idle(self) -> bool:
        """Nothing queued, no merge waiting, no batch deferred: only new admissions or messages can
        wake this rank."""
        return self.queued_items() == 0 and len(self.merge) == 0 and not self.deferred

    def oldest_wait(self) -> float:
        """How long the longest-waiting queued item has waited so far (0 when all queues are empty)."""
        now = self.clock.now()
        return max((now - q.oldest_enqueue() for q in self.queues if len(q)), default=0.0)

    def take_finished(self) -> list[Request]:
        out, self.finished = self.finished, []
        return out

    def state(self) -> str:
        """One line for stall reports."""
        qs = ", ".join(f"{s.name}={len(q)}" for s, q in zip(self.stages, self.queues) if len(q))
        return (f"rank {self.rank}: live={len(self.requests)} merges={len(self.merge)} deferred={len(self.deferred)} "
                f"free_blocks={self.free_blocks()} queues[{qs or 'empty'}]")

    # ------------------------------------------------------------------ events: admission
    def can_admit(self, req: Request) -> bool:
        return self.kv.allocator.blocks_for(req.kv_tokens) <= self.free_blocks()

    def admit(self, req: Request) -> bool:
        """Bind `req` to this rank and queue its prompt for attn(0). False (no change) if KV is short."""
        if not req.prompt:
            raise ValueError(f"request {req.name!r} has an empty prompt")
        if req.max_new_tokens < 1:
            raise ValueError(f"request {req.name!r}: max_new_tokens must be >= 1")
        if not self.kv.reserve(req.rid, req.kv_tokens):
            return False
        now = self.clock.now()
        req.home, req.t_admit = self.rank, now
        req.kv_next = [0] * self.cfg.num_layers
        self.requests[req.rid] = req
        # The prompt is one segment, chunked by the attention cap. Later chunks wait in the queue
        # (not eligible) until the previous chunk wrote its K/V at that layer.
        sid = self.attn_stage[0]
        if self.decode_only and len(req.prompt) > 1:
            last = len(req.prompt) - 1
            self.kv.prefix(req.rid, last)
            req.kv_next = [last] * self.cfg.num_layers
            self.queues[sid].push(AttnItem(req.rid, last, 1, [req.prompt[-1]], None, now))
            return True
        cap = self.queues[sid].cap
        if len(req.prompt) > cap:
            req.chunked = True
            self._chunked += 1
        for start in range(0, len(req.prompt), cap):
            toks = req.prompt[start:start + cap]
            self.queues[sid].push(AttnItem(req.rid, start, len(toks), toks, None, now))
        return True

    # ------------------------------------------------------------------ events: messages
    def poll(self) -> int:
        """Receptor: drain the transport into queues and merges. Returns the number of messages."""
        arrivals = self.transport.poll()
        for a in arrivals:
            self.on_message(a.src, a.meta, a.tensor)
        return len(arrivals)

    def on_message(self, src: int, meta: dict, tensor: Optional[torch.Tensor]) -> None:
        t = meta["t"]
        if t == MSG_EXPERT_IN:
            self._enqueue_expert_rows(meta["layer"], meta["home"], decode_tags(meta["rows"]),
                                      decode_ids(meta["e"], self._id_dtype), tensor, meta.get("more", 0.0),
                                      meta.get("next", 0.0), "d" in meta)
        elif t == MSG_EXPERT_ROUTED:
            self._enqueue_routed(meta["layer"], meta["home"], tensor, meta["rows"][0], meta.get("more", 0.0),
                                 "d" in meta)
        elif t == MSG_EXPERT_OUT:
            self._merge_rows(meta["layer"], meta["rows"], tensor, meta.get("landed", False))  # array or run form
        elif self.on_control is not None:
            self.on_control(src, meta, tensor)
        else:
            raise ValueError(f"rank {self.rank}: unknown message kind {t!r} from rank {src}")

    def _enqueue_expert_rows(self, layer: int, home: int, tags, experts, x: torch.Tensor,
                             more: float = 0.0, nxt: float = 0.0, decode: bool = False) -> None:
        """One queue item for the whole block of routed rows; `more`: rows `home` expects to send here
        for this layer soon (the rest of its wave), for the wave hold; `nxt`: rows the same tokens will
        bring to this rank's expert(layer + 1) (the policy's hold_ahead; replaced by `more` when that
        layer's dispatch from `home` arrives); `decode`: their attention batch held decode rows (the queue's
        decode lane; on the wire, meta key "d")."""
        self._announced[layer][home] = more
        if nxt:
            ahead = self._announced[layer + 1]
            ahead[home] = ahead.get(home, 0.0) + nxt
        tags = np.asarray(tags, dtype=np.int64)
        self.queues[self.expert_stage[layer]].push(
            ExpertItem(home, layer, x, tags, np.asarray(experts, dtype=np.int64), self.clock.now(), len(tags), decode))

    def _enqueue_routed(self, layer: int, home: int, payload: torch.Tensor, tag0: int, more: float = 0.0,
                        decode: bool = False) -> None:
        """One RoutedItem for a home's whole attention batch (device-routed dispatch; its packed payload as is)."""
        self._announced[layer][home] = more
        n = payload.shape[0] * self.cfg.top_k
        self.queues[self.expert_stage[layer]].push(RoutedItem(home, layer, payload, tag0, self.clock.now(), n,
                                                              decode))

    def owned_experts(self, layer: int, device: torch.device) -> torch.Tensor:
        """bool [E] on `device`: the experts of `layer` this rank holds (one tensor per (layer, device): the CUDA
        executor keys its device-routed graphs by it; CudaExecutor.prepare captures them from it)."""
        key = (layer, device)
        owned = self._owned.get(key)
        if owned is None:
            owned = self._owned[key] = torch.from_numpy(self._expert_rank[layer] == self.rank).to(device)
        return owned

    def _merge_rows(self, layer: int, tags, y: torch.Tensor, landed: bool = False) -> None:
        for group, segs in self.merge.add(tags, y, landed):
            self._merged(group, segs)

    def _landing(self, src: int, meta: dict, shape: tuple, dtype: torch.dtype):
        """The transport's receive-in-place hook (phase 2 of the exchange, header already read): the
        merge-buffer slice an expert-output message can be received into, with the event a receive
        on another stream waits for, or None. Marks the message so `on_message` skips the copy.
        May run on the transport's receptor thread: it only reads the merge table (a group and its
        buffer exist from open() until all its parts were merged, this one included)."""
        if meta.get("t") != MSG_EXPERT_OUT:
            return None
        target = self.merge.landing(meta["rows"], shape, dtype)
        if target is not None:
            meta["landed"] = True
        return target

    def _merged(self, g: MergeGroup, segs: np.ndarray) -> None:
        """Segments of group `g` whose k parts are all in: combine in slot order (one call for all
        of them: the combine is row-wise elementwise fp32, so batching changes no bits), move on."""
        if len(segs) == len(g.rids):
            rows = None
            h_res, shared, w = g.h_res, g.shared, g.weights
        else:
            rows = g.rows_of(segs)
            idx = to_device(rows, g.h_res.device)
            h_res = g.h_res.index_select(0, idx)
            shared = None if g.shared is None else g.shared.index_select(0, idx)
            w = g.weights.index_select(0, idx)
        y, row_index = MergeTable.combine_inputs(g, rows)
        nxt = self.stages[self.expert_stage[g.layer]].next
        h_next = self.executor.combine(h_res, shared, y, w, row_index, feeds_attention=self.stages[nxt].kind == "attn")
        if rows is None and not g.multi:  # a whole decode wave: its lists as they are (see _block_segments); pos0 ==
            # first for one-row segments, except after the last layer, where first is the sampled position, which the
            # sample stage does not read
            self._forward(nxt, g.rids, g.pos0, None, h_next, False)  # (ns is read only when multi)
            return
        n = g.n[segs]
        segs = segs.tolist()
        self._forward(nxt, [g.rids[s] for s in segs], [int(g.first[s]) for s in segs], n.tolist(), h_next, n.max() > 1)

    def _forward(self, sid: int, rids: list[int], first: list[int], ns: list[int], h: torch.Tensor,
                 multi: bool) -> None:
        """Queue segments that finished a layer for stage `sid` (next layer's attention, or sample):
        segment i has rows first[i].. (ns[i] of them), back to back in h. `multi`: some ns[i] > 1."""
        now = self.clock.now()
        q = self.queues[sid]
        if self.stages[sid].kind == "sample":
            # Only the last position of a request is ever sampled (rows were filtered before).
            if multi:
                h = h.index_select(0, to_device(np.cumsum(ns) - 1, h.device))
            q.push(SampleItem(rids, h, now, len(rids)))
        elif not multi:
            q.push(AttnBlock(rids, first, None, h, now, len(rids)))
        else:
            row = 0
            for rid, p, n in zip(rids, first, ns):
                q.push(AttnItem(rid, p, n, None, h, now, row))
                row += n

    def _attn_eligible(self, layer: int):
        reqs = self.requests

        def eligible(item) -> bool:
            if type(item) is AttnItem:
                req = reqs[item.rid]
                return not req.chunked or req.kv_next[layer] == item.pos0
            if not item.ready:
                item.ready = all(not reqs[r].chunked or reqs[r].kv_next[layer] == p for r, p in zip(item.rids, item.pos))
            return item.ready
        return eligible

    def _eligibility(self, sid: int):
        """Stage sid's per-item eligibility check, or None when every queued item is eligible: a stage other than
        attention, or no chunked prompt in flight (then no request can overtake itself: Request.kv_next)."""
        return self._eligible.get(sid) if self._chunked else None

    # ------------------------------------------------------------------ decisions: scheduling
    def views(self) -> list[StageView]:
        """One StageView per stage for the policy. Most stages are empty at any moment: they share one
        read-only view; `incoming` (the wave hold's) is computed only where the policy reads it, on
        runnable stages."""
        now = self.clock.now()
        hold = getattr(self.policy, "hold_fill", 0.0) > 0
        # While an attention batch of layer l waits for its routing (asynchronous dispatch), this rank's
        # expert(l) waits too: that batch's rows for it are about to join (run 51: running it meanwhile made
        # expert batches 13% smaller and the rank slower; NOTES §22 item 4).
        waiting = () if not self.deferred else {self.expert_stage[l] for l, r in enumerate(self._deferred_attn_rows)
                                                 if r and l in self.expert_stage}
        out = []
        for sid, q in enumerate(self.queues):
            if not q.rows:  # (an attribute: len(q) is a method call, 17-73 per decision)
                out.append(_EMPTY_VIEW)
                continue
            v = StageView(q.depth, sid not in waiting and q.has_eligible(self._eligibility(sid)),
                          now - q.oldest_enqueue())
            if hold and v.runnable:
                v.incoming = self._incoming(sid)
            out.append(v)
        return out

    def _incoming(self, sid: int) -> float:
        """Tokens on their way to stage `sid` soon, as far as this rank knows: a home's tokens in open
        merges of the layer before (and, for attn(0), those about to be sampled); an owner's rows the
        homes announced with their last dispatch of this layer (in tokens: rows / k)."""
        st = self.stages[sid]
        last = self.cfg.num_layers - 1
        if st.kind == "expert":
            return sum(self._announced[st.layer].values()) / self.cfg.top_k
        if st.kind == "sample":
            return float(self.merge.open_rows(last))
        if st.layer == 0:
            return self.queues[self.sample_stage].depth + self.merge.open_rows(last) + self._deferred_attn_rows[last]
        return float(self.merge.open_rows(st.layer - 1) + self._deferred_attn_rows[st.layer - 1])

    def _decode_overdue(self, chosen: MuQueue, views: list[StageView]) -> Optional[int]:
        """The stage to run instead of `chosen`'s batch when that would hold prompt rows alone: the runnable stage
        whose decode rows have waited longest, if that is at least `decode_wait_bound` (else None). Decode-only
        serving returns at the first line (the chosen queue's decode lane)."""
        if chosen.has_eligible_decode(self._eligibility(chosen.stage_id)):
            return None
        now, best, best_wait = self.clock.now(), None, self.decode_wait_bound
        for sid, v in enumerate(views):
            if not v.runnable:
                continue
            q = self.queues[sid]
            t = q.decode_enqueue()
            if t is not None and now - t >= best_wait and q.has_eligible_decode(self._eligibility(sid)):
                best, best_wait = sid, now - t
        return best

    def next_batch(self) -> Optional[Batch]:
        """Ask the policy for a stage and assemble its batch (popped from the queue), or None. A HOLD
        decision also returns None and sets `hold_s`: the driver should look again within that long
        even if no message arrives."""
        tm = self._decide_timer
        tm.start()
        if self.deferred:
            self.complete_deferred()
            tm.lap("deferred")
        self.hold_s = 0.0
        if self._idle_at == self._changes[0]:  # nothing was runnable at the last decision and nothing changed since
            self.policy.repeat_idle()
            return None
        views = self.views()
        tm.lap("views")
        decision = self.policy.choose(views, self.next_of)
        tm.lap("choose")
        if decision is None:  # (every policy: no runnable stage, whatever the time or the history)
            self._idle_at = self._changes[0]
            return None
        if decision.stage == HOLD:
            self.hold_s = decision.hold_s
            return None
        stage = self.stages[decision.stage]
        q = self.queues[stage.id]
        if stage.kind != "sample" and self.decode_wait_bound:
            overdue = self._decode_overdue(q, views)
            if overdue is not None:
                decision = Decision(overdue, decision.scores)
                stage, q = self.stages[overdue], self.queues[overdue]
                self.metrics.prompt_yields += 1
        items = q.take(self._eligibility(stage.id))
        tm.lap("take")
        if not items:
            raise RuntimeError(f"rank {self.rank}: policy {self.policy.name} chose {stage.name}, which has "
                               f"nothing runnable")
        rows = sum(it.n for it in items)
        if stage.kind == "attn" and rows >= stage.cap and q.rows:  # the cap cut a wave
            if q.rows < stage.cap // 4:
                self.metrics.attn_small_remainders += 1
            if sum(it.segments for it in items) == rows:  # decode rows only (prefill chunks fill the cap by design)
                self.metrics.attn_capped_decode += 1
        now = self.clock.now()
        if self.trace is not None:
            self.trace.decision(self.rank, now, self.policy.name, stage.id, stage.name, decision.scores, rows)
        batch = Batch(stage, items, rows, now, decision)
        tm.lap("batch")
        return batch

    # ------------------------------------------------------------------ batch execution
    def execute(self, batch: Batch) -> None:
        """Run the batch's math on the executor (results kept on the batch; nothing dispatched)."""
        kind = batch.stage.kind
        if kind == "attn":
            self._exec_attn(batch)
        elif kind == "expert":
            items = batch.items
            if type(items[0]) is RoutedItem:  # device-routed: whole batches, selected on the device
                layer = batch.stage.layer
                owned = self.owned_experts(layer, items[0].payload.device)
                # This home's own item alone: its output goes straight into its merge group's buffer (the expert
                # graph's output copied there, where it went to a new tensor and then the merge copied it again)
                into = self.merge.rows_at(items[0].tag0, items[0].out_rows) \
                    if len(items) == 1 and items[0].home == self.rank else None
                batch.out["y"] = self.executor.experts_routed(layer, [it.payload for it in items], owned, out=into)
                batch.out["landed"] = into is not None
                return
            if len(items) == 1:
                x, ids = items[0].x, items[0].expert
            else:  # row blocks: the executor concatenates them where the batch's input lives
                x = [it.x for it in items]
                ids = np.concatenate([it.expert for it in items])
            batch.out["y"] = self.executor.experts(batch.stage.layer, x, torch.from_numpy(ids))
        else:
            items = batch.items
            h = items[0].h if len(items) == 1 else torch.cat([it.h for it in items])
            rids = items[0].rids if len(items) == 1 else [r for it in items for r in it.rids]
            reqs = [self.requests[r] for r in rids]
            logits = self.executor.logits(h)
            # a request's step counts its unread samples too (step-ahead: its output may lag)
            params, steps = [r.params for r in reqs], [len(r.output) + r.unread for r in reqs]
            start = getattr(self.executor, "sample_batch_start", None) if self.async_sample else None
            pending = start(logits, params, steps) if start is not None else None
            if pending is None:
                # (the CUDA executor starts every non-empty batch; an executor that declines one lands here)
                if self._unread:  # tokens go to a request in step order: read the older samples of any first
                    self._read_unread()
                batch.out["tokens"] = self.executor.sample_batch(logits, params, steps)
            else:  # ready() / tokens(): completed by complete() or complete_deferred()
                batch.out["pending"] = pending
                batch.out["ahead"] = self._step_ahead(reqs, pending) if self.step_ahead else None
                for r in reqs:
                    r.unread += 1
                self._unread += len(reqs)
            batch.out["reqs"] = reqs

    def _step_ahead(self, reqs: list[Request], pending) -> Optional[list[bool]]:
        """Queue the next step's layer-0 block of the requests of a sample batch just launched that go on whatever
        token they sample, their ids taken on the device (see `step_ahead`); which rows it queued (None: none). Not a
        request whose earlier sample is still unread (its tokens, EOS or not, are not known yet: it goes on when
        they are, as without step-ahead), draining, or finishing its chunked prompt."""
        device_ids = getattr(pending, "device_ids", None)
        if device_ids is None:
            return None
        max_pos = self.cfg.max_position
        rows, rids, pos = [], [], []
        for i, req in enumerate(reqs):
            if req.unread or req.draining or req.chunked:
                continue
            n = len(req.output) + 1  # the output's length with the token being sampled
            p = len(req.prompt) + n - 1  # where that token's K/V goes next step
            if n < req.max_new_tokens and p < max_pos:
                rows.append(i)
                rids.append(req.rid)
                pos.append(p)
        if not rows:
            return None
        ids = device_ids(None if len(rows) == len(reqs) else rows)
        self.queues[self.attn_stage[0]].push(AttnBlock(rids, pos, ids, None, self.clock.now(), len(rids)))
        if len(rows) == len(reqs):
            return [True] * len(reqs)
        ahead = [False] * len(reqs)
        for i in rows:
            ahead[i] = True
        return ahead

    def _read_unread(self) -> None:
        """Wait for every deferred sample batch's tokens and complete it (with the other deferred batches ready)."""
        for b in self.deferred:
            p = b.out.get("pending")
            if p is not None:
                p.wait()
        self.complete_deferred()

    def _layer0_ids(self, items: list):
        """A layer-0 batch's token ids for the embedding: a list of ints, or a device tensor when a block's ids stayed
        on the device (step-ahead)."""
        if len(items) == 1:
            return items[0].tokens
        if all(type(it.tokens) is list for it in items):
            return [t for it in items for t in it.tokens]
        dev = next(it.tokens.device for it in items if type(it.tokens) is not list)
        return torch.cat([it.tokens if type(it.tokens) is not list else to_device(np.asarray(it.tokens, dtype=np.int64), dev)
                          for it in items])

    def _exec_attn(self, batch: Batch) -> None:
        tm = self._exec_timer
        tm.start()
        layer = batch.stage.layer
        items: list = batch.items  # AttnItem segments and AttnBlocks
        if layer == 0:
            h = self.executor.embed(self._layer0_ids(items))
        else:
            h = self._gather_h(items)
        tm.lap("embed" if layer == 0 else "gather_h")
        if len(items) == 1 and type(items[0]) is AttnBlock:  # a decode wave's batch
            positions, segments = items[0].pos, self._block_segments(items[0])
            items = ()
        else:
            positions, segments = [], []
        row = 0
        for it in items:
            if type(it) is AttnBlock:
                positions.extend(it.pos)
                segments.extend(zip(it.rids, range(row, row + it.n), repeat(1)))
                row += it.n
                continue
            if it.n == 1:
                positions.append(it.pos0)
            else:
                positions.extend(range(it.pos0, it.pos0 + it.n))
            segments.append((it.rid, row, it.n))
            row += it.n
        tm.lap("segments")
        h_res, x = self.executor.attention(layer, h, positions, segments, self.kv)
        tm.lap("executor")
        if not self.cfg.expert_rank[layer]:
            batch.out["h_next"] = h_res + self.executor.dense_mlp(layer, x)
        else:
            if self.device_routed:  # the routing stays where the graph made it (device tensors)
                make = getattr(self.executor, "routed_payload", None)
                if make is not None:  # rows, ids and weights packed by the attention graph (runtime/core/routed_rows.py)
                    payload = make(layer, x)
                else:
                    ids, weights = self.executor.route(layer, x)
                    payload = pack_routed(x, ids.to(x.device), weights.to(x.device))
                batch.out.update(h_res=h_res, payload=payload, shared=self.executor.shared_expert(layer, x))
                tm.lap("payload")
                return
            start = getattr(self.executor, "route_start", None) if self.async_route else None
            routing = start(layer, x) if start is not None else None
            if routing is None:  # numpy arrays where the executor hands them out (route_arrays), else tensors
                arrays = getattr(self.executor, "route_arrays", None)
                ids, weights = (arrays or self.executor.route)(layer, x)
                batch.out.update(h_res=h_res, x=x, ids=ids, weights=weights,
                                 shared=self.executor.shared_expert(layer, x))
            else:  # ready() / result(): read by complete() once on the host
                batch.out.update(h_res=h_res, x=x, routing=routing, shared=routing.shared)

    def _block_segments(self, blk: AttnBlock) -> list:
        """The one-row segments (rid, row, 1) of a batch that is one block: the same list object at every layer of
        the wave (the device tables key their row lookup on it: DeviceBlockTables.batch_rows)."""
        memo = self._wave_segments
        if memo is not None and memo[0] is blk.rids and memo[1] is blk.pos:
            return memo[2]
        segments = list(zip(blk.rids, range(blk.n), repeat(1)))
        self._wave_segments = (blk.rids, blk.pos, segments)
        return segments

    @staticmethod
    def _gather_h(items: list) -> torch.Tensor:
        """The items' hidden rows, back to back: one slice per contiguous run of a source block."""
        runs = []  # [block, first row, end row]
        for it in items:
            if runs and runs[-1][0] is it.h and runs[-1][2] == it.hrow:
                runs[-1][2] += it.n
            else:
                runs.append([it.h, it.hrow, it.hrow + it.n])
        parts = [blk if a == 0 and b == blk.shape[0] else blk[a:b] for blk, a, b in runs]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    def complete(self, batch: Batch) -> None:
        """The batch finished (now): record it and dispatch its outputs to their next stages. A sample
        batch whose tokens are not on the host yet, or an attention batch whose routing is not, is deferred
        (see `async_sample`, `async_route`)."""
        self._changes[0] += 1
        out = batch.out
        pending = out.get("pending")
        if pending is not None:
            if not pending.ready():
                self.deferred.append(batch)
                return
            del out["pending"]
            out["tokens"] = pending.tokens()
        routing = out.get("routing")
        if routing is not None:
            if not routing.ready():
                if not out.get("deferred"):
                    out["deferred"] = True
                    self._deferred_attn_rows[batch.stage.layer] += batch.rows
                self.deferred.append(batch)
                return
            del out["routing"]
            if out.pop("deferred", False):
                self._deferred_attn_rows[batch.stage.layer] -= batch.rows
            out["ids"], out["weights"] = routing.result()
        now = self.clock.now()
        t0 = batch.t_start
        rec = BatchRecord(self.rank, batch.stage.id, batch.stage.kind, batch.stage.layer, batch.rows,
                          t0, now, t0 - min(it.t_enq for it in batch.items))
        # Queueing delay per item: a segment counts once, a block of expert/sample rows once per row.
        if batch.stage.kind == "attn":
            self.metrics.on_batch(rec, [t0 - it.t_enq for it in batch.items], [it.segments for it in batch.items])
        else:
            self.metrics.on_batch(rec, [t0 - it.t_enq for it in batch.items], [it.n for it in batch.items])
        if self.trace is not None:
            self.trace.batch(self.rank, batch.stage.name, batch.t_start, now,
                             {"rows": batch.rows, "items": len(batch.items)})
        kind = batch.stage.kind
        if kind == "attn":
            self._complete_attn(batch)
        elif kind == "expert":
            self._complete_expert(batch)
        else:
            self._complete_sample(batch)

    def complete_deferred(self) -> int:
        """Complete the deferred batches whose tokens or routing arrived; returns how many."""
        n = 0
        for _ in range(len(self.deferred)):
            batch = self.deferred.popleft()
            if _waiting_on(batch).ready():
                self.complete(batch)
                n += 1
            else:
                self.deferred.append(batch)
        return n

    def wait_deferred(self) -> bool:
        """Block until the oldest deferred batch's tokens or routing are on the host, if its handle can be
        waited on (a driver calls this when nothing else can run: sleeping a fixed time instead would add
        up to that long to every deferred batch). True when it waited."""
        if not self.deferred:
            return False
        wait = getattr(_waiting_on(self.deferred[0]), "wait", None)
        if wait is None:
            return False
        wait()
        return True

    def step(self) -> bool:
        """Wall-clock convenience: receive, pick, run, dispatch one batch. False when nothing ran."""
        self.poll()
        batch = self.next_batch()
        if batch is None:
            return False
        self.execute(batch)
        self.complete(batch)
        return True

    # ------------------------------------------------------------------ dispatch
    @staticmethod
    def _sampled(req: Request, last_pos: int) -> bool:
        """Whether a segment of `req` ending at position last_pos is sampled after the last layer: a decode row, or the
        prompt's last chunk (an earlier chunk is not). By position, not by len(req.output): with step-ahead a row can
        reach the last layer before its request's previous token was read."""
        return last_pos >= len(req.prompt) - 1

    def _complete_attn(self, batch: Batch) -> None:
        tm = self._dispatch_timer
        tm.start()
        layer = batch.stage.layer
        last = layer == self.cfg.num_layers - 1
        out = batch.out
        sent = None
        if not last and "payload" in out:
            # Device-routed: every row moves on, so the payload leaves first and the holders start on it while this
            # rank does the batch's bookkeeping (that is on the wave's critical path; run 82's timeline, NOTES §28).
            sent = self._send_routed(batch, layer, out["payload"])
        reqs = self.requests
        rids, pos0s, first, ns = [], [], [], []
        keep: Optional[list[int]] = [] if last else None  # batch rows that move on (None: all)
        row = 0
        multi = False
        track = self._chunked > 0  # else no K/V order to record, and every block row is its request's sampled one
        items = batch.items
        if not last and not track and len(items) == 1 and type(items[0]) is AttnBlock:
            # A decode wave: its lists move on as they are (one-row segments: pos0 == first), and with them what
            # _block_segments derived from them
            it = items[0]
            rids, pos0s, first, row = it.rids, it.pos, it.pos, it.n
            items = ()
        for it in items:
            if type(it) is AttnBlock:  # one-row segments
                if track:
                    for r, p in zip(it.rids, it.pos):
                        reqs[r].kv_next[layer] = p + 1
                if last and track:  # a chunked prompt's one-row chunk may not be its sampled row
                    for i, (r, p) in enumerate(zip(it.rids, it.pos)):
                        if self._sampled(reqs[r], p):
                            keep.append(row + i)
                            rids.append(r)
                            pos0s.append(p)
                            first.append(p)
                            ns.append(1)
                else:
                    if last:
                        keep += range(row, row + it.n)
                    rids += it.rids
                    pos0s += it.pos
                    first += it.pos
                    ns += repeat(1, it.n)
                row += it.n
                continue
            req = reqs[it.rid]
            req.kv_next[layer] = it.pos0 + it.n
            if last:
                # After the last layer only the sampled position matters; the other prompt rows
                # were needed for their K/V only.
                sp = it.pos0 + it.n - 1
                if self._sampled(req, sp):
                    keep.append(row + it.n - 1)
                    rids.append(it.rid)
                    pos0s.append(it.pos0)
                    first.append(sp)
                    ns.append(1)
            else:
                rids.append(it.rid)
                pos0s.append(it.pos0)
                first.append(it.pos0)
                ns.append(it.n)
                multi |= it.n > 1
            row += it.n
        if not rids:
            return
        sel = None
        if keep is not None and len(keep) != row:
            sel = np.asarray(keep, dtype=np.int64)

        def rows_of(t):
            if sel is None:
                return t
            return t[sel] if type(t) is np.ndarray else t.index_select(0, to_device(sel, t.device))

        nxt = batch.stage.next
        if "h_next" in out:  # a dense layer: no experts
            self._forward(nxt, rids, first, ns, rows_of(out["h_next"]), multi)
            return
        tm.lap("bookkeeping")
        # The batch's merge group, opened below with its dispatch order (host-routed) or its holders (device-routed).
        shared = rows_of(out["shared"]) if out["shared"] is not None else None
        n = np.asarray(ns, dtype=np.int64) if multi else None  # (None: one row each. A list -> array is ~1 us per 30 rows)
        open_group = partial(self.merge.open, layer, rids, pos0s, first, n,
                             rows_of(out["h_res"]), shared)
        if "payload" in out:
            self._dispatch_routed(batch, layer, open_group, rows_of, sent)
            return
        weights = rows_of(out["weights"])
        open_group = partial(open_group, weights, batch.t_start)
        ids = rows_of(out["ids"])
        if type(ids) is not np.ndarray:
            ids = ids.numpy() if ids.device.type == "cpu" else ids.cpu().numpy()
        # Dispatch: the destination of every (row, slot), flat index f = row * k + slot; rows of a
        # destination keep ascending f order (stable sort), one message per destination per batch,
        # destinations in rank order (deterministic). The merge addresses rows by their position in
        # this order (tags = positions), so each message's outputs come back as one contiguous range.
        # The order, its inverse and the merge's packed device inputs come from one compiled call.
        T, k = ids.shape
        plan = plan_dispatch(ids, weights, self._expert_rank[layer], self.cfg.world_size)
        g = open_group(plan=plan)
        tm.lap("order+merge_open")
        x = rows_of(out["x"])
        tag0 = g.gid << TAG_SHIFT  # the tag of dispatch position p is tag0 + p
        # The routed rows in dispatch order, one gather for all destinations: each destination's rows are
        # then a contiguous slice (a view: nothing more to copy before the send or the local enqueue).
        experts = plan.experts
        x_sorted = x.repeat_interleave(k, dim=0) if plan.order is None else x.index_select(0, g.gather)
        # Wave announcement: this home's tokens still headed for attn(layer) soon (queued, or in merges of
        # the layer before), times this batch's rows per token to each owner: what that owner's expert
        # queue can still expect from here (the scheduler's wave hold uses it; meta key "more").
        ahead = self._wave_ahead(batch)
        # hold_ahead: the same tokens' rows at expert(layer + 1), estimated with this layer's share per owner
        announce_next = getattr(self.policy, "hold_ahead", 0) and layer + 1 < self.cfg.num_layers and self.cfg.expert_rank[layer + 1]
        decode = _holds_decode(batch)
        tm.lap("gather")
        off = 0
        for d, c in enumerate(plan.counts.tolist()):
            if not c:
                continue
            xd, ed = x_sorted[off:off + c], experts[off:off + c]
            more = ahead * c / T
            nxt = float(c) if announce_next else 0.0
            if d == self.rank:
                td = np.arange(tag0 + off, tag0 + off + c, dtype=np.int64)
                self._enqueue_expert_rows(layer, self.rank, td, ed, xd, more, nxt, decode)
            else:
                meta = {"t": MSG_EXPERT_IN, "layer": layer, "home": self.rank, "rows": (tag0 + off, c),
                        "e": encode_ids(ed, self._id_dtype), "more": more}  # wire forms: runtime/core/expert_wire.py
                if nxt:
                    meta["next"] = nxt
                if decode:
                    meta["d"] = 1
                self.transport.send(d, meta, xd)
            off += c
        tm.lap("send+enqueue")

    def _dispatch_routed(self, batch: Batch, layer: int, open_group, rows_of,
                         sent: Optional[tuple[int, float]] = None) -> None:
        """Device-routed dispatch (runtime/core/routed_rows.py): the whole batch's payload (rows, expert ids and weights)
        to every rank holding experts of the layer; each returns one row per token (the weighted sum of its own
        slots), which the merge group, a holder group, lands at holder j's range j*T .. (j+1)*T - 1. `sent`: what
        _send_routed returned when the payload already went out (before the bookkeeping); None: send it now."""
        payload = rows_of(batch.out["payload"])
        owners = self._owners[layer]
        gid, more = sent if sent is not None else self._send_routed(batch, layer, payload)
        g = open_group(None, batch.t_start, holders=len(owners))
        assert g.gid == gid, (g.gid, gid)
        tm = self._dispatch_timer
        tm.lap("routed:merge_open")
        T = payload.shape[0]
        if self.rank in owners:  # (opening the layer's group changed no count `more` was made of)
            self._enqueue_routed(layer, self.rank, payload, (gid << TAG_SHIFT) + owners.index(self.rank) * T, more,
                                 _holds_decode(batch))
        tm.lap("routed:enqueue")

    def _send_routed(self, batch: Batch, layer: int, payload: torch.Tensor) -> tuple[int, float]:
        """Send the payload to every other holder of `layer`, tagged for the merge group the next open() makes
        (holder j's rows at j*T ..); returns that group's id and the wave announcement sent with it (`more`)."""
        gid = self.merge.next_gid
        T = payload.shape[0]
        more = self._wave_ahead(batch) * self.cfg.top_k
        decode = _holds_decode(batch)
        for j, d in enumerate(self._owners[layer]):
            if d != self.rank:
                meta = {"t": MSG_EXPERT_ROUTED, "layer": layer, "home": self.rank,
                        "rows": ((gid << TAG_SHIFT) + j * T, T), "more": more}
                if decode:
                    meta["d"] = 1
                self.transport.send(d, meta, payload)
        return gid, more

    def _wave_ahead(self, batch: Batch) -> float:
        """This home's tokens still headed for the batch's attention stage soon (the wave announcement)."""
        return self.queues[batch.stage.id].depth + self._incoming(batch.stage.id)

    def _complete_expert(self, batch: Batch) -> None:
        layer = batch.stage.layer
        y = batch.out["y"]
        items = batch.items
        by_home: dict[int, list[tuple[int, int, object]]] = {}  # home -> [(first row, end row, item)]
        row = 0
        for it in items:
            by_home.setdefault(it.home, []).append((row, row + it.out_rows, it))
            row += it.out_rows
        for dst in sorted(by_home, key=lambda d: (d == self.rank, d)):  # other homes' first (they wait for them)
            parts = by_home[dst]
            # The rows' merge tags in the wire form: usually one run, bookkept with slices (MergeTable.add), 3 ints
            # on the wire. A device-routed item's tags are a run by construction (no array made and scanned for it).
            if len(parts) == 1:
                a, b, it = parts[0]
                part = y if a == 0 and b == row else y[a:b]
                rows = (it.tag0, it.out_rows) if type(it) is RoutedItem else encode_tags(it.tag)
            else:
                part = torch.cat([y[a:b] for a, b, _ in parts])
                rows = encode_tags(np.concatenate([it.tag for _, _, it in parts]))
            if dst == self.rank:
                self._merge_rows(layer, rows, part, batch.out.get("landed", False))  # (landed: the batch's only part)
            else:
                self.transport.send(dst, {"t": MSG_EXPERT_OUT, "layer": layer, "rows": rows}, part)

    def _complete_sample(self, batch: Batch) -> None:
        now = self.clock.now()
        q0 = self.queues[self.attn_stage[0]]
        eos = self.cfg.eos_token_ids
        max_pos = self.cfg.max_position
        reqs = batch.out["reqs"]
        # The wave hold's adaptive bound (hold_step) reads the mean time since each request's last token, and a
        # chunked prompt's first token ends its chunking: both skipped when nothing uses them (this loop runs once per
        # request per step: 0.15 -> 0.09 us per request here, ~3-4x that on the H200 hosts).
        observe = getattr(self.policy, "observe_step", None) if getattr(self.policy, "hold_step", 0) > 0 else None
        if observe is not None:
            gaps = [now - r.token_times[-1] for r in reqs if r.token_times and not r.draining]
            if gaps:
                observe(sum(gaps) / len(gaps))
        if self._chunked:
            for req in reqs:
                if req.chunked:  # its prompt's chunks are all through every layer: one segment in flight from now on
                    req.chunked = False
                    self._chunked -= 1
        cont_rids, cont_pos, cont_toks = [], [], []  # requests that go on: one attn(0) block
        tokens = batch.out["tokens"]
        ahead = batch.out.get("ahead")  # rows whose next step was queued at the launch (step-ahead), or None
        read = int("ahead" in batch.out)  # launched asynchronously: its requests' unread samples are counted
        self._unread -= read * len(reqs)
        counted = len(tokens)
        for i, (req, tok) in enumerate(zip(reqs, tokens)):
            req.unread -= read
            if req.draining:  # its EOS came at the step before; this row was queued before that was known
                self._release(req)
                counted -= 1
                continue
            out = req.output
            out.append(tok)
            req.token_times.append(now)
            n = len(out)
            pos = len(req.prompt) + n - 1  # where the new token would be written
            if tok in eos and not req.ignore_eos:
                self._finish(req, "eos", now, ahead is not None and ahead[i])
            elif req.stop_token_ids and tok in req.stop_token_ids:  # the request's own stop ids (runtime/core/requests.py)
                self._finish(req, "stop", now, ahead is not None and ahead[i])
            elif n >= req.max_new_tokens or pos >= max_pos:
                self._finish(req, "length", now)
            elif req.cancelled:
                self._finish(req, "abort", now, ahead is not None and ahead[i])
            elif ahead is None or not ahead[i]:
                cont_rids.append(req.rid)
                cont_pos.append(pos)
                cont_toks.append(tok)
        if cont_rids:
            q0.push(AttnBlock(cont_rids, cont_pos, cont_toks, None, now, len(cont_rids)))
        self.metrics.tokens += counted
        if self.sampled is not None:  # a serving front streams their new tokens (runtime/drivers/front_link.py)
            self.sampled.extend(reqs)

    def cancel(self, rid: int) -> bool:
        """Its client went away: the request finishes at its next sampled token ("abort"), its KV freed then. False
        when it is not here (finished already)."""
        req = self.requests.get(rid)
        if req is None:
            return False
        req.cancelled = True
        return True

    def _finish(self, req: Request, reason: str, now: float, row_queued: bool = False) -> None:
        """`row_queued`: its next step's row is on its way already (step-ahead): it drains (see `step_ahead`)."""
        req.finish_reason, req.t_finish = reason, now
        if row_queued:
            req.draining = True
        else:
            self._release(req)

    def _release(self, req: Request) -> None:
        """A finished request leaves: its KV blocks are freed and the driver may report it."""
        self.kv.release(req.rid)
        del self.requests[req.rid]
        self.finished.append(req)
