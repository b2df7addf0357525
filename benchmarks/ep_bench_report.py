"""The results of benchmarks/gpu_ep_bench.py: a row per reported workload (summarize), the tokens each system's run
agrees on with the first one's, the ratios between systems and to the clean scenario, the medians over rounds, and the
tables (ep_bench.md, and printed at the end)."""
from __future__ import annotations

import json
from pathlib import Path


def summarize(w: dict) -> dict:
    from lab.dist_job import token_stats
    from lab.itl_tail import describe, itl_tail
    s = token_stats(w["requests"], w["wall_s"] or 0.0)
    s["itl_tail"] = describe(itl_tail(w["requests"]))
    s.update(system=w["system"], scenario=w["scenario"], name=w["name"])
    b = w.get("batches", {})
    for kind in ("attn", "expert", "moe"):   # moe: the barrier's whole MoE part per layer (lab/barrier_dist.py)
        if kind in b:
            s[f"{kind}_mean_batch"] = b[kind]["mean_rows"]
            s[f"{kind}_host_us"] = b[kind]["host_us"]
            s[f"{kind}_batches"] = b[kind]["batches"]
            s[f"{kind}_device_us"] = b[kind].get("device_us")
            s[f"{kind}_hidden"] = b[kind].get("hidden_share")
            s[f"{kind}_busy"] = b[kind].get("busy_share")
            s["gpu_busy"] = b[kind].get("gpu_busy_share")  # (a rank-level share: the same in every kind)
    if "expert" in b:
        s["expert_GBps"] = b["expert"].get("GBps")
        s["expert_pct_copy"] = b["expert"].get("pct_copy")
    if w.get("delay_stalls_s") is not None:
        s["delay_stall_s"] = w["delay_stalls_s"]
    return s


_OUTPUTS: dict = {}


def tokens_check(results: dict, workloads: list) -> None:
    """Requests whose tokens equal the first system's of the same (scenario, C) (bf16: near-ties may differ)."""
    for w in workloads:
        if not w["report"]:
            continue
        _, sc, C = w["name"].split("/")
        key = (sc, C)
        outs = {r["rid"]: r["output"] for r in w["requests"]}
        if key not in _OUTPUTS:
            _OUTPUTS[key] = (w["system"], outs)
            continue
        ref_sys, ref = _OUTPUTS[key]
        same = sum(outs.get(r) == o for r, o in ref.items())
        for s in reversed(results["runs"]):  # the newest row of that workload (rounds/variants repeat names)
            if s.get("workload", s["name"]) == w["name"]:
                s["tokens_equal_to"] = f"{same}/{len(ref)} requests equal to {ref_sys}"
                break


def ratios(results: dict) -> None:
    # Keyed by the scenario label of the name (clean, clean#2, ...) so repeated scenarios stay apart.
    by = {(r["system"], r["name"].split("/")[1], r["name"].split("/")[2]): r for r in results["runs"]}
    for r in results["runs"]:
        if not r["system"].startswith("streaming-"):
            continue
        C = r["name"].split("/")[2]
        for base in ("ag-ep", "a2a-ep"):
            b = by.get((base, r["name"].split("/")[1], C))
            if b and b.get("tokens_per_s") and r.get("tokens_per_s"):
                r[f"ratio_vs_{base}"] = r["tokens_per_s"] / b["tokens_per_s"]
    for r in results["runs"]:
        rnd = _round_of(r["name"].split("/")[1])
        clean = by.get((r["system"], "clean" + (f".r{rnd}" if rnd else ""), r["name"].split("/")[2]))
        if clean and clean.get("tokens_per_s") and r.get("tokens_per_s"):
            r["vs_clean"] = r["tokens_per_s"] / clean["tokens_per_s"]


def _round_of(label: str) -> int:
    """The round of a scenario label ('clean.r2' -> 2; 0 without rounds)."""
    head, dot, tail = label.rpartition(".r")
    return int(tail) if dot and tail.isdigit() else 0


def median_rows(results: dict) -> list[dict]:
    """Per (system, scenario without the round, C): median tok/s over rounds, min, max, and the median
    of the per-round ratios to ag-ep (each round's streaming against the same round's barrier); the
    grouping and medians are `python -m lab bench`'s (report.median_over_repeats)."""
    from lab.report import median_over_repeats
    cells = []
    for r in results["runs"]:
        system, label, C = r["name"].split("/")
        cells.append({**r, "label": f"{system}/{C}",
                      "scenario": label.rpartition(".r")[0] if _round_of(label) else label})
    out = []
    for m in median_over_repeats(cells):
        tps = m.get("tokens_per_s_repeats") or [m.get("tokens_per_s")]
        tps = [x for x in tps if x]
        if tps:
            system, C = m["label"].split("/")
            out.append(dict(system=system, scenario=m["scenario"], C=C[1:], rounds=len(tps), median=m["tokens_per_s"],
                            lo=min(tps), hi=max(tps), ratio=m.get("ratio_vs_ag-ep")))
    return out


def median_lines(results: dict) -> list[str]:
    rows = median_rows(results)
    if not rows or max(r["rounds"] for r in rows) < 2:
        return []
    L = ["| system | scenario | C/rank | rounds | tok/s median (min-max) | /ag-ep median of rounds |", "|---|---|---|---|---|---|"]
    for r in rows:
        L.append(f"| {r['system']} | {r['scenario']} | {r['C']} | {r['rounds']} | {r['median']:.1f} ({r['lo']:.1f}-{r['hi']:.1f}) | "
                 f"{_f(r['ratio'], '{:.2f}x')} |")
    return L


def _f(x, fmt="{:.1f}"):
    return "-" if x is None else fmt.format(x)


def table_lines(results: dict) -> list[str]:
    L = ["| system | scenario | C/rank | tok/s | vs clean | /ag-ep | /a2a-ep | ITL p50 ms | ITL p99 ms | attn batch | "
         "expert batch | host us attn (hidden own/any) | host us expert (hidden own/any) | expert GB/s (% copy) | GPU busy | "
         "unfinished | tokens |",
         "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
    def pct(own, any_):
        return "" if own is None else f" ({100 * own:.0f}%" + ("" if any_ is None else f" / {100 * any_:.0f}%") + ")"

    for r in results["runs"]:
        L.append(f"| {r['system']} | {r['name'].split('/')[1]} | {r['name'].split('/')[2][1:]} | {_f(r.get('tokens_per_s'))} | "
                 f"{_f(r.get('vs_clean'), '{:.2f}')} | {_f(r.get('ratio_vs_ag-ep'), '{:.2f}x')} | "
                 f"{_f(r.get('ratio_vs_a2a-ep'), '{:.2f}x')} | {_f(r.get('itl_p50_ms'), '{:.2f}')} | "
                 f"{_f(r.get('itl_p99_ms'), '{:.2f}')} | {_f(r.get('attn_mean_batch'))} | {_f(r.get('expert_mean_batch'))} | "
                 f"{_f(r.get('attn_host_us'), '{:.0f}')}{pct(r.get('attn_hidden'), r.get('attn_busy'))} | "
                 f"{_f(r.get('expert_host_us'), '{:.0f}')}{pct(r.get('expert_hidden'), r.get('expert_busy'))} | "
                 f"{_f(r.get('expert_GBps'), '{:.0f}')}{_f(r.get('expert_pct_copy'), ' ({:.0f}%)') if r.get('expert_pct_copy') else ''} | "
                 f"{_f(r.get('gpu_busy'), '{:.0%}')} | {r['unfinished']} | "
                 f"{r.get('tokens_equal_to', 'reference')} |")
    return L


def write_md(path: Path, results: dict) -> None:
    m = results["meta"]
    L = [f"# EP bench: streaming vs all-gather EP vs all-to-all EP ({m['date']})", "",
         f"`{m['command']}`", "",
         f"{m['model']} ({m['layers']} layers, {m['experts']} experts, top-{m['top_k']}, {m['dtype']}), {m['ranks']} ranks "
         f"one process each on {m['device']} {m['gpus']}, torch {m['torch']}; decode-only, {m.get('lengths', 'sharegpt')} prompts "
         f"clipped to {m['max_prompt']} (mean {m['prompt_len_mean']}), new tokens {m['new_tokens']}, Zipf s={m['zipf_s']}, "
         f"all requests at t=0; bursts {m['burst']}.", "",
         "tok/s = generated tokens / (last finish - start); ratios = streaming / baseline at the same scenario and C; "
         "host us = wall of the executor calls of a batch minus time blocked on the device (streaming: "
         "execute+complete of a batch; barrier: attention+route+shared, and expert compute incl. index ops); "
         "(hidden own/any) = share of that host time overlapped by device work: own = the batch's own (per batch "
         "exposed = max(0, wall - device time of its attention/expert graphs); 1 - exposed / host), any = any "
         "graph of the rank (the paper's: exposed = the part of the batch's wall with the GPU idle; "
         "lab/busy_timeline.py); expert GB/s = "
         "bytes an expert batch cannot avoid (active experts' weights + rows in/out) / its device time, "
         "and its share of the measured device copy bandwidth; GPU busy = share of the ranks' batch span during which "
         "their GPUs ran any recorded graph (low: the host is the bottleneck).", ""]
    L += table_lines(results)
    med = median_lines(results)
    if med:
        L += ["", "Medians over rounds (ratios: each round's streaming against the same round's barrier):", ""] + med
    tails = [f"- {r['system']} / {r['name'].split('/')[1]}: {r['itl_tail']}" for r in results["runs"] if r.get("itl_tail")]
    if tails:
        L += ["", "ITL tails (inter-token gaps >= the p99, overlapping ones merged into stall windows: few long windows "
              "= rank-wide stalls; lab/itl_tail.py):", ""] + tails
    if results.get("hogs"):
        L += ["", "Hogs (rate while running):", ""] + [f"- {json.dumps(h)}" for h in results["hogs"]]
    if results.get("errors"):
        L += ["", "Errors:", ""] + [f"- {e}" for e in results["errors"]]
    path.write_text("\n".join(L) + "\n")


def print_table(results: dict) -> None:
    print("\n".join(table_lines(results) + [""] + median_lines(results)), flush=True)
    for e in results.get("errors", []):
        print(f"ERROR {e}", flush=True)
