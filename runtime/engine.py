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
Dense layers run their MLP inside the attention stage. Sample: final_logits + sample (per-request
seed, step index) -> append -> stop on EOS / max tokens, else the new token enters attn(0).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch

from runtime.kv_cache import BlockAllocator, PagedKVStore
from runtime.merge import MergeEntry, MergeTable
from runtime.metrics import BatchRecord, RankMetrics
from runtime.queues import AttnItem, ExpertItem, MuQueue, SampleItem
from runtime.requests import Request
from runtime.scheduler import Decision, StageView, make_policy

# Message kinds on the wire (meta["t"]).
MSG_EXPERT_IN = "x"  # home -> expert owner: routed rows
MSG_EXPERT_OUT = "y"  # expert owner -> home: expert output rows


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
                        eos_token_ids=frozenset(spec.eos_token_ids), max_position=spec.max_position)


@dataclass
class Batch:
    stage: StageInfo
    items: list
    rows: int
    t_start: float
    decision: Optional[Decision] = None
    out: dict = field(default_factory=dict)  # executor results, filled by execute()


class Engine:
    def __init__(self, cfg: EngineConfig, executor, transport, clock, policy=None,
                 trace=None) -> None:
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
        self.queues = [MuQueue(s.id, s.kind, s.layer, s.cap, 1.0 / k if s.kind == "expert" else 1.0)
                       for s in cfg.stages]
        self.attn_stage = {s.layer: s.id for s in cfg.stages if s.kind == "attn"}
        self.sample_stage = next(s.id for s in cfg.stages if s.kind == "sample")
        self.kv = PagedKVStore(cfg.num_layers, BlockAllocator(cfg.num_blocks, cfg.block_size))
        self.merge = MergeTable(k)
        self.requests: dict[int, Request] = {}  # live requests homed here
        self.finished: list[Request] = []  # done, not yet collected by the driver (take_finished)
        self.metrics = RankMetrics(cfg.rank)
        # Messages of kinds the engine does not own (a multi-process driver's admissions, finish
        # notices, stop) go here, so drivers share the transport instead of opening a second one.
        self.on_control = None
        self._eligible = {sid: self._attn_eligible(s.layer) for sid, s in enumerate(cfg.stages) if s.kind == "attn"}
        self.decode_only = False

    def enable_decode_only(self, seed: int = 0) -> None:
        """The paper's throughput mode (runtime/decode_only.py): no prefill compute; an admitted request's
        prompt K/V is random and it enters attn(0) at its last prompt token. Set before any admission."""
        from runtime.decode_only import RandomPrefixKV
        self.kv = RandomPrefixKV(self.kv, seed)
        self.decode_only = True

    # ------------------------------------------------------------------ policy / introspection
    def set_policy(self, policy, **params) -> None:
        """Switch the scheduling policy between any two decisions (a name or a policy object)."""
        self.policy = make_policy(policy, **params) if isinstance(policy, str) else policy

    def free_blocks(self) -> int:
        return self.kv.allocator.free_blocks

    def queued_items(self) -> int:
        return sum(len(q) for q in self.queues)

    def idle(self) -> bool:
        """Nothing queued and no merge waiting: only new admissions or messages can wake this rank."""
        return self.queued_items() == 0 and len(self.merge) == 0

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
        return (f"rank {self.rank}: live={len(self.requests)} merges={len(self.merge)} "
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
            self._enqueue_expert_rows(meta["layer"], meta["home"], meta["rows"], tensor)
        elif t == MSG_EXPERT_OUT:
            self._merge_rows(meta["layer"], meta["rows"], tensor)
        elif self.on_control is not None:
            self.on_control(src, meta, tensor)
        else:
            raise ValueError(f"rank {self.rank}: unknown message kind {t!r} from rank {src}")

    def _enqueue_expert_rows(self, layer: int, home: int, rows: list, x: torch.Tensor) -> None:
        q = self.queues[self._expert_stage(layer)]
        now = self.clock.now()
        for i, (rid, pos0, row, slot, expert, weight) in enumerate(rows):
            q.push(ExpertItem(rid, pos0, row, home, layer, slot, expert, weight, x[i], now))

    def _merge_rows(self, layer: int, rows: list, y: torch.Tensor) -> None:
        done = []
        for i, (rid, pos0, row, slot) in enumerate(rows):
            entry = self.merge.add(rid, pos0, layer, row, slot, y[i])
            if entry is not None:
                done.append(entry)
        if done:
            self._merged(layer, done)

    def _merged(self, layer: int, entries: list[MergeEntry]) -> None:
        """Segments whose k parts are all in: combine in slot order, move on to the next stage.

        Segments completed by one message are combined in one call: the combine is row-wise
        elementwise fp32, so batching changes no bits, only the number of kernel launches.
        """
        if len(entries) == 1:
            e = entries[0]
            h_next = self.executor.combine(e.h_res, e.shared, MergeTable.stacked(e), e.weights)
        else:
            shared = None if entries[0].shared is None else torch.cat([e.shared for e in entries])
            h_next = self.executor.combine(torch.cat([e.h_res for e in entries]), shared,
                                           torch.cat([MergeTable.stacked(e) for e in entries]),
                                           torch.cat([e.weights for e in entries]))
        nxt = self.stages[self._expert_stage(layer)].next
        row = 0
        for e in entries:
            n = len(e.positions)
            self._forward(nxt, e.rid, e.positions, h_next[row:row + n])
            row += n

    def _forward(self, sid: int, rid: int, positions: list[int], h: torch.Tensor) -> None:
        """Queue rows that finished a layer for stage `sid` (next layer's attention, or sample)."""
        now = self.clock.now()
        if self.stages[sid].kind == "sample":
            # Only the last position of a request is ever sampled (rows were filtered before).
            self.queues[sid].push(SampleItem(rid, positions[-1], h[-1], now))
        else:
            self.queues[sid].push(AttnItem(rid, positions[0], len(positions), None, h, now))

    def _expert_stage(self, layer: int) -> int:
        return self.stages[self.attn_stage[layer]].next

    def _attn_eligible(self, layer: int):
        reqs = self.requests

        def eligible(item: AttnItem) -> bool:
            return reqs[item.rid].kv_next[layer] == item.pos0
        return eligible

    # ------------------------------------------------------------------ decisions: scheduling
    def views(self) -> list[StageView]:
        now = self.clock.now()
        out = []
        for sid, q in enumerate(self.queues):
            oldest = q.oldest_enqueue()
            out.append(StageView(q.depth, q.has_eligible(self._eligible.get(sid)),
                                 now - oldest if oldest is not None else 0.0))
        return out

    def next_batch(self) -> Optional[Batch]:
        """Ask the policy for a stage and assemble its batch (popped from the queue), or None."""
        decision = self.policy.choose(self.views(), self.next_of)
        if decision is None:
            return None
        stage = self.stages[decision.stage]
        items = self.queues[stage.id].take(self._eligible.get(stage.id))
        if not items:
            raise RuntimeError(f"rank {self.rank}: policy {self.policy.name} chose {stage.name}, which has "
                               f"nothing runnable")
        rows = sum(it.n for it in items) if stage.kind == "attn" else len(items)
        now = self.clock.now()
        if self.trace is not None:
            self.trace.decision(self.rank, now, self.policy.name, stage.id, stage.name, decision.scores, rows)
        return Batch(stage, items, rows, now, decision)

    # ------------------------------------------------------------------ batch execution
    def execute(self, batch: Batch) -> None:
        """Run the batch's math on the executor (results kept on the batch; nothing dispatched)."""
        kind = batch.stage.kind
        if kind == "attn":
            self._exec_attn(batch)
        elif kind == "expert":
            x = torch.stack([it.x for it in batch.items])
            batch.out["y"] = self.executor.experts(batch.stage.layer, x, [it.expert for it in batch.items])
        else:
            h = torch.stack([it.h for it in batch.items])
            logits = self.executor.logits(h)
            batch.out["tokens"] = [
                self.executor.sample(logits[i], self.requests[it.rid].params, len(self.requests[it.rid].output))
                for i, it in enumerate(batch.items)]

    def _exec_attn(self, batch: Batch) -> None:
        layer = batch.stage.layer
        items: list[AttnItem] = batch.items
        if layer == 0:
            h = self.executor.embed([t for it in items for t in it.tokens])
        else:
            h = items[0].h if len(items) == 1 else torch.cat([it.h for it in items])
        positions, segments, row = [], [], 0
        for it in items:
            positions.extend(range(it.pos0, it.pos0 + it.n))
            segments.append((it.rid, row, it.n))
            row += it.n
        h_res, x = self.executor.attention(layer, h, positions, segments, self.kv)
        if not self.cfg.expert_rank[layer]:
            batch.out["h_next"] = h_res + self.executor.dense_mlp(layer, x)
        else:
            ids, weights = self.executor.route(layer, x)
            batch.out.update(h_res=h_res, x=x, ids=ids, weights=weights,
                             shared=self.executor.shared_expert(layer, x))

    def complete(self, batch: Batch) -> None:
        """The batch finished (now): record it and dispatch its outputs to their next stages."""
        now = self.clock.now()
        rec = BatchRecord(self.rank, batch.stage.id, batch.stage.kind, batch.stage.layer, batch.rows,
                          batch.t_start, now, max(batch.t_start - it.t_enq for it in batch.items))
        self.metrics.on_batch(rec, (batch.t_start - it.t_enq for it in batch.items))
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
    def _sample_pos(self, req: Request) -> int:
        """The position whose logits give the request's next token."""
        return len(req.prompt) - 1 + len(req.output)

    def _complete_attn(self, batch: Batch) -> None:
        layer = batch.stage.layer
        last = layer == self.cfg.num_layers - 1
        out = batch.out
        moe = "ids" in out
        nxt = batch.stage.next
        sends: dict[int, tuple[list, list]] = {}  # dst -> (row metadata, batch row indices)
        row = 0
        for it in batch.items:
            req = self.requests[it.rid]
            req.kv_next[layer] = it.pos0 + it.n
            lo = row
            row += it.n
            if last:
                # After the last layer only the sampled position matters; the other prompt rows
                # were needed for their K/V only.
                sp = self._sample_pos(req)
                if not it.pos0 <= sp < it.pos0 + it.n:
                    continue
                idx = [lo + sp - it.pos0]
                positions = [sp]
            else:
                idx = list(range(lo, row))
                positions = list(range(it.pos0, it.pos0 + it.n))
            sel = torch.tensor(idx, dtype=torch.long) if len(idx) != it.n else slice(lo, row)
            if not moe:
                self._forward(nxt, it.rid, positions, out["h_next"][sel])
                continue
            shared = out["shared"][sel] if out["shared"] is not None else None
            self.merge.open(it.rid, it.pos0, layer, positions, out["h_res"][sel], shared, out["weights"][sel],
                            batch.t_start)
            ids = out["ids"][sel].tolist()
            ws = out["weights"][sel].tolist()
            for r, (erow, wrow) in enumerate(zip(ids, ws)):
                for slot, (e, w) in enumerate(zip(erow, wrow)):
                    dst = self.cfg.expert_rank[layer][e]
                    meta, rows = sends.setdefault(dst, ([], []))
                    meta.append((it.rid, it.pos0, r, slot, e, w))
                    rows.append(idx[r])
        # One message per destination per batch; destinations in rank order for determinism.
        for dst in sorted(sends):
            meta, rows = sends[dst]
            x = out["x"][torch.tensor(rows, dtype=torch.long)]
            if dst == self.rank:
                self._enqueue_expert_rows(layer, self.rank, meta, x)
            else:
                self.transport.send(dst, {"t": MSG_EXPERT_IN, "layer": layer, "home": self.rank, "rows": meta}, x)

    def _complete_expert(self, batch: Batch) -> None:
        layer = batch.stage.layer
        y = batch.out["y"]
        sends: dict[int, tuple[list, list]] = {}
        for i, it in enumerate(batch.items):
            meta, rows = sends.setdefault(it.home, ([], []))
            meta.append((it.rid, it.pos0, it.row, it.slot))
            rows.append(i)
        for dst in sorted(sends):
            meta, rows = sends[dst]
            part = y[torch.tensor(rows, dtype=torch.long)]
            if dst == self.rank:
                self._merge_rows(layer, meta, part)
            else:
                self.transport.send(dst, {"t": MSG_EXPERT_OUT, "layer": layer, "rows": meta}, part)

    def _complete_sample(self, batch: Batch) -> None:
        now = self.clock.now()
        sid0 = self.attn_stage[0]
        for it, tok in zip(batch.items, batch.out["tokens"]):
            req = self.requests[it.rid]
            req.output.append(tok)
            req.token_times.append(now)
            self.metrics.tokens += 1
            pos = len(req.prompt) + len(req.output) - 1  # where the new token would be written
            if tok in self.cfg.eos_token_ids and not req.ignore_eos:
                self._finish(req, "eos", now)
            elif len(req.output) >= req.max_new_tokens or pos >= self.cfg.max_position:
                self._finish(req, "length", now)
            else:
                self.queues[sid0].push(AttnItem(req.rid, pos, 1, [tok], None, now))

    def _finish(self, req: Request, reason: str, now: float) -> None:
        req.finish_reason, req.t_finish = reason, now
        self.kv.release(req.rid)
        del self.requests[req.rid]
        self.finished.append(req)
