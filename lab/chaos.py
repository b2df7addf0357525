"""Seeded random per-message delays for chaos tests (the transport's LinkDelays hook, runtime/transport/base.py):
timing changes, content and per-peer order don't. And WedgeAfter: a rank's serving loop stopped for good (the
failure-detection tests), through RunOptions.engine_setup.

Each lane (direction and peer) draws from its own RNG seeded by (seed, direction, peer), so a run is
reproducible message by message regardless of how threads interleave. The transports apply the delay
after the message completed and before it is handed on, inside the lane, so FIFO per peer holds.
"""
from __future__ import annotations

import random
import threading
from dataclasses import dataclass
from typing import Callable, Optional


class ChaosDelays:
    def __init__(self, seed: int, max_delay_s: float = 0.005, probability: float = 0.5,
                 peers: Optional[set[int]] = None, directions: tuple[str, ...] = ("send", "recv")):
        """`peers`/`directions` restrict the delays to some lanes (e.g. one slow link: peers={2},
        directions=("send",)); by default every lane is delayed."""
        self.seed = seed
        self.peers = peers
        self.directions = directions
        self.max_delay_s = max_delay_s
        self.probability = probability

    def lane(self, direction: str, me: int, peer: int) -> Callable[[], float]:
        rng = random.Random(f"{self.seed}/{direction}/{me}/{peer}")
        if direction not in self.directions or (self.peers is not None and peer not in self.peers):
            return lambda: 0.0

        def draw() -> float:
            if rng.random() >= self.probability:
                return 0.0
            return rng.uniform(0.0, self.max_delay_s)
        return draw


@dataclass(frozen=True)
class WedgeAfter:
    """Fault injection through RunOptions.engine_setup (picklable: it reaches the rank processes): rank `rank`'s
    serving loop stops for good in the first batch after it sampled `tokens` tokens, with the GIL released and its
    heartbeat thread alive (a wedged main thread)."""
    rank: int
    tokens: int

    def __call__(self, engine) -> None:
        if engine.rank != self.rank:
            return
        execute = engine.execute

        def wedged(batch):
            if engine.metrics.tokens >= self.tokens:
                threading.Event().wait()
            execute(batch)
        engine.execute = wedged
