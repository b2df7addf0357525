"""Wall time per step of a repeated code path, for finding where a hot path's host time goes on a machine
where a sampling profiler's line numbers cannot be trusted (py-spy on Python 3.12, run 37). Disabled (the
default), start/lap do nothing, so the hot path calls them unconditionally."""
from __future__ import annotations

import time


class StepTimer:
    """Median and mean us per named step over all calls: start(), then lap("step") after each step."""

    def __init__(self, name: str, enabled: bool) -> None:
        self.name, self.enabled, self.t0, self.steps = name, enabled, 0.0, {}

    def start(self) -> None:
        if self.enabled:
            self.t0 = time.perf_counter()

    def lap(self, step: str) -> None:
        if self.enabled:
            now = time.perf_counter()
            self.steps.setdefault(step, []).append(now - self.t0)
            self.t0 = now

    def report(self) -> str:
        rows = [f"{k}: n {len(v)} median {sorted(v)[len(v) // 2] * 1e6:.1f} us mean {sum(v) / len(v) * 1e6:.1f} us"
                for k, v in self.steps.items() if v]
        return f"{self.name}: " + "; ".join(rows)
