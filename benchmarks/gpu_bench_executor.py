"""gpu_bench's executor section (benchmarks/gpu_bench.py --sections executor): the CUDA executor's expert and attention
calls on GPT-OSS-20B shapes, checked against the TorchExecutor, then timed: device time per graph replay against the
bytes floor and the measured copy ceiling, host time per call, graphs against eager (`--profile-graphs`: the kernels
each graph runs)."""
from __future__ import annotations

import json
import random
import time
import traceback

import torch

from gpu_bench_common import log, sync
from lab.barrier_dist import cut_spec, device_weights
from lab.floors import expert_batch_bytes, measure_copy_bps
from runtime.core.kv_cache import BlockAllocator, PagedKVStore
from runtime.executors.cuda_executor import CudaExecutor
from runtime.executors.torch_executor import TorchExecutor



def time_call(fn, dev: torch.device, iters: int) -> tuple[float, float]:
    """(GPU seconds per call from events, host seconds per call) over `iters` back-to-back calls."""
    fn()
    sync(dev)
    if dev.type == "cuda":
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    host = (time.perf_counter() - t) / iters
    if dev.type == "cuda":
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / 1e3 / iters, host
    return host, host


def time_call_host(fn, dev: torch.device, iters: int, waited) -> tuple[float, float, float]:
    """time_call plus the host CPU per call: the loop's wall time minus the time the same calls
    spent blocked on events (`waited()`: the executor's cumulative wait counters), both read
    around exactly the timed calls, so it is the host work inside the calls and never negative.
    (Not process_time: CUDA event waits spin, so they would count as CPU.)"""
    fn()
    sync(dev)
    w0 = waited()
    if dev.type == "cuda":
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
    t = time.perf_counter()
    for _ in range(iters):
        fn()
    wall = time.perf_counter() - t
    blocked = waited() - w0
    host_cpu = max(wall - blocked, 0.0) / iters
    if dev.type == "cuda":
        e.record()
        e.synchronize()
        return s.elapsed_time(e) / 1e3 / iters, wall / iters, host_cpu
    return wall / iters, wall / iters, host_cpu


def replay_gpu_s(ex, key: tuple, dev: torch.device, iters: int) -> float | None:
    """Pure device time of one captured graph: back-to-back replays between two events (the
    per-call timing includes the host's staging and, for attention, the routing wait)."""
    g = ex.graphs._graphs.get(key)
    if dev.type != "cuda" or g is None or g.graph is None:
        return None
    gpu, _ = time_call(g.graph.replay, dev, iters)
    return gpu


def graph_kernels(ex, key: tuple, dev: torch.device, replays: int = 10, top: int = 14) -> list | None:
    """What one captured graph runs on the device (`--profile-graphs`): torch.profiler over `replays` back-to-back
    replays, the kernels (and copies/memsets) grouped by name: [name, launches per replay, device us per replay], the
    largest first (top `top`, the rest summed as "(other)"), and first a ("(all)", launches, us) row."""
    g = ex.graphs._graphs.get(key)
    if dev.type != "cuda" or g is None or g.graph is None:
        return None
    g.graph.replay()
    sync(dev)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    with torch.profiler.profile(activities=acts) as prof:
        for _ in range(replays):
            g.graph.replay()
        sync(dev)
    return kernel_table(prof, replays, top)


def kernel_table(prof, replays: int, top: int) -> list:
    """graph_kernels' table from a finished torch.profiler run, read from its chrome trace (the device events'
    "cat", as benchmarks/trace_summary.py reads them on the device machine)."""
    import tempfile
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        events = json.load(open(f.name))["traceEvents"]
    by: dict = {}
    for e in events:
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset"):
            n, t = by.get(e["name"], (0, 0.0))
            by[e["name"]] = (n + 1, t + e["dur"])
    rows = sorted(([name[:90], n / replays, t / replays] for name, (n, t) in by.items()), key=lambda r: -r[2])
    out = [["(all)", sum(r[1] for r in rows), sum(r[2] for r in rows)]] + rows[:top]
    if len(rows) > top:
        out.append(["(other)", sum(r[1] for r in rows[top:]), sum(r[2] for r in rows[top:])])
    return out


def zipf_ids(n: int, E: int, s: float, g: random.Random) -> list[int]:
    w = [1.0 / (i + 1) ** s for i in range(E)]
    return g.choices(range(E), weights=w, k=n)


def section_executor(args, dev: torch.device, results: dict, S: dict) -> None:
    res = results.setdefault("executor", {})
    copy_bps = measure_copy_bps(dev)
    res["copy_GBps"] = None if copy_bps is None else copy_bps / 1e9
    ceiling = copy_bps or 4.2e12
    spec = cut_spec(S["model"], 2, S.get("dtype"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    w = device_weights(spec, dev, dtype)
    H, I, E, k = spec.hidden_size, spec.experts.intermediate_size, spec.experts.num_experts, spec.experts.top_k
    es = torch.finfo(dtype).bits // 8
    log(f"executor: {spec.name} H={H} I={I} E={E} k={k} {dtype}; copy ceiling "
        f"{'-' if copy_bps is None else f'{copy_bps / 1e9:.0f} GB/s'}")
    torch_ex = TorchExecutor(spec, w)
    rows = []
    for impl in args.ffn_impls.split(",") if dev.type == "cuda" else ["torch"]:
        for graphs in (True, False):
            try:
                ex = CudaExecutor(spec, w, None, dev, ffn_impl=impl, graphs=graphs,
                                  buckets={"attn": S["attn_buckets"], "expert": S["expert_buckets"]})
            except Exception as err:  # noqa: BLE001
                log(f"  experts {impl}: {err!r}")
                continue
            for skew in S["skews"]:
                for N in S["expert_rows"]:
                    g = random.Random(N)
                    ids = zipf_ids(N, E, skew, g) if skew > 0 else [g.randrange(E) for _ in range(N)]
                    x = (torch.randn(N, H, device=dev, dtype=dtype) * 0.5)
                    rec = dict(op="experts", ffn=impl, graphs=graphs, N=N, zipf_s=skew, active=len(set(ids)))
                    try:
                        y = ex.experts(0, x, ids)
                        want = torch_ex.experts(0, x, ids)
                        err = float((y.float() - want.float()).abs().max() / (want.float().abs().max() + 1e-9))
                        call_gpu, host, host_cpu = time_call_host(lambda: ex.experts(0, x, ids), dev, S["iters"],
                                                                  lambda: ex.staging.wait_s)
                        from runtime.executors.capture import bucket_for
                        key = ("expert", 0, bucket_for(N, S["expert_buckets"]))
                        gpu = replay_gpu_s(ex, key, dev, S["iters"]) or call_gpu
                        if args.profile_graphs:
                            rec["kernels"] = graph_kernels(ex, key, dev)
                        rec["call_gpu_us"] = call_gpu * 1e6  # back-to-back calls: max(host, device) per call
                        nbytes = expert_batch_bytes(rec["active"], N, H, I, es)
                        flops = 6 * N * H * I
                        floor = max(nbytes / ceiling, flops / 800e12)
                        rec.update(rel_err=err, ok=err < (3e-2 if dtype != torch.float32 else 1e-4),
                                   gpu_us=gpu * 1e6, host_us=host * 1e6, host_cpu_us=host_cpu * 1e6,
                                   bytes=nbytes, flops=flops,
                                   floor_us=floor * 1e6, GBps=nbytes / gpu / 1e9, pct_copy_ceiling=100 * nbytes / gpu / ceiling,
                                   TFLOPs=flops / gpu / 1e12)
                    except Exception as err:  # noqa: BLE001
                        rec.update(ok=False, error=f"{type(err).__name__}: {err}"[:300])
                        traceback.print_exc()
                    rows.append(rec)
                    log(f"  experts ffn={impl:10s} graphs={graphs!s:5s} N={N:5d} zipf={skew} active={rec['active']:3d} "
                        f"{'ok' if rec.get('ok') else 'BAD'} gpu {rec.get('gpu_us', 0):8.1f} us host {rec.get('host_us', 0):7.1f} us "
                        f"floor {rec.get('floor_us', 0):7.1f} us {rec.get('GBps', 0):7.0f} GB/s "
                        f"({rec.get('pct_copy_ceiling', 0):.0f}% of copy) {rec.get('error', '')}")
    # attention: decode batches over a paged cache holding `ctx` random positions per sequence
    a = spec.attention
    for graphs in (True, False):
        ex = CudaExecutor(spec, w, None, dev, graphs=graphs, max_context=max(S["contexts"]) + 64,
                          buckets={"attn": S["attn_buckets"], "expert": S["expert_buckets"]})
        for ctx in S["contexts"]:
            for B in S["attn_batch"]:
                kv = PagedKVStore(spec.num_layers, BlockAllocator(B * (ctx // S["block"] + 4), S["block"]))
                for sid in range(B):
                    kv.reserve(sid, ctx + 8)
                ex._view(kv)
                for layer in range(spec.num_layers):  # random history (the paper's dummy KV)
                    kc, vc = kv.storage(layer)
                    kc.normal_()
                    vc.normal_()
                h = torch.randn(B, H, device=dev, dtype=dtype)
                positions = [ctx] * B
                segs = [(sid, sid, 1) for sid in range(B)]
                for layer in range(spec.num_layers):
                    window = a.window(layer)
                    rec = dict(op="attention", graphs=graphs, B=B, context=ctx, window=window)
                    try:
                        if graphs and layer == 0:
                            ex.prepare(kv)

                        def call():
                            # The same KV slot is rewritten each call: timing, not serving.
                            _, x = ex.attention(layer, h, positions, segs, kv)
                            return ex.route(layer, x)
                        if graphs:  # outputs vs the torch path on a copy of the cache state
                            _, x = ex.attention(layer, h, positions, segs, kv)
                            ids, _ = ex.route(layer, x)
                            kv2 = PagedKVStore(spec.num_layers, BlockAllocator(kv.allocator.num_blocks, S["block"]))
                            for sid in range(B):
                                kv2.reserve(sid, ctx + 8)
                            for l2 in range(spec.num_layers):
                                k0, v0 = kv.storage(l2)
                                kv2.preallocate(l2, k0.shape[2:], v0.shape[2:], dtype, dev)
                                kv2.storage(l2)[0].copy_(k0)
                                kv2.storage(l2)[1].copy_(v0)
                            _, wx = torch_ex.attention(layer, h, positions, segs, kv2)
                            rec["rel_err_x"] = float((x.float() - wx.float()).abs().max() / (wx.float().abs().max() + 1e-9))
                            del kv2
                        call_gpu, host, host_cpu = time_call_host(
                            call, dev, S["iters"], lambda: ex.staging.wait_s)  # route_wait_s is part of it
                        from runtime.executors.capture import bucket_for
                        key = ("attn", layer, bucket_for(B, S["attn_buckets"]), kv._cuda_exec_serial)
                        gpu = replay_gpu_s(ex, key, dev, S["iters"]) or call_gpu
                        if args.profile_graphs:
                            rec["kernels"] = graph_kernels(ex, key, dev)
                        rec["call_gpu_us"] = call_gpu * 1e6  # per call incl. the routing wait: the wall per call
                        vis = min(ctx + 1, window) if window else ctx + 1
                        nkv, hd = a.num_kv_heads, a.head_dim
                        wbytes = sum(t.numel() * t.element_size() for n, t in w.layers[layer].items()
                                     if not n.startswith("experts."))
                        nbytes = wbytes + B * vis * nkv * 2 * hd * es + 4 * B * H * es
                        flops = 2 * B * H * (a.num_heads + 2 * nkv) * hd + 2 * B * a.num_heads * hd * H \
                            + 4 * B * vis * a.num_heads * hd + 2 * B * H * E
                        floor = max(nbytes / ceiling, flops / 800e12)
                        rec.update(ok=rec.get("rel_err_x", 0.0) < 5e-2, gpu_us=gpu * 1e6, host_us=host * 1e6,
                                   host_cpu_us=host_cpu * 1e6, bytes=nbytes, floor_us=floor * 1e6,
                                   GBps=nbytes / gpu / 1e9)
                    except Exception as err:  # noqa: BLE001
                        rec.update(ok=False, error=f"{type(err).__name__}: {err}"[:300])
                        traceback.print_exc()
                    rows.append(rec)
                    log(f"  attention graphs={graphs!s:5s} B={B:4d} ctx={ctx:5d} window={window} "
                        f"{'ok' if rec.get('ok') else 'BAD'} gpu {rec.get('gpu_us', 0):8.1f} us "
                        f"host(attn+route, incl. wait) {rec.get('host_us', 0):7.1f} us host CPU {rec.get('host_cpu_us', 0):7.1f} us "
                        f"floor {rec.get('floor_us', 0):6.1f} us err {rec.get('rel_err_x', '-')} {rec.get('error', '')}")
                ex.detach(kv)
                del kv
    res["rows"] = rows
