"""The tokens/s verdict of an A/B device run (benchmarks/device/ab_trees.sh's ab.txt, either bench): per tree the
launches and their median, and per round the second tree over the first, so a session reads "ahead in k of n rounds"
off the file instead of working it out by hand (the lent machine drifts 10-45% between launches: medians and
rounds, not single launches; benchmarks/NOTES.md §23).

    python benchmarks/ab_summary.py benchmarks/results/h200/run110_ab.txt [...]

A line is `TREE ROUND | system | ... | tok/s | ...` with tok/s the fourth column after the label (both benches).
"""
from __future__ import annotations

import re
import sys
from statistics import median


def launches(text: str) -> dict[str, dict[int, float]]:
    """{tree: {round: tok/s}} in the order the trees first appear."""
    out: dict[str, dict[int, float]] = {}
    for line in text.splitlines():
        m = re.match(r"(\w+) (\d+) \|", line)
        if not m:
            continue
        cols = line.split("|")
        out.setdefault(m.group(1), {})[int(m.group(2))] = float(cols[4])
    return out


def summary(text: str) -> str:
    runs = launches(text)
    if len(runs) != 2:
        return f"expected two trees, found {sorted(runs) or 'none'}"
    a, b = ("old", "new") if set(runs) == {"old", "new"} else tuple(runs)
    lines = [f"{t}: median {median(runs[t].values()):,.0f} tok/s over {len(runs[t])} launches "
             f"({', '.join(f'{v:,.0f}' for _, v in sorted(runs[t].items()))})" for t in (a, b)]
    rounds = sorted(set(runs[a]) & set(runs[b]))
    ratios = [runs[b][r] / runs[a][r] for r in rounds]
    ahead = sum(x > 1 for x in ratios)
    lines.append(f"{b}/{a} per round: {', '.join(f'{x:.2f}x' for x in ratios)}; {b} ahead in {ahead} of "
                 f"{len(ratios)} rounds; medians {median(runs[b].values()) / median(runs[a].values()):.3f}x")
    return "\n".join(lines)


if __name__ == "__main__":
    for path in sys.argv[1:]:
        print(f"== {path}")
        print(summary(open(path).read()))
