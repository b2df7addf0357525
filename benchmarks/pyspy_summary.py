"""Summarize a py-spy raw (collapsed) profile of rank processes: where one serving loop's samples go.

    python benchmarks/pyspy_summary.py pyspy_py.txt [--under RankNode._loop] [--top 60]

py-spy `record --format raw --subprocesses --threads` writes one line per distinct stack:
`process ...;thread ...;frame (file:line);...;leaf (file:line) COUNT`. For every process with samples
under the `--under` frame, prints the share of those samples each function appears in (inclusive,
counted once per sample) and each leaf line holds (exclusive). Used for benchmarks/NOTES.md §16 / §19.
"""
from __future__ import annotations

import argparse
import re
from collections import Counter, defaultdict

_FRAME = re.compile(r"^(.*) \((.*):(\d+)\)$")


def func_of(frame: str) -> tuple[str, str]:
    """'Engine.poll (runtime/core/engine.py:206)' -> ('Engine.poll (runtime/core/engine.py)', 'Engine.poll (runtime/core/engine.py:206)')."""
    m = _FRAME.match(frame)
    return (f"{m.group(1)} ({m.group(2)})", frame) if m else (frame, frame)


def summarize(path: str, under: str, top: int) -> str:
    incl: dict[str, Counter] = defaultdict(Counter)
    leaf: dict[str, Counter] = defaultdict(Counter)
    total: Counter = Counter()
    with open(path) as f:
        for line in f:
            stack, _, count = line.rstrip("\n").rpartition(" ")
            if not stack or not count.isdigit():
                continue
            frames = stack.split(";")
            proc = next((x for x in frames if x.startswith("process ") and x.split(":")[0] != frames[0].split(":")[0]),
                        frames[0]).split(":")[0]
            names = [func_of(x) for x in frames if not x.startswith(("process ", "thread "))]
            try:
                i = next(i for i, (fn, _) in enumerate(names) if fn.startswith(under + " "))
            except StopIteration:
                continue
            n = int(count)
            total[proc] += n
            for fn in {fn for fn, _ in names[i:]}:
                incl[proc][fn] += n
            leaf[proc][names[-1][1]] += n
    out = []
    for proc, n in total.most_common():
        out.append(f"== {proc}: {n} samples under {under}")
        out.append("--- inclusive")
        out += [f"{100 * c / n:5.1f}% {fn}" for fn, c in incl[proc].most_common(top)]
        out.append("--- leaf")
        out += [f"{100 * c / n:5.1f}% {fr}" for fr, c in leaf[proc].most_common(top // 2)]
    return "\n".join(out) if out else f"no samples under {under} in {path}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("path")
    p.add_argument("--under", default="RankNode._loop", help="count only samples below this function")
    p.add_argument("--top", type=int, default=60)
    a = p.parse_args()
    print(summarize(a.path, a.under, a.top))


if __name__ == "__main__":
    main()
