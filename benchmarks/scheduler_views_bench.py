"""Host cost of one scheduling decision: Engine.views() and policy.choose(views()) on a rank of an
8-layer MoE chain (17 stages, engine_overhead.py's config), with one queue holding work.

    python benchmarks/scheduler_views_bench.py [--layers 8] [--calls 5000] [--policy "defrag:hold_fill=1,hold_us=30000"]

benchmarks/NOTES.md §19 item 10: views 8.2 -> 2.5 us, views + defrag choose 14.1 -> 8.3 us on the 2-core CPU VM.
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import engine_overhead as eo  # noqa: E402


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--calls", type=int, default=5000)
    p.add_argument("--policy", default="defrag:hold_fill=1,hold_us=30000")
    a = p.parse_args()
    eo.LAYERS = a.layers
    from runtime.core.clock import WallClock
    from runtime.core.engine import Engine
    from runtime.core.requests import Request
    from runtime.core.scheduler import make_policy
    from runtime.transport.inproc import InprocHub
    clock = WallClock()
    e = Engine(eo.config(0, 256, 8), eo.NullExecutor(64), InprocHub(2, clock).transports()[0], clock,
               policy=make_policy(a.policy))
    for i in range(64):  # attn(0) holds 64 prompts; every other stage is empty
        e.admit(Request(i, f"r{i}", [5, 6, 7], 8))
    for _ in range(3):
        t = time.perf_counter()
        for _ in range(a.calls):
            e.views()
        views_us = (time.perf_counter() - t) / a.calls * 1e6
        t = time.perf_counter()
        for _ in range(a.calls):
            e.policy.choose(e.views(), e.next_of)
        both_us = (time.perf_counter() - t) / a.calls * 1e6
        print(f"{len(e.queues)} stages: views {views_us:.1f} us, views + choose {both_us:.1f} us per decision")


if __name__ == "__main__":
    main()
