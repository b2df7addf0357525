"""Which batch a rank runs next: the policy's view of every stage, its decision, and the engine's one guard on it.

Part of the Engine (runtime/core/engine.py), which holds the state read here: the queues, the stages, the live
requests, the policy, the merge table and the wave announcements. The policy (runtime/core/scheduler.py) scores
stages; this part shows it the stages (`views`: depth, runnable, the oldest item's wait, and for the wave hold the
tokens on their way), takes the batch it chose, and overrides one kind of choice: a batch of prompt rows alone when
decode rows somewhere have waited `decode_wait_bound` (`_decode_overdue`).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

from runtime.core.queues import AttnItem
from runtime.core.scheduler import HOLD, StageView, StageViews

if TYPE_CHECKING:
    from runtime.core.engine import StageInfo


@dataclass(slots=True)
class Batch:
    """A stage's batch from its choice to its completion: the items taken from the queue, and what the executor
    returned for them (`out`)."""

    stage: "StageInfo"
    items: list
    rows: int
    t_start: float
    out: dict = field(default_factory=dict)  # executor results, filled by execute()


class BatchChoice:
    """The Engine's scheduling decisions (module docstring)."""

    def views(self) -> StageViews:
        """One StageView per stage for the policy. Most stages are empty at any moment: they share one
        read-only view (Engine._no_views), and only the non-empty ones (the queues' shared `_active` set) are visited;
        `incoming` (the wave hold's) is computed only where the policy reads it, on runnable stages."""
        if not self._active:  # every stage empty (a quarter of the decisions in a 1-request-per-rank simulation)
            return self._no_views  # (read-only, as every view in it: a policy keeps `depths`, never writes it)
        now, hold, queues, chunked = self.clock.now(), self.policy.hold_fill > 0, self.queues, self._chunked
        out, depths, runnable, active = StageViews(self._no_views), self._no_views.depths.copy(), [], sorted(self._active)
        for sid in active:  # (a non-empty queue has rows: without a chunked prompt in flight it is runnable)
            q = queues[sid]
            d = depths[sid] = q.rows * q.token_weight  # (MuQueue.depth)
            v = out[sid] = StageView(d, not chunked or q.has_eligible(self._eligible.get(sid)), now - q.oldest_enqueue())
            if v.runnable:
                runnable.append(sid)
                if hold:
                    v.incoming = self._incoming(sid)
        out.depths, out.runnable, out.active = depths, runnable, active
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
            return self.queues[self.sample_stage].depth + self.merge.open_rows(last)
        return float(self.merge.open_rows(st.layer - 1))

    def _decode_overdue(self, views: StageViews) -> Optional[int]:
        """The stage to run instead of the chosen batch, which would hold prompt rows alone (next_batch asks only
        then: decode-only serving never does): the runnable stage whose decode rows have waited longest, if that is at
        least `decode_wait_bound` (else None).

        Why: a policy that scores queue depth (defrag) sweeps the prompts queued at a layer before the decode wave
        behind them moves on (ITL p99 0.5-1.1 s on the H200 with 2-8k-token prompts arriving;
        benchmarks/prefill_flood_sim.py). With the guard a token waits at most about the bound per stage (2 x
        layers + 1 stages) behind prompts. Decode-only serving never picks a prompt-only batch, so it decides as
        the policy does."""
        now, best, best_wait = self.clock.now(), None, self.decode_wait_bound
        for sid in views.runnable:
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
        if stage.kind != "sample" and self.decode_wait_bound and not q.has_eligible_decode(self._eligibility(stage.id)):
            overdue = self._decode_overdue(views)
            if overdue is not None:  # (the trace shows the policy's scores with the stage that ran)
                stage, q = self.stages[overdue], self.queues[overdue]
                self.metrics.prompt_yields += 1
        items = q.take(self._eligibility(stage.id))
        tm.lap("take")
        if not items:
            raise RuntimeError(f"rank {self.rank}: policy {self.policy.name} chose {stage.name}, which has nothing runnable")
        rows = items[0].n if len(items) == 1 else sum(it.n for it in items)
        if stage.kind == "attn" and rows >= stage.cap and q.rows:  # the cap cut a wave
            if q.rows < stage.cap // 4:
                self.metrics.attn_small_remainders += 1
            if sum(it.segments for it in items) == rows:  # decode rows only (prefill chunks fill the cap by design)
                self.metrics.attn_capped_decode += 1
        now = self.clock.now()
        if self.trace is not None:
            self.trace.decision(self.rank, now, self.policy.name, stage.id, stage.name, decision.scores, rows)
        batch = Batch(stage, items, rows, now)
        tm.lap("batch")
        return batch

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
