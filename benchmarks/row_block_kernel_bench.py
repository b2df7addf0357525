"""The row-block attention against the decode kernel on one prompt chunk and, with --decode, decode rows beside it,
side by side in one run: a chunk of --chunk rows of one sequence at positions --at.., and --decode rows of their own
sequences at context --decode-at (GPT-OSS-20B's heads: 64 query, 8 kv, dim 64; no window), bf16 on CUDA, microseconds
per call for a few tile shapes (--block-t, warps) and the largest difference from the decode kernel. With decode rows
it also times them in one-row blocks of their own (session 18's first form), against the decode kernel for them.

    python benchmarks/row_block_kernel_bench.py --chunk 256 --at 3840
    python benchmarks/row_block_kernel_bench.py --chunk 128 --at 2048 --decode 128 --decode-at 2048

Bytes: the decode kernel reads each row's whole context (rows x context x kv heads x dim x 2 x 2 bytes), the row-block
kernel each K/V tile once per block of rows (blocks x context x ...); a chunk's from L2 (one sequence's K/V).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from dataflow_kernels.paged_attention import (block_rows_for, clear_block_rows, paged_decode_attention_triton,  # noqa: E402
                                     paged_row_block_attention_triton, row_blocks)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--at", type=int, default=3840)
    ap.add_argument("--decode", type=int, default=0, help="decode rows beside the chunk")
    ap.add_argument("--decode-at", type=int, default=2048, help="their context")
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA (the kernels' CPU checks are tests/test_kernels_attention.py)")
        return 0
    dev, dt = torch.device("cuda"), torch.bfloat16
    nh, nkv, d, bs = 64, 8, 64, 16
    n, ctx, nd = args.chunk, args.at + args.chunk, args.decode
    pages, dpages = -(-ctx // bs), -(-args.decode_at // bs)
    width = max(pages, dpages)
    g = torch.Generator(device="cpu").manual_seed(0)
    kc = torch.randn(pages + nd * dpages + 1, bs, nkv, d, generator=g).to(dev, dt)
    vc = torch.randn_like(kc)
    q = torch.randn(n + nd, nh, d, generator=g).to(dev, dt)
    bt = torch.zeros(n + nd, width, dtype=torch.int32, device=dev)
    bt[:n, :pages] = torch.arange(pages, dtype=torch.int32, device=dev)
    for i in range(nd):  # decode row i's pages: its own range after the chunk's
        bt[n + i, :dpages] = torch.arange(pages + i * dpages, pages + (i + 1) * dpages, dtype=torch.int32)
    lens = torch.cat([torch.arange(args.at + 1, ctx + 1), torch.full((nd,), args.decode_at)]).to(dev, torch.int32)
    sinks = torch.randn(nh, generator=g).to(dev, dt)
    segments = [(0, 0, n)] + [(1 + i, n + i, 1) for i in range(nd)]

    def timed(fn) -> tuple[float, torch.Tensor]:
        out = fn()
        torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(args.reps):
            fn()
        b.record()
        torch.cuda.synchronize()
        return a.elapsed_time(b) / args.reps * 1e3, out

    def as_t(v: list[int]) -> torch.Tensor:
        return torch.tensor(v, dtype=torch.int32, device=dev)
    ref_us, ref = timed(lambda: paged_decode_attention_triton(q, kc, vc, bt, lens, 0.125, sinks, None))
    chunk_reads = n * (args.at + n / 2) * nkv * d * 2 * 2
    decode_reads = nd * args.decode_at * nkv * d * 2 * 2
    print(f"chunk {n} rows at {args.at}.., {nd} decode rows at {args.decode_at}: decode kernel {ref_us:.1f} us "
          f"({(chunk_reads + decode_reads) / 1e9:.2f} GB of K/V reads, "
          f"{(chunk_reads + decode_reads) / ref_us / 1e6:.2f} TB/s)")
    print("| rows per block | decode rows | block_t | warps | us | vs decode kernel | K/V reads GB | max abs diff |")
    print("|---|---|---|---|---|---|---|---|")
    for rows in sorted({block_rows_for(nh, nkv), 8, 32}):
        first, count = row_blocks(segments, rows)
        solo = clear_block_rows(lens.clone(), first, count)
        forms = [("decode kernel", as_t(first), as_t(count), solo)]
        if nd:  # each decode row a one-row block (no solo rows)
            forms.append(("one-row blocks", as_t(first + list(range(n, n + nd))), as_t(count + [1] * nd),
                          torch.zeros_like(lens)))
        reads = len(first) * (args.at + n) * nkv * d * 2 * 2 + decode_reads
        for form, f_t, c_t, solo_t in forms:
            for bt_, warps in ((32, 4), (32, 8), (64, 8)):
                us, out = timed(lambda: paged_row_block_attention_triton(
                    q, kc, vc, bt, lens, 0.125, sinks, None, first=f_t, count=c_t, solo_lens=solo_t,
                    rows_per_block=rows, block_t=bt_, num_warps=warps))
                diff = float((out.float() - ref.float()).abs().max())
                print(f"| {rows} | {form if nd else '-'} | {bt_} | {warps} | {us:.1f} | {ref_us / us:.2f}x | "
                      f"{reads / 1e9:.3f} | {diff:.2e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
