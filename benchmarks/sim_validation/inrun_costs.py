"""What a streaming run's messages and host work cost in real rank processes, under the run's own load (the CPU cost
profile's streaming inputs, lab/costs/cpu_tiny.yaml): one streaming cell of a `clock: process` bench config with
1. every send and receive logged (lab/message_log.py), matched per (src, dst) in order: the one-way latency of the
   messages that reached a rank waiting in an idle poll (the poll began before the send: what the simulator's
   message latency models; a busy rank's mail waits for its batch in both), next to all messages', and a floor +
   lognormal fitted to it (cost.message_latency);
2. the serving loop's phase timers (the profile_ranks option, no cProfile): CPU per send call (cost.send_cpu_us) and
   the host per batch outside execute and sends (complete, feed of arrivals, next_batch, poll, tick, finish notices:
   cost.host, the same for every kind);
3. every batch's math (execute) by rows as affine costs per kind (the math fields), and the spread of its whole time
   (execute + complete) around its size's mean (cost.batch_sigma).
`--system ag-ep`: the barrier baseline's cell instead: its batches' math (the barrier ranks' own timers) as affine
costs per kind (cost.barrier_math) and their spread.

    python benchmarks/sim_validation/inrun_costs.py benchmarks/cpu_bench_process_slowrank.yaml [SCENARIO] [-o DIR]
    python benchmarks/sim_validation/inrun_costs.py benchmarks/cpu_bench_process_slowrank.yaml --system ag-ep
"""
import argparse
import json
import os
import re
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))


def read_logs(log_dir: Path) -> tuple[dict, dict, dict]:
    """(sends per (src, dst): times; hand-overs per (src, dst): (time, poll start); batch ends per rank: times)."""
    sends, recvs, ends = defaultdict(list), defaultdict(list), defaultdict(list)
    for path in sorted(log_dir.glob("rank*.tsv")):
        me = int(path.stem[4:])
        for line in path.read_text().splitlines():
            f = line.split()
            if f[0] in "BX":
                continue  # (a batch's start and its math's end: batch_costs reads them)
            if f[0] == "S":
                sends[(me, int(f[1]))].append(float(f[2]))
            elif f[0] == "R":
                recvs[(int(f[1]), me)].append((float(f[2]), float(f[3])))
            else:
                ends[me].append(float(f[1]))
    return sends, recvs, ends


def latencies(log_dir: Path) -> tuple[np.ndarray, np.ndarray]:
    """(every message's latency, the idle-receiver ones'), seconds."""
    sends, recvs, _ = read_logs(log_dir)
    every, idle = [], []
    for key, rs in recvs.items():
        for t_send, (t_recv, t_poll) in zip(sends[key], rs):  # FIFO per (src, dst): the k-th send is the k-th receive
            every.append(t_recv - t_send)
            if t_poll <= t_send:
                idle.append(t_recv - t_send)
    return np.array(every), np.array(idle)


def busy_receivers(log_dir: Path, floor_s: float) -> dict:
    """Messages handed to a rank that was not waiting for them: how many of the receiver's batches ended between the
    earliest it could have landed (send + the idle-receiver floor) and its hand-over (1: at the end of the batch it
    landed in, as the simulator delivers; 2+: batches later), and the time from the last of those ends to the
    hand-over."""
    sends, recvs, ends = read_logs(log_dir)
    counts, after = [], []
    for (src, dst), rs in recvs.items():
        e = np.array(ends[dst])
        for t_send, (t_recv, t_poll) in zip(sends[(src, dst)], rs):
            if t_poll <= t_send:
                continue
            lo, hi = np.searchsorted(e, t_send + floor_s), np.searchsorted(e, t_recv)
            counts.append(hi - lo)
            if hi > lo:
                after.append(t_recv - e[hi - 1])
    c = np.array(counts)
    return {"n": int(len(c)), "batch_ends_between": {str(k): int((c == k).sum()) for k in range(4)} | {"4+": int((c >= 4).sum())},
            "after_last_end": describe(np.array(after))}


def logged_batches(log_dir: Path) -> list[tuple[str, int, float, float]]:
    """Every streaming batch of the logs: (kind, rows, its math: execute's seconds, the whole: execute + complete with
    its sends)."""
    out = []
    for path in sorted(log_dir.glob("rank*.tsv")):
        start = math_end = None
        for line in path.read_text().splitlines():
            f = line.split()
            if f[0] == "B":
                start, math_end = (f[1], int(f[2]), float(f[3])), None
            elif f[0] == "X" and start is not None:
                math_end = float(f[1])
            elif f[0] == "E" and start is not None and math_end is not None:
                out.append((start[0], start[1], math_end - start[2], float(f[1]) - start[2]))
                start = None
    return out


def _row_groups(batches, column: int) -> list[np.ndarray]:
    """The batches by (kind, rows within a power of 2): per group an array of (rows, seconds: `column`) pairs."""
    groups: dict[tuple[str, int], list] = defaultdict(list)
    for b in batches:
        groups[(b[0], b[1].bit_length())].append((b[1], b[column]))
    return [np.array(v, dtype=float) for v in groups.values()]


def affine_costs(batches, column: int = 2, max_rows: int = 128) -> dict:
    """Per kind, fixed_us + per_row_us x rows through its batches' mean seconds (`column`): a least-squares line
    through the means of its row groups (rows within a power of 2), each weighted by its count (a cost profile's math
    fields). Batches of no rows (a barrier rank with none in a step: ~1 us) are left out. Where no line with both
    parts >= 0 fits every group, the line through the groups of up to `max_rows` rows (so far only while the barrier
    ranks' first prompt batches held a cold kernel load, 5x their line: fixed in session 27, `fitted_rows` says which
    groups a line went through). Each group's measured mean and the line's value are reported beside it ("groups")."""
    out = {}
    for kind in sorted({b[0] for b in batches}):
        groups = sorted((float(g[:, 0].mean()), float(g[:, 1].mean()), len(g))
                        for g in _row_groups([b for b in batches if b[0] == kind and b[1] > 0], column))
        for fit in (groups, [g for g in groups if g[0] <= max_rows]):
            x, y, n = (np.array(v, dtype=float) for v in zip(*fit))
            per_row, fixed = np.polyfit(x, y, 1, w=np.sqrt(n)) if len(fit) > 1 else (0.0, y[0])
            if per_row >= 0 and fixed >= 0:
                break
        else:  # (a cost is never negative: the count-weighted mean, flat)
            per_row, fixed = 0.0, float(np.average(y, weights=n))
        out[kind] = {"fixed_us": round(float(fixed) * 1e6, 1), "per_row_us": round(float(per_row) * 1e6, 3),
                     "fitted_rows": f"1-{int(max(x))}", "groups": [
                         {"rows": round(gx, 1), "batches": gn, "mean_us": round(gy * 1e6),
                          "line_us": round((fixed + per_row * gx) * 1e6)} for gx, gy, gn in groups]}
    return out


def batch_spread(batches, column: int = 3) -> dict:
    """How far a batch's wall time (`column`) strays from the mean of its kind's batches of about its size (rows within
    a power of 2): the ratio's quantiles over every batch (groups of 20 or more), and the mean-1 lognormal with its
    median (cost.batch_sigma = sqrt(-2 ln median)): the spread that rank processes time-sharing the cores add, which
    a profile of mean costs leaves out."""
    ratios = np.concatenate([g[:, 1] / g[:, 1].mean() for g in _row_groups(batches, column) if len(g) >= 20])
    q = np.percentile(ratios, [10, 50, 90, 99])
    sigma = float(np.sqrt(-2 * np.log(q[1]))) if q[1] < 1 else 0.0
    lognormal = np.exp(sigma * np.array([-1.2816, 0.0, 1.2816, 2.3263]) - sigma * sigma / 2)
    return {"batches": int(len(ratios)), "ratio_p10_p50_p90_p99": [round(float(v), 3) for v in q],
            "batch_sigma": round(sigma, 3), "its_p10_p50_p90_p99": [round(float(v), 3) for v in lognormal]}


def barrier_costs(config: str, scenario=None, system: str = "ag-ep", repeats: int = 3) -> dict:
    """A barrier baseline's cell of the config in real rank processes (lab/bench.py _process_barrier), `repeats`
    times: its batches' math (each batch record's start to end, timed by the barrier ranks), pooled over the runs, as
    affine costs and their spread (a run has few large prompt batches: one run's line through them is noisy)."""
    from dataflow.cmd_compile import resolve_model
    from lab.bench import _process_barrier, _requests, _router
    from lab.bench_config import load_config
    from lab.interference import from_config
    from lab.report import summarize
    from lowering.plan import compile_plan
    cfg = load_config(config)
    scenario = scenario or cfg.clean_scenario
    spec, _ = resolve_model(cfg.model)
    plan = compile_plan(spec, cfg.ranks)
    inter = from_config(cfg.scenarios[scenario] or {}, scenario, None)
    names = [f"{s.kind}({s.layer})" if s.kind != "sample" else "sample" for s in plan.stages]
    batches, tokens_per_s = [], []
    for _ in range(repeats):
        run = _process_barrier(cfg, plan, _requests(cfg, spec, None), system, scenario, inter, names,
                               _router(cfg, spec))
        batches += [(b.kind, b.rows, b.t_end - b.t_start, b.t_end - b.t_start) for b in run.batches]
        tokens_per_s.append(round(summarize(run, cfg.peak_window_s)["tokens_per_s"], 1))
    return {"system": system, "scenario": scenario, "tokens_per_s": tokens_per_s,
            "math": affine_costs(batches), "batch_spread": batch_spread(batches)}


def describe(x: np.ndarray) -> dict:
    q = np.percentile(x, [10, 50, 90, 99]) * 1e6 if len(x) else [float("nan")] * 4
    return {"n": int(len(x)), "mean_us": float(x.mean() * 1e6) if len(x) else None,
            **{f"p{p}_us": float(v) for p, v in zip((10, 50, 90, 99), q)}}


def fit(x: np.ndarray) -> dict:
    """A scenario's `latency_us` + lognormal `jitter` (lab/interference.py) with the quantiles of `x`: the floor and
    the lognormal's median and sigma that match the 5th..95th percentiles best (least squares over a grid of floors;
    for each floor, the lognormal of the shifted quantiles by a line fit in normal scores)."""
    from statistics import NormalDist
    ps = np.arange(5, 96, 5)
    q = np.percentile(x, ps) * 1e6
    z = np.array([NormalDist().inv_cdf(p / 100) for p in ps])
    best = None
    for floor in np.linspace(0, q[0] * 0.99, 100):
        logs = np.log(q - floor)
        sigma, mu = np.polyfit(z, logs, 1)
        err = float(np.sum((floor + np.exp(mu + sigma * z) - q) ** 2))
        if best is None or err < best[0]:
            best = (err, floor, float(np.exp(mu)), float(sigma))
    _, floor, median, sigma = best
    return {"latency_us": round(floor), "jitter": {"median_us": round(median), "sigma": round(sigma, 3)}}


def phases(log_dir: Path) -> dict:
    """Per send call and per batch host, us, over every rank's phase table (rank_profile.PhaseTimes.report)."""
    total: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    batches = 0
    for path in sorted(log_dir.glob("rank*.phases.txt")):
        text = path.read_text()
        batches += int(re.search(r"loop iterations, (\d+) batches", text).group(1))
        for name, n, ms in re.findall(r"^(\S+)\s+(\d+)\s+([\d.]+)\s+[\d.]+\s+[\d.]+\s+[\d.]+$", text, re.M):
            total[name] += float(ms) * 1e3
            calls[name] += int(n)
    host = sum(v for k, v in total.items() if not k.startswith(("execute:", "idle_wait", "hold_wait", "(")))
    host -= total["(send)"]  # (nested in complete, feed and finish)
    return {"send_cpu_us": round(total["(send)"] / calls["(send)"], 1), "host_per_batch_us": round(host / batches, 1),
            "batches": batches, "phase_us": {k: round(v / calls[k], 1) for k, v in sorted(total.items())}}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("config")
    ap.add_argument("scenario", nargs="?")
    ap.add_argument("-o", "--out", type=Path, help="keep the per-rank logs here (default: a temporary directory)")
    ap.add_argument("--system", default="streaming", help="streaming (default) or a barrier baseline (ag-ep): its "
                    "batches' math and spread only")
    args = ap.parse_args()
    if args.system != "streaming":
        print(json.dumps(barrier_costs(args.config, args.scenario, args.system), indent=1))
        return
    from lab.message_log import MessageLog
    from process_metrics import run_streaming_cell
    out = args.out or Path(tempfile.mkdtemp(prefix="inrun-"))
    out.mkdir(parents=True, exist_ok=True)
    # (settings reach the rank processes through the environment, as DATAFLOW_OPTIONS does from a shell)
    os.environ["DATAFLOW_OPTIONS"] = json.dumps({"profile_ranks": "all", "profile_cprofile": False,
                                                 "profile_out": str(out / "rank{rank}.prof")})
    t0 = time.perf_counter()
    scenario, res = run_streaming_cell(args.config, args.scenario, MessageLog(str(out)))
    every, idle = latencies(out)
    print(json.dumps({"scenario": scenario, "tokens_per_s": res.metrics["tokens_per_s"],
                      "wall_s": time.perf_counter() - t0, "messages": res.metrics["messages"], "logs": str(out),
                      "idle_receiver": describe(idle), "every": describe(every),
                      "fit_idle_receiver": fit(idle), "phases": phases(out),
                      "math": affine_costs(batches := logged_batches(out)), "batch_spread": batch_spread(batches),
                      "busy_receiver": busy_receivers(out, float(np.percentile(idle, 5)) if len(idle) else 0.0)},
                     indent=1))


if __name__ == "__main__":
    main()
