"""The row-block attention kernel against the decode kernel on one prompt chunk, side by side in one run: a chunk of
--chunk rows of one sequence at positions --at.. (GPT-OSS-20B's heads: 64 query, 8 kv, dim 64; no window), bf16 on
CUDA, microseconds per call for a few tile shapes (--block-t, warps) and the largest difference from the decode kernel.

    python benchmarks/row_block_kernel_bench.py --chunk 256 --at 3840

Bytes: the decode kernel reads each row's whole context (rows x context x kv heads x dim x 2 x 2 bytes), the row-block
kernel each K/V tile once per block of rows (blocks x context x ...); both mostly from L2 (one sequence's K/V).
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from kernels.paged_attention import (block_rows_for, paged_decode_attention_triton,  # noqa: E402
                                     paged_row_block_attention_triton, row_blocks)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--chunk", type=int, default=256)
    ap.add_argument("--at", type=int, default=3840)
    ap.add_argument("--reps", type=int, default=50)
    args = ap.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs CUDA (the kernels' CPU checks are tests/test_kernels.py)")
        return 0
    dev, dt = torch.device("cuda"), torch.bfloat16
    nh, nkv, d, bs = 64, 8, 64, 16
    n, ctx = args.chunk, args.at + args.chunk
    pages = -(-ctx // bs)
    g = torch.Generator(device="cpu").manual_seed(0)
    kc = torch.randn(pages + 1, bs, nkv, d, generator=g).to(dev, dt)
    vc = torch.randn(pages + 1, bs, nkv, d, generator=g).to(dev, dt)
    q = torch.randn(n, nh, d, generator=g).to(dev, dt)
    bt = torch.arange(pages, dtype=torch.int32, device=dev)[None].expand(n, pages).contiguous()
    lens = torch.arange(args.at + 1, ctx + 1, dtype=torch.int32, device=dev)
    sinks = torch.randn(nh, generator=g).to(dev, dt)

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
    ref_us, ref = timed(lambda: paged_decode_attention_triton(q, kc, vc, bt, lens, 0.125, sinks, None))
    per_row = n * (args.at + n / 2) * nkv * d * 2 * 2
    print(f"chunk {n} rows at {args.at}..: decode kernel {ref_us:.1f} us ({per_row / 1e9:.2f} GB of K/V reads, "
          f"{per_row / ref_us / 1e3:.2f} TB/s)")
    print("| rows per block | block_t | warps | us | vs decode kernel | K/V reads GB | max abs diff |")
    print("|---|---|---|---|---|---|---|")
    for rows in sorted({block_rows_for(nh, nkv), 8, 32}):
        first, count = row_blocks([(0, 0, n)], rows)
        f_t = torch.tensor(first, dtype=torch.int32, device=dev)
        c_t = torch.tensor(count, dtype=torch.int32, device=dev)
        reads = len(first) * (args.at + n) * nkv * d * 2 * 2
        for bt_, warps in ((32, 4), (32, 8), (64, 8)):
            us, out = timed(lambda: paged_row_block_attention_triton(
                q, kc, vc, bt, lens, 0.125, sinks, None, first=f_t, count=c_t, rows_per_block=rows,
                block_t=bt_, num_warps=warps))
            diff = float((out.float() - ref.float()).abs().max())
            print(f"| {rows} | {bt_} | {warps} | {us:.1f} | {ref_us / us:.2f}x | {reads / 1e9:.3f} | {diff:.2e} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
