"""Run metrics: per-rank batch totals and queueing delays, summarized per run.

Queueing delay of an item = start of the batch that ran it - when it entered that mu-queue (one
stage's wait, the quantity the aging policy bounds). Batch size is counted in rows: tokens for
attention and sample batches, routed (token, expert) rows for expert batches.

Memory stays flat however long a rank serves: every summary figure comes from running totals
(`RankMetrics.kinds`, the queueing-delay sums, `RequestStats`), and the per-batch records
(`RankMetrics.batches`) keep only the latest `batch_log` to 2 x `batch_log` batches (None: keep all, for
benches that study a finite run batch by batch; the engine's default is BATCH_LOG).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional

BATCH_LOG = 2048  # batch records an engine keeps (the most recent; RunOptions.batch_log)


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
    # The latest batch records: at least the last `batch_log` and at most twice that (trimmed in one go when it
    # doubles; every one when batch_log is None). A plain list, so the report crosses the wire as plain values.
    # Totals over every batch: `kinds`.
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
    # Every batch of the run, per kind: [batches, rows, busy seconds] (what summarize reads; exact however long it ran).
    kinds: dict = field(default_factory=dict)
    batch_log: Optional[int] = None  # None: keep every record (finite studies); an engine passes BATCH_LOG

    def __post_init__(self) -> None:
        for b in self.batches if not self.kinds else ():  # records given at construction count in the totals
            self._count(b)

    def _count(self, rec: BatchRecord) -> None:
        k = self.kinds.get(rec.kind)
        if k is None:
            k = self.kinds[rec.kind] = [0, 0, 0.0]
        k[0] += 1
        k[1] += rec.rows
        k[2] += rec.t_end - rec.t_start

    @property
    def batch_count(self) -> int:
        return sum(k[0] for k in self.kinds.values())

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
        self._count(rec)
        if self.batch_log is not None and len(self.batches) > 2 * self.batch_log:
            del self.batches[:len(self.batches) - self.batch_log]


def _pct(sorted_vals: list[float], p: float) -> float:
    if not sorted_vals:
        return 0.0
    i = min(len(sorted_vals) - 1, max(0, round(p / 100 * (len(sorted_vals) - 1))))
    return sorted_vals[i]


class RequestStats:
    """Totals over finished requests: how many, tokens, inter-token latencies (ITL: gaps between a request's
    consecutive tokens). exact=True keeps every gap (exact percentiles; memory grows with the tokens);
    exact=False keeps a histogram of 1%-wide log bins instead (p99 within 1% of the exact one, max and mean exact,
    memory bounded however many requests finish; a coordinator that drops finished outputs uses it)."""

    _BIN = math.log(1.01)

    def __init__(self, exact: bool = True) -> None:
        self.finished = 0
        self.tokens = 0
        self.itl_n = 0
        self.itl_sum = 0.0
        self.itl_max = 0.0
        self._itl: Optional[list[float]] = [] if exact else None
        self._hist: dict[int, int] = {}  # bin -> gaps (exact=False); bin None-like -10**9 for gaps <= 0

    @classmethod
    def of(cls, requests: Iterable) -> "RequestStats":
        st = cls()
        for r in requests:
            st.add(r)
        return st

    def add(self, req) -> None:
        """Count `req` (its tokens count whether or not it finished; only finished ones count as finished)."""
        self.finished += 1 if req.done else 0
        self.tokens += len(req.output)
        tt = req.token_times
        for a, b in zip(tt, tt[1:]):
            g = b - a
            self.itl_n += 1
            self.itl_sum += g
            if g > self.itl_max:
                self.itl_max = g
            if self._itl is not None:
                self._itl.append(g)
            else:
                k = math.floor(math.log(g) / self._BIN) if g > 0 else -10 ** 9
                self._hist[k] = self._hist.get(k, 0) + 1

    def itl_pct(self, p: float) -> float:
        if self._itl is not None:
            return _pct(sorted(self._itl), p)
        if not self.itl_n:
            return 0.0
        want = min(self.itl_n - 1, max(0, round(p / 100 * (self.itl_n - 1))))
        seen = 0
        for k in sorted(self._hist):
            seen += self._hist[k]
            if seen > want:
                return 0.0 if k == -10 ** 9 else min(math.exp((k + 1) * self._BIN), self.itl_max)
        return self.itl_max


def summarize(requests: list, ranks: list[RankMetrics], elapsed: float, stats: Optional[RequestStats] = None) -> dict:
    """One flat dict: what `dataflow run` prints and tests assert on. `stats`: the finished requests' totals when
    the caller kept them as it went (default: computed from `requests`, exact)."""
    st = stats if stats is not None else RequestStats.of(requests)
    tokens = st.tokens
    out = {"requests": len(requests), "finished": st.finished,
           "tokens": tokens, "elapsed_s": elapsed, "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0}
    for kind in ("attn", "expert", "sample"):
        n = sum(m.kinds.get(kind, (0, 0, 0.0))[0] for m in ranks)
        rows = sum(m.kinds.get(kind, (0, 0, 0.0))[1] for m in ranks)
        out[f"{kind}_batches"] = n
        out[f"{kind}_mean_batch"] = rows / n if n else 0.0
    out["batches"] = sum(m.batch_count for m in ranks)
    out["attn_small_remainders"] = sum(m.attn_small_remainders for m in ranks)
    out["attn_capped_decode"] = sum(m.attn_capped_decode for m in ranks)
    out["prompt_yields"] = sum(m.prompt_yields for m in ranks)
    items = sum(m.queued_items for m in ranks)
    out["max_queue_delay_s"] = max((m.max_queue_delay for m in ranks), default=0.0)
    out["mean_queue_delay_s"] = sum(m.queue_delay_sum for m in ranks) / items if items else 0.0
    out["mean_itl_s"] = st.itl_sum / st.itl_n if st.itl_n else 0.0
    out["p99_itl_s"] = st.itl_pct(99)
    out["max_itl_s"] = st.itl_max
    busy = [sum(k[2] for k in m.kinds.values()) for m in ranks]
    out["busy_fraction"] = [x / elapsed if elapsed > 0 else 0.0 for x in busy]
    return out
