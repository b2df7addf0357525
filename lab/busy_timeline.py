"""When was the GPU busy? The union of a rank's device intervals, and how much of a host span it covers.

The GPU bench reports, per batch kind, the share of the host time "hidden behind GPU work" two ways:

- own work (HostProbe's first definition, NOTES §5): a batch's host time counts as hidden up to the
  device time of that batch's own graphs. A 192-row decode attention batch has ~50-100 us of device
  work, so its 500-900 us of host time can never be more than ~10-20% hidden by this definition.
- any work (the StreamEP paper's: "633.4 us per attention batch, 67.0% hidden behind GPU work, GPU time
  178.4 us", which is more than the batch's own device time could hide): the part of the batch's host
  span during which the GPU was running anything of this rank, e.g. the expert batch queued before it.
  That is what overlap buys: the host prepares batch i+1 while the device runs batch i, and only the
  host time during which the GPU sits idle is exposed.

Device intervals come from CUDA events, host spans from perf_counter; one anchor event recorded on an
idle device at a known host time maps one clock onto the other (error: the launch latency, ~5-10 us).
"""
from __future__ import annotations

from bisect import bisect_right
from typing import Iterable


class BusyTimeline:
    """The union of intervals [start, end) (seconds, any clock), queried for the busy time inside a span."""

    def __init__(self, intervals: Iterable[tuple[float, float]]) -> None:
        starts: list[float] = []
        ends: list[float] = []
        for a, b in sorted(iv for iv in intervals if iv[1] > iv[0]):
            if ends and a <= ends[-1]:        # overlaps or touches the last merged interval
                ends[-1] = max(ends[-1], b)
            else:
                starts.append(a)
                ends.append(b)
        self.starts, self.ends = starts, ends
        self._before = [0.0]                   # busy time before merged interval i
        for a, b in zip(starts, ends):
            self._before.append(self._before[-1] + b - a)

    def busy_before(self, t: float) -> float:
        """Busy time in (-inf, t)."""
        i = bisect_right(self.starts, t) - 1
        if i < 0:
            return 0.0
        return self._before[i] + min(t, self.ends[i]) - self.starts[i]

    def busy(self, a: float, b: float) -> float:
        """Busy time inside [a, b]."""
        return max(0.0, self.busy_before(b) - self.busy_before(a)) if b > a else 0.0
