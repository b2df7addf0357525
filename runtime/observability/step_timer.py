"""Wall time per step of a repeated code path, for finding where a hot path's host time goes on a machine
where a sampling profiler's line numbers cannot be trusted (py-spy on Python 3.12 misattributes lines). Disabled (the
default), start/lap do nothing, so the hot path calls them unconditionally. Enabled, memory stays flat: counts and
sums are totals, the median is over the latest SAMPLES laps of each step."""
from __future__ import annotations

import time
from collections import deque

SAMPLES = 4096


class StepTimer:
    """Mean us per named step over all calls, median over the latest SAMPLES: start(), then lap("step") after each."""

    def __init__(self, name: str, enabled: bool) -> None:
        self.name, self.enabled, self.t0, self.steps = name, enabled, 0.0, {}
        self.totals: dict[str, list] = {}  # step -> [laps, seconds]

    def start(self) -> None:
        if self.enabled:
            self.t0 = time.perf_counter()

    def lap(self, step: str) -> None:
        if self.enabled:
            now = time.perf_counter()
            dt = now - self.t0
            if step not in self.steps:
                self.steps[step], self.totals[step] = deque(maxlen=SAMPLES), [0, 0.0]
            self.steps[step].append(dt)
            tot = self.totals[step]
            tot[0] += 1
            tot[1] += dt
            self.t0 = now

    def report(self) -> str:
        rows = [f"{k}: n {self.totals[k][0]} median {sorted(v)[len(v) // 2] * 1e6:.1f} us mean "
                f"{self.totals[k][1] / self.totals[k][0] * 1e6:.1f} us" for k, v in self.steps.items() if v]
        return f"{self.name}: " + "; ".join(rows)
