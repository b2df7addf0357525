"""When requests arrive, and what they ask for: Poisson arrivals or closed-loop concurrency, seeded.

A workload is a list of `RequestSpec`s (id, prompt token ids, max new tokens) plus an arrival
process that releases them to the system:
- `PoissonArrivals`: open loop, exponential inter-arrival gaps at `rate` requests/s. Arrival times
  are fixed up front, so every system in a comparison sees the same offered load at the same times.
- `ClosedLoopArrivals`: `concurrency` requests in flight; a new one is released the moment one
  finishes. Offered load then depends on the system, which is the point (saturation throughput).

Both expose the same three calls, so a driver on the wall clock and one on a virtual clock share the
loop: `release(now)` hands over the requests that are due, `next_arrival()` says when the next one
is due (a virtual clock jumps there), `finished(now)` reports a completion (closed loop refills).

Prompt token ids are sampled uniformly from the vocabulary with a per-request seed, avoiding ids
the caller reserves (EOS, padding) so a random prompt never contains a stop token by accident.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable, Optional, Sequence

import numpy as np

from graph_ir.errors import UserError
from lab.lengths import Lengths, LengthSampler


@dataclass
class RequestSpec:
    """One request as a workload generator emits it; `arrival_time` is None until released."""

    id: str
    prompt_token_ids: list[int]
    max_new_tokens: int
    arrival_time: Optional[float] = None

    def to_json(self) -> dict:
        # Same keys as `dataflow run --prompts FILE.jsonl` lines, plus the arrival time.
        d = {"id": self.id, "prompt_token_ids": list(self.prompt_token_ids), "max_new_tokens": self.max_new_tokens}
        if self.arrival_time is not None:
            d["arrival_time"] = self.arrival_time
        return d


def _allowed_ids(vocab_size: int, reserved: frozenset[int]) -> np.ndarray:
    allowed = np.setdiff1d(np.arange(vocab_size, dtype=np.int64), np.fromiter(reserved, dtype=np.int64))
    if allowed.size == 0:
        raise UserError(f"every token id of the vocabulary ({vocab_size}) is reserved; nothing to sample prompts from")
    return allowed


def _prompt_ids(rng: np.random.Generator, n: int, allowed: np.ndarray) -> list[int]:
    return allowed[rng.integers(0, allowed.size, size=n)].tolist()


def make_requests(lengths: Sequence[Lengths], vocab_size: int, seed: int,
                  reserved_ids: Iterable[int] = (), id_prefix: str = "req") -> list[RequestSpec]:
    """Turn sampled lengths into requests with seeded random prompts.

    Request i's prompt depends only on (seed, i): a child generator per request (numpy SeedSequence
    spawn keys) keeps it stable when the number of requests changes.
    """
    if vocab_size < 1:
        raise UserError(f"vocab_size must be positive, got {vocab_size}")
    reserved = frozenset(int(t) for t in reserved_ids)
    width = max(4, len(str(max(len(lengths) - 1, 0))))
    # Once, not per request: over GPT-OSS's 201k-token vocabulary it took ~0.1-0.3 s a request (session 24's profile).
    allowed = _allowed_ids(vocab_size, reserved) if lengths else None
    out = []
    for i, ln in enumerate(lengths):
        rng = np.random.default_rng(np.random.SeedSequence(seed, spawn_key=(i,)))
        out.append(RequestSpec(f"{id_prefix}-{i:0{width}d}", _prompt_ids(rng, ln.prompt, allowed), ln.output))
    return out


def sample_requests(sampler: LengthSampler, n: int, vocab_size: int, seed: int,
                    reserved_ids: Iterable[int] = ()) -> list[RequestSpec]:
    """Lengths from `sampler` and prompts from the vocabulary, both from one seed."""
    # Separate streams for lengths and prompt ids, so swapping the length distribution does not
    # change which token ids a same-length prompt gets.
    ss = np.random.SeedSequence(seed)
    len_seed, ids_seed = (int(s.generate_state(1)[0]) for s in ss.spawn(2))
    return make_requests(sampler.sample(n, len_seed), vocab_size, ids_seed, reserved_ids)


class PoissonArrivals:
    """Open loop: request i arrives at t0 + sum of i exponential gaps with mean 1/rate."""

    def __init__(self, requests: Sequence[RequestSpec], rate: float, seed: int, t0: float = 0.0):
        if not (rate > 0 and math.isfinite(rate)):
            raise UserError(f"arrival rate must be a positive number of requests/s, got {rate}")
        gaps = np.random.default_rng(seed).exponential(1.0 / rate, size=len(requests))
        # The first request arrives at t0 itself: a run should not start with an idle gap.
        gaps[:1] = 0.0
        times = t0 + np.cumsum(gaps)
        self._pending = [RequestSpec(r.id, r.prompt_token_ids, r.max_new_tokens, float(t)) for r, t in zip(requests, times)]
        self._next = 0

    def release(self, now: float) -> list[RequestSpec]:
        start = self._next
        while self._next < len(self._pending) and self._pending[self._next].arrival_time <= now:
            self._next += 1
        return self._pending[start:self._next]

    def next_arrival(self) -> Optional[float]:
        return self._pending[self._next].arrival_time if self._next < len(self._pending) else None

    def finished(self, now: float) -> None:
        del now  # open loop: completions do not change the schedule

    def done(self) -> bool:
        return self._next >= len(self._pending)

    @property
    def total(self) -> int:
        return len(self._pending)


@dataclass
class ClosedLoopArrivals:
    """Closed loop: keep `concurrency` requests in flight; each completion releases the next one."""

    requests: Sequence[RequestSpec]
    concurrency: int
    _next: int = field(default=0, init=False)
    _credits: int = field(default=0, init=False)

    def __post_init__(self) -> None:
        if self.concurrency < 1:
            raise UserError(f"concurrency must be at least 1, got {self.concurrency}")
        self._credits = self.concurrency

    def release(self, now: float) -> list[RequestSpec]:
        n = min(self._credits, len(self.requests) - self._next)
        out = [RequestSpec(r.id, r.prompt_token_ids, r.max_new_tokens, now) for r in self.requests[self._next:self._next + n]]
        self._next += n
        self._credits -= n
        return out

    def next_arrival(self) -> Optional[float]:
        # Closed-loop arrivals are caused by completions, not by time: nothing to jump to.
        return None

    def finished(self, now: float) -> None:
        del now
        self._credits += 1

    def done(self) -> bool:
        return self._next >= len(self.requests)

    @property
    def total(self) -> int:
        return len(self.requests)


ArrivalProcess = PoissonArrivals | ClosedLoopArrivals
