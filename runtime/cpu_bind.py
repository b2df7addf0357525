"""Pin a GPU rank's serving thread to a physical core of its own, near its GPU.

A GPU rank's throughput is set by one Python thread (the engine loop: every batch's host work runs
on it). Left to the OS scheduler, that thread shares physical cores with other busy threads (the
other ranks' loops, which busy-poll, NCCL's proxy threads, ZeroMQ's I/O thread) as hyperthread
siblings, or runs on the socket far from its GPU. On 2 x H200 a profiled launch showed one rank
paying 1.5-2x the other's time for every phase of the same loop (run 46, benchmarks/NOTES.md §21),
and launches drift by 10-45%.

`bind_rank_threads` gives the calling (serving) thread a physical core alone: the first free core
among the CPUs local to its GPU (sysfs `local_cpulist` of the GPU's PCI device), its hyperthread
siblings left empty, and moves every other thread of the process onto the CPUs that no rank's
serving core uses. Each rank computes every local rank's choice the same way (rank i uses GPU i),
so ranks never pick the same core. Threads created later inherit the serving thread's single CPU,
so the call is repeated at every workload start.

Off by default: `DATAFLOW_CPU_BIND=1` turns it on. Measured on the lent 2 x H200 VM (32 vCPUs, one
thread per core, one NUMA node), binding changed nothing beyond the drift (run 47: streaming / all-gather
EP 0.91x bound against 0.96x unbound, medians of 3 alternating rounds), so it stays a knob for hosts with
hyperthreads or several sockets (issue 8's machines), where it is unmeasured. CPU ranks should not use it
(their torch intra-op threads, started later, would inherit the serving thread's single CPU). Anything it
cannot read (no sysfs, no affinity API) leaves the process as it was.
"""
from __future__ import annotations

import os
import sys
import threading
from pathlib import Path
from typing import Callable, Optional

_SYS_CPU = Path("/sys/devices/system/cpu")


def parse_cpulist(text: str) -> list[int]:
    """'0-3,8,10-11' -> [0, 1, 2, 3, 8, 10, 11]."""
    out: list[int] = []
    for part in text.strip().split(","):
        if not part:
            continue
        a, _, b = part.partition("-")
        out.extend(range(int(a), int(b or a) + 1))
    return out


def _siblings(cpu: int) -> frozenset:
    try:
        return frozenset(parse_cpulist((_SYS_CPU / f"cpu{cpu}/topology/thread_siblings_list").read_text()))
    except OSError:
        return frozenset([cpu])


def gpu_local_cpus(index: int) -> Optional[list[int]]:
    """CPUs of the NUMA node of CUDA device `index` (None when unknown)."""
    try:
        import torch
        p = torch.cuda.get_device_properties(index)
        bus = f"{p.pci_domain_id:04x}:{p.pci_bus_id:02x}:{p.pci_device_id:02x}.0"
        return parse_cpulist(Path(f"/sys/bus/pci/devices/{bus}/local_cpulist").read_text()) or None
    except (AttributeError, OSError, RuntimeError, ValueError):
        return None


def plan_serving_cores(world: int, allowed: list[int], local_of: Callable[[int], Optional[list[int]]],
                       siblings: Callable[[int], frozenset] = _siblings) -> list[tuple[int, frozenset]]:
    """For local ranks 0..world-1: (serving CPU, its core's CPUs), in rank order, each core used once.
    Rank i looks first among the allowed CPUs local to its GPU, then among all allowed ones."""
    taken: set = set()
    plan: list[tuple[int, frozenset]] = []
    allowed_set = set(allowed)
    for i in range(world):
        local = [c for c in (local_of(i) or []) if c in allowed_set]
        pick = None
        for c in local + sorted(allowed_set):
            if c not in taken:
                pick = c
                break
        if pick is None:
            raise ValueError(f"no free core for local rank {i} among {len(allowed)} allowed CPUs")
        core = siblings(pick) & allowed_set | {pick}
        taken |= core
        plan.append((pick, frozenset(core)))
    return plan


def bind_enabled() -> bool:
    v = os.environ.get("DATAFLOW_CPU_BIND", "").strip()
    if v not in ("", "0", "1"):
        raise ValueError(f"DATAFLOW_CPU_BIND={v!r}: expected 1 (bind each rank's serving thread) or 0 / unset (off)")
    return v == "1"


_said: set = set()
_original: Optional[list[int]] = None


def bind_rank_threads(local_rank: int, local_world: int, device_type: str) -> Optional[str]:
    """Bind the calling thread (the rank's serving loop) to its own core and the process's other threads
    to the CPUs left; returns what it did (printed once per process), or None when off or impossible."""
    if not bind_enabled() or not hasattr(os, "sched_setaffinity"):
        return None
    try:
        global _original
        if _original is None:  # the mask the process was started with (before any binding of ours)
            _original = sorted(os.sched_getaffinity(0))
        allowed = _original
        plan = plan_serving_cores(local_world, allowed,
                                  gpu_local_cpus if device_type == "cuda" else (lambda i: None))
        main, _ = plan[local_rank]
        reserved = frozenset().union(*(core for _, core in plan))
        rest = [c for c in allowed if c not in reserved] or [c for c in allowed if c not in plan[local_rank][1]]
        me = threading.get_native_id()
        moved = 0
        for tid in _thread_ids():
            if tid != me and rest:
                try:
                    os.sched_setaffinity(tid, rest)
                    moved += 1
                except OSError:
                    pass  # a thread that just exited
        os.sched_setaffinity(0, [main])
    except (OSError, ValueError) as err:
        what = f"rank {local_rank}: CPU binding skipped ({type(err).__name__}: {err})"
    else:
        what = (f"rank {local_rank}: serving thread on CPU {main} (its core {sorted(plan[local_rank][1])} alone), "
                f"{moved} other thread(s) on {len(rest)} CPU(s)")
    if local_rank not in _said:
        _said.add(local_rank)
        print(what, file=sys.stderr, flush=True)
    return what


def _thread_ids() -> list[int]:
    try:
        return [int(t) for t in os.listdir("/proc/self/task")]
    except OSError:
        return []

