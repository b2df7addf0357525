"""Decode rows under a flood of long prompts, on the virtual clock (the engine, queues and scheduler as in real runs,
the simulated executor, a cost model for batch times): ITL and TTFT per scheduling policy, with the engine's
decode-wait bound (prompt-only batches yield to decode rows that waited that long at their stage; decode_wait_ms)
at each of --bounds, side by side in one run. CPU only, seconds.

    python benchmarks/prefill_flood_sim.py                       # run 154's load: 96 requests, 2-8k-token prompts
    python benchmarks/prefill_flood_sim.py --policies defrag,mtfs,flfs --bounds 0,2,10

Why: on the H200 (run 154) a burst of long prompts gave ITL p99 0.5-1.1 s: a policy that scores queue depth runs the
prompts' batches of a layer before the decode wave behind them moves on. Batch times: attention 150 us + 0.1 us a
row, expert 200 us + 0.3 us a row (a 1,024-row prompt batch ~0.25 ms per layer at GPT-OSS-20B shapes, runs 153-154).
"""
from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from arrivals_bench import decode_wait  # noqa: E402

from lab.barrier_dist import cut_spec  # noqa: E402
from lowering.plan import compile_plan  # noqa: E402
from runtime.drivers.cluster import Cluster, RunOptions  # noqa: E402
from runtime.executors.cost_model import CostModel  # noqa: E402
from runtime.executors.sim_executor import SimExecutor  # noqa: E402
from runtime.core.requests import Request  # noqa: E402


def _range(text: str) -> tuple[int, int]:
    a, _, b = text.partition(":")
    return int(a), int(b or a)


def flood(policy: str, bound_ms: float, *, model: str = "gpt-oss-20b", layers: int = 4, requests: int = 96,
          initial: int = 32, rate: float = 40.0, prompt=(2048, 8192), new=(16, 32), attn_per_row: float = 0.1e-6,
          seed: int = 1, ranks: int = 1) -> dict:
    """One run: ITL / TTFT percentiles (seconds) and the engine's counts. `bound_ms` 0: the guard off."""
    spec = cut_spec(model, layers, None)
    plan = compile_plan(spec, ranks, "cpu")
    g = random.Random(seed)
    t, reqs = 0.0, []
    for i in range(requests):
        if i >= initial:
            t += g.expovariate(rate)
        reqs.append(Request(i, f"r{i}", [5] * g.randint(*prompt), g.randint(*new), ignore_eos=True, arrival=t))
    cost = CostModel(attn_fixed=150e-6, attn_per_row=attn_per_row, expert_fixed=200e-6, expert_per_row=0.3e-6)
    kv_blocks = requests * (prompt[1] + new[1] + 16) // plan.kv.block_size + 8  # (per rank: room for all)
    with decode_wait(bound_ms):  # read when the engine is made
        cl = Cluster(plan, SimExecutor.for_spec(spec), RunOptions(policy=policy, clock="virtual", executor="sim",
                                                                  cost_model=cost, kv_blocks=kv_blocks))
        res = cl.run(reqs)
    itl = sorted(b - a for r in reqs for a, b in zip(r.token_times, r.token_times[1:]))
    ttft = sorted(r.token_times[0] - r.arrival for r in reqs)
    q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))]  # noqa: E731
    return dict(itl50=q(itl, 0.5), itl99=q(itl, 0.99), itl_max=itl[-1], ttft50=q(ttft, 0.5), ttft99=q(ttft, 0.99),
                end=max(r.token_times[-1] for r in reqs), tokens=sum(len(r.output) for r in reqs),
                wanted=sum(r.max_new_tokens for r in reqs),
                yields=res.metrics["prompt_yields"])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--policies", default="defrag,aging")
    ap.add_argument("--bounds", default="0,2,5", help="decode-wait bounds in ms (0: the guard off; default 2)")
    ap.add_argument("--requests", type=int, default=96)
    ap.add_argument("--initial", type=int, default=32)
    ap.add_argument("--rate", type=float, default=40.0)
    ap.add_argument("--prompt", default="2048:8192")
    ap.add_argument("--max-new", default="16:32")
    ap.add_argument("--attn-per-row-us", type=float, default=0.1)
    args = ap.parse_args(argv)
    print(f"{args.requests} requests ({args.initial} at t=0, then {args.rate:g}/s), prompts {args.prompt}, "
          f"{args.max_new} new tokens; GPT-OSS-20B cut to 4 layers, one rank, virtual clock")
    print("| policy | decode wait bound ms | ITL p50 ms | ITL p99 ms | ITL max ms | TTFT p50 ms | TTFT p99 ms | "
          "last token s | prompt batches that yielded |")
    print("|---|---|---|---|---|---|---|---|---|")
    for policy in args.policies.split(","):
        for b in args.bounds.split(","):
            r = flood(policy, float(b), requests=args.requests, initial=args.initial, rate=args.rate,
                      prompt=_range(args.prompt), new=_range(args.max_new), attn_per_row=args.attn_per_row_us * 1e-6)
            print(f"| {policy} | {b if float(b) else 'off'} | {r['itl50'] * 1e3:.1f} | {r['itl99'] * 1e3:.1f} | "
                  f"{r['itl_max'] * 1e3:.1f} | {r['ttft50'] * 1e3:.0f} | {r['ttft99'] * 1e3:.0f} | {r['end']:.2f} | "
                  f"{r['yields']} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
