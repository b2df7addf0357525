"""An attention layer of a mixed batch (decode rows beside a new prompt's chunk: what a serving rank runs whenever a
request arrives during decode) with its one-row segments batched (models.attention._attend_segments, session 16)
against every segment one by one (the path such batches took before), and a pure decode batch for scale, side by
side in one run: milliseconds per layer and the ratio. Then the CUDA executor's whole attention stage (routing
included) of the same batches and of the chunk alone, by each of its prompt paths (CudaExecutor.prompts): "paged",
the whole batch through the paged kernels like a decode batch (a CUDA graph on CUDA up to the largest bucket;
session 18), and "eager", all by models.attention; and the pure decode batch on its bucketed path. With the Triton
kernels "paged" runs a batch with chunks by row blocks (each K/V tile read once per block of a chunk's rows), and
"paged, row by row" on the decode kernel (CudaExecutor.block_rows = 0; session 18's first form).

    python benchmarks/mixed_batch_bench.py                          # tiny-gpt-oss, on CUDA if there is one
    python benchmarks/mixed_batch_bench.py --spec gpt-oss-20b --layers 1 --decode 256 --chunk 256 --context 512

Random weights of the spec (cut to --layers), one PagedKVStore page table per sequence, decode rows at position
--context, the chunk at positions --chunk-at.. of a sequence (its earlier positions' K/V are whatever the store holds).
Every variant's outputs are checked against the eager one's (1e-2 relative in bf16, 1e-5 in fp32).
"""
from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
from graph_ir.spec import load_spec  # noqa: E402
from models import layers  # noqa: E402
from lab.reference import PerSegmentKV  # noqa: E402
from models.weights import random_weights  # noqa: E402
from runtime.executors.cuda_executor import PROMPT_PATHS, CudaExecutor  # noqa: E402
from runtime.core.kv_cache import BlockAllocator, PagedKVStore  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--spec", default="tiny-gpt-oss")
    ap.add_argument("--layers", type=int, default=1)
    ap.add_argument("--layer", type=int, default=None,
                    help="the layer timed (default the first MoE one; GPT-OSS's odd layers attend without a window)")
    ap.add_argument("--decode", type=int, default=256)
    ap.add_argument("--chunk", type=int, default=40)
    ap.add_argument("--context", type=int, default=100)
    ap.add_argument("--chunk-at", type=int, default=0,
                    help="the chunk's first position (a later chunk of a long prompt)")
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--device", default=None)
    args = ap.parse_args(argv)
    dev = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    spec = load_spec(ROOT / "models" / "specs" / f"{args.spec}.yaml")
    keep = max(args.layers, (args.layer or 0) + 1)
    spec = spec.model_copy(update={"num_layers": min(keep, spec.num_layers)})
    dtype = torch.float32 if dev.type == "cpu" else getattr(torch, spec.dtype)
    w = random_weights(spec, device=dev, dtype=dtype)
    D, P = args.decode, args.chunk
    longest = max(args.context, args.chunk_at + P) + 1
    kv = PagedKVStore(spec.num_layers, BlockAllocator((D + 1) * ((longest + 16) // 16 + 1), 16))
    for s in range(D + 1):
        kv.reserve(s, longest)
    layer = args.layer if args.layer is not None else next((i for i in range(spec.num_layers) if spec.is_moe_layer(i)), 0)
    g = torch.Generator().manual_seed(0)
    h = (torch.randn(D + P, spec.hidden_size, generator=g) * 0.1).to(dev, dtype)
    k = D // 2  # the chunk sits between decode rows, as a queue's order puts it
    mixed = [(s, s, 1) for s in range(k)] + [(D, k, P)] + [(s, P + s, 1) for s in range(k, D)]
    c0 = args.chunk_at
    pos_mixed = torch.tensor([args.context] * k + list(range(c0, c0 + P)) + [args.context] * (D - k), device=dev)
    decode = [(s, s, 1) for s in range(D)]
    pos_decode = torch.full((D,), args.context, device=dev)

    def run(store, segs, pos, x):
        with torch.no_grad():
            return layers.attention_stage(spec, w, layer, x, pos, segs, store)[0]

    def timed(fn, *a):
        out = fn(*a)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t = time.perf_counter()
        for _ in range(args.reps):
            fn(*a)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        return (time.perf_counter() - t) / args.reps * 1e3, out

    t_dec, _ = timed(run, kv, decode, pos_decode, h[:D])
    t_new, out_new = timed(run, kv, mixed, pos_mixed, h)
    t_old, out_old = timed(run, PerSegmentKV(kv), mixed, pos_mixed, h)
    rel = float((out_new.float() - out_old.float()).abs().max() / out_old.float().abs().max())
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    print(f"{args.spec} layer {layer} (window {spec.attention.window(layer)}) on {dev} ({str(dtype)[6:]}): {D} decode "
          f"rows at context {args.context}, a {P}-row chunk at {args.chunk_at}; ms per attention layer")
    print("| batch | ms | vs pure decode |")
    print("|---|---|---|")
    print(f"| pure decode ({D} rows) | {t_dec:.2f} | 1.00x |")
    print(f"| mixed, decode rows batched | {t_new:.2f} | {t_new / t_dec:.2f}x |")
    print(f"| mixed, one segment at a time (before) | {t_old:.2f} | {t_old / t_dec:.2f}x |")
    print(f"batched against one by one: {t_old / t_new:.1f}x faster; outputs max relative difference {rel:.2e} "
          f"(tolerance {tol:g}): {'ok' if rel <= tol else 'FAILED'}")

    # The executor (its own page tables over the same store; its attention and routing as the engine calls them):
    # each batch by each prompt path (CudaExecutor.prompts); a prompt-only batch (the chunk alone) too
    ex = CudaExecutor(spec, w, device=dev, max_context=max(args.context, P + args.chunk_at) + 16)
    ex.prepare(kv)
    pos_m, pos_d = pos_mixed.tolist(), pos_decode.tolist()
    chunk = [(D, 0, P)]
    pos_c = pos_m[k:k + P]

    def ex_run(segs, pos, x):
        with torch.no_grad():
            return ex.attention(layer, x, pos, segs, kv)[0]
    e_dec, _ = timed(ex_run, decode, pos_d, h[:D])
    print(f"\nthe CUDA executor's attention stage (routing included; graphs: {ex.attn_graphs}, attention buckets up to "
          f"{max(ex.buckets['attn'])} rows); ms per layer")
    print("| batch | prompt path | ms | speed-up over eager | vs pure decode |")
    print("|---|---|---|---|---|")
    print(f"| pure decode ({D} rows) | (bucketed) | {e_dec:.2f} | | 1.00x |")
    ok_e = True
    batches = ((f"mixed ({D} + {P} rows)", mixed, pos_m, h), (f"prompt only ({P} rows)", chunk, pos_c, h[k:k + P]))
    block_rows = ex.block_rows
    paths = ("eager",) + (("paged, row by row",) if block_rows else ()) + ("paged",)  # eager first: the reference
    assert set(PROMPT_PATHS) <= set(paths)
    for name, segs, pos, x in batches:
        times, outs = {}, {}
        for path in paths:
            ex.prompts = path.split(",")[0]
            ex.block_rows = 0 if "row by row" in path else block_rows
            times[path], outs[path] = timed(ex_run, segs, pos, x)
            ref = outs["eager"].float()
            rel_p = float((outs[path].float() - ref).abs().max() / ref.abs().max())
            ok_e &= rel_p <= tol
            print(f"| {name} | {path} | {times[path]:.2f} | {times['eager'] / times[path]:.2f}x | "
                  f"{times[path] / e_dec:.2f}x | (max relative difference {rel_p:.1e}"
                  f"{'' if rel_p <= tol else ' FAILED'})")
    ok_e &= ex.stats.attn_paged_prompt > 0
    print(f"outputs within {tol:g} of eager; {ex.stats.attn_paged_prompt} paged prompt batches: "
          f"{'ok' if ok_e else 'FAILED'}")
    return 0 if rel <= tol and ok_e else 1


if __name__ == "__main__":
    raise SystemExit(main())
