"""What a simulator split over P processes could gain at best (issue 34's 1,024 x 100 target; session 28).

Runs one `python -m lab simulate ...` command in this process with every engine call timed (complete, on_message,
next_batch, execute: the per-event Python of the engine, the lab's hooks inside them included) and attributed to
(virtual time, partition), the partitions being P contiguous blocks of ranks (whole nodes when the ranks per
partition are a multiple of -g). A conservative parallel simulator advances all partitions window by window: each
window's wall is its slowest partition's work. So, per window length W:

    bound(W) = (sum over windows of max over partitions of work + the driver's own time / P) / serial wall

the driver's own time (the loop around the engine calls, not attributed to a rank) split evenly. This is a lower
bound on a real parallel run's wall over the serial one: it leaves out packing and passing the messages that cross
partitions, the window synchronisations and the process start and result merge. W = the smallest cross-partition
delivery delay (the NIC latency plus one row's transfer, ~5.2 us in the default topology) is what an exact
conservative simulator of today's event semantics can use; W up to the shortest batch (~400 us of host time with
lab/costs/h200_host.yaml) needs each batch's sends computed when it starts (they depend only on the rank's state
then: a busy rank receives nothing) and a partition-independent count of idle decisions (Cluster._run_virtual's
`repeat_idle` counts every event of the whole cluster).

    python benchmarks/sim_parallel_bound.py --partitions 2 -- simulate gpt-oss-120b --ranks 1024 -g 8 \\
        --requests-per-rank 1 --new-tokens 5 --scenario slow-nic --systems streaming -o /tmp/bound
"""
from __future__ import annotations

import argparse
import collections
import json
import sys
from pathlib import Path
from time import perf_counter

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the lab is not installed: run from the tree

WINDOWS_US = (5.2, 20.0, 100.0, 400.0)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--partitions", type=int, nargs="+", default=[2, 4])
    ap.add_argument("--json", help="write the table here too")
    ap.add_argument("lab_args", nargs=argparse.REMAINDER, help="-- then the `python -m lab` arguments")
    a = ap.parse_args()
    lab_args = a.lab_args[1:] if a.lab_args[:1] == ["--"] else a.lab_args

    from runtime.core.engine import Engine
    import runtime.drivers.cluster as cluster

    work: dict[tuple[float, int], float] = collections.defaultdict(float)  # (virtual t, rank) -> seconds
    state: dict = {}

    def timed(name: str) -> None:
        f = getattr(Engine, name)

        def g(self, *args, **kw):
            t0 = perf_counter()
            try:
                return f(self, *args, **kw)
            finally:
                work[(self.clock.now(), self.rank)] += perf_counter() - t0
        setattr(Engine, name, g)

    for name in ("complete", "on_message", "next_batch", "execute"):
        timed(name)
    run_virtual = cluster.Cluster._run_virtual

    def driver(self, *args):
        state["ranks"] = self.world_size
        t0 = perf_counter()
        try:
            return run_virtual(self, *args)
        finally:
            state["serial"] = perf_counter() - t0
    cluster.Cluster._run_virtual = driver

    from dataflow.cli import run_app
    from lab.__main__ import app
    sys.argv = ["lab", *lab_args]
    try:
        run_app(app)
    except SystemExit as e:
        if e.code:
            raise

    R, serial = state["ranks"], state["serial"]
    engine = sum(work.values())
    own = serial - engine
    t0 = min(t for t, _ in work)
    rows = []
    print(f"serial driver wall {serial:.1f} s: engine calls {engine:.1f} s, the driver's own loop {own:.1f} s; "
          f"{len({t for t, _ in work}):,} event times")
    for P in a.partitions:
        per = -(-R // P)
        total = collections.Counter()
        for (t, r), s in work.items():
            total[r // per] += s
        ideal = (max(total.values()) + own / P) / serial
        for w_us in WINDOWS_US:
            W = w_us * 1e-6
            win: dict[tuple[int, int], float] = collections.defaultdict(float)
            for (t, r), s in work.items():
                win[(int((t - t0) // W), r // per)] += s
            slowest: dict[int, float] = collections.defaultdict(float)
            for (k, _), s in win.items():
                slowest[k] = max(slowest[k], s)
            bound = (sum(slowest.values()) + own / P) / serial
            rows.append({"partitions": P, "window_us": w_us, "windows": len(slowest), "bound": round(bound, 3),
                         "balanced": round(ideal, 3)})
            print(f"P={P} W={w_us:6.1f} us: {len(slowest):9,} windows, parallel/serial >= {bound:.3f} "
                  f"(work split alone: {ideal:.3f})")
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"command": ["python", "-m", "lab", *lab_args], "serial_s": serial, "engine_s": engine,
                       "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
