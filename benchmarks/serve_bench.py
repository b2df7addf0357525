"""Serving benchmark, in the style of vLLM's `bench serve`: requests arrive at a rate against a running
`dataflow serve` (or one this script starts), streamed, and the client measures what a user sees.

    python benchmarks/serve_bench.py --plan dataflow-plan --num-prompts 200 --request-rate 8
    python benchmarks/serve_bench.py --base-url http://127.0.0.1:8000 --dataset gsm8k --request-rate inf

Prompt and output lengths come from the ShareGPT or GSM8K length tables (lab/lengths.py, clipped to
--max-context); prompts are random token ids (the shipped specs have random weights and no tokenizer), outputs run
to their sampled length (ignore_eos). Arrivals are a Poisson process at --request-rate requests/s (inf: all at once),
seeded. Reported: request throughput, output tokens/s, and TTFT / TPOT / ITL mean, p50, p90, p99 (ITL: the time
between consecutive streamed chunks of a request, divided by the tokens in the later chunk). Writes serve_bench.json
and serve_bench.md to --out.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))


def _pct(xs: list[float], p: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(p / 100 * (len(s) - 1))))]


async def _one(client, base: str, model: str, prompt: list[int], max_tokens: int, delay: float) -> dict:
    await asyncio.sleep(delay)
    body = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True, "ignore_eos": True,
            "temperature": 0}
    t0 = time.perf_counter()
    times, counts, error = [], [], None
    try:
        async with client.stream("POST", f"{base}/v1/completions", json=body) as res:
            if res.status_code != 200:
                error = f"HTTP {res.status_code}: {(await res.aread())[:200]!r}"
            else:
                async for line in res.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    n = len(json.loads(line[6:])["choices"][0].get("token_ids") or ())
                    if n:
                        times.append(time.perf_counter())
                        counts.append(n)
    except Exception as err:  # noqa: BLE001 (counted as a failed request)
        error = f"{type(err).__name__}: {err}"
    end = time.perf_counter()
    out = sum(counts)
    itl = [(b - a) / n for a, b, n in zip(times, times[1:], counts[1:])]
    return {"ok": error is None and out == max_tokens, "error": error, "prompt": len(prompt), "output": out,
            "ttft": times[0] - t0 if times else None, "latency": end - t0,
            "tpot": (times[-1] - times[0]) / (out - 1) if out > 1 else None, "itl": itl}


async def run(args) -> dict:
    if args.plan:
        from lab.serve_thread import serve_in_thread
        t0 = time.monotonic()
        with serve_in_thread(Path(args.plan), kv_blocks=args.kv_blocks, max_outstanding=args.max_outstanding) as (
                base, _server):
            print(f"server up in {time.monotonic() - t0:.1f} s at {base}", file=sys.stderr)
            return await _measure(args, base)
    return await _measure(args, args.base_url)


async def _measure(args, base: str) -> dict:
    import httpx

    from lab.lengths import length_distribution
    async with httpx.AsyncClient(timeout=None, limits=httpx.Limits(max_connections=None)) as client:
        served = (await client.get(f"{base}/v1/models")).json()["data"][0]
        model, vocab = served["id"], args.vocab_size or served.get("vocab_size", 500)
        lengths = length_distribution(args.dataset, args.max_context).sample(args.num_prompts, args.seed)
        rng = random.Random(args.seed)
        prompts = [[rng.randrange(3, vocab) for _ in range(ln.prompt)] for ln in lengths]
        delays, t = [], 0.0
        for _ in lengths:
            delays.append(t)
            t += 0.0 if args.request_rate == float("inf") else rng.expovariate(args.request_rate)
        t0 = time.perf_counter()
        results = await asyncio.gather(*(_one(client, base, model, p, ln.output, d)
                                         for p, ln, d in zip(prompts, lengths, delays)))
        wall = time.perf_counter() - t0
    ok = [r for r in results if r["ok"]]
    itl = [x for r in ok for x in r["itl"]]
    report = {"model": model, "dataset": args.dataset, "num_prompts": args.num_prompts,
              "request_rate": args.request_rate, "completed": len(ok), "failed": len(results) - len(ok),
              "errors": sorted({r["error"] for r in results if r["error"]})[:5], "duration_s": wall,
              "request_throughput": len(ok) / wall, "output_tokens_per_s": sum(r["output"] for r in ok) / wall,
              "total_input_tokens": sum(r["prompt"] for r in ok), "total_output_tokens": sum(r["output"] for r in ok)}
    for name, xs in (("ttft", [r["ttft"] for r in ok if r["ttft"] is not None]),
                     ("tpot", [r["tpot"] for r in ok if r["tpot"] is not None]), ("itl", itl),
                     ("e2e", [r["latency"] for r in ok])):
        report[f"mean_{name}_ms"] = statistics.fmean(xs) * 1e3 if xs else 0.0
        for p in (50, 90, 99):
            report[f"p{p}_{name}_ms"] = _pct(xs, p) * 1e3
    return report


def write(report: dict, out: Path, command: str) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "serve_bench.json").write_text(json.dumps(report, indent=1))
    rows = [f"# Serving benchmark: {report['model']}, {report['dataset']} lengths", "",
            f"`{command}` ({time.strftime('%Y-%m-%d %H:%M:%S')})", "",
            f"- {report['completed']} of {report['num_prompts']} requests completed ({report['failed']} failed) in "
            f"{report['duration_s']:.1f} s at {report['request_rate']} requests/s offered",
            f"- request throughput {report['request_throughput']:.2f} req/s, output {report['output_tokens_per_s']:.1f} "
            f"tokens/s ({report['total_input_tokens']} prompt, {report['total_output_tokens']} output tokens)", "",
            "| ms | mean | p50 | p90 | p99 |", "|---|---|---|---|---|"]
    for name in ("ttft", "tpot", "itl", "e2e"):
        rows.append(f"| {name.upper()} | " + " | ".join(f"{report[f'{k}_{name}_ms']:.1f}"
                                                      for k in ("mean", "p50", "p90", "p99")) + " |")
    if report["errors"]:
        rows += ["", "errors: " + "; ".join(report["errors"])]
    (out / "serve_bench.md").write_text("\n".join(rows) + "\n")
    print("\n".join(rows))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    where = ap.add_mutually_exclusive_group(required=True)
    where.add_argument("--base-url", help="a running `dataflow serve`, e.g. http://127.0.0.1:8000")
    where.add_argument("--plan", help="a plan directory: start `dataflow serve` on it in this process first")
    ap.add_argument("--dataset", default="sharegpt", choices=("sharegpt", "gsm8k"))
    ap.add_argument("--num-prompts", type=int, default=200)
    ap.add_argument("--request-rate", type=float, default=float("inf"), help="requests/s, Poisson (inf: all at once)")
    ap.add_argument("--max-context", type=int, default=512, help="prompt + output tokens at most")
    ap.add_argument("--vocab-size", type=int, default=None,
                    help="prompt token ids are drawn from 3..this (default: the served model's vocabulary)")
    ap.add_argument("--kv-blocks", type=int, default=None)
    ap.add_argument("--max-outstanding", type=int, default=4096)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", type=Path, default=ROOT / "benchmarks" / "results" / "serve")
    args = ap.parse_args()
    report = asyncio.run(run(args))
    write(report, args.out, "python benchmarks/serve_bench.py " + " ".join(sys.argv[1:]))
    sys.exit(0 if report["failed"] == 0 else 1)


if __name__ == "__main__":
    main()
