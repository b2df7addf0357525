"""Serving with arrivals: real prompts (prefill) arriving while others decode, one rank in-process, the CUDA
executor, side by side in one run: tokens/s, ITL and time to first token of its prompt paths (CudaExecutor.prompts):
  paged     - a batch holding prompt chunks runs like a decode batch, through the paged kernels (a CUDA graph up to
              the largest bucket; the default since session 18), its attention by row blocks (Triton: each K/V tile
              read once per block of a chunk's rows);
  per-row   - the same with its attention on the decode kernel, row by row (session 18's first form);
  no-yield  - paged, with prompt-only batches not yielding to overdue decode rows (decode_wait_ms=0: the
              engine before session 19); yield-10: yielding after 10 ms instead of the default;
  eager     - all of it by models.attention, decode rows batched (session 16's; session 17's "split", its decode rows
              through the paged kernels and the chunks by models.attention, is gone: run 150).

    python benchmarks/arrivals_bench.py                           # CUDA: GPT-OSS-20B cut to 4 layers, bf16
    python benchmarks/arrivals_bench.py --smoke                   # CPU: tiny-gpt-oss, fp32, seconds
    ... --requests 384 --initial 128 --rate 400 --prompt 64:512 --max-new 64:128 --rounds 2

An untimed pass of the first variant comes first (first-use costs). `--initial` requests arrive at t = 0, the rest
at `--rate` per second (Poisson, seeded); prompt lengths and new
tokens uniform in A:B; greedy, EOS ignored, Zipf routing (benchmarks/gpu_bench.py's setting). Every variant gets the
same requests; the table also says how many requests' tokens equal the first variant's (bf16 batches of another
composition may round a near-tie the other way). TTFT is over all requests (the `--initial` burst shares one
prefill, so it sets the percentiles) and, in the last column, over those arriving later.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import random
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from gpu_bench_common import detach_all, sync  # noqa: E402  (first: Triton's interpreter without CUDA)

from lab.barrier_dist import cut_spec, device_weights  # noqa: E402
from lowering.plan import compile_plan  # noqa: E402
from runtime.drivers.cluster import Cluster, RunOptions  # noqa: E402
from runtime.executors.cuda_executor import PROMPT_PATHS, CudaExecutor  # noqa: E402
from runtime.core.requests import Request  # noqa: E402

# variant -> (CudaExecutor.prompts, row-block attention for chunks: CudaExecutor.block_rows kept, or 0, the engine's
# decode-wait bound in ms: None for the default)
SETTINGS = {"paged": ("paged", True, None), "per-row": ("paged", False, None), "no-yield": ("paged", True, "0"),
            "yield-10": ("paged", True, "10"), "eager": ("eager", True, None)}
VARIANTS = tuple(SETTINGS)
assert set(PROMPT_PATHS) <= {p for p, _, _ in SETTINGS.values()}


def _range(text: str) -> tuple[int, int]:
    a, _, b = text.partition(":")
    return int(a), int(b or a)


def _requests(spec, n: int, initial: int, rate: float, prompt: tuple, new: tuple, seed: int) -> list[tuple]:
    g = random.Random(seed)
    out, t = [], 0.0
    for i in range(n):
        if i >= initial:
            t += g.expovariate(rate)
        out.append(([g.randrange(3, spec.vocab_size - 8) for _ in range(g.randint(*prompt))], g.randint(*new), t))
    return out


@contextlib.contextmanager
def decode_wait(ms):
    """RuntimeOptions.decode_wait_ms = `ms` (None: the default) while the block runs; the options before, after."""
    from runtime import settings
    before = settings.current()
    values = before.model_dump()
    values.pop("decode_wait_ms")
    if ms is not None:
        values["decode_wait_ms"] = ms
    settings.configure(settings.options_from(values, "arrivals_bench"))
    try:
        yield
    finally:
        settings.configure(before)


def _run(variant: str, plan, ex, inner, template, kv_blocks: int, dev, block_rows: int) -> dict:
    inner.prompts, blocks, wait_ms = SETTINGS[variant]
    inner.block_rows = block_rows if blocks else 0
    with decode_wait(None if wait_ms is None else float(wait_ms)):  # the engines read the bound when they are made
        cl = Cluster(plan, ex, RunOptions(policy="defrag", kv_blocks=kv_blocks, stall_timeout_s=300, batch_log=None))
    if hasattr(inner, "prepare"):
        for e in cl.engines:
            inner.prepare(e.kv, owned=e.owned_experts)
    sync(dev)
    t0 = cl.clock.now()  # arrivals count from here (the cluster's clock started before the graphs' capture)
    reqs = [Request(i, f"r{i}", list(p), m, ignore_eos=True, arrival=t0 + a)
            for i, (p, m, a) in enumerate(template)]
    before = dataclasses.asdict(inner.stats)
    t = time.perf_counter()
    cl.run(reqs)
    sync(dev)
    wall = time.perf_counter() - t
    after = dataclasses.asdict(inner.stats)
    detach_all(inner, cl)
    itl = sorted(b - a for r in reqs for a, b in zip(r.token_times, r.token_times[1:]))
    ttft = sorted(r.token_times[0] - r.arrival for r in reqs if r.token_times)
    later = sorted(r.token_times[0] - r.arrival for r in reqs if r.token_times and r.arrival > t0)
    q = lambda xs, p: xs[min(len(xs) - 1, int(p * len(xs)))] * 1e3 if xs else float("nan")  # noqa: E731
    # Where the batches went: attention batches (count, mean rows, host ms in execute + complete) and the executor's
    # paths (graph replays, paged batches without a graph, paged batches with a prompt chunk, batches by
    # models.attention, outputs and claims moved out of a bucket)
    att = [b for e in cl.engines for b in e.metrics.batches if b.kind == "attn"]
    paths = {k: after[k] - before[k] for k in ("attn_graph", "attn_paged_eager", "attn_paged_prompt", "attn_eager",
                                              "attn_outputs_moved", "attn_claims_moved")
             if after[k] != before[k]}
    diag = (f"{len(att)} attention batches, {sum(b.rows for b in att) / max(1, len(att)):.0f} rows each, "
            f"{sum(b.t_end - b.t_start for b in att) * 1e3:.0f} ms in them; {paths}; "
            f"{sum(e.metrics.prompt_yields for e in cl.engines)} prompt batches yielded to decode rows; "
            f"ITL max {itl[-1] * 1e3 if itl else float('nan'):.1f} ms")
    return dict(diag=diag, tokens=sum(len(r.output) for r in reqs), wall=wall,
                tok_s=sum(len(r.output) for r in reqs) / wall, itl50=q(itl, 0.5), itl99=q(itl, 0.99),
                ttft50=q(ttft, 0.5), ttft99=q(ttft, 0.99), later50=q(later, 0.5), outputs=[list(r.output) for r in reqs])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--smoke", action="store_true", help="CPU, tiny-gpt-oss, fp32, small workload")
    ap.add_argument("--model", default="gpt-oss-20b")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--requests", type=int, default=384)
    ap.add_argument("--initial", type=int, default=128)
    ap.add_argument("--rate", type=float, default=400.0)
    ap.add_argument("--prompt", default="64:512")
    ap.add_argument("--max-new", default="64:128")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--variants", default=",".join(VARIANTS))
    args = ap.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if args.smoke or dev.type == "cpu":
        args.model, args.layers, dtype_name = "tiny-gpt-oss", None, "float32"
        args.requests, args.initial, args.rate = min(args.requests, 24), min(args.initial, 8), min(args.rate, 400.0)
        args.prompt, args.max_new = "2:12", "4:8"
    else:
        dtype_name = None
    spec = cut_spec(args.model, args.layers, dtype_name)
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    w = device_weights(spec, dev, dtype)
    plan = compile_plan(spec, 1, "cuda" if dev.type == "cuda" else "cpu")
    P, M = _range(args.prompt), _range(args.max_new)
    inner = CudaExecutor(spec, w, plan, dev, max_context=P[1] + M[1] + 32)
    block_rows = inner.block_rows
    ex = inner
    if dev.type == "cuda":
        from lab.routing_override import ZipfRouting, routed
        ex = routed(inner, ZipfRouting(spec.experts.num_experts, spec.experts.top_k, s=1.2, seed=0))
    template = _requests(spec, args.requests, args.initial, args.rate, P, M, seed=1)
    kv_blocks = math.ceil(args.requests * (P[1] + M[1] + 8) / plan.kv.block_size) + 8
    variants = args.variants.split(",")
    print(f"{spec.name} ({spec.num_layers} layers, {str(dtype)[6:]}) on {dev}: {args.requests} requests, {args.initial} "
          f"at t=0, then {args.rate:g}/s; prompts {args.prompt}, new tokens {args.max_new}; {args.rounds} round(s), "
          f"variants alternating", flush=True)
    # An untimed pass first (the first variant, the first quarter of the requests): the launch's first run pays
    # first-use costs (kernel compiles, allocator growth) that would otherwise land on whichever variant runs first
    # (run 144: identical code paths measured 17-23% apart, the first run of the launch the slower)
    _run(variants[0], plan, ex, inner, template[:max(1, len(template) // 4)], kv_blocks, dev, block_rows)
    rows: dict[str, list] = {v: [] for v in variants}
    for r in range(args.rounds):
        for v in (variants if r % 2 == 0 else variants[::-1]):
            res = _run(v, plan, ex, inner, template, kv_blocks, dev, block_rows)
            rows[v].append(res)
            print(f"  round {r + 1} {v:9s} {res['tok_s']:9.1f} tok/s  ITL p50 {res['itl50']:.2f} p99 {res['itl99']:.2f} "
                  f"ms  TTFT p50 {res['ttft50']:.1f} p99 {res['ttft99']:.1f} (later arrivals p50 {res['later50']:.1f}) ms  "
                  f"({res['wall']:.2f} s)\n      {res['diag']}", flush=True)
    first = rows[variants[0]][0]["outputs"]
    base = statistics.median(x["tok_s"] for x in rows[variants[0]])
    print(f"\n| variant | tok/s (median of {args.rounds}) | vs {variants[0]} | ITL p50 ms | ITL p99 ms | TTFT p50 ms | "
          f"TTFT p99 ms | requests with {variants[0]}'s tokens | TTFT p50 ms, later arrivals |")
    print("|---|---|---|---|---|---|---|---|---|")
    for v in variants:
        med = lambda k: statistics.median(x[k] for x in rows[v])  # noqa: E731
        same = sum(a == b for a, b in zip(rows[v][0]["outputs"], first))
        print(f"| {v} | {med('tok_s'):.1f} | {med('tok_s') / base:.2f}x | {med('itl50'):.2f} | {med('itl99'):.2f} | "
              f"{med('ttft50'):.1f} | {med('ttft99'):.1f} | {same}/{len(first)} | {med('later50'):.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
