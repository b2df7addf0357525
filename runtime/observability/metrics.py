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
    # as several waves per layer (each wave costs a batch's host work per layer, so many of them slow every decode).
    attn_capped_decode: int = 0
    # Decisions where a batch of prompt chunks alone gave way to overdue decode rows (Engine._decode_overdue).
    prompt_yields: int = 0
    # Every batch of the run, per kind: [batches, rows, busy seconds] (what summarize reads; exact however long it ran).
    kinds: dict = field(default_factory=dict)
    batch_log: Optional[int] = None  # None: keep every record (finite studies); an engine passes BATCH_LOG

    @property
    def batch_count(self) -> int:
        return sum(k[0] for k in self.kinds.values())

    def on_batch(self, rec: BatchRecord, waits: Iterable[float], counts: Iterable[int] = ()) -> None:
        """`waits[i]`: queueing delay of item i; `counts[i]`: how many rows it stands for (a block of expert or
        sample rows counts every row, as if queued one by one). A batch without queued items (the lab's barrier
        baselines) passes neither."""
        for w, c in zip(waits, counts):
            self.queue_delay_sum += w * c
            self.queued_items += c
            if w > self.max_queue_delay:
                self.max_queue_delay = w
        self.batches.append(rec)
        k = self.kinds.setdefault(rec.kind, [0, 0, 0.0])
        k[0] += 1
        k[1] += rec.rows
        k[2] += rec.t_end - rec.t_start
        if self.batch_log is not None and len(self.batches) > 2 * self.batch_log:
            del self.batches[:len(self.batches) - self.batch_log]


def _rank(n: int, p: float) -> int:
    """The index of percentile `p` among `n` sorted samples (n > 0)."""
    return min(n - 1, max(0, round(p / 100 * (n - 1))))


def _pct(sorted_vals: list[float], p: float) -> float:
    return sorted_vals[_rank(len(sorted_vals), p)] if sorted_vals else 0.0


class Distribution:
    """Samples of one latency (seconds): count, sum and max exactly, and either every sample (exact=True: exact
    percentiles, memory grows with the samples) or a histogram of 1%-wide log bins (exact=False: percentiles within
    1% of the exact ones, memory bounded however many samples come)."""

    _BIN = math.log(1.01)
    _ZERO = -10 ** 9  # the bin of samples <= 0

    def __init__(self, exact: bool = True) -> None:
        self.n = 0
        self.sum = 0.0
        self.max = 0.0
        self._all: Optional[list[float]] = [] if exact else None
        self._hist: dict[int, int] = {}

    def add(self, x: float) -> None:
        self.n += 1
        self.sum += x
        if x > self.max:
            self.max = x
        if self._all is not None:
            self._all.append(x)
        else:
            k = math.floor(math.log(x) / self._BIN) if x > 0 else self._ZERO
            self._hist[k] = self._hist.get(k, 0) + 1

    @property
    def mean(self) -> float:
        return self.sum / self.n if self.n else 0.0

    def pct(self, p: float) -> float:
        if self._all is not None:
            return _pct(sorted(self._all), p)
        if not self.n:
            return 0.0
        want = _rank(self.n, p)
        seen = 0
        for k in sorted(self._hist):
            seen += self._hist[k]
            if seen > want:
                return 0.0 if k == self._ZERO else min(math.exp((k + 1) * self._BIN), self.max)
        return self.max


def request_timings(req) -> dict:
    """One request's latencies, on the run's clock: time to first token (from its arrival, queueing for KV
    included), time per output token after the first (TPOT), and its inter-token latencies' median and p99.
    None where a request has too few tokens for it."""
    tt = req.token_times
    gaps = sorted(b - a for a, b in zip(tt, tt[1:]))
    return {"ttft_s": tt[0] - req.arrival if tt else None,
            "tpot_s": (tt[-1] - tt[0]) / (len(tt) - 1) if len(tt) > 1 else None,
            "itl_p50_s": _pct(gaps, 50) if gaps else None, "itl_p99_s": _pct(gaps, 99) if gaps else None}


class RequestStats:
    """Totals over finished requests: how many, tokens, and the distributions of inter-token latency (ITL: gaps
    between a request's consecutive tokens), time to first token (TTFT) and time per output token (TPOT, one sample
    per request). exact=False keeps histograms (Distribution): a coordinator that drops finished outputs uses it."""

    def __init__(self, exact: bool = True) -> None:
        self.finished = 0
        self.tokens = 0
        self.itl = Distribution(exact)
        self.ttft = Distribution(exact)
        self.tpot = Distribution(exact)

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
            self.itl.add(b - a)
        if tt:
            self.ttft.add(tt[0] - req.arrival)
        if len(tt) > 1:
            self.tpot.add((tt[-1] - tt[0]) / (len(tt) - 1))


def summarize(requests: list, per_rank: list[RankMetrics], elapsed: float, stats: Optional[RequestStats] = None,
              **run) -> dict:
    """One flat dict: what `dataflow run` prints and tests assert on. `stats`: the finished requests' totals when
    the caller kept them as it went (default: computed from `requests`, exact). `run`: the driver's own entries
    (policy, ranks, dispatch, messages, ...), added as they are."""
    st = stats if stats is not None else RequestStats.of(requests)
    tokens = st.tokens
    out = {"requests": len(requests), "finished": st.finished,
           "tokens": tokens, "elapsed_s": elapsed, "tokens_per_s": tokens / elapsed if elapsed > 0 else 0.0}
    for kind in ("attn", "expert", "sample"):
        n, rows = (sum(m.kinds.get(kind, (0, 0, 0.0))[i] for m in per_rank) for i in (0, 1))
        out[f"{kind}_batches"] = n
        out[f"{kind}_mean_batch"] = rows / n if n else 0.0
    out["batches"] = sum(m.batch_count for m in per_rank)
    for name in ("attn_small_remainders", "attn_capped_decode", "prompt_yields"):
        out[name] = sum(getattr(m, name) for m in per_rank)
    items = sum(m.queued_items for m in per_rank)
    out["max_queue_delay_s"] = max((m.max_queue_delay for m in per_rank), default=0.0)
    out["mean_queue_delay_s"] = sum(m.queue_delay_sum for m in per_rank) / items if items else 0.0
    out["max_itl_s"] = st.itl.max
    for name, dist in (("itl", st.itl), ("ttft", st.ttft), ("tpot", st.tpot)):
        out[f"mean_{name}_s"] = dist.mean
        out[f"p50_{name}_s"] = dist.pct(50)
        out[f"p99_{name}_s"] = dist.pct(99)
    busy = [sum(k[2] for k in m.kinds.values()) for m in per_rank]
    out["busy_fraction"] = [x / elapsed if elapsed > 0 else 0.0 for x in busy]
    out.update(run)
    return out
