"""Time for the engine comes from a clock adapter, never from `time` directly.

The engine only reads `now()`. The wall clock serves real runs; the virtual clock is advanced by an
event-heap driver (the simulator and the deterministic tests), so the very same engine and scheduler
code can be timed by a cost model instead of the machine it happens to run on.
"""
from __future__ import annotations

import time


class WallClock:
    """Seconds since construction, from the monotonic high-resolution counter."""

    def __init__(self) -> None:
        self._t0 = time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() - self._t0


class VirtualClock:
    """Time that moves only when the driver says so; forward only, but for `at`."""

    def __init__(self, start: float = 0.0) -> None:
        self._now = float(start)

    def now(self) -> float:
        return self._now

    def advance_to(self, t: float) -> None:
        if t < self._now:
            raise ValueError(f"virtual clock cannot go back from {self._now} to {t}")
        self._now = float(t)

    def at(self, t: float) -> None:
        """Set the time, back too: a split simulation completes a window's batches at their own end times ahead of
        the window's other events, then comes back (runtime/drivers/partitions.py)."""
        self._now = float(t)
