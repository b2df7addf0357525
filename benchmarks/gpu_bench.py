"""GPU checks and timings of the CUDA executor in one command (see benchmarks/NOTES.md).

    python benchmarks/gpu_bench.py --out DIR                 # device box: everything, ~6-8 min on one H200
    python benchmarks/gpu_bench.py --out DIR --smoke         # CPU: tiny shapes, the same code paths, < 60 s
    python benchmarks/gpu_bench.py --out DIR --sections correctness,executor   # pick sections

Sections (each prints progress and lands in DIR/gpu_bench.json + DIR/gpu_bench.md):
  correctness  tiny models, all policies, 2 in-process ranks. fp32 GPU tokens vs the fp32 CPU
               reference (near-tie margin 1e-3, the tests' rule). bf16 (router-x30 variant of the
               model, see BF16_ROUTER_SCALE): (1) teacher-forced logits, the reference's tokens fed
               back through the runtime, max|diff| / max|logit| vs the stated tolerance u (6L+2),
               u = 2^-8 (bf16_logit_tol), over the steps that are not router near-ties
               (_router_near_ties: left out and counted); (2) free-running tokens vs the reference up to the first
               step whose reference top-2 margin is below delta = 2 x the largest |logit error|
               of an independent bf16 run (the CPU reference in bf16), plus the greedy prefix that
               matches before the first divergence. Per grouped-FFN implementation.
  executor     GPT-OSS-20B shapes (bf16, random weights): per expert bucket and routing skew, GPU
               time of one expert batch (graph replay) vs its bytes floor and the measured device
               copy ceiling; per attention bucket and context, GPU time and the host microseconds
               of attention()+route() and experts(); graphs vs eager for the same call. Outputs
               are checked against the TorchExecutor on the same device first.
  e2e          GPT-OSS-20B cut to --layers layers, decode-only (random prompt KV), Zipf routing,
               all requests at t=0, --concurrency levels: streaming (per policy) vs all-gather EP
               vs all-to-all EP (lab/barrier.py; skipped with the reason if it cannot run on
               the GPU), --ranks in-process ranks on one GPU. tokens/s, ITL p50/p99, CPU us per
               attention / expert batch and the share hidden behind GPU work.
  mp           (--mp-ranks N) the streaming engine through runtime/drivers/multiproc.py, one process per GPU.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path

import torch

from gpu_bench_common import log  # first: Triton's interpreter without CUDA, the repository on sys.path
from gpu_bench_correctness import section_correctness
from gpu_bench_e2e import section_e2e, section_mp
from gpu_bench_executor import section_executor


GPU = dict(model="gpt-oss-20b", expert_rows=[16, 128, 256, 512, 1024], skews=[0.0, 1.2],
           attn_batch=[1, 8, 40, 128, 256], contexts=[512, 2048], block=16, iters=20,
           attn_buckets=[1, 8, 40, 72, 104, 128, 192, 256], expert_buckets=[128, 256, 512, 1024, 2048],
           concurrency=[64, 256], prompt=512, max_new=32)
SMOKE = dict(model="tiny-gpt-oss", dtype="float32", expert_rows=[5, 16], skews=[0.0, 1.2], attn_batch=[3],
             contexts=[20], block=4, iters=2, attn_buckets=[1, 8], expert_buckets=[8, 16], concurrency=[4],
             prompt=6, max_new=3)


def write_md(path: Path, meta: dict, results: dict) -> None:
    L = [f"# GPU bench ({meta['date']})", "", f"device {meta['device']}; torch {meta['torch']}; triton {meta['triton']}; "
         f"command `{meta['command']}`", ""]
    if "correctness" in results:
        L += ["## Correctness vs the fp32 CPU reference", "",
              "fp32: shipped weights, tokens up to the first near-tie (margin 1e-3). bf16: router-x30 variant; "
              "teacher-forced logits (the reference's tokens fed back) max|diff| / max|logit| against the stated "
              "tolerance u (6L+2), u = 2^-8, over the steps that are not router near-ties (the reference's k-th and "
              "(k+1)-th router logits closer than twice the CPU bf16 router-logit error at some layer: another rounding "
              "may pick the other expert there; left out: the count after the ratio), and tokens up to the first "
              "near-tie of 2x the CPU bf16 logit error; 'greedy prefix': tokens equal before each request's first "
              "divergence, any margin.", "",
              "| model | dtype | weights | ffn | policy | logits ratio (tol; CPU bf16; steps left out) | tol (margin) | "
              "compared | mismatches | greedy prefix | ok |", "|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in results["correctness"]:
            lr = (f"{r['tf_ratio']:.4f} ({r['tf_tol']:.3f}; {r['cpu_bf16_ratio']:.4f}; "
                  f"{r['tf_left_out']}/{r['tf_left_out'] + r['tf_steps']})" if "tf_ratio" in r else "-")
            L.append(f"| {r.get('model')} | {r.get('dtype')} | {r.get('variant', '-')} | {r.get('ffn')} | "
                     f"{r.get('policy', '-')} | {lr} | {r.get('tol', 0):.4f} | {r.get('compared', '-')} | "
                     f"{r.get('mismatches', '-')} | {r.get('prefix_match', '-')}/{r.get('prefix_total', '-')} | "
                     f"{'yes' if r.get('ok') else 'NO ' + str(r.get('error') or r.get('first_mismatch') or '')} |")
        L.append("")
    ex = results.get("executor")
    if ex:
        L += [f"## Executor (copy ceiling {ex.get('copy_GBps') and round(ex['copy_GBps'])} GB/s)", "",
              "| op | impl | graphs | N/B | zipf/ctx | active/window | gpu us | host us | host CPU us | floor us | GB/s | % copy | ok |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        f = lambda v: "-" if v is None else (f"{v:.1f}" if isinstance(v, float) else str(v))  # noqa: E731
        for r in ex.get("rows", []):
            if r["op"] == "experts":
                L.append(f"| experts | {r['ffn']} | {r['graphs']} | {r['N']} | {r['zipf_s']} | {r['active']} | "
                         f"{f(r.get('gpu_us'))} | {f(r.get('host_us'))} | {f(r.get('host_cpu_us'))} | {f(r.get('floor_us'))} | "
                         f"{f(r.get('GBps'))} | {f(r.get('pct_copy_ceiling'))} | {r.get('ok')} |")
            else:
                L.append(f"| attention | paged | {r['graphs']} | {r['B']} | {r['context']} | {r['window']} | "
                         f"{f(r.get('gpu_us'))} | {f(r.get('host_us'))} | {f(r.get('host_cpu_us'))} | {f(r.get('floor_us'))} | "
                         f"{f(r.get('GBps'))} | - | {r.get('ok')} |")
        L.append("")
        prof = [r for r in ex.get("rows", []) if r.get("kernels")]
        if prof:
            L += ["### Graph kernels (`--profile-graphs`: torch.profiler over 10 replays; launches and device us per replay)", ""]
            for r in prof:
                what = (f"experts {r['ffn']} N={r['N']} zipf={r['zipf_s']}" if r["op"] == "experts"
                        else f"attention B={r['B']} ctx={r['context']} window={r['window']}")
                L += [f"{what}:", "", "| kernel | launches | us |", "|---|---|---|"]
                L += [f"| {n} | {c:.1f} | {t:.1f} |" for n, c, t in r["kernels"]] + [""]
    if results.get("e2e"):
        L += ["## End to end (decode-only, Zipf routing, in-process ranks on one GPU)", "",
              "| system | policy | C | tokens/s | steady tokens/s | ratio vs a2a | ITL p50 ms | ITL p99 ms | "
              "attn CPU us (hidden) | expert CPU us (hidden) | graphs: prepare / in run | note |",
              "|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for r in results["e2e"]:
            b = r.get("batches", {})
            cell = lambda k: "-" if k not in b else f"{b[k]['host_us']:.0f} ({100 * (b[k]['hidden_share'] or 0):.0f}%)"  # noqa: E731
            fm = lambda v, p=1: "-" if v is None else f"{v:.{p}f}"  # noqa: E731
            L.append(f"| {r['system']} | {r['policy']} | {r['concurrency']} | {fm(r.get('tokens_per_s'))} | "
                     f"{fm(r.get('steady_tokens_per_s'))} | {fm(r.get('ratio_vs_a2a'), 2)} | {fm(r.get('itl_p50_ms'), 2)} | "
                     f"{fm(r.get('itl_p99_ms'), 2)} | {cell('attn')} | {cell('expert')} | "
                     f"{r.get('graphs_captured', '-')} / {r.get('captured_in_run', '-')} | {r.get('skipped') or ''} |")
        L.append("")
    if results.get("mp"):
        L += ["## Multi-process", "", "```", json.dumps(results["mp"], indent=1), "```", ""]
    path.write_text("\n".join(L))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--smoke", action="store_true", help="tiny shapes (default without CUDA)")
    p.add_argument("--sections", default="correctness,executor,e2e")
    p.add_argument("--check-models", default="tiny-gpt-oss,tiny-qwen3-moe")
    p.add_argument("--check-requests", type=int, default=12)
    p.add_argument("--check-new", type=int, default=8)
    p.add_argument("--ffn-impls", default="triton")
    p.add_argument("--layers", type=int, default=4, help="e2e: GPT-OSS-20B cut to this many layers")
    p.add_argument("--ranks", type=int, default=2, help="e2e: in-process ranks (one device)")
    p.add_argument("--systems", default="streaming,ag-ep,a2a-ep")
    p.add_argument("--policies", default="defrag")
    p.add_argument("--concurrency", default=None, help="e2e: comma list (default 64,256; smoke 4)")
    p.add_argument("--max-new", type=int, default=None)
    p.add_argument("--prompt", type=int, default=None)
    p.add_argument("--zipf", type=float, default=1.2)
    p.add_argument("--expert-cap", type=int, default=None,
                   help="e2e: routed rows (slots, with the device-routed dispatch) per expert batch and largest expert "
                        "bucket (default: the plan's, lowering.plan.default_expert_cap)")
    p.add_argument("--profile-graphs", action="store_true",
                   help="executor: also the kernels each captured graph runs (torch.profiler), in gpu_bench.md")
    p.add_argument("--attn-batch", default=None, help="executor: comma list of attention batch sizes")
    p.add_argument("--contexts", default=None, help="executor: comma list of attention contexts")
    p.add_argument("--expert-rows", default=None, help="executor: comma list of expert batch rows")
    p.add_argument("--mp-ranks", type=int, default=0, help="also run the multi-process path on this many GPUs")
    p.add_argument("--mp-layers", type=int, default=2)
    p.add_argument("--mp-timeout", type=float, default=240.0)
    args = p.parse_args(argv)
    dev = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    smoke = args.smoke or dev.type != "cuda"
    S = dict(SMOKE if smoke else GPU)
    if args.concurrency:
        S["concurrency"] = [int(c) for c in args.concurrency.split(",")]
    for name in ("attn_batch", "contexts", "expert_rows"):
        if getattr(args, name):
            S[name] = [int(c) for c in getattr(args, name).split(",")]
    if args.max_new:
        S["max_new"] = args.max_new
    if args.prompt:
        S["prompt"] = args.prompt
    if smoke:
        args.check_requests = min(args.check_requests, 4)
        args.check_new = min(args.check_new, 4)
        args.check_models = args.check_models.split(",")[0]
        args.layers = min(args.layers, 2)
    torch.manual_seed(0)
    torch.set_num_threads(min(8, os.cpu_count() or 1))
    triton_v = None
    try:
        import triton
        triton_v = triton.__version__
    except Exception:  # noqa: BLE001
        pass
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M:%S"), device=torch.cuda.get_device_name(dev) if dev.type == "cuda" else "cpu",
                torch=torch.__version__, triton=triton_v, smoke=smoke, command=" ".join(sys.argv), shapes=S)
    log(f"gpu_bench on {meta['device']} (torch {meta['torch']}, triton {triton_v}); sections {args.sections}")
    results: dict = {}
    args.out.mkdir(parents=True, exist_ok=True)

    def dump() -> None:
        (args.out / "gpu_bench.json").write_text(json.dumps(dict(meta=meta, results=results), indent=1, default=str))
        write_md(args.out / "gpu_bench.md", meta, results)

    sections = args.sections.split(",") + (["mp"] if args.mp_ranks else [])
    for sec in sections:
        t = time.perf_counter()
        try:
            if sec == "correctness":
                section_correctness(args, dev, results)
            elif sec == "executor":
                section_executor(args, dev, results, S)
            elif sec == "e2e":
                section_e2e(args, dev, results, S)
            elif sec == "mp":
                section_mp(args, dev, results, S)
            else:
                raise ValueError(f"unknown section {sec}")
        except Exception as err:  # noqa: BLE001  one broken section must not lose the others
            results.setdefault("errors", []).append(f"{sec}: {type(err).__name__}: {err}")
            traceback.print_exc()
        log(f"section {sec} took {time.perf_counter() - t:.1f} s")
        dump()
    bad = [r for r in results.get("correctness", []) if not r.get("ok")]
    bad += [r for r in results.get("executor", {}).get("rows", []) if not r.get("ok")]
    log(f"wrote {args.out}/gpu_bench.json and .md; {len(bad)} failed checks; errors: {results.get('errors', [])}")
    return 1 if bad or results.get("errors") else 0


if __name__ == "__main__":
    sys.exit(main())
