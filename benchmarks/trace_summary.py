"""Summarize a torch.profiler chrome trace of a rank (DATAFLOW_PROFILE_TORCH): over the traced window,
the device's busy share (union of kernel and memcpy intervals), and per CUDA runtime / NCCL call name
the count, total and median host microseconds (a call that waits for the GPU shows as a long median).

    python benchmarks/trace_summary.py dataflow-rank0.prof.trace.json [more traces]
"""
from __future__ import annotations

import json
import sys
from collections import defaultdict


def summarize(path: str) -> str:
    ev = [e for e in json.load(open(path))["traceEvents"] if e.get("ph") == "X"]
    dev = sorted((e["ts"], e["ts"] + e["dur"]) for e in ev if e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"))
    host = [e for e in ev if e.get("cat") == "cuda_runtime" or e.get("cat") == "cuda_driver"]
    ops = [e for e in ev if e.get("cat") == "cpu_op"]
    t0 = min(e["ts"] for e in ev)
    t1 = max(e["ts"] + e["dur"] for e in ev)
    busy, end = 0.0, -1.0
    for a, b in dev:
        if b > end:
            busy += b - max(a, end)
            end = b
    out = [f"{path}: window {(t1 - t0) / 1e3:.1f} ms, device busy {busy / 1e3:.1f} ms ({100 * busy / (t1 - t0):.0f}%), "
           f"{len(dev)} device intervals"]
    for title, evs in (("CUDA runtime calls", host), ("top-level CPU ops", ops)):
        by = defaultdict(list)
        for e in evs:
            by[e["name"]].append(e["dur"])
        out.append(f"{title}: name, count, total ms, median us, p90 us")
        for name, d in sorted(by.items(), key=lambda kv: -sum(kv[1]))[:25]:
            d.sort()
            out.append(f"  {name[:60]:<60} {len(d):6d} {sum(d) / 1e3:9.1f} {d[len(d) // 2]:8.1f} {d[int(len(d) * .9)]:8.1f}")
    return "\n".join(out)


if __name__ == "__main__":
    for p in sys.argv[1:]:
        print(summarize(p))
