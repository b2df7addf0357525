"""A rank process's start-up, phase by phase (the seconds `dataflow run` prints as "rank start-up", and the label of
its progress bar while the ranks start): StartupTimes, and the atomic file write rank 0 reports through."""
from __future__ import annotations

import os
import time
from typing import Optional

from runtime import settings


def write_atomically(path: str, text: str) -> None:
    """`text` as `path`'s whole content, swapped in at once (a reader sees the old text or the new, never half)."""
    tmp = f"{path}.tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


# Start-up phases of a rank process, in order (seconds each; StartupTimes): the launcher's spawn of the process up to
# its first line of Python (the interpreter and runtime.drivers.launch), the imports (torch, the transport, the executor and
# its kernels, and the job's unpickling), the device (CUDA context), the rendezvous (every rank arrived, the process
# group, the ZeroMQ transport), the weights (built or loaded on the device), the executor (built over them), the KV
# pool (sizing and allocation), the CUDA-graph capture and the start-up barrier (every rank ready, clocks synced);
# "other" is the rest of "total" (spawn to serving).
STARTUP_PHASES = ("spawn", "imports", "device_init", "rendezvous", "weights", "executor", "kv_alloc", "capture",
                  "barrier")


class StartupTimes:
    """One rank's start-up phases (STARTUP_PHASES), timed with perf_counter from the process's first line (runtime.drivers.launch
    records it; under torchrun, from rank_main's), the spawn from the launcher's clock reading in the environment
    (time.time(): one host). A later workload of the same launch restarts the count: its KV pool, capture and barrier."""

    def __init__(self) -> None:
        from runtime.drivers.launch import child_started
        started = child_started()
        wall0, self.t0 = started or (time.time(), time.perf_counter())
        spawned = settings.launch_environment().spawned_at if started else None  # (launch_local's ranks only)
        self.phases = dict.fromkeys(STARTUP_PHASES, 0.0)
        self.phases["spawn"] = max(wall0 - spawned, 0.0) if spawned else 0.0
        self.last = self.t0

    # What a rank does after each phase (for the progress display: rank 0 writes it where the launcher reads it).
    NEXT = {"imports": "starting the device", "device_init": "connecting the ranks", "rendezvous": "building weights",
            "weights": "building the executor", "executor": "allocating the KV cache", "kv_alloc": "capturing graphs",
            "capture": "waiting for every rank", "barrier": "serving"}
    phase_path: Optional[str] = None  # set on rank 0 of a launch that shows progress

    def lap(self, phase: str) -> None:
        """The time since the last lap (or start) goes to `phase` ("other": to none; report() counts it there)."""
        now = time.perf_counter()
        if phase != "other":
            self.phases[phase] += now - self.last
            if self.phase_path is not None and phase in self.NEXT:
                write_atomically(self.phase_path, self.NEXT[phase])
        self.last = now

    def restart(self) -> None:
        self.phases = dict.fromkeys(STARTUP_PHASES, 0.0)
        self.t0 = self.last = time.perf_counter()

    def report(self) -> dict:
        """{phase: seconds} with "other" (not in a phase) and "total" (spawn to now)."""
        out = {k: round(v, 6) for k, v in self.phases.items()}
        total = self.phases["spawn"] + time.perf_counter() - self.t0
        out["other"] = round(max(total - sum(self.phases.values()), 0.0), 6)
        out["total"] = round(total, 6)
        return out
