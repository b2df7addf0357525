"""Barrier EP baselines over real torch.distributed collectives, one process per rank (rank r on cuda:r), for
benchmarks/gpu_ep_bench.py.

lab/barrier_rank.py runs the same step logic as coroutines over point-to-point messages (lab/barrier.py
drives them in process, lab/barrier_mp.py over our own ZeroMQ + gloo transport). Here every MoE layer ends in
the collectives an EP serving system really calls:

  ag   dispatch: dist.all_gather_into_tensor of the hidden rows and of the routing (ids and weights
       packed as float32, rows padded to the largest rank's count: the collective needs equal sizes);
       each rank runs its experts on every row routed to them, weights the outputs, and the combine is
       dist.all_reduce (sum) over [R x max rows, H] (SGLang's portable path; DP attention keeps only
       its own slice).
  a2a  sizes first: dist.all_to_all_single of a [R, 2] count table (tokens, (token, slot) pairs per
       destination); then all_to_all_single of the token rows (one row per token and destination)
       and of the pair metadata (message row, expert id); experts in source-rank order (as
       lab/barrier_rank.py); combine: all_to_all_single of the unweighted slot rows back, placed at
       token * k + slot and summed by executor.combine in slot order (what the streaming engine does).
  Per step: all_gather_into_tensor of the token counts (the global batch shape; the run ends when
  every rank has no work left).

Same executor calls as lab/barrier_rank.py (embed, attention, route, shared_expert, experts, combine,
logits, sample), same KV store (PagedKVStore, RandomPrefixKV in decode-only mode), same admission
(runtime.drivers.admission.Admission over the same capacities; every rank computes it identically, as all
requests of a workload arrive at t = 0: a closed batch, which is what the bench runs).

Every rank of both systems builds its executor by one recipe (ExecSpec, build_executor): the streaming ranks'
main (lab/stream_dist.py) too. The job, its launch (lab/dist_job.py) and the interference of each workload's
scenario (lab/dist_scenarios.py) are shared as well.
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

from runtime.drivers.gc_settle import settle_heap, thaw_heap
from lab.barrier_rank import step_batch
from lab.dist_job import DistJob, Workload, say, start_rank
from lab.dist_scenarios import ACTIVE, hogs_off, scenario_on
from lab.floors import measure_copy_bps
from lab.host_probe import merge_probes, new_probe

ROOT = Path(__file__).resolve().parents[1]


# ------------------------------------------------------------------------------ model + executor
@dataclass
class ExecSpec:
    """How every rank builds the same executor (picklable)."""
    model: str = "tiny-gpt-oss"
    layers: Optional[int] = None
    dtype: str = "float32"            # float32 | bfloat16 (weights and activations)
    executor: str = "torch"           # torch (TorchExecutor, host-drawn weights) | cuda (CudaExecutor, device-drawn)
    zipf_s: Optional[float] = None    # None: the model's own router
    seed: int = 0
    max_context: int = 2048


def cut_spec(name: str, layers: Optional[int] = None, dtype: Optional[str] = None):
    """A shipped spec, optionally cut to its first `layers` layers, optionally in another dtype."""
    from graph_ir.spec import cut_layers, load_spec
    spec = load_spec(ROOT / "models/specs" / f"{name}.yaml")
    if layers is not None:
        spec = cut_layers(spec, layers)
    return spec.model_copy(update={"dtype": dtype}) if dtype else spec


def device_weights(spec, device, dtype, seed: int = 0, experts=None):
    """Random weights drawn on the device (models.weights.random_weights' recipe); `experts`: per
    layer the experts to build (None: all)."""
    from models.weights import random_weights
    return random_weights(spec, seed, device=device, dtype=dtype, experts=experts)


def build_executor(es: ExecSpec, plan, device, rank: Optional[int] = None, route_on_device: Optional[bool] = None):
    """(executor the engines call, inner executor). Same recipe on every rank and in every system.
    With `rank` the weights hold only that rank's experts of the plan's placement: ag-ep and a2a-ep
    run an expert on its owner (plan.placement.expert_rank) only, as the streaming engine does.
    None: every expert (one executor shared by in-process ranks). `route_on_device`: CudaExecutor's (the barriers
    pass False: they read every batch's routing on the host, so the attention graph copies it there as it finishes,
    whatever DATAFLOW_DISPATCH says)."""
    spec = plan.spec
    mine = None if rank is None else plan.placement.held_by(rank)
    if es.executor == "cuda":
        from runtime.executors.cuda_executor import CudaExecutor
        dt = getattr(torch, es.dtype)
        inner = CudaExecutor(spec, device_weights(spec, device, dt, es.seed, mine), plan, device,
                             max_context=es.max_context, route_on_device=route_on_device)
    else:
        from models.weights import load_weights
        from runtime.executors.torch_executor import TorchExecutor
        inner = TorchExecutor(spec, load_weights(spec, experts=mine).to(device))
    ex = inner
    if es.zipf_s is not None:
        from lab.routing_override import ZipfRouting, routed
        ex = routed(inner, ZipfRouting(spec.experts.num_experts, spec.experts.top_k, s=es.zipf_s, seed=es.seed))
    return ex, inner


# ------------------------------------------------------------------------------ barrier rank main
def barrier_dist_rank_main(env, job: DistJob):
    """One rank of the barrier baselines; every workload in order. Rank 0 returns the results."""
    import torch.distributed as dist
    device = start_rank(env, job)
    ex, inner = build_executor(job.exec, job.plan, device, env.rank, route_on_device=False)
    # the expert batches' bandwidth is reported against it; rank 0's is the one reported (1 GiB copies: once)
    copy_bps = measure_copy_bps(device) if env.rank == 0 else None
    hogs_state: dict = {"log": []}
    out = []
    try:
        for w in job.workloads:
            scenario_on(job, w, hogs_state, env.rank)
            mode = {"ag-ep": "ag", "a2a-ep": "a2a"}[w.system]
            res = run_barrier_workload(env.rank, env.world_size, job, w, mode, ex, inner, device)
            res["copy_bps"] = copy_bps
            allr = [None] * env.world_size
            dist.all_gather_object(allr, res)
            if env.rank == 0:
                out.append(_merge_rank_results(w, allr))
                toks = sum(len(r["output"]) for r in out[-1]["requests"])
                say(job, f"done {w.name}: {toks} tokens in {out[-1]['wall_s']:.2f} s = {toks / max(out[-1]['wall_s'], 1e-9):.1f} tok/s")
    finally:
        ACTIVE["delay"] = 0.0
        hogs_off(hogs_state)
        thaw_heap()
        try:
            dist.barrier()
            dist.destroy_process_group()
        except Exception:  # noqa: BLE001
            pass
    return {"workloads": out, "hogs": hogs_state["log"]} if env.rank == 0 else None


def _merge_rank_results(w: Workload, allr: list) -> dict:
    reqs = [r for rr in allr for r in rr["requests"]]
    return {"name": w.name, "system": w.system, "scenario": w.scenario, "report": w.report,
            "wall_s": max(rr["wall_s"] for rr in allr), "requests": sorted(reqs, key=lambda r: r["rid"]),
            "batches": merge_probes([rr["host"] for rr in allr], allr[0].get("copy_bps")),
            "delay_stalls_s": [rr["delay_s"] for rr in allr]}


def _sync(device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_barrier_workload(me: int, R: int, job: DistJob, w: Workload, mode: str, ex, inner, device) -> dict:
    """One closed batch of requests (all at t = 0) under synchronous EP with real collectives."""
    import torch.distributed as dist
    from runtime.core.kv_cache import BlockAllocator, PagedKVStore
    from runtime.core.requests import Request
    from runtime.drivers.admission import Admission
    plan, spec = job.plan, job.plan.spec
    block = plan.kv.block_size
    reqs = [Request(q.rid, q.name, list(q.prompt), q.max_new_tokens, ignore_eos=q.ignore_eos, arrival=0.0)
            for q in w.requests]
    admission = Admission(block, [w.kv_blocks] * R, plan.placement.home_policy)
    for q in sorted(reqs, key=lambda r: r.rid):
        admission.submit(q)
    placed = admission.admit([w.kv_blocks] * R)
    if len(placed) != len(reqs):
        raise ValueError(f"{w.name}: {len(reqs) - len(placed)} request(s) do not fit the KV pools "
                         f"({w.kv_blocks} blocks per rank): the barrier runs a closed batch")
    kv = PagedKVStore(spec.num_layers, BlockAllocator(w.kv_blocks, block))
    if job.decode_only:
        from lab.decode_only import RandomPrefixKV
        kv = RandomPrefixKV(kv)
    live = []
    for q, home in placed:
        q.home = home
        if home == me:
            if not kv.reserve(q.rid, q.kv_tokens):
                raise RuntimeError(f"rank {me}: no KV for {q.name!r}")
            live.append(q)
    live.sort(key=lambda r: r.rid)
    mine = list(live)
    if hasattr(inner, "prepare") and device.type == "cuda":
        inner.prepare(kv)
    eos = frozenset(spec.eos_token_ids)
    k = spec.experts.top_k
    if plan.placement.replicas:  # (the padded global batch has no home per row to choose a copy by)
        raise ValueError("the torch.distributed barrier baselines take no expert replicas; run them without --replicas")
    owners = [torch.tensor(plan.placement.expert_rank[l], dtype=torch.int64) for l in range(spec.num_layers)]
    probe = new_probe(inner, spec, job.exec.dtype)
    delay_s = [0.0]

    def stall() -> None:
        if job.delays is not None and ACTIVE["delay"]:
            d = job.delays.collective(me, R)
            if d > 0:
                time.sleep(d)
                delay_s[0] += d

    started: set = set()
    settle_heap()  # as the streaming ranks do before serving (runtime/drivers/gc_settle.py)
    _sync(device)
    dist.barrier()
    t0 = time.perf_counter()
    while True:
        tokens, positions, segments, seq_of_row = step_batch(live, started, job.decode_only, kv)
        for q in live:
            started.add(q.rid)
        T = len(tokens)
        cnt = torch.tensor([T], dtype=torch.int64, device=device)
        allc = torch.empty(R, dtype=torch.int64, device=device)
        dist.all_gather_into_tensor(allc, cnt)
        counts = allc.tolist()
        if sum(counts) == 0:
            break
        h = ex.embed(tokens) if T else None
        for layer in range(spec.num_layers):
            ta = probe.start()
            if T:
                h_res, x = ex.attention(layer, h, positions, segments, kv)
                ids, wts = ex.route(layer, x)
                shared = ex.shared_expert(layer, x)
            else:
                h_res = x = shared = None
                ids = torch.zeros(0, k, dtype=torch.int64)
                wts = torch.zeros(0, k, dtype=torch.float32)
            if T:
                probe.add("attn", T, ta)
            tm = probe.start()  # the layer's MoE part whole: dispatch, collectives, experts, combine (host wall)
            ids = ids.cpu().to(torch.int64)
            wts = wts.cpu().to(torch.float32)
            xr = x if x is not None else ex.embed([])
            xr = xr.to(device)
            feeds = layer + 1 < spec.num_layers  # the combine's rows are the next attention's input
            if mode == "ag":
                h = _ag_layer(me, R, layer, xr, ids, wts, h_res, shared, counts, owners[layer], ex, inner, device,
                              probe, stall, feeds)
            else:
                h = _a2a_layer(me, R, layer, xr, ids, wts, h_res, shared, counts, owners[layer], ex, inner, device,
                               probe, stall, k, feeds)
            # "moe" minus "expert" is the barrier's host time outside its two batch timers (routing to the host,
            # packing, collective launches and waits, combine): what the simulator's barrier_host lacks
            # (benchmarks/results/sim_validation.md). Its wall includes the collectives' device time it waits for.
            probe.add("moe", T, tm)
        if T:
            last = torch.tensor([start + n - 1 for _, start, n in segments], dtype=torch.long, device=h.device)
            logits = ex.logits(h.index_select(0, last))
            if hasattr(ex, "sample_batch"):
                toks = ex.sample_batch(logits, [q.params for q in live], [len(q.output) for q in live])
            else:
                toks = [ex.sample(logits[i], q.params, len(q.output)) for i, q in enumerate(live)]
            now = time.perf_counter() - t0
            keep = []
            for q, tok in zip(live, toks):
                q.output.append(int(tok))
                q.token_times.append(now)
                if tok in eos and not q.ignore_eos:
                    q.finish_reason, q.t_finish = "eos", now
                elif len(q.output) >= q.max_new_tokens or len(q.prompt) + len(q.output) - 1 >= spec.max_position:
                    q.finish_reason, q.t_finish = "length", now
                else:
                    keep.append(q)
                    continue
                kv.release(q.rid)
            live = keep
    _sync(device)
    wall = time.perf_counter() - t0
    if hasattr(inner, "detach"):
        try:
            inner.detach(kv)
        except Exception:  # noqa: BLE001
            pass
    return {"rank": me, "wall_s": wall, "host": probe.summary(), "delay_s": delay_s[0],
            "requests": [{"rid": q.rid, "home": me, "output": list(q.output), "token_times": list(q.token_times),
                          "t_finish": q.t_finish, "prompt_len": len(q.prompt)} for q in mine]}


def _ag_layer(me, R, layer, xr, ids, wts, h_res, shared, counts, owner, ex, inner, device, probe, stall, feeds=False):
    import torch.distributed as dist
    M = max(counts)
    T, H = xr.shape[0], xr.shape[1]
    k = ids.shape[1]
    xp = torch.zeros(M, H, dtype=xr.dtype, device=device)
    xp[:T] = xr
    meta = torch.zeros(M, 2 * k, dtype=torch.float32)
    meta[:T, :k] = ids.to(torch.float32)          # expert ids < 2^24: exact in float32
    meta[:T, k:] = wts
    meta = meta.to(device)
    x_all = torch.empty(R * M, H, dtype=xr.dtype, device=device)
    meta_all = torch.empty(R * M, 2 * k, dtype=torch.float32, device=device)
    stall()
    dist.all_gather_into_tensor(x_all, xp)
    dist.all_gather_into_tensor(meta_all, meta)
    te = probe.start()
    meta_h = meta_all.cpu()
    ids_all, w_all = meta_h[:, :k].to(torch.int64), meta_h[:, k:]
    valid = torch.zeros(R * M, dtype=torch.bool)
    for p in range(R):
        valid[p * M:p * M + counts[p]] = True
    hit = (owner[ids_all] == me) & valid[:, None]
    pairs = hit.nonzero()                                   # (row, slot), row-major = slot order
    t_idx, s_idx = pairs[:, 0], pairs[:, 1]
    t_dev = t_idx.to(device)
    partial = torch.zeros(R * M, H, dtype=torch.float32, device=device)
    eids = ids_all[t_idx, s_idx]
    if len(t_idx):
        y = ex.experts(layer, x_all.index_select(0, t_dev), eids.tolist())
        partial.index_add_(0, t_dev, y.to(device).float() * w_all[t_idx, s_idx, None].to(device))
    probe.add("expert", int(len(t_idx)), te, [eids])
    red = partial.to(xr.dtype)
    stall()
    dist.all_reduce(red)
    if not counts[me]:
        return None
    acc = red[me * M:me * M + counts[me]]
    ones = torch.ones(counts[me], 1, dtype=torch.float32, device=device)
    return ex.combine(h_res, shared, acc.to(h_res.dtype).unsqueeze(1), ones, feeds_attention=feeds)


def _a2a_layer(me, R, layer, xr, ids, wts, h_res, shared, counts, owner, ex, inner, device, probe, stall, k,
               feeds=False):
    import torch.distributed as dist
    T, H = xr.shape[0], xr.shape[1]
    own = owner[ids] if ids.numel() else torch.zeros(0, k, dtype=torch.int64)
    x_parts, meta_parts, flat_parts, send_tok, send_pairs = [], [], [], [], []
    for p in range(R):
        pairs = (own == p).nonzero()                         # (token, slot), slot order within a token
        if len(pairs):
            toks, mrow = torch.unique(pairs[:, 0], sorted=True, return_inverse=True)
            x_parts.append(xr.index_select(0, toks.to(device)))
            meta_parts.append(torch.stack([mrow, ids[pairs[:, 0], pairs[:, 1]]], 1))
            flat_parts.append(pairs[:, 0] * k + pairs[:, 1])
            send_tok.append(len(toks))
            send_pairs.append(len(pairs))
        else:
            send_tok.append(0)
            send_pairs.append(0)
    # sizes first
    sc = torch.tensor([[a, b] for a, b in zip(send_tok, send_pairs)], dtype=torch.int64, device=device)
    rc = torch.empty_like(sc)
    stall()
    dist.all_to_all_single(rc, sc)
    rc_h = rc.cpu()
    recv_tok, recv_pairs = rc_h[:, 0].tolist(), rc_h[:, 1].tolist()
    x_send = torch.cat(x_parts) if x_parts else xr[:0]
    x_recv = torch.empty(sum(recv_tok), H, dtype=xr.dtype, device=device)
    dist.all_to_all_single(x_recv, x_send.contiguous(), recv_tok, send_tok)
    m_send = (torch.cat(meta_parts) if meta_parts else torch.zeros(0, 2, dtype=torch.int64)).to(device).reshape(-1)
    m_recv = torch.empty(2 * sum(recv_pairs), dtype=torch.int64, device=device)
    dist.all_to_all_single(m_recv, m_send, [2 * n for n in recv_pairs], [2 * n for n in send_pairs])
    te = probe.start()
    m = m_recv.view(-1, 2).cpu()
    tok_off = [0]
    for n in recv_tok:
        tok_off.append(tok_off[-1] + n)
    rows = torch.empty(len(m), dtype=torch.int64)
    i = 0
    for p in range(R):
        n = recv_pairs[p]
        rows[i:i + n] = m[i:i + n, 0] + tok_off[p]
        i += n
    if len(m):
        y = ex.experts(layer, x_recv.index_select(0, rows.to(device)), m[:, 1].tolist()).to(device)
    else:
        y = x_recv[:0]
    probe.add("expert", int(len(m)), te, [m[:, 1]])
    back = torch.empty(sum(send_pairs), H, dtype=y.dtype if len(m) else xr.dtype, device=device)
    stall()
    dist.all_to_all_single(back, y.to(back.dtype).contiguous(), send_pairs, recv_pairs)
    if not counts[me]:
        return None
    Y = torch.zeros(T * k, H, dtype=h_res.dtype, device=h_res.device)
    if flat_parts:
        Y.index_copy_(0, torch.cat(flat_parts).to(Y.device), back.to(device=Y.device, dtype=Y.dtype))
    return ex.combine(h_res, shared, Y.view(T, k, H), wts, feeds_attention=feeds)
