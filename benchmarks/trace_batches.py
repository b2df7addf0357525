"""Where a run's batch time went, from its `dataflow run --trace FILE` (the engine's batch spans, runtime/observability
/trace.py): per stage kind (attention, expert, sample) and rows bucket, the batches, their total and median
milliseconds and microseconds per row. A batch span runs from its start to its completion on the rank's clock, so on
a GPU it includes the host's launch work and any wait for the device.

    python benchmarks/trace_batches.py run_trace.json
"""
from __future__ import annotations

import json
import statistics
import sys
from collections import defaultdict


def summarize(path: str) -> str:
    doc = json.load(open(path))
    spans = [e for e in (doc["traceEvents"] if isinstance(doc, dict) else doc) if e.get("ph") == "X"]
    groups = defaultdict(list)
    for e in spans:
        kind = e["name"].split("(")[0]
        rows = e.get("args", {}).get("rows", 0)
        bucket = next(b for b in (1, 8, 64, 256, 1024, 1 << 30) if rows <= b)
        groups[(kind, bucket)].append((e["dur"] / 1e3, rows))
    total = sum(e["dur"] for e in spans) / 1e3
    out = [f"{path}: {len(spans)} batch spans, {total:.1f} ms", "| stage | rows <= | batches | total ms | share | "
           "median ms | us per row |", "|---|---|---|---|---|---|---|"]
    for (kind, bucket), xs in sorted(groups.items()):
        ms = sum(d for d, _ in xs)
        rows = sum(r for _, r in xs)
        out.append(f"| {kind} | {bucket if bucket < 1 << 30 else 'more'} | {len(xs)} | {ms:.1f} | {100 * ms / total:.0f}% "
                   f"| {statistics.median(d for d, _ in xs):.2f} | {1e3 * ms / max(rows, 1):.1f} |")
    return "\n".join(out)


if __name__ == "__main__":
    print("\n\n".join(summarize(p) for p in sys.argv[1:]))
