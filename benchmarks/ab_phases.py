"""Per launch of an A/B device run (benchmarks/device/ab_trees.sh with AB_BENCH=gpu_bench), the engine's dispatch
steps and the executor's meta upload, medians over ranks, and the dispatch steps over the meta upload: the
meta upload is a phase no session-8 change touched, so the ratio takes out most of the drift between launches
(throughput on the lent machine drifts 10-45% between launches, benchmarks/device/README.md).

    python benchmarks/ab_phases.py benchmarks/results/h200/run59_phases.txt [...]
"""
from __future__ import annotations

import re
import sys

STEPS = ("bookkeeping", "order+merge_open", "gather", "send+enqueue", "meta_h2d")


def launches(path: str) -> dict:
    """{(tree, round): {step: mean over ranks of the step's median us}}."""
    out: dict = {}
    cur = None
    for line in open(path):
        m = re.match(r"=== (\w+) round (\d+)", line)
        if m:
            cur = out.setdefault((m.group(1), int(m.group(2))), {})
            continue
        for step in STEPS:
            for mm in re.finditer(re.escape(step) + r": n \d+ median ([\d.]+) us", line):
                cur.setdefault(step, []).append(float(mm.group(1)))
    return {k: {s: sum(v) / len(v) for s, v in d.items()} for k, d in out.items()}


def main(paths: list[str]) -> None:
    for path in paths:
        print(path)
        for (tree, r), med in launches(path).items():
            disp = sum(med[s] for s in STEPS[:4])
            print(f"  {tree:3s} round {r}: order+merge_open {med['order+merge_open']:4.0f} us, dispatch {disp:4.0f} us, "
                  f"meta upload {med['meta_h2d']:3.0f} us; order+merge_open / meta {med['order+merge_open'] / med['meta_h2d']:.2f}, "
                  f"dispatch / meta {disp / med['meta_h2d']:.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
