"""Host price of one Triton kernel launch, taken apart (CUDA only): where the ~54 us of a topk_merge launch go.

The 'y' message of a device-routed layer ends in one topk_merge launch outside any CUDA graph (the merge of the
holders' partial sums; runtime/engine.Engine._merged), two per layer-wave and rank. Variants, each the mean host time
of one call (no synchronization inside; median of 5 rounds):

- wrapper: dataflow_kernels.topk_merge.topk_merge (checks, output allocation, backend choice, the JIT launch);
- jit: the jitted kernel's `kernel[grid](...)` alone (Triton's binder, cache key, launch);
- compiled: the CompiledKernel the JIT returned, run directly with the bound arguments (no binder, no key);
- the wrapper with a no-op launch, and its steps one by one;
- torch: the same sum as separate torch ops (h_res + shared + y0 + y1 in fp32), for scale.

    python benchmarks/triton_launch_bench.py [--reps 2000]
"""
from __future__ import annotations

import argparse
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from benchmarks.host_speed import per_call_us  # noqa: E402 - after the path above


class _NoLaunch:
    """Stands in for the jitted kernel: `[grid](...)` does nothing (the wrapper's own cost)."""

    def __getitem__(self, grid):
        return lambda *args, **meta: None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=2000)
    ap.add_argument("--rows", type=int, default=256)
    args = ap.parse_args()
    import triton

    from dataflow_kernels.dispatch import cdiv, next_power_of_2
    from dataflow_kernels.topk_merge import _TOPK_MERGE, topk_merge

    dev = torch.device("cuda")
    T, H, k = args.rows, 2880, 2  # a device-routed holder group on 2 ranks: one partial sum per holder
    h = torch.randn(T, H, dtype=torch.bfloat16, device=dev)
    sh = torch.randn(T, H, dtype=torch.bfloat16, device=dev)
    ys = torch.randn(T * k, H, dtype=torch.bfloat16, device=dev)
    ri = torch.arange(T * k, device=dev).view(k, T).t().contiguous()
    w = torch.ones(T, k, device=dev)
    out = torch.empty_like(h)
    block_h = min(1024, next_power_of_2(H))
    grid = (T, cdiv(H, block_h))
    a = (h, sh, ys, ri, w, out, H, h.stride(0), sh.stride(0), ys.stride(0), out.stride(0))
    meta = dict(K=k, HAS_SHARED=True, BLOCK_H=block_h, num_warps=4, enable_fp_fusion=False)
    jit = _TOPK_MERGE._get()
    compiled = jit[grid](*a, **meta)
    rows = [("wrapper: topk_merge(...)", per_call_us(lambda: topk_merge(h, sh, ys, ri, w), args.reps)),
            ("jit: kernel[grid](...)", per_call_us(lambda: jit[grid](*a, **meta), args.reps))]
    from triton.runtime.driver import driver
    drv = driver.active
    bound = a + (k, True, block_h)  # the constexprs follow the runtime arguments in the signature

    def direct():
        stream = drv.get_current_stream(drv.get_current_device())
        compiled.run(grid[0], grid[1], 1, stream, compiled.function, compiled.packed_metadata, None, None, None,
                     *bound)
    try:
        direct()
        torch.cuda.synchronize()
        ref = torch.empty_like(out)
        ref.copy_(out)
        out.zero_()
        direct()
        torch.cuda.synchronize()
        same = torch.equal(out, ref)
        rows.append((f"compiled: CompiledKernel.run (output equal to the jit launch: {same})",
                     per_call_us(direct, args.reps)))
    except Exception as err:  # noqa: BLE001 - the launcher's signature differs between Triton versions
        rows.append((f"compiled: unavailable ({type(err).__name__}: {err})", float("nan")))
    # The wrapper's own steps, each on these CUDA tensors (run 102: the wrapper cost 58 us where the JIT launch
    # inside it cost 18: where do the other 40 go?)
    import dataflow_kernels.topk_merge as tm
    from dataflow_kernels import dispatch
    jitted, _TOPK_MERGE._jitted = _TOPK_MERGE._jitted, _NoLaunch()
    try:
        rows.append(("wrapper with a no-op launch", per_call_us(lambda: topk_merge(h, sh, ys, ri, w), args.reps)))
    finally:
        _TOPK_MERGE._jitted = jitted
    rows.append(("  _check", per_call_us(lambda: tm._check(h, sh, ys, ri, w), args.reps)))
    rows.append(("  backend_for", per_call_us(lambda: dispatch.backend_for(h, sh, ys, ri, w), args.reps)))
    rows.append(("  torch.empty like the output", per_call_us(
        lambda: torch.empty((T, H), dtype=dispatch.kernel_store_dtype(h.dtype), device=h.device), args.reps)))
    rows.append(("  out.to(same dtype)", per_call_us(lambda: out.to(h.dtype), args.reps)))
    rows.append(("  three _last_dim_dense + two contiguous", per_call_us(
        lambda: (tm._last_dim_dense(h), tm._last_dim_dense(ys), tm._last_dim_dense(sh), ri.contiguous(),
                 w.contiguous()), args.reps)))
    rows.append(("  five strides", per_call_us(
        lambda: (h.stride(0), sh.stride(0), ys.stride(0), out.stride(0), w.stride(0)), args.reps)))
    rows.append(("torch: four fp32 ops", per_call_us(
        lambda: (h.float() + sh.float() + ys[:T].float() + ys[T:].float()).to(h.dtype), args.reps)))
    rows.append(("torch: current_stream()", per_call_us(torch.cuda.current_stream, args.reps)))
    rows.append(("triton: driver get_current_stream", per_call_us(
        lambda: drv.get_current_stream(drv.get_current_device()), args.reps)))
    torch.cuda.synchronize()
    print(f"torch {torch.__version__}, triton {triton.__version__}, rows {T}")
    for name, us in rows:
        print(f"{us:9.2f} us  {name}")


if __name__ == "__main__":
    main()
