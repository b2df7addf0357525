"""Time each kernel (torch reference vs Triton) against its bytes/FLOPs floor.

    python benchmarks/kernels_bench.py --out DIR            # GPU box: GPT-OSS (and DeepSeek MLA) shapes, bf16
    python benchmarks/kernels_bench.py --out DIR --smoke    # tiny shapes (default without CUDA)

Writes DIR/kernels_bench.json (one record per op x shape x implementation) and
DIR/kernels_bench.md (the same as tables). Every implementation's output is checked against the
torch reference first; a failed check is recorded (ok=false), not hidden.

Floors. Each op's minimum time is max(bytes / copy bandwidth, flops / peak bf16 FLOP/s), with the
H200 figures ~4.2 TB/s (nominal HBM3e 4.8 TB/s; ~4.2 is what a device copy achieves) and
~800 TFLOP/s dense bf16 (a sustainable figure, below the 989 TFLOP/s datasheet peak). The copy
bandwidth is also measured here (a large device-to-device copy) and reported next to the nominal
one. Bytes count only the traffic the op cannot avoid (each input read once, each output
written once; intermediates that a fused implementation would keep on chip are not counted), so
"% of floor" is an honest upper bound on how much better any implementation could do.

Timing: CUDA events around `--iters` launches after warmup, median of `--reps` repetitions. With
--graphs (default on CUDA) the launches are also captured in a CUDA graph, which is how the
runtime executes them; implementations that synchronize with the host (the torch references of
grouped_ffn and paged attention read offsets / lengths on the host) cannot be captured and get
no graph time. On CPU (smoke) the Triton kernels run in the interpreter: times there mean nothing.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Callable

import torch

if not torch.cuda.is_available():
    # Must precede triton's first import (kernels/ imports it lazily, at the first launch).
    os.environ.setdefault("TRITON_INTERPRET", "1")

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from dataflow_kernels.dispatch import triton_available  # noqa: E402
from dataflow_kernels.grouped_ffn import grouped_ffn_torch, grouped_ffn_triton  # noqa: E402
from dataflow_kernels.mla_attention import (  # noqa: E402
    paged_mla_attention, paged_mla_attention_gather, triton_fits,
)
from dataflow_kernels.paged_attention import paged_decode_attention_torch, paged_decode_attention_triton  # noqa: E402
from dataflow_kernels.permute import permute_to_experts_torch, permute_to_experts_triton  # noqa: E402
from dataflow_kernels.topk_merge import topk_merge_torch, topk_merge_triton  # noqa: E402
from lab.floors import measure_copy_bps  # noqa: E402

NOMINAL_COPY_BPS = 4.2e12  # H200 achieved device copy, bytes/s
NOMINAL_BF16_FLOPS = 800e12  # H200 sustainable dense bf16, FLOP/s

GPU_SHAPES = dict(
    H=2880, I=2880, k=4, experts=(32, 128),  # GPT-OSS-20B (E=32) and -120B (E=128)
    merge_tokens=(1, 8, 64, 256),  # attention-side batch sizes (tokens)
    ffn_rows=(16, 128, 256, 512, 1024),  # routed expert rows per batch (expert-side buckets)
    nh=64, nkv=8, head_dim=64, block_size=16, attn_batch=(1, 8, 64, 256), context=(1024, 8192),
    windows=(None, 128),  # GPT-OSS alternates full and 128-token sliding layers
    # DeepSeek MLA decode: V2-Lite's 16 heads and V3's 128, latent 512 + rope 64 per token; the decompressed cache
    # it replaced held nope + rope keys (192) and values (128) per head
    mla_heads=(16, 128), mla_rank=512, mla_rope=64, mla_v=128, mla_nope=128, mla_batch=(1, 64, 256),
    mla_context=(1024, 4096),
)
SMOKE_SHAPES = dict(
    H=72, I=40, k=3, experts=(9,), merge_tokens=(1, 5), ffn_rows=(12,),
    nh=6, nkv=2, head_dim=24, block_size=4, attn_batch=(3,), context=(30,), windows=(None, 5),
    mla_heads=(4,), mla_rank=16, mla_rope=4, mla_v=8, mla_nope=8, mla_batch=(3,), mla_context=(30,),
)


# ----------------------------------------------------------------------------------------------
# timing


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_eager(fn: Callable[[], object], device: torch.device, iters: int, reps: int) -> float:
    """Median seconds per call over `reps` runs of `iters` back-to-back calls."""
    fn()
    _sync(device)
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            for _ in range(iters):
                fn()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1e3 / iters)
        else:
            t0 = time.perf_counter()
            for _ in range(iters):
                fn()
            samples.append((time.perf_counter() - t0) / iters)
    return statistics.median(samples)


def time_graph(fn: Callable[[], object], device: torch.device, iters: int, reps: int) -> float | None:
    """Like time_eager, replaying a CUDA graph of `iters` calls; None if capture fails (host sync)."""
    if device.type != "cuda":
        return None
    try:
        stream = torch.cuda.Stream(device)
        stream.wait_stream(torch.cuda.current_stream(device))
        with torch.cuda.stream(stream):  # warm up (Triton compiles, allocator) off the capture
            fn()
        torch.cuda.current_stream(device).wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            for _ in range(iters):
                fn()
    except Exception:
        torch.cuda.synchronize(device)
        return None
    return time_eager(graph.replay, device, 1, reps) / iters


# ----------------------------------------------------------------------------------------------
# records


class Recorder:
    def __init__(self, device: torch.device, copy_bps: float, flops_peak: float, iters: int, reps: int, graphs: bool):
        self.device, self.copy_bps, self.flops_peak = device, copy_bps, flops_peak
        self.iters, self.reps, self.graphs = iters, reps, graphs
        self.records: list[dict] = []

    def run(self, op: str, shape: dict, impls: dict[str, Callable[[], torch.Tensor]], nbytes: float, flops: float,
            compare: Callable[[torch.Tensor, torch.Tensor], tuple[bool, float]]) -> None:
        floor_s = max(nbytes / self.copy_bps, flops / self.flops_peak)
        reference = None
        for name, fn in impls.items():
            rec = dict(op=op, impl=name, **shape, bytes=nbytes, flops=flops, floor_us=floor_s * 1e6)
            try:
                out = fn()
                if reference is None:
                    reference = out  # the first implementation listed is the torch reference
                ok, err = compare(out, reference)
                eager = time_eager(fn, self.device, self.iters, self.reps)
                graph = time_graph(fn, self.device, self.iters, self.reps) if self.graphs else None
                best = min(t for t in (eager, graph) if t is not None)
                rec.update(ok=ok, max_err=err, eager_us=eager * 1e6, graph_us=None if graph is None else graph * 1e6,
                           achieved_GBps=nbytes / best / 1e9, achieved_TFLOPs=flops / best / 1e12,
                           pct_of_floor=100 * floor_s / best)
            except Exception as exc:  # keep going: one broken impl must not hide the others
                rec.update(ok=False, error=f"{type(exc).__name__}: {exc}"[:300])
            self.records.append(rec)
            status = "ok" if rec.get("ok") else "FAIL"
            t = rec.get("graph_us") or rec.get("eager_us")
            print(f"{op:14s} {name:11s} {json.dumps(shape):70s} {status:4s} "
                  f"{'' if t is None else f'{t:9.1f} us'}  floor {floor_s * 1e6:8.1f} us", flush=True)


def exact(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
    out_t = out if isinstance(out, torch.Tensor) else torch.cat([o.reshape(-1).double() for o in out])
    ref_t = ref if isinstance(ref, torch.Tensor) else torch.cat([r.reshape(-1).double() for r in ref])
    return bool(torch.equal(out_t, ref_t)), float((out_t.double() - ref_t.double()).abs().max()) if out_t.numel() else 0.0


def close(rel: float) -> Callable[[torch.Tensor, torch.Tensor], tuple[bool, float]]:
    """max |out - ref| <= rel * max |ref| (bf16 rounding of intermediates differs between impls)."""
    def check(out: torch.Tensor, ref: torch.Tensor) -> tuple[bool, float]:
        if ref.numel() == 0:
            return True, 0.0
        err = float((out.double() - ref.double()).abs().max())
        return err <= rel * float(ref.double().abs().max()) + 1e-6, err
    return check


# ----------------------------------------------------------------------------------------------
# ops


def bench_topk_merge(r: Recorder, S: dict, dtype: torch.dtype, use_triton: bool) -> None:
    H, k, dev, es = S["H"], S["k"], r.device, torch.finfo(dtype).bits // 8
    for T in S["merge_tokens"]:
        N = T * k + 7  # receive buffer with a few unrelated rows
        h_res, shared = torch.randn(T, H, device=dev, dtype=dtype), torch.randn(T, H, device=dev, dtype=dtype)
        rows = torch.randn(N, H, device=dev, dtype=dtype)
        row_index = torch.randperm(N, device=dev)[: T * k].view(T, k)
        weights = torch.rand(T, k, device=dev)
        # bytes: k gathered rows + residual + shared read, h_next written; index int64 + weight fp32
        nbytes = (k + 3) * T * H * es + T * k * 12
        flops = 2 * T * k * H + 2 * T * H  # k multiply-adds per element, then 2 adds
        impls = {"torch": lambda: topk_merge_torch(h_res, shared, rows, row_index, weights)}
        if use_triton:
            impls["triton"] = lambda: topk_merge_triton(h_res, shared, rows, row_index, weights)
        r.run("topk_merge", dict(T=T, H=H, k=k), impls, nbytes, flops, exact)


def bench_permute(r: Recorder, S: dict, dtype: torch.dtype, use_triton: bool) -> None:
    k, dev = S["k"], r.device
    for E in S["experts"]:
        for N in S["ffn_rows"]:
            T = max(1, N // k)
            ids = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(T)])
            # bytes: ids read (int64), order written (int64), offsets written
            impls = {"torch": lambda: permute_to_experts_torch(ids, E)}
            if use_triton:
                impls["triton"] = lambda: permute_to_experts_triton(ids, E)
            r.run("permute", dict(T=T, k=k, E=E), impls, 16 * T * k + 8 * (E + 1), 0, exact)


def bench_grouped_ffn(r: Recorder, S: dict, dtype: torch.dtype, use_triton: bool) -> None:
    H, I, k, dev, es = S["H"], S["I"], S["k"], r.device, torch.finfo(dtype).bits // 8
    for E in S["experts"]:
        gen = torch.Generator(device=dev).manual_seed(E)
        w_gate = torch.randn(E, I, H, device=dev, dtype=dtype, generator=gen) * H ** -0.5
        w_up = torch.randn(E, I, H, device=dev, dtype=dtype, generator=gen) * H ** -0.5
        w_down = torch.randn(E, H, I, device=dev, dtype=dtype, generator=gen) * I ** -0.5
        b_gate, b_up = torch.randn(E, I, device=dev, dtype=dtype) * 0.1, torch.randn(E, I, device=dev, dtype=dtype) * 0.1
        b_down = torch.randn(E, H, device=dev, dtype=dtype) * 0.1
        for N in S["ffn_rows"]:
            T = max(1, N // k)
            ids = torch.stack([torch.randperm(E, device=dev)[:k] for _ in range(T)])  # uniform routing
            order, offsets = permute_to_experts_torch(ids, E)
            x = torch.randn(T, H, device=dev, dtype=dtype)[order // k].contiguous()
            active = int((offsets[1:] > offsets[:-1]).sum())
            # bytes: gate/up/down weights + biases of the experts that got rows, read once; x read,
            # y written. (h [N, I] between the two GEMMs is not counted: it could stay on chip.)
            nbytes = active * (3 * H * I + 2 * I + H) * es + 2 * x.shape[0] * H * es
            flops = 2 * x.shape[0] * H * I * 3  # three GEMMs over the routed rows
            args = (x, offsets, w_gate, w_up, w_down, b_gate, b_up, b_down, "gptoss_glu")
            impls = {"torch": lambda: grouped_ffn_torch(*args)}
            if use_triton:
                impls["triton"] = lambda: grouped_ffn_triton(*args)
            r.run("grouped_ffn", dict(N=x.shape[0], E=E, active=active, H=H, I=I), impls, nbytes, flops,
                  close(3e-2 if dtype != torch.float32 else 1e-4))


def bench_paged_attention(r: Recorder, S: dict, dtype: torch.dtype, use_triton: bool) -> None:
    nh, nkv, d, bs, dev, es = S["nh"], S["nkv"], S["head_dim"], S["block_size"], r.device, torch.finfo(dtype).bits // 8
    sinks = torch.randn(nh, device=dev, dtype=dtype)
    for L in S["context"]:
        for B in S["attn_batch"]:
            max_blocks = math.ceil(L / bs)
            lens = torch.randint(L // 2, L + 1, (B,), device=dev, dtype=torch.int32)  # ragged
            num_blocks = B * max_blocks
            k_cache = torch.randn(num_blocks, bs, nkv, d, device=dev, dtype=dtype)
            v_cache = torch.randn(num_blocks, bs, nkv, d, device=dev, dtype=dtype)
            table = torch.randperm(num_blocks, device=dev).view(B, max_blocks).to(torch.int32)
            q = torch.randn(B, nh, d, device=dev, dtype=dtype)
            for window in S["windows"]:
                visible = lens.clamp(max=window) if window else lens
                ctx = int(visible.sum())
                # bytes: visible K and V of every sequence once (all heads of a group share them),
                # q read, out written, block table; flops: q.k and p.v over the visible keys.
                nbytes = ctx * nkv * 2 * d * es + 2 * B * nh * d * es + table.numel() * 4
                flops = 2 * ctx * nh * 2 * d
                args = (q, k_cache, v_cache, table, lens, d ** -0.5, sinks, window)
                impls = {"torch": lambda: paged_decode_attention_torch(*args)}
                if use_triton:
                    impls["triton"] = lambda: paged_decode_attention_triton(*args)
                r.run("paged_attn", dict(B=B, max_ctx=L, window=window, nh=nh, nkv=nkv, d=d), impls, nbytes, flops,
                      close(2e-2 if dtype != torch.float32 else 1e-4))
            del k_cache, v_cache


def bench_mla_attention(r: Recorder, S: dict, dtype: torch.dtype, use_triton: bool) -> None:
    """MLA decode over the latent cache (one [R + P] row per token shared by every head) in its three forms, and
    the same batch over the decompressed per-head cache it replaced (paged_attn_decompressed: nope + rope keys and
    values per head, the pre-issue-32 layout) for the bytes and time the latent saves."""
    R, P, dv, dn, bs, dev = S["mla_rank"], S["mla_rope"], S["mla_v"], S["mla_nope"], S["block_size"], r.device
    es = torch.finfo(dtype).bits // 8
    scale = (dn + P) ** -0.5
    for nh in S["mla_heads"]:
        for L in S["mla_context"]:
            for B in S["mla_batch"]:
                max_blocks = math.ceil(L / bs)
                lens = torch.randint(L // 2, L + 1, (B,), device=dev, dtype=torch.int32)
                table = torch.randperm(B * max_blocks, device=dev).view(B, max_blocks).to(torch.int32)
                ctx = int(lens.sum())
                shape = dict(B=B, max_ctx=L, nh=nh)
                cache = torch.randn(B * max_blocks, bs, 1, R + P, device=dev, dtype=dtype)
                q = torch.randn(B, nh, R + P, device=dev, dtype=dtype)
                args = (q, cache, R, table, lens, scale)
                impls = {"torch": lambda: paged_mla_attention(*args),
                         "gather": lambda: paged_mla_attention_gather(*args)}
                if use_triton and triton_fits(nh, R, dtype):
                    impls["triton"] = lambda: paged_mla_attention(*args, impl="triton")
                r.run("mla_latent", shape, impls, ctx * (R + P) * es + B * nh * (2 * R + P) * es + table.numel() * 4,
                      2 * ctx * nh * (2 * R + P), close(2e-2 if dtype != torch.float32 else 1e-4))
                del cache
                if B * max_blocks * bs * nh * (dn + P + dv) * es > 40e9:
                    continue  # (V3's 128 heads at B=256 x 4,096: 85 GB of decompressed cache, the reason for latent)
                k = torch.randn(B * max_blocks, bs, nh, dn + P, device=dev, dtype=dtype)
                v = torch.randn(B * max_blocks, bs, nh, dv, device=dev, dtype=dtype)
                qd = torch.randn(B, nh, dn + P, device=dev, dtype=dtype)
                dargs = (qd, k, v, table, lens, scale, None, None)
                impls = {"torch": lambda: paged_decode_attention_torch(*dargs)}
                if use_triton:
                    impls["triton"] = lambda: paged_decode_attention_triton(*dargs)
                r.run("paged_attn_decompressed", shape, impls,
                      ctx * nh * (dn + P + dv) * es + B * nh * (dn + P + dv) * es + table.numel() * 4,
                      2 * ctx * nh * (dn + P + dv), close(2e-2 if dtype != torch.float32 else 1e-4))
                del k, v


# ----------------------------------------------------------------------------------------------


def write_markdown(path: Path, meta: dict, records: list[dict]) -> None:
    lines = [f"# Kernel benchmark ({meta['date']})", "",
             f"device: {meta['device']}; dtype {meta['dtype']}; torch {meta['torch']}; triton {meta['triton']}",
             f"copy bandwidth: measured {meta['measured_copy_GBps']} GB/s, floor uses {meta['copy_GBps_used']} GB/s; "
             f"peak {meta['peak_TFLOPs']} TFLOP/s", ""]
    for op in dict.fromkeys(r["op"] for r in records):
        rows = [r for r in records if r["op"] == op]
        keys = [k for k in rows[0] if k not in ("op", "impl", "bytes", "flops", "floor_us", "ok", "max_err", "eager_us",
                                                "graph_us", "achieved_GBps", "achieved_TFLOPs", "pct_of_floor", "error")]
        lines += [f"## {op}", "", "| " + " | ".join(keys + ["impl", "ok", "eager us", "graph us", "floor us",
                                                            "GB/s", "TFLOP/s", "% of floor"]) + " |",
                  "|" + "---|" * (len(keys) + 8)]
        fmt = lambda v, f="{:.1f}": "-" if v is None else f.format(v)  # noqa: E731
        for r in rows:
            lines.append("| " + " | ".join([str(r[k]) for k in keys] + [
                r["impl"], "yes" if r.get("ok") else f"NO {r.get('error', '')}", fmt(r.get("eager_us")),
                fmt(r.get("graph_us")), fmt(r["floor_us"]), fmt(r.get("achieved_GBps")),
                fmt(r.get("achieved_TFLOPs"), "{:.2f}"), fmt(r.get("pct_of_floor"))]) + " |")
        lines.append("")
    path.write_text("\n".join(lines))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--smoke", action="store_true", help="tiny shapes, few iterations (default without CUDA)")
    p.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32"])
    p.add_argument("--ops", default="topk_merge,permute,grouped_ffn,paged_attn,mla_attn")
    p.add_argument("--iters", type=int, default=None)
    p.add_argument("--reps", type=int, default=None)
    p.add_argument("--no-graphs", action="store_true")
    args = p.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    smoke = args.smoke or device.type != "cuda"
    S = SMOKE_SHAPES if smoke else GPU_SHAPES
    dtype = getattr(torch, args.dtype)
    iters = args.iters or (1 if smoke else 20)
    reps = args.reps or (1 if smoke else 5)
    torch.manual_seed(0)
    measured = measure_copy_bps(device)
    copy_bps = NOMINAL_COPY_BPS  # the floor uses the nominal figure; the measured one is reported
    rec = Recorder(device, copy_bps, NOMINAL_BF16_FLOPS, iters, reps, graphs=not args.no_graphs)
    use_triton = triton_available() and (device.type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1")
    benches = dict(topk_merge=bench_topk_merge, permute=bench_permute, grouped_ffn=bench_grouped_ffn,
                   paged_attn=bench_paged_attention, mla_attn=bench_mla_attention)
    for op in args.ops.split(","):
        benches[op](rec, S, dtype, use_triton)

    triton_version = None
    if triton_available():
        import triton

        triton_version = triton.__version__
    meta = dict(date=time.strftime("%Y-%m-%d %H:%M:%S"), device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu",
                dtype=args.dtype, torch=torch.__version__, triton=triton_version, smoke=smoke, iters=iters, reps=reps,
                measured_copy_GBps=None if measured is None else round(measured / 1e9, 1),
                copy_GBps_used=copy_bps / 1e9, peak_TFLOPs=NOMINAL_BF16_FLOPS / 1e12, shapes={k: str(v) for k, v in S.items()},
                command=" ".join(sys.argv))
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "kernels_bench.json").write_text(json.dumps(dict(meta=meta, records=rec.records), indent=1))
    write_markdown(args.out / "kernels_bench.md", meta, rec.records)
    failed = [r for r in rec.records if not r.get("ok")]
    print(f"wrote {args.out}/kernels_bench.json and .md; {len(failed)} failed checks")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
