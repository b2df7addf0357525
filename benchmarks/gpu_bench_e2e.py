"""gpu_bench's end-to-end sections (benchmarks/gpu_bench.py --sections e2e, and mp with --mp-ranks): GPT-OSS-20B cut
to a few layers, decode-only, Zipf routing, every request at t=0: streaming (per policy) against all-gather and
all-to-all EP (lab/barrier.py) on in-process ranks on one GPU, and the streaming engine in one process per GPU."""
from __future__ import annotations

import math
import random
import time
import traceback

import torch

from gpu_bench_common import detach_all, log, pct, sync
from lab.barrier_dist import cut_spec, device_weights
from lab.decode_only import decode_only
from lab.floors import measure_copy_bps
from lab.host_probe import merge_probes, new_probe, probe_engine
from lowering.plan import compile_plan
from runtime.core.requests import Request
from runtime.drivers.cluster import Cluster, RunOptions
from runtime.executors.cuda_executor import CudaExecutor



def token_stats(reqs: list[Request], wall: float) -> dict:
    itl = [b - a for r in reqs for a, b in zip(r.token_times, r.token_times[1:])]
    toks = sum(len(r.output) for r in reqs)
    starts = [r.token_times[1] for r in reqs if len(r.token_times) > 1]
    end = max((r.token_times[-1] for r in reqs if r.token_times), default=0.0)
    steady_t0 = max(starts) if starts else None
    steady = sum(1 for r in reqs for t in r.token_times if steady_t0 is not None and t > steady_t0)
    return dict(tokens=toks, wall_s=wall, tokens_per_s=toks / wall if wall else None,
                steady_tokens_per_s=steady / (end - steady_t0) if steady_t0 is not None and end > steady_t0 else None,
                itl_p50_ms=None if not itl else 1e3 * pct(itl, 50), itl_p99_ms=None if not itl else 1e3 * pct(itl, 99),
                unfinished=sum(1 for r in reqs if not r.done))


def section_e2e(args, dev: torch.device, results: dict, S: dict) -> None:
    from lab.routing_override import ZipfRouting, routed
    out = results.setdefault("e2e", [])
    spec = cut_spec(S["model"], args.layers, S.get("dtype"))
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    w = device_weights(spec, dev, dtype)
    plan = compile_plan(spec, args.ranks, "cuda" if dev.type == "cuda" else "cpu", expert_cap=args.expert_cap)
    router = ZipfRouting(spec.experts.num_experts, spec.experts.top_k, s=args.zipf, seed=0)
    P, M = S["prompt"], S["max_new"]
    inner = CudaExecutor(spec, w, plan, dev, max_context=P + M + 32)
    ex = routed(inner, router)
    copy_bps = measure_copy_bps(dev)
    block = plan.kv.block_size
    log(f"e2e: {spec.name} ranks={args.ranks} (in-process, one device) prompt={P} (random KV) max_new={M} "
        f"zipf s={args.zipf}; buckets attn {plan.capture.buckets['attn']} expert {plan.capture.buckets['expert']}")
    for C in S["concurrency"]:
        kv_blocks = math.ceil(C / args.ranks + 1) * math.ceil((P + M + 8) / block) + 8
        g = random.Random(C)
        template = [[g.randrange(3, spec.vocab_size - 8) for _ in range(P)] for _ in range(C)]
        for system in args.systems.split(","):
            policies = args.policies.split(",") if system == "streaming" else ["-"]
            for policy in policies:
                reqs = [Request(i, f"r{i}", list(template[i]), M, ignore_eos=True, arrival=0.0) for i in range(C)]
                rec = dict(system=system, policy=policy, concurrency=C, layers=spec.num_layers, ranks=args.ranks)
                log(f"  {system} {policy} C={C} ...")
                try:
                    if system == "streaming":
                        opts = RunOptions(policy=policy, kv_blocks=kv_blocks, engine_setup=decode_only, stall_timeout_s=120)
                        cl = Cluster(plan, ex, opts)
                        t = time.perf_counter()
                        ncap = sum(inner.prepare(e.kv, owned=e.owned_experts) for e in cl.engines)
                        rec["capture_s"], rec["graphs_captured"] = time.perf_counter() - t, ncap
                        probe = new_probe(inner, spec, str(dtype)[6:])  # one executor serves every in-process rank
                        for e in cl.engines:
                            probe_engine(e, probe)
                        t = time.perf_counter()
                        before = inner.graphs.captures
                        cl.run(reqs)
                        sync(dev)
                        wall = time.perf_counter() - t
                        # prepare() should have captured every graph the run replays (d746ce9): a capture inside
                        # the timed run is counted here and shows as a non-zero column
                        rec["captured_in_run"] = inner.graphs.captures - before
                        rec.update(token_stats(reqs, wall))
                        rec["batches"] = merge_probes([probe.summary()], copy_bps)
                        detach_all(inner, cl)
                    else:
                        from lab.barrier import run_barrier
                        mode = {"ag-ep": "ag", "a2a-ep": "a2a"}[system]
                        # a barrier reads every batch's routing on the host: its copy starts as the graph ends
                        keep, inner.route_on_device = inner.route_on_device, False
                        t = time.perf_counter()
                        try:
                            run_barrier(plan, ex, reqs, mode, clock="wall", router=router, kv_blocks=kv_blocks,
                                        decode_only=True, stall_timeout_s=120)
                        finally:
                            inner.route_on_device = keep
                        sync(dev)
                        rec.update(token_stats(reqs, time.perf_counter() - t))
                        rec["note"] = ("barrier collectives are in-process messages between ranks on one GPU "
                                       "(rows stay on the device, batched index ops); no NCCL collective")
                        for k in list(inner._views):  # run_barrier's KV stores are gone: drop their graphs
                            inner.detach(inner._views[k].kv)
                except Exception as err:  # noqa: BLE001
                    rec.update(skipped=f"{type(err).__name__}: {err}"[:400])
                    log(f"    skipped: {rec['skipped']}")
                    traceback.print_exc(limit=3)
                    sync(dev)
                out.append(rec)
                b = rec.get("batches", {})
                log(f"    graphs captured by prepare {rec.get('graphs_captured', '-')}, inside the timed run "
                    f"{rec.get('captured_in_run', '-')}")
                log(f"    tokens/s {rec.get('tokens_per_s') or 0:9.1f} (steady {rec.get('steady_tokens_per_s') or 0:9.1f}) "
                    f"ITL p50 {rec.get('itl_p50_ms') or 0:.2f} ms p99 {rec.get('itl_p99_ms') or 0:.2f} ms "
                    + " ".join(f"{k}: host {v['host_us']:.0f} us device {v['device_us'] or 0:.0f} us hidden "
                               f"{100 * (v['hidden_share'] or 0):.0f}%" for k, v in b.items()))
    base = {r["concurrency"]: r for r in out if r["system"] == "a2a-ep" and r.get("tokens_per_s")}
    for r in out:
        b = base.get(r["concurrency"])
        if b and r.get("tokens_per_s"):
            r["ratio_vs_a2a"] = r["tokens_per_s"] / b["tokens_per_s"]


def section_mp(args, dev: torch.device, results: dict, S: dict) -> None:
    out = results.setdefault("mp", [])
    try:
        from runtime.drivers.multiproc import run_workload_multiprocess
    except Exception as err:  # noqa: BLE001
        out.append(dict(skipped=f"runtime.drivers.multiproc not importable: {err!r}"))
        log(f"mp: skipped ({err!r})")
        return
    spec = cut_spec(S["model"], args.mp_layers, S.get("dtype"))
    plan = compile_plan(spec, args.mp_ranks, "cuda" if dev.type == "cuda" else "cpu")
    P, M = S["prompt"], S["max_new"]
    for C in S["concurrency"]:
        g = random.Random(C)
        reqs = [Request(i, f"r{i}", [g.randrange(3, spec.vocab_size - 8) for _ in range(P)], M, ignore_eos=True,
                        arrival=0.0) for i in range(C)]
        kv_blocks = math.ceil(C / args.mp_ranks + 1) * math.ceil((P + M + 8) / plan.kv.block_size) + 8
        rec = dict(system="streaming-mp", ranks=args.mp_ranks, layers=spec.num_layers, concurrency=C)
        log(f"mp: {spec.name} ranks={args.mp_ranks} C={C} (weights drawn on each rank's host: slow for big models)")
        try:
            t = time.perf_counter()
            res = run_workload_multiprocess(plan, reqs, RunOptions(kv_blocks=kv_blocks),
                                            timeout=args.mp_timeout)
            rec.update(token_stats(res.requests, time.perf_counter() - t))
        except Exception as err:  # noqa: BLE001
            rec["skipped"] = f"{type(err).__name__}: {err}"[:400]
        out.append(rec)
        log(f"  {rec}")
