"""Where an ITL tail comes from: rank-wide stalls or scattered slow steps.

Streaming's ITL p99 on the H200s jumps to 150-370 ms in some launches while p50 stays ~20 ms (session 7,
runs 51-54). A p99 alone cannot tell whether a whole rank stalled a few times (every request homed there
waits through the same window) or many tokens were each slow for their own reasons. This summary can:
the inter-token gaps at or above the p99 are treated as time intervals, overlapping ones merged into
*stall windows*; a few long windows that hold most of the tail gaps mean rank-wide stalls, about as many
windows as gaps means scattered delays. Each window reports when it happened (seconds since the first
token) and the share of its gaps per home rank.
"""
from __future__ import annotations

from collections import Counter


def itl_tail(requests: list, q: float = 99.0, top: int = 3) -> dict:
    """From requests with "token_times" (seconds) and "home": the gaps >= the q-th percentile gap, merged
    into stall windows. Returns {"threshold_ms", "gaps", "windows", "top": [{"t_s", "ms", "gaps",
    "homes": {rank: share}}]} (the `top` longest windows), or {} when there are no gaps."""
    gaps = [(a, b, r.get("home")) for r in requests for a, b in zip(r["token_times"], r["token_times"][1:])]
    if not gaps:
        return {}
    lengths = sorted(b - a for a, b, _ in gaps)
    threshold = lengths[min(len(lengths) - 1, int(round(q / 100 * (len(lengths) - 1))))]
    tail = sorted(g for g in gaps if g[1] - g[0] >= threshold)
    t0 = min(r["token_times"][0] for r in requests if r["token_times"])
    windows: list[list] = []  # [start, end, homes Counter]
    for a, b, home in tail:
        if windows and a <= windows[-1][1]:
            w = windows[-1]
            w[1] = max(w[1], b)
        else:
            w = [a, b, Counter()]
            windows.append(w)
        w[2][home] += 1
    longest = sorted(windows, key=lambda w: w[0] - w[1])[:top]
    return {"threshold_ms": 1e3 * threshold, "gaps": len(tail), "windows": len(windows),
            "top": [{"t_s": w[0] - t0, "ms": 1e3 * (w[1] - w[0]), "gaps": sum(w[2].values()),
                     "homes": {h: n / sum(w[2].values()) for h, n in sorted(w[2].items(), key=str)}}
                    for w in longest]}


def describe(tail: dict) -> str:
    """One line: '512 gaps >= 238 ms in 3 window(s); longest 241 ms at 12.3 s (140 gaps, home 0: 100%)'."""
    if not tail:
        return "no gaps"
    parts = [f"{tail['gaps']} gaps >= {tail['threshold_ms']:.0f} ms in {tail['windows']} window(s)"]
    for w in tail["top"]:
        homes = ", ".join(f"home {h}: {100 * s:.0f}%" for h, s in w["homes"].items())
        parts.append(f"{w['ms']:.0f} ms at {w['t_s']:.1f} s ({w['gaps']} gaps, {homes})")
    return "; ".join(parts[:1]) + ("; longest " + "; ".join(parts[1:]) if len(parts) > 1 else "")
