"""What a streaming run's messages and host work cost in real rank processes, under the run's own load (the CPU cost
profile's streaming inputs, lab/costs/cpu_tiny.yaml): one streaming cell of a `clock: process` bench config with
1. every send and receive logged (lab/message_log.py), matched per (src, dst) in order: the one-way latency of the
   messages that reached a rank waiting in an idle poll (the poll began before the send: what the simulator's
   message latency models; a busy rank's mail waits for its batch in both), next to all messages', and a floor +
   lognormal fitted to it (cost.message_latency);
2. the serving loop's phase timers (the profile_ranks option, no cProfile): CPU per send call (cost.send_cpu_us) and
   the host per batch outside execute and sends (complete, feed of arrivals, next_batch, poll, tick, finish notices:
   cost.host, the same for every kind).

    python benchmarks/sim_validation/inrun_costs.py benchmarks/cpu_bench_process_slowrank.yaml [SCENARIO] [-o DIR]
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
    args = ap.parse_args()
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
                      "busy_receiver": busy_receivers(out, float(np.percentile(idle, 5)) if len(idle) else 0.0)},
                     indent=1))


if __name__ == "__main__":
    main()
