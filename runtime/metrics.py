"""Run metrics: per-rank batch records and queueing delays, summarized per run.

Queueing delay of an item = start of the batch that ran it - when it entered that mu-queue (one
stage's wait, the quantity the aging policy bounds). Batch size is counted in rows: tokens for
attention and sample batches, routed (token, expert) rows for expert batches.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Iterable, Optional


@dataclass(slots=True)
class BatchRecord:
    rank: int
    stage: int
    kind: str
    layer: int
    rows: int
    t_start: float
    t_end: float
    max_wait: float


@dataclass
class RankMetrics:
    rank: int
    batches: list[BatchRecord] = field(default_factory=list)
    max_queue_delay: float = 0.0
    queue_delay_sum: float = 0.0
    queued_items: int = 0
    tokens: int = 0  # tokens sampled by this rank (requests homed here)
    # Attention batches the cap cut while less than a quarter of a batch stayed queued: a tiny second wave
    # that then runs through every layer on its own (a rank serving a few more decodes than the cap).
    attn_small_remainders: int = 0
    # Decode attention batches (one-row segments only) the cap cut with rows still queued: the rank ran its decodes
    # as several waves per layer (each wave costs a batch's host work per layer; benchmarks/NOTES.md §29 item 6).
    attn_capped_decode: int = 0
    # Decisions where a batch of prompt chunks alone gave way to overdue decode rows (Engine._decode_overdue).
    prompt_yields: int = 0

    def on_batch(self, rec: BatchRecord, waits: Iterable[float], counts: Optional[Iterable[int]] = None) -> None:
        """`waits[i]`: queueing delay of item i; `counts[i]`: how many rows it stands for (1 each when
        None; a block of expert or sample rows counts every row, as if queued one by one)."""
        if counts is None:
            for w in waits:
                self.queue_delay_sum += w
                self.queued_items += 1
                if w > self.max_queue_delay:
                    self.max_queue_delay = w
        else:
            for w, c in zip(waits, counts):
                self.queue_delay_sum += w * c
                self.queued_items += c
                if w > self.max_queue_delay:
                    self.max_queue_delay = w
        self.batches.append(rec)


def _pct(sorted_vals: list[float], p: float) -> float:
    if not sorted_vals:
        return 0.0
    i = min(len(sorted_vals) - 1, max(0, round(p / 100 * (len(sorted_vals) - 1))))
    return sorted_vals[i]


def summarize(requests: list, ranks: list[RankMetrics], elapsed: float) -> dict:
    """One flat dict: what `dataflow run` prints and tests assert on."""
    tokens = sum(len(r.output) for r in requests)
    out = {"requests": len(requests), "finished": sum(1 for r in requests if r.done),
           "tokens": tokens, "elapsed_s": elapsed, "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0}
    for kind in ("attn", "expert", "sample"):
        recs = [b for m in ranks for b in m.batches if b.kind == kind]
        out[f"{kind}_batches"] = len(recs)
        out[f"{kind}_mean_batch"] = sum(b.rows for b in recs) / len(recs) if recs else 0.0
    out["batches"] = sum(len(m.batches) for m in ranks)
    out["attn_small_remainders"] = sum(m.attn_small_remainders for m in ranks)
    out["attn_capped_decode"] = sum(m.attn_capped_decode for m in ranks)
    out["prompt_yields"] = sum(m.prompt_yields for m in ranks)
    items = sum(m.queued_items for m in ranks)
    out["max_queue_delay_s"] = max((m.max_queue_delay for m in ranks), default=0.0)
    out["mean_queue_delay_s"] = sum(m.queue_delay_sum for m in ranks) / items if items else 0.0
    itl = sorted(b - a for r in requests for a, b in zip(r.token_times, r.token_times[1:]))
    out["mean_itl_s"] = sum(itl) / len(itl) if itl else 0.0
    out["p99_itl_s"] = _pct(itl, 99)
    out["max_itl_s"] = itl[-1] if itl else 0.0
    busy = [sum(b.t_end - b.t_start for b in m.batches) for m in ranks]
    out["busy_fraction"] = [x / elapsed if elapsed > 0 else 0.0 for x in busy]
    return out
