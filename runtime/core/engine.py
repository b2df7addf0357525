"""The per-rank engine: a deterministic state machine over mu-queues (receptor -> queues ->
scheduler -> batch assembly -> executor -> dispatcher).

Events in:   `admit(request)`, `on_message(src, meta, tensor)` (what `poll()` feeds from the
             transport), and the batch life cycle `next_batch()` -> `execute(batch)` -> `complete(batch)`.
Decisions out: which stage batch to run (`next_batch`, via the pluggable policy) and what to send
             where (`complete`, through the transport; sends to this rank stay local).

Time comes only from the clock adapter, tensors only from the executor adapter (its contract:
runtime/executors/base.py), wires only from the transport adapter; there are no globals and no sleeps. A
wall-clock driver calls execute and complete back to back; a virtual-clock driver executes at the batch start
and completes at start + cost, so the same engine serves tests, in-process and multi-process runs and the
simulator.

Data path of one token at a MoE layer l (home rank h):
  attn(l) on h: attention_stage -> route + shared_expert -> merge entry opened on h ->
  k routed copies grouped per destination rank, one message per destination per batch ->
  expert(l) on the owner: experts_forward -> each row back to h ->
  merge on h: all k parts in -> moe_combine (slot order) -> attn(l+1), or sample after the last layer.

The hot path works on blocks of rows, never on single rows in Python: routing is dispatched with
array ops (runtime/core/expert_dispatch.py), a routed message is one expert-queue item (its rows, expert ids and
merge tags as arrays), decode tokens queue for attention as blocks (queues.AttnBlock), expert outputs land in the
home's per-batch merge buffer at their dispatch positions (runtime/core/merge.py: a slice copy, or received in
place through the transport's `recv_into` hook), and sample items are blocks too. Dense layers run their MLP
inside the attention stage. Sample: final_logits + sample (per-request seed, step index) -> append -> stop on EOS
/ max tokens, else the new token enters attn(0).

The class is assembled from one part per concept, each in its own file:
  runtime/core/batch_choice.py     which batch runs next (the policy's views, its decision, the decode-wait guard)
  runtime/core/attention_stage.py  an attention batch: its inputs, the executor call, which rows move on
  runtime/core/expert_dispatch.py  routed rows to their experts (host- or device-routed) and their outputs home
  runtime/core/sample_stage.py     sampling: asynchronous completion, step-ahead, finishing requests
This file holds the state they share, admission, the receptor and the batch life cycle.
"""
from __future__ import annotations

import atexit
import sys
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch

from runtime import settings
from runtime.core.attention_stage import AttentionStage
from runtime.core.batch_choice import Batch, BatchChoice
from runtime.core.dispatch_plan import warm_up as warm_up_dispatch
from runtime.core.expert_dispatch import MSG_EXPERT_IN, MSG_EXPERT_OUT, MSG_EXPERT_ROUTED, MSG_NONE, ExpertDispatch
from runtime.core.expert_wire import decode_ids, id_dtype
from runtime.core.kv_cache import BlockAllocator, PagedKVStore
from runtime.core.merge import MergeTable
from runtime.core.queues import AttnItem, MuQueue
from runtime.core.replica_choice import ReplicaChoice
from runtime.core.requests import Request
from runtime.core.routed_rows import use_device_routing
from runtime.core.sample_stage import SampleStage
from runtime.core.scheduler import StageView, StageViews, make_policy
from runtime.executors.base import Executor
from runtime.observability.metrics import BATCH_LOG, BatchRecord, RankMetrics
from runtime.observability.step_timer import StepTimer


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
    dispatch: Optional[str] = None  # the plan's ("host" / "device"; None: not recorded); the dispatch option overrides
    replicas: list = field(default_factory=list)  # [layer][expert] -> further ranks holding a copy ([]: none)


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
                        dispatch=plan.cluster.dispatch, replicas=plan.placement.replicas)


class Engine(BatchChoice, AttentionStage, ExpertDispatch, SampleStage):
    def __init__(self, cfg: EngineConfig, executor: Executor, transport, clock, policy=None,
                 trace=None, batch_log: Optional[int] = BATCH_LOG) -> None:
        options = settings.current()
        self.cfg = cfg
        self.rank = cfg.rank
        # (fresh_outputs: every tensor the executor returns is a new one; runtime/transport/inproc.py)
        self.executor, self._fresh_outputs = executor, getattr(executor, "fresh_outputs", False)
        self.transport = transport
        self.clock = clock
        self.trace = trace
        self.policy = policy if policy is not None else make_policy("defrag")
        self.stages = cfg.stages
        self.next_of = [s.next for s in cfg.stages]
        k = cfg.top_k
        # Pushes to any queue, and completed batches (they move K/V positions, which decides an attention item's
        # eligibility, and end deferrals): after a decision found no stage runnable, nothing can be runnable until
        # this counts on, so next_batch answers None again without the views and the policy (an idle rank's loop
        # would otherwise pay for both on every look).
        self._changes = [0]
        self._idle_at = -1  # self._changes when the last decision found nothing runnable
        self._active: set[int] = set()  # ids of the non-empty queues (MuQueue keeps it)
        # The views of every stage while all are empty (BatchChoice.views): one view shared by every empty stage
        self._no_views = StageViews([StageView(0.0, False, 0.0)] * len(cfg.stages))
        self._no_views.depths, self._no_views.runnable, self._no_views.active = [0.0] * len(cfg.stages), [], []
        self.queues = [MuQueue(s.id, s.kind, s.layer, s.cap, 1.0 / k if s.kind == "expert" else 1.0, self._changes,
                               self._active) for s in cfg.stages]
        self.attn_stage = {s.layer: s.id for s in cfg.stages if s.kind == "attn"}
        self.expert_stage = {s.layer: s.id for s in cfg.stages if s.kind == "expert"}
        self.sample_stage = next(s.id for s in cfg.stages if s.kind == "sample")
        self.kv = PagedKVStore(cfg.num_layers, BlockAllocator(cfg.num_blocks, cfg.block_size))
        self.merge = MergeTable(k, self._whole_groups())
        # expert -> rank per layer as an array, for dispatching a whole batch at once
        self._expert_rank = [np.asarray(er, dtype=np.int64) for er in cfg.expert_rank]
        self._owners = [np.unique(er).tolist() for er in self._expert_rank]  # ranks holding each layer's experts
        # replicated experts: the copy each batch's rows go to is chosen at dispatch (runtime/core/replica_choice.py)
        self._replica = ReplicaChoice(cfg.expert_rank, cfg.replicas, cfg.rank, cfg.world_size) if cfg.replicas \
            else None
        warm_up_dispatch()  # numba: load (or compile) now, not in the first timed batch
        self._id_dtype = id_dtype(max((len(er) for er in cfg.expert_rank), default=1))  # expert ids on the wire
        self.requests: dict[int, Request] = {}  # live requests homed here
        self.sampled: Optional[list[Request]] = None  # a list: requests of every sample batch go here (streaming)
        self.finished: list[Request] = []  # done, not yet collected by the driver (take_finished)
        # Totals over every batch, records of the latest `batch_log` only (runtime/observability/metrics.py): flat
        # memory over a long run
        self.metrics = RankMetrics(cfg.rank, batch_log=batch_log)
        # Messages of kinds the engine does not own (a multi-process driver's admissions, finish
        # notices, stop) go here, so drivers share the transport instead of opening a second one.
        self.on_control = None
        self._eligible = {sid: self._attn_eligible(s.layer) for sid, s in enumerate(cfg.stages) if s.kind == "attn"}
        # Live requests with `chunked` set: while there are none (decode, prompts of one chunk), no row's K/V order
        # is checked or recorded (a per-row Python loop per attention batch and another per block; 10-25 us per
        # 256-row attention batch on the H200 host)
        self._chunked = 0
        self._unread = 0  # rows of sample batches launched whose tokens are not read yet (Request.unread summed)
        self.decode_only = False  # random prompt K/V, requests enter at their last prompt token (lab/decode_only.py)
        # Wave hold (runtime/core/scheduler.py): rows each home announced it will still send to this rank's
        # expert(l) ([layer] -> {home: rows}), and how long the last HOLD decision may wait.
        self._announced: list[dict[int, float]] = [{} for _ in range(cfg.num_layers)]
        self._promised: dict[int, set[int]] = {}  # layer -> ranks this home's hold_ahead told to expect rows there
        self.hold_s = 0.0
        # Asynchronous sampling (runtime/core/sample_stage.py) with an executor that starts sample batches
        # (sample_batch_start): a sample batch whose tokens are still on their way to the host waits in `deferred`
        # and completes at a later next_batch() that finds them there. A virtual-clock driver turns it off: a
        # simulated batch's results are there when it completes.
        self.async_sample = True
        self.deferred: deque = deque()
        # Prompts yield to overdue decode rows (runtime/core/batch_choice.py, `_decode_overdue`; 0 turns it off)
        self.decode_wait_bound = options.decode_wait_ms * 1e-3
        # The executor's choice where it makes one (the CUDA executor keeps the routing on the device or brings it
        # to the host); else the plan's or the dispatch option's (runtime/core/routed_rows.py).
        own, capable = executor.route_on_device, executor.supports_device_routing
        self.device_routed = own if own is not None else use_device_routing(cfg.dispatch == "device" and capable)
        self.dispatch_name = "device-routed" if self.device_routed else "host-routed"  # (run summaries say which)
        if self.device_routed and self._replica is not None:  # (its kernels mask the experts by one owner)
            raise ValueError("expert replicas need dispatch=host")
        if self.device_routed and not capable:
            raise ValueError(f"dispatch=device needs an executor that runs experts_routed(); "
                             f"{type(executor).__name__} does not (use dispatch=host)")
        self._owned: dict = {}  # (layer, device) -> bool tensor [E]: experts this rank holds (device-routed dispatch)
        # A decode wave keeps its (rids, pos) lists through every layer of a step (_complete_attn, _merged pass them
        # on as they are), so the batch lists derived from them are made once per step: (rids, pos, segments).
        self._wave_segments: Optional[tuple] = None
        transport.recv_into = self._landing  # expert outputs received in place (runtime/transport/base.py)
        # The profile_steps option: wall time per step of an attention batch's dispatch, printed at exit
        profile = options.profile_steps
        self._dispatch_timer = StepTimer(f"rank {self.rank} attention dispatch", profile)
        # ... and of its execute (the executor call, layer 0's embedding, the lists around them)
        self._exec_timer = StepTimer(f"rank {self.rank} attention execute", profile)
        # ... and of every decision that ran a batch (next_batch: deferred completions, the views, the policy, the take)
        self._decide_timer = StepTimer(f"rank {self.rank} decision", profile)
        if profile:
            atexit.register(lambda: print(f"{self._dispatch_timer.report()}\n{self._exec_timer.report()}\n"
                                          f"{self._decide_timer.report()}", file=sys.stderr))

    # ------------------------------------------------------------------ policy / introspection
    def set_policy(self, policy, **params) -> None:
        """Switch the scheduling policy between any two decisions (a name or a policy object)."""
        self.policy = make_policy(policy, **params) if isinstance(policy, str) else policy
        self.merge.whole_groups = self._whole_groups()

    def _whole_groups(self) -> bool:
        """Merge whole attention batches (MergeTable.whole_groups) under the wave hold, where a token
        finished early waits at the next attention stage for its wave anyway; each segment on its own
        otherwise (the paper's per-token dataflow)."""
        return self.policy.hold_fill > 0

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
        return max((self.clock.now() - q.oldest_enqueue() for q in self.queues if len(q)), default=0.0)

    def take_finished(self) -> list[Request]:
        out, self.finished = self.finished, []
        return out

    def state(self) -> str:
        """One line for stall reports."""
        qs = ", ".join(f"{s.name}={len(q)}" for s, q in zip(self.stages, self.queues) if len(q))
        return (f"rank {self.rank}: live={len(self.requests)} merges={len(self.merge)} deferred={len(self.deferred)} "
                f"free_blocks={self.free_blocks()} queues[{qs or 'empty'}]")

    # ------------------------------------------------------------------ events: admission
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

    def cancel(self, rid: int) -> None:
        """Its client went away: the request finishes at its next sampled token ("abort"), its KV freed then.
        Nothing to do when it is not here (finished already)."""
        req = self.requests.get(rid)
        if req is not None:
            req.cancelled = True

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
            self._enqueue_expert_rows(meta["layer"], meta["home"], meta["rows"],  # (tags in either wire form)
                                      decode_ids(meta["e"], self._id_dtype), tensor, meta.get("more", 0.0),
                                      meta.get("next", 0.0), "d" in meta)
        elif t == MSG_EXPERT_ROUTED:
            self._enqueue_routed(meta["layer"], meta["home"], tensor, meta["rows"][0], meta.get("more", 0.0),
                                 "d" in meta)
        elif t == MSG_NONE:
            self._announced[meta["layer"]].pop(meta["home"], None)
        elif t == MSG_EXPERT_OUT:
            if self._replica is not None:
                self._replica.returned(src, meta["rows"], self.clock.now())
            self._merge_rows(meta["rows"], tensor, meta.get("landed", False))  # array or run form
        elif self.on_control is not None:
            self.on_control(src, meta, tensor)
        else:
            raise ValueError(f"rank {self.rank}: unknown message kind {t!r} from rank {src}")

    # ------------------------------------------------------------------ batch life cycle
    def execute(self, batch: Batch) -> None:
        """Run the batch's math on the executor (results kept on the batch; nothing dispatched)."""
        kind = batch.stage.kind
        (self._exec_attn if kind == "attn" else self._exec_expert if kind == "expert" else self._exec_sample)(batch)

    def complete(self, batch: Batch) -> None:
        """The batch finished (now): record it and dispatch its outputs to their next stages. A sample
        batch whose tokens are not on the host yet is deferred (see `async_sample`)."""
        self._changes[0] += 1
        out = batch.out
        pending = out.get("pending")
        if pending is not None:
            if not pending.ready():
                self.deferred.append(batch)
                return
            del out["pending"]
            out["tokens"] = pending.tokens()
        now, t0, stage, kind = self.clock.now(), batch.t_start, batch.stage, batch.stage.kind
        waits = [t0 - it.t_enq for it in batch.items]  # (max(waits) == t0 - the earliest t_enq: rounding is monotone)
        rec = BatchRecord(self.rank, stage.id, kind, stage.layer, batch.rows, t0, now, max(waits))
        # Queueing delay per item: a segment counts once, a block of expert/sample rows once per row.
        counts = [it.segments if kind == "attn" else it.n for it in batch.items]
        self.metrics.on_batch(rec, waits, counts)
        if self.trace is not None:
            self.trace.batch(self.rank, stage.name, batch.t_start, now, {"rows": batch.rows, "items": len(batch.items)})
        (self._complete_attn if kind == "attn" else self._complete_expert if kind == "expert" else
         self._complete_sample)(batch)
