"""Opt-in profiling of a rank's serving loop (the profile_ranks option): cProfile, per-phase wall times of the loop and
an optional torch.profiler window. Off by default; the serving loop times nothing unless asked."""
from __future__ import annotations

import os
import time
from typing import Optional

from runtime import settings


def profile_wanted(rank: int) -> bool:
    want = settings.current().profile_ranks  # (validated: "all" or a comma list of ranks)
    return want is not None and (want == "all" or rank in {int(x) for x in want.split(",")})


def profiled(node):  # runtime.drivers.rank_node.RankNode
    """Opt-in (off by default): the profile_ranks option (a rank, a comma list, or "all") runs that
    rank's serve() under cProfile and writes the stats to the profile_out option's path (default
    dataflow-rank{rank}.prof in the working directory; "{rank}" in the name is replaced), plus
    the serving loop's wall time per phase (poll, idle wait, wave-hold wait, tick, next_batch, execute,
    complete, finish notices) per iteration to the same name + ".phases.txt".
    profile_cprofile=false: the phase times only (no cProfile overhead in them).
    profile_torch=START:COUNT: also a torch.profiler trace (host ops, CUDA runtime calls, device
    kernels) of batches START .. START+COUNT-1 of the process (warm-up workload included), written to
    the same name + ".trace.json" (chrome://tracing / Perfetto)."""
    import cProfile
    import pstats
    options = settings.current()
    path = options.profile_out.replace("{rank}", str(node.rank))
    os.makedirs(os.path.dirname(path) or ".", exist_ok=True)
    node.phases = PhaseTimes()
    if options.profile_torch:  # (validated: START:COUNT)
        start, count = (int(x) for x in options.profile_torch.split(":"))
        node.phases.trace = TraceWindow(start, count, path + ".trace.json")
    # Nested inside complete/feed/finish (not part of the loop's sum): every send, data or control. Wrapped here,
    # once per process: a wrapper added per workload would count each send once per workload so far.
    node.transport.send = timed(node.phases, "(send)", node.transport.send)
    prof = cProfile.Profile() if options.profile_cprofile else None
    try:
        return prof.runcall(node.serve) if prof is not None else node.serve()
    finally:
        if node.phases.trace is not None:
            node.phases.trace.close()  # a window the run ended inside of
        with open(path + ".phases.txt", "w") as f:
            f.write(node.phases.report(node.rank))
            if prof is not None:
                prof.dump_stats(path)
                f.write("\n")
                pstats.Stats(prof, stream=f).sort_stats("tottime").print_stats(40)


def timed(ph: "PhaseTimes", name: str, fn, by_kind: bool = False):
    """`fn` timed into `ph` under `name` (by_kind: name:attn / :expert / :sample of its batch argument)."""
    if fn is None:
        return None

    def timed(*args):
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            ph.add(f"{name}:{args[0].stage.kind}" if by_kind else name, time.perf_counter() - t0)
    return timed


class TraceWindow:
    """A torch.profiler trace of batches [start, start + count) of this process (the profile_torch option)."""

    def __init__(self, start: int, count: int, path: str) -> None:
        self.start, self.stop, self.path = start, start + count, path
        self.batches = 0
        self._prof = None

    def on_batch(self) -> None:
        import torch
        self.batches += 1
        if self.batches == self.start:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if torch.cuda.is_available():
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self._prof = torch.profiler.profile(activities=acts)
            self._prof.__enter__()
        elif self.batches == self.stop and self._prof is not None:
            self.close()

    def close(self) -> None:
        if self._prof is not None:
            prof, self._prof = self._prof, None
            prof.__exit__(None, None, None)
            prof.export_chrome_trace(self.path)


class PhaseTimes:
    """Wall seconds per phase of RankNode._loop (only when profiling: the normal loop times nothing)."""

    def __init__(self) -> None:
        self.trace: Optional[TraceWindow] = None
        self.iterations = 0
        self.batches: dict[str, int] = {}
        self.all: dict[str, list[float]] = {}  # every call's seconds (first calls, median, max)
        # Python's cyclic garbage collector: time per generation (runs inside whatever allocated), counted only while
        # the loop runs (`in_loop`): start-up's collections and settle_heap's own are not the loop's, and counting them
        # made a "gc gen2" line look like a serving stall
        import gc
        self._gc_t0 = 0.0
        self.gc: dict[int, list[float]] = {}
        self.in_loop = False

        def on_gc(phase: str, info: dict) -> None:
            if phase == "start":
                self._gc_t0 = time.perf_counter()
            elif self.in_loop:
                self.gc.setdefault(info["generation"], []).append(time.perf_counter() - self._gc_t0)
        self.on_gc = on_gc
        gc.callbacks.append(on_gc)

    def add(self, phase: str, dt: float) -> None:
        self.all.setdefault(phase, []).append(dt)

    def report(self, rank: int) -> str:
        t = {k: sum(v) for k, v in self.all.items()}
        total = sum(v for k, v in t.items() if not k.startswith("("))
        nb = sum(self.batches.values())
        lines = [f"rank {rank}: {self.iterations} loop iterations, {nb} batches {self.batches}, "
                 f"{total * 1e3:.1f} ms in the loop (cProfile overhead included when on)",
                 f"{'phase':<14}{'calls':>8}{'total ms':>10}{'us/call':>9}{'us/iter':>9}{'us/batch':>9}"]
        for k in sorted(t, key=t.get, reverse=True):
            n = len(self.all[k])
            lines.append(f"{k:<14}{n:>8}{t[k] * 1e3:>10.1f}{t[k] / n * 1e6:>9.1f}"
                         f"{t[k] / max(1, self.iterations) * 1e6:>9.1f}{t[k] / max(1, nb) * 1e6:>9.1f}")
        for g, v in sorted(self.gc.items()):
            lines.append(f"gc gen{g}: {len(v)} collections, {sum(v) * 1e3:.1f} ms, max {max(v) * 1e3:.2f} ms")
        lines.append("per call, us: median / max / first three")
        for k, v in sorted(self.all.items()):
            srt = sorted(v)
            lines.append(f"  {k:<12} {srt[len(srt) // 2] * 1e6:8.0f} {srt[-1] * 1e6:8.0f}   "
                         + " ".join(f"{x * 1e6:.0f}" for x in v[:3]))
        return "\n".join(lines) + "\n"
