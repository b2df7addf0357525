"""Where a decode wave's layer goes: split a home's layer round trip across the ranks of a streaming run.

    python benchmarks/gpu_ep_bench.py --out DIR --timeline --systems "streaming-..." --scenarios clean ...
    python benchmarks/wave_timeline.py DIR/timeline_*.json

The bench's probe (lab/host_probe.py, HostProbe with timeline=True) keeps, per rank, the
middle of the timed run: every batch (kind, layer, the homes of its items, rows, host start and wall of execute +
complete, the device start and end of its graphs on the host clock) and every data message handed to the engine
(kind, layer, source, handling time). perf_counter is one clock for every process of a host, so the ranks' records
line up. For each attention batch of a home at layer l (a wave) this follows the wave to every holder and back:

    attn host      the home's execute + complete of the attention batch (the payload sent at its end)
    attn device    from the batch's host start to its graph's device end
    to holder      home's send done -> the payload handed to the holder's engine
    holder queue   -> the holder starts the expert batch holding it (busy with its other batches, or held)
    holder expert  the expert batch's host wall (its device end relative to its start in brackets)
    back           the holder's send done -> the partial sums handed to the home's engine (the last holder's)
    home tail      -> the home starts its next batch for these tokens (its next attention or sample)
    cycle          attention start -> the next attention or sample start of this home

and per rank the share of the span its GPU ran any recorded graph, its host spent inside batches, and in message
handling, and the median host time per batch and per message of each kind ("msg y": a holder's rows landing in
the home's merge, with the combine when they complete it). Medians over waves, microseconds.
"""
from __future__ import annotations

import bisect
import json
import statistics
import sys
from collections import defaultdict

KIND, LAYER, HOMES, ROWS, T0, WALL, DS, DE, SRC = range(9)


def _median(v: list) -> float:
    return statistics.median(v) if v else float("nan")


def _union(iv: list) -> float:
    busy, end = 0.0, float("-inf")
    for a, b in sorted(iv):
        if b > end:
            busy += b - max(a, end)
            end = b
    return busy


def analyze(ranks: list) -> str:
    ranks = [r or [] for r in ranks]
    world = len(ranks)
    out = []
    for r, recs in enumerate(ranks):
        if not recs:
            out.append(f"rank {r}: no records")
            continue
        t_a = min(x[T0] for x in recs)
        t_b = max(x[T0] + x[WALL] for x in recs)
        span = t_b - t_a
        gpu = _union([(x[DS], x[DE]) for x in recs if x[DS] is not None])
        host = sum(x[WALL] for x in recs if x[KIND] != "msg")
        msg = sum(x[WALL] for x in recs if x[KIND] == "msg")
        n = defaultdict(int)
        for x in recs:
            n[x[KIND]] += 1
        mixed = sum(1 for x in recs if x[KIND] == "expert" and len(x[HOMES]) > 1)
        out.append(f"rank {r}: span {1e3 * span:.1f} ms, GPU busy {100 * gpu / span:.0f}%, host in batches "
                   f"{100 * host / span:.0f}%, in message handling {100 * msg / span:.0f}%; batches "
                   f"{dict(sorted((k, v) for k, v in n.items() if k != 'msg'))}, expert batches of several homes "
                   f"{mixed}, messages {n['msg']}")
        # host us per batch or message, by kind (a message kind: r payload in, x rows in, y outputs back: the merge)
        walls = defaultdict(list)
        for x in recs:
            walls[f"msg {x[ROWS]}" if x[KIND] == "msg" else x[KIND]].append(x[WALL])
        out.append("  host us, median per: " + ", ".join(f"{k} {1e6 * _median(v):.0f}" for k, v in sorted(walls.items())))
    # index per rank: batches of (kind, layer) and messages of (layer, src) in start order
    batches = [defaultdict(list) for _ in ranks]
    msgs = [defaultdict(list) for _ in ranks]
    for r, recs in enumerate(ranks):
        for x in sorted(recs, key=lambda x: x[T0]):
            if x[KIND] == "msg":
                msgs[r][(x[LAYER], x[SRC], x[ROWS])].append(x)
            else:
                batches[r][(x[KIND], x[LAYER])].append(x)

    def first_after(seq: list, t: float, pred=lambda x: True):
        i = bisect.bisect_left(seq, t, key=lambda x: x[T0])  # (seq in start order)
        for x in seq[i:]:
            if pred(x):
                return x
        return None

    cols = defaultdict(list)
    order = defaultdict(int)  # on a holder: was the home's batch run before the holder's own?
    for h in range(world):
        home_attn = sorted((x for k, v in batches[h].items() if k[0] == "attn" for x in v), key=lambda x: x[T0])
        nexts = sorted((x for k, v in batches[h].items() if k[0] in ("attn", "sample") for x in v), key=lambda x: x[T0])
        for a in home_attn:
            layer, a1 = a[LAYER], a[T0] + a[WALL]
            nxt = first_after(nexts, a1)
            if nxt is None:
                continue
            back_last, parts = None, {}
            for j in range(world):
                if j == h:
                    continue
                m = None
                for kind in ("r", "x"):
                    m = m or first_after(msgs[j].get((layer, h, kind), []), a[T0])
                if m is None:
                    continue
                xb = first_after(batches[j].get(("expert", layer), []), m[T0], lambda x: h in x[HOMES])
                if xb is None:
                    continue
                y = first_after(msgs[h].get((layer, j, "y"), []), xb[T0])
                if y is None or y[T0] > nxt[T0]:
                    continue
                own = [x for x in batches[j].get(("expert", layer), []) if x[HOMES] == [j] and abs(x[T0] - xb[T0]) < 0.05]
                if own:
                    order["holder ran its own wave first" if own[0][T0] < xb[T0] else "holder ran this home's first"] += 1
                elif j in xb[HOMES]:
                    order["one batch with the holder's own wave"] += 1
                parts[j] = (m, xb, y)
                if back_last is None or y[T0] > back_last[0][T0]:
                    back_last = (y, m, xb)
            if back_last is None:
                continue
            y, m, xb = back_last
            cols["attn host"].append(a[WALL])
            if a[DE] is not None:
                cols["attn device"].append(a[DE] - a[T0])
            cols["to holder"].append(m[T0] - a1)
            cols["holder queue"].append(xb[T0] - m[T0])
            cols["holder expert"].append(xb[WALL])
            if xb[DE] is not None:
                cols["holder expert device"].append(xb[DE] - xb[T0])
            cols["back"].append(y[T0] - (xb[T0] + xb[WALL]))
            cols["home tail"].append(nxt[T0] - y[T0])
            cols["cycle"].append(nxt[T0] - a[T0])
            own = first_after(batches[h].get(("expert", layer), []), a1, lambda x: h in x[HOMES])
            if own is not None and own[T0] < nxt[T0]:
                cols["home's own expert start"].append(own[T0] - a1)
                cols["home's own expert"].append(own[WALL])
    out.append(f"waves followed: {len(cols['cycle'])}; medians, us (device ends relative to the batch's host start):")
    for k in ("attn host", "attn device", "to holder", "holder queue", "holder expert", "holder expert device", "back",
              "home tail", "cycle", "home's own expert start", "home's own expert"):
        v = cols.get(k, [])
        if v:
            q = sorted(v)
            out.append(f"  {k:<26} {1e6 * _median(v):8.0f}   p10 {1e6 * q[len(q) // 10]:7.0f}  p90 "
                       f"{1e6 * q[(9 * len(q)) // 10]:7.0f}")
    legs = ["attn host", "to holder", "holder queue", "holder expert", "back", "home tail"]
    if all(cols.get(k) for k in legs):
        s = sum(_median(cols[k]) for k in legs)
        out.append(f"  sum of the legs' medians   {1e6 * s:8.0f}   (the cycle's median: {1e6 * _median(cols['cycle']):.0f})")
    if order:
        out.append("on the holder: " + ", ".join(f"{k} {v}" for k, v in sorted(order.items())))
    return "\n".join(out)


def main(paths: list) -> None:
    for p in paths:
        d = json.load(open(p))
        print(f"== {d.get('name', p)}")
        print(analyze(d["ranks"]))


if __name__ == "__main__":
    main(sys.argv[1:])
