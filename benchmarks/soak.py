"""Soak: serve requests arriving over time on CPU rank processes for a while; does rank memory stay flat, and is
every output there exactly once, of the right length?

What `dataflow run -o out.jsonl --ignore-eos` does (runtime/drivers/multiproc.py's run_workloads_multiprocess: one process
per rank, gloo + ZeroMQ, rank 0 writing each request's line as it finishes and keeping no outputs), on a workload
of seeded random prompts whose arrivals are a Poisson process at --rate requests/s for --minutes. Every
--sample-s seconds this reads every rank process's VmRSS from /proc/PID/status (the launcher's children that carry
RANK in their environment); at the end it checks the output file (every request once, max_new_tokens tokens each,
finish reason "length") and compares each rank's RSS after the warm-up (the first sample at or after
--warmup-minutes, default a quarter of the run, at least 20 s) with its last sample while serving: flat = grown by
at most --tolerance (10%). Also the least-squares slope over the samples after the warm-up (MB per minute).

    python benchmarks/soak.py --minutes 2          # a quick check
    python benchmarks/soak.py --minutes 30         # the soak of issue 29

Writes soak_<minutes>min.json and .md to --out (default benchmarks/results/soak). Exit 0 when outputs are complete
and every rank stayed flat, else 1. Linux only (/proc).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def rank_pids(parent: int) -> dict[int, int]:
    """rank -> pid of `parent`'s rank children (runtime.drivers.launch sets RANK and DATAFLOW_LAUNCH_DIR in their env)."""
    out = {}
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) != parent:
                    continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = dict(x.split(b"=", 1) for x in f.read().split(b"\0") if b"=" in x)
        except (OSError, ValueError, IndexError):
            continue
        if b"DATAFLOW_LAUNCH_DIR" in env and b"RANK" in env:
            out[int(env[b"RANK"])] = int(pid)
    return out


def rss_kb(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1])
    except OSError:
        return None
    return None


class Sampler(threading.Thread):
    """Every `every` s: (seconds since start, {rank: VmRSS kB}) of this process's rank children."""

    def __init__(self, every: float) -> None:
        super().__init__(daemon=True)
        self.every = every
        self.samples: list[tuple[float, dict[int, int]]] = []
        self.pids: dict[int, int] = {}
        self.stop = threading.Event()
        self.t0 = time.monotonic()

    def run(self) -> None:
        me = os.getpid()
        while not self.stop.is_set():
            if not self.pids:
                self.pids = rank_pids(me)
            got = {r: v for r, p in self.pids.items() if (v := rss_kb(p)) is not None}
            if got:
                self.samples.append((time.monotonic() - self.t0, got))
            self.stop.wait(self.every)


def workload(spec, minutes: float, rate: float, max_new: int, max_prompt: int, seed: int):
    from runtime.core.requests import Request
    rng = random.Random(seed)
    vocab = [t for t in range(spec.vocab_size) if t not in set(spec.eos_token_ids)]
    reqs, t, end = [], 0.0, minutes * 60.0
    while True:
        t += rng.expovariate(rate)
        if t >= end:
            return reqs
        n = rng.choice([rng.randint(1, 8), rng.randint(8, max_prompt)])
        reqs.append(Request(len(reqs), f"req-{len(reqs)}", [rng.choice(vocab) for _ in range(n)], max_new,
                            ignore_eos=True, arrival=t))


def check_outputs(path: Path, reqs: list, max_new: int) -> dict:
    seen: dict[str, int] = {}
    wrong = []
    for line in path.read_text().splitlines():
        d = json.loads(line)
        seen[d["id"]] = seen.get(d["id"], 0) + 1
        if len(d["output_token_ids"]) != max_new or d["finish_reason"] != "length":
            wrong.append(d["id"])
    names = {r.name for r in reqs}
    return {"requests": len(reqs), "lines": sum(seen.values()), "missing": sorted(names - set(seen))[:20],
            "missing_count": len(names - set(seen)), "duplicated": sorted(k for k, v in seen.items() if v > 1)[:20],
            "unknown": sorted(set(seen) - names)[:20], "wrong_length": wrong[:20], "wrong_length_count": len(wrong)}


def slope_mb_per_min(points: list[tuple[float, int]]) -> float:
    if len(points) < 2:
        return 0.0
    n = len(points)
    mx = sum(t for t, _ in points) / n
    my = sum(v for _, v in points) / n
    den = sum((t - mx) ** 2 for t, _ in points)
    return 0.0 if den == 0 else sum((t - mx) * (v - my) for t, v in points) / den * 60 / 1024


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--minutes", type=float, default=2.0, help="how long requests keep arriving")
    ap.add_argument("--ranks", type=int, default=2)
    ap.add_argument("--model", default="tiny", help="a shipped model name (models/specs) or a spec YAML")
    ap.add_argument("--rate", type=float, default=20.0, help="requests per second (Poisson arrivals)")
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-prompt", type=int, default=48)
    ap.add_argument("--sample-s", type=float, default=5.0, help="seconds between RSS samples")
    ap.add_argument("--warmup-minutes", type=float, default=None,
                    help="default: a quarter of --minutes, at least 20 s")
    ap.add_argument("--tolerance", type=float, default=0.10, help="allowed RSS growth after the warm-up")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--peer-timeout", type=float, default=10.0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "soak")
    a = ap.parse_args()
    if not sys.platform.startswith("linux"):
        print("soak.py reads /proc: Linux only", file=sys.stderr)
        return 2

    from dataflow.cmd_compile import resolve_model
    from lowering.plan import compile_plan
    from runtime.drivers.cluster import RunOptions
    from runtime.drivers.multiproc import RunFailed, run_workloads_multiprocess

    spec, _ = resolve_model(a.model)
    plan = compile_plan(spec, a.ranks)
    reqs = workload(spec, a.minutes, a.rate, a.max_new_tokens, a.max_prompt, a.seed)
    warmup_s = a.warmup_minutes * 60 if a.warmup_minutes is not None else max(20.0, a.minutes * 15)
    tmp = Path(tempfile.mkdtemp(prefix="dataflow-soak-"))
    out_path = tmp / "out.jsonl"
    fields = {f.name for f in dataclasses.fields(RunOptions)}
    streams = "output_path" in fields  # (before issue 29: outputs come back at the end; written here then)
    opts = RunOptions(output_path=str(out_path), keep_outputs=False) if streams else RunOptions()
    print(f"soak: {len(reqs)} requests over {a.minutes:g} min ({a.rate:g}/s, {a.max_new_tokens} tokens each) on "
          f"{a.ranks} CPU rank processes of {spec.name}; RSS every {a.sample_s:g} s, warm-up {warmup_s:.0f} s",
          flush=True)
    sampler = Sampler(a.sample_s)
    sampler.start()
    t0 = time.monotonic()
    error = None
    result = None
    try:
        [result] = run_workloads_multiprocess(plan, [(reqs, opts)], peer_timeout_s=a.peer_timeout)
    except RunFailed as err:
        error = str(err)
    wall = time.monotonic() - t0
    sampler.stop.set()
    sampler.join()
    if not streams and result is not None:
        from runtime.drivers.workload import output_line
        out_path.write_text("".join(output_line(r) for r in result.requests))
    outputs = check_outputs(out_path, reqs, a.max_new_tokens) if out_path.exists() else {"error": "no output file"}

    # The end: the last sample with every rank alive (after it, rank 0 alone builds the run's result)
    ranks = sorted({r for _, s in sampler.samples for r in s})
    serving = [(t, s) for t, s in sampler.samples if len(s) == len(ranks)]
    last_t = serving[-1][0] if serving else float("inf")
    mem = {}
    for r in ranks:
        pts = [(t, s[r]) for t, s in sampler.samples if r in s and t <= last_t]
        after = [(t, v) for t, v in pts if t >= warmup_s]
        warm = after[0] if after else (pts[-1] if pts else (0.0, 0))
        end = pts[-1] if pts else (0.0, 0)
        growth = (end[1] - warm[1]) / warm[1] if warm[1] else 0.0
        mem[r] = {"first_mb": round(pts[0][1] / 1024, 1) if pts else None, "warm_mb": round(warm[1] / 1024, 1),
                  "warm_t_s": round(warm[0], 1), "end_mb": round(end[1] / 1024, 1), "end_t_s": round(end[0], 1),
                  "max_mb": round(max(v for _, v in pts) / 1024, 1) if pts else None,
                  "growth": round(growth, 4), "slope_mb_per_min": round(slope_mb_per_min(after), 2),
                  "flat": growth <= a.tolerance}
    ok_outputs = ("error" not in outputs and not outputs["missing_count"] and not outputs["duplicated"]
                  and not outputs["unknown"] and not outputs["wrong_length_count"])
    ok = error is None and ok_outputs and bool(mem) and all(m["flat"] for m in mem.values())
    report = {"minutes": a.minutes, "ranks": a.ranks, "model": spec.name, "rate": a.rate,
              "max_new_tokens": a.max_new_tokens, "requests": len(reqs), "wall_s": round(wall, 1),
              "warmup_s": warmup_s, "tolerance": a.tolerance, "error": error, "outputs": outputs,
              "outputs_ok": ok_outputs, "memory": mem, "ok": ok, "streamed_outputs": streams,
              "metrics": {k: v for k, v in (result.metrics if result else {}).items()
                          if isinstance(v, (int, float, str))},
              "samples": [[round(t, 1), s] for t, s in sampler.samples],
              "date": time.strftime("%Y-%m-%d %H:%M:%S"), "cpus": os.cpu_count()}
    a.out.mkdir(parents=True, exist_ok=True)
    stem = a.out / f"soak_{a.minutes:g}min"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    md = [f"# Soak: {a.minutes:g} min, {a.ranks} CPU ranks, {spec.name}", "",
          f"`python benchmarks/soak.py --minutes {a.minutes:g} --rate {a.rate:g} --max-new-tokens "
          f"{a.max_new_tokens}` ({report['date']}, {os.cpu_count()} CPUs)", "",
          f"- {len(reqs)} requests arriving over {a.minutes:g} min; run took {wall:.0f} s"
          + (f"; FAILED: {error}" if error else ""),
          f"- outputs: {outputs.get('lines')} lines for {len(reqs)} requests; missing {outputs.get('missing_count')}, "
          f"duplicated {len(outputs.get('duplicated', []))}, wrong length {outputs.get('wrong_length_count')} -> "
          f"{'ok' if ok_outputs else 'NOT OK'}", "",
          f"| rank | first MB | after warm-up MB (t) | end MB (t) | growth | slope after warm-up | within "
          f"{a.tolerance:.0%} |", "|---|---|---|---|---|---|---|"]
    for r, m in mem.items():
        md.append(f"| {r} | {m['first_mb']} | {m['warm_mb']} ({m['warm_t_s']:.0f} s) | {m['end_mb']} "
                  f"({m['end_t_s']:.0f} s) | {m['growth']:+.1%} | {m['slope_mb_per_min']:+.2f} MB/min | "
                  f"{'yes' if m['flat'] else 'NO'} |")
    md += ["", f"Result: {'PASS' if ok else 'FAIL'}", ""]
    stem.with_suffix(".md").write_text("\n".join(md))
    print("\n".join(md))
    print(f"written: {stem}.json, {stem}.md")
    import shutil
    shutil.rmtree(tmp, ignore_errors=True)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
