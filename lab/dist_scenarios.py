"""The interference of the distributed EP bench (benchmarks/gpu_ep_bench.py), switched per workload by its scenario.

Link delay bursts (BurstDelays): a barrier rank sleeps, before each dispatch and each combine collective,
the largest burst delay currently on a link to or from it; the streaming engine gets the same
schedule through the transport's chaos hook (lanes of the chosen direction), on the same wall clock.
The burst's size is the workload's scenario's (delay_of_scenario): `delay` = the BurstDelays' own
extra_us, `delay-<N>ms` = N ms (e.g. delay-5ms, delay-0.5ms), same period and duty.

Hogs (lab/hogs.py) are started by rank 0 before a workload that asks for one and stopped after it.
"""
from __future__ import annotations

import re
import time
from typing import TYPE_CHECKING, Optional

from lab.dist_job import say

if TYPE_CHECKING:
    from lab.dist_job import DistJob, Workload

# What scenario is on in this process (set per workload; read by BurstDelays lanes in transport threads).
# "delay": the burst's extra seconds of the running workload's scenario (0.0: no delay scenario).
ACTIVE: dict = {"delay": 0.0}

_DELAY_MS = re.compile(r"delay-(\d+(?:\.\d+)?)ms")


def delay_of_scenario(name: str, default_us: float) -> Optional[float]:
    """Extra seconds per burst of a delay scenario: `delay` -> default_us (the CLI's --burst-us),
    `delay-<N>ms` -> N ms (N > 0, e.g. delay-5ms, delay-10ms, delay-0.5ms); None for any other name
    (clean, the hogs, delay-0ms, delay-5us, ...)."""
    if name == "delay":
        return float(default_us) * 1e-6
    m = _DELAY_MS.fullmatch(name)
    if m is None:
        return None
    ms = float(m.group(1))
    return ms * 1e-3 if ms > 0 else None



class BurstDelays:
    """On/off link delay bursts on the wall clock (time.time() since `epoch`: one clock for every
    process of the host), on only while a workload of a delay scenario runs in this process, with
    that scenario's size (ACTIVE["delay"], set by scenario_on from delay_of_scenario; `extra_us` is
    plain `delay`'s size).
    - `lane(direction, me, peer)`: the streaming transport's chaos hook (ZmqDistTransport); lanes of
      `directions` get the burst delay of the link (me -> peer for send, peer -> me for recv).
    - `collective(me, world)`: the barrier baselines' host-side stall before a collective: the largest
      delay on any link to or from `me` right now (a collective ends with its slowest message)."""

    def __init__(self, period_ms: float = 20.0, duty: float = 0.3, extra_us: float = 2000.0,
                 links: Optional[list] = None, directions: tuple = ("recv",), epoch: Optional[float] = None) -> None:
        self.period_s, self.duty, self.extra_s = period_ms * 1e-3, duty, extra_us * 1e-6
        self.links = None if links is None else {(int(a), int(b)) for a, b in links}
        self.directions = tuple(directions)
        self.epoch = time.time() if epoch is None else epoch

    def delay(self, src: int, dst: int) -> float:
        extra = ACTIVE["delay"]
        if not extra or src == dst:
            return 0.0
        if self.links is not None and (src, dst) not in self.links:
            return 0.0
        t = time.time() - self.epoch
        return extra if (t % self.period_s) < self.duty * self.period_s else 0.0

    def lane(self, direction: str, me: int, peer: int):
        if direction not in self.directions:
            return lambda: 0.0
        if direction == "send":
            return lambda: self.delay(me, peer)
        return lambda: self.delay(peer, me)

    def collective(self, me: int, world: int) -> float:
        return max([0.0] + [max(self.delay(p, me), self.delay(me, p)) for p in range(world) if p != me])


def scenario_on(job: DistJob, w: Workload, hogs_state: dict, rank: int) -> None:
    """Switch interference to workload `w`'s scenario (the burst size here, 0.0 = off; hogs from rank 0)."""
    default_us = job.delays.extra_s * 1e6 if job.delays is not None else 0.0
    ACTIVE["delay"] = delay_of_scenario(w.scenario, default_us) or 0.0
    if rank != 0:
        return
    say(job, f"start {w.name} ({len(w.requests)} requests, {w.kv_blocks} KV blocks per rank)")
    want = job.hogs.get(w.scenario)
    cur = hogs_state.get("hog")
    if cur is not None and hogs_state.get("scenario") != w.scenario:
        hogs_state["log"].append(cur.stop())
        hogs_state["hog"] = None
    if want is not None and hogs_state.get("hog") is None:
        from lab.hogs import Hog
        hogs_state["hog"] = Hog(**want).start()
        hogs_state["scenario"] = w.scenario
        say(job, f"{want['kind']} hog started (pid {hogs_state['hog'].proc.pid})")


def hogs_off(hogs_state: dict) -> None:
    if hogs_state.get("hog") is not None:
        hogs_state["log"].append(hogs_state["hog"].stop())
        hogs_state["hog"] = None
