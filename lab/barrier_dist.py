"""Barrier EP baselines over real torch.distributed collectives, one process per rank (rank r on cuda:r),
plus the streaming engine's rank main with the same executor recipe, for benchmarks/gpu_ep_bench.py.

lab/barrier.py runs the same step logic as coroutines over point-to-point messages (and
lab/barrier_mp.py drives them over our own ZeroMQ + gloo transport). Here every MoE layer ends in
the collectives an EP serving system really calls:

  ag   dispatch: dist.all_gather_into_tensor of the hidden rows and of the routing (ids and weights
       packed as float32, rows padded to the largest rank's count: the collective needs equal sizes);
       each rank runs its experts on every row routed to them, weights the outputs, and the combine is
       dist.all_reduce (sum) over [R x max rows, H] (SGLang's portable path; DP attention keeps only
       its own slice).
  a2a  sizes first: dist.all_to_all_single of a [R, 2] count table (tokens, (token, slot) pairs per
       destination); then all_to_all_single of the token rows (one row per token and destination)
       and of the pair metadata (message row, expert id); experts in source-rank order (as
       lab/barrier.py); combine: all_to_all_single of the unweighted slot rows back, placed at
       token * k + slot and summed by executor.combine in slot order (what the streaming engine does).
  Per step: all_gather_into_tensor of the token counts (the global batch shape; the run ends when
  every rank has no work left).

Same executor calls as lab/barrier.py (embed, attention, route, shared_expert, experts, combine,
logits, sample), same KV store (PagedKVStore, RandomPrefixKV in decode-only mode), same admission
(runtime.core.requests.Admission over the same capacities; every rank computes it identically, as all
requests of a workload arrive at t = 0: a closed batch, which is what the bench runs).

Link delay bursts (BurstDelays): a rank sleeps, before each dispatch and each combine collective,
the largest burst delay currently on a link to or from it; the streaming engine gets the same
schedule through the transport's chaos hook (lanes of the chosen direction), on the same wall clock.
The burst's size is the workload's scenario's (delay_of_scenario): `delay` = the BurstDelays' own
extra_us, `delay-<N>ms` = N ms (e.g. delay-5ms, delay-0.5ms), same period and duty.

Hogs (lab/hogs.py) are started by rank 0 before a workload that asks for one and stopped after it.
"""
from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional

import torch

from runtime.drivers.gc_settle import settle_heap, thaw_heap
from lab.barrier import step_batch
from lab.floors import measure_copy_bps
from lab.host_probe import HostProbe, merge_probes, new_probe, probe_engine  # (merge_probes: for callers)  # noqa: F401

ROOT = Path(__file__).resolve().parents[1]

# What scenario is on in this process (set per workload; read by BurstDelays lanes in transport threads).
# "delay": the burst's extra seconds of the running workload's scenario (0.0: no delay scenario).
_ACTIVE: dict = {"delay": 0.0}

_DELAY_MS = re.compile(r"delay-(\d+(?:\.\d+)?)ms")


def delay_of_scenario(name: str, default_us: float) -> Optional[float]:
    """Extra seconds per burst of a delay scenario: `delay` -> default_us (the CLI's --burst-us),
    `delay-<N>ms` -> N ms (N > 0, e.g. delay-5ms, delay-10ms, delay-0.5ms); None for any other name
    (clean, the hogs, delay-0ms, delay-5us, ...)."""
    if name == "delay":
        return float(default_us) * 1e-6
    m = _DELAY_MS.fullmatch(name)
    if m is None:
        return None
    ms = float(m.group(1))
    return ms * 1e-3 if ms > 0 else None


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


class BurstDelays:
    """On/off link delay bursts on the wall clock (time.time() since `epoch`: one clock for every
    process of the host), on only while a workload of a delay scenario runs in this process, with
    that scenario's size (_ACTIVE["delay"], set by _scenario_on from delay_of_scenario; `extra_us` is
    plain `delay`'s size).
    - `lane(direction, me, peer)`: the streaming transport's chaos hook (ZmqDistTransport); lanes of
      `directions` get the burst delay of the link (me -> peer for send, peer -> me for recv).
    - `collective(me, world)`: the barrier baselines' host-side stall before a collective: the largest
      delay on any link to or from `me` right now (a collective ends with its slowest message)."""

    def __init__(self, period_ms: float = 20.0, duty: float = 0.3, extra_us: float = 2000.0,
                 links: Optional[list] = None, directions: tuple = ("recv",), epoch: Optional[float] = None) -> None:
        self.period_s, self.duty, self.extra_s = period_ms * 1e-3, duty, extra_us * 1e-6
        self.links = None if links is None else {(int(a), int(b)) for a, b in links}
        self.directions = tuple(directions)
        self.epoch = time.time() if epoch is None else epoch

    def delay(self, src: int, dst: int) -> float:
        extra = _ACTIVE["delay"]
        if not extra or src == dst:
            return 0.0
        if self.links is not None and (src, dst) not in self.links:
            return 0.0
        t = time.time() - self.epoch
        return extra if (t % self.period_s) < self.duty * self.period_s else 0.0

    def lane(self, direction: str, me: int, peer: int):
        if direction not in self.directions:
            return lambda: 0.0
        if direction == "send":
            return lambda: self.delay(me, peer)
        return lambda: self.delay(peer, me)

    def collective(self, me: int, world: int) -> float:
        return max([0.0] + [max(self.delay(p, me), self.delay(me, p)) for p in range(world) if p != me])


@dataclass
class Workload:
    name: str
    system: str                   # streaming-<policy> | ag-ep | a2a-ep
    requests: list                # runtime.core.requests.Request, arrival 0
    kv_blocks: int
    scenario: str = "clean"       # clean | delay | delay-<N>ms | compute-hog | nvlink-hog
    report: bool = True           # False: warm-up (graph capture), not reported


@dataclass
class DistJob:
    plan: object
    exec: ExecSpec
    workloads: list               # [Workload]
    delays: Optional[BurstDelays] = None
    hogs: dict = field(default_factory=dict)   # scenario -> lab.hogs kwargs (kind, ...)
    decode_only: bool = True
    peer_timeout_s: float = 30.0
    log_t0: Optional[float] = None  # rank 0 prints progress lines, in seconds since this time.time(); None: quiet
    timeline: bool = False  # the streaming ranks' probes also keep a timeline (HostProbe.timeline)


def _say(job: DistJob, msg: str) -> None:
    """Progress line from rank 0 when the bench asks (job.log_t0), on the bench's time base."""
    if job.log_t0 is not None:
        print(f"[{time.time() - job.log_t0:7.1f}s {time.strftime('%H:%M:%S')}]   rank 0: {msg}", flush=True)


def _scenario_on(job: DistJob, w: Workload, hogs_state: dict, rank: int) -> None:
    """Switch interference to workload `w`'s scenario (the burst size here, 0.0 = off; hogs from rank 0)."""
    default_us = job.delays.extra_s * 1e6 if job.delays is not None else 0.0
    _ACTIVE["delay"] = delay_of_scenario(w.scenario, default_us) or 0.0
    if rank != 0:
        return
    _say(job, f"start {w.name} ({len(w.requests)} requests, {w.kv_blocks} KV blocks per rank)")
    want = job.hogs.get(w.scenario)
    cur = hogs_state.get("hog")
    if cur is not None and hogs_state.get("scenario") != w.scenario:
        hogs_state["log"].append(cur.stop())
        hogs_state["hog"] = None
    if want is not None and hogs_state.get("hog") is None:
        from lab.hogs import Hog
        hogs_state["hog"] = Hog(**want).start()
        hogs_state["scenario"] = w.scenario
        _say(job, f"{want['kind']} hog started (pid {hogs_state['hog'].proc.pid})")


def _hogs_off(hogs_state: dict) -> None:
    if hogs_state.get("hog") is not None:
        hogs_state["log"].append(hogs_state["hog"].stop())
        hogs_state["hog"] = None


def _device(plan, local_rank: int):
    if plan.cluster.device == "cuda" and torch.cuda.is_available():
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def _threads(env, job) -> None:
    from runtime.drivers.launch import set_rank_threads
    set_rank_threads(env, on_gpu=job.plan.cluster.device == "cuda")


# ------------------------------------------------------------------------------ barrier rank main
def barrier_dist_rank_main(env, job: DistJob):
    """One rank of the barrier baselines; every workload in order. Rank 0 returns the results."""
    import torch.distributed as dist
    from runtime.transport.rendezvous import init_distributed
    _threads(env, job)
    device, backend = _device(job.plan, env.local_rank)
    init_distributed(env.rank, env.world_size, backend)
    ex, inner = build_executor(job.exec, job.plan, device, env.rank, route_on_device=False)
    # the expert batches' bandwidth is reported against it; rank 0's is the one reported (1 GiB copies: once)
    copy_bps = measure_copy_bps(device) if env.rank == 0 else None
    hogs_state: dict = {"log": []}
    out = []
    try:
        for w in job.workloads:
            _scenario_on(job, w, hogs_state, env.rank)
            mode = {"ag-ep": "ag", "a2a-ep": "a2a"}[w.system]
            res = run_barrier_workload(env.rank, env.world_size, job, w, mode, ex, inner, device)
            res["copy_bps"] = copy_bps
            allr = [None] * env.world_size
            dist.all_gather_object(allr, res)
            if env.rank == 0:
                out.append(_merge_rank_results(w, allr))
                toks = sum(len(r["output"]) for r in out[-1]["requests"])
                _say(job, f"done {w.name}: {toks} tokens in {out[-1]['wall_s']:.2f} s = {toks / max(out[-1]['wall_s'], 1e-9):.1f} tok/s")
    finally:
        _ACTIVE["delay"] = 0.0
        _hogs_off(hogs_state)
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
    from runtime.core.requests import Admission, Request
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
        from runtime.core.decode_only import RandomPrefixKV
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
    owners = [torch.tensor(plan.placement.expert_rank[l], dtype=torch.int64) for l in range(spec.num_layers)]
    probe = new_probe(inner, spec, job.exec.dtype)
    delay_s = [0.0]

    def stall() -> None:
        if job.delays is not None and _ACTIVE["delay"]:
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


# ------------------------------------------------------------------------------ streaming rank main
def stream_rank_main(env, job: DistJob):
    """runtime.drivers.multiproc.rank_main with the bench's executor (device-drawn weights, Zipf routing), the
    BurstDelays chaos hook, hogs from rank 0 and host time per batch; one workload per (policy, scenario)."""
    from runtime.drivers.cluster import RunOptions
    from runtime.drivers.multiproc import COORDINATOR, RankJob, RankNode, SyncedClock, serve_rank
    from runtime.transport.zmq_dist import ZmqDistTransport
    from runtime.transport.rendezvous import init_distributed
    _threads(env, job)
    device, backend = _device(job.plan, env.local_rank)
    init_distributed(env.rank, env.world_size, backend)
    from runtime.core.requests import Request

    def fresh(w):  # the coordinator fills its Request objects in: every workload gets its own
        return [Request(q.rid, q.name, list(q.prompt), q.max_new_tokens, ignore_eos=q.ignore_eos, arrival=q.arrival)
                for q in w.requests]
    works = [(fresh(w), RunOptions(policy=w.system.split("-", 1)[1], clock="wall", kv_blocks=w.kv_blocks,
                                           decode_only=job.decode_only, stall_timeout_s=120.0))
             for w in job.workloads]
    rjob = RankJob(job.plan, works, job.peer_timeout_s, job.delays)
    hogs_state: dict = {"log": []}
    probes: list = []
    with ZmqDistTransport(env.rank, env.world_size, device, peer_timeout_s=job.peer_timeout_s,
                          chaos=job.delays) as transport:
        ex, inner = build_executor(job.exec, job.plan, device, env.rank)
        copy_bps = measure_copy_bps(device) if env.rank == COORDINATOR else None  # only the coordinator reports

        class Node(RankNode):
            def _start_workload(self, w, options):
                _scenario_on(job, job.workloads[w], hogs_state, self.rank)
                super()._start_workload(w, options)
                if options.decode_only and not self.engine.decode_only:
                    self.engine.enable_decode_only()
                if device.type == "cuda" and hasattr(inner, "prepare"):
                    # capture this KV store's graphs before requests come (the barrier does the same
                    # before its start barrier); lazy capture would land inside the timed run
                    try:
                        inner.prepare(self.engine.kv, owned=self.engine.owned_experts)
                    except Exception as err:  # noqa: BLE001
                        _say(job, f"prepare failed ({type(err).__name__}: {err}); graphs captured lazily")
                if probes and isinstance(probes[-1], HostProbe):
                    probes[-1] = probes[-1].summary()  # release the last workload's CUDA events
                probe = new_probe(inner, job.plan.spec, job.exec.dtype, job.timeline)
                probes.append(probe)
                probe_engine(self.engine, probe)

        clock = SyncedClock()
        try:
            # as `dataflow run`'s ranks: the profile_ranks option, PeerFailure naming the rank
            results = serve_rank(Node(env, job.plan, ex, transport, clock, rjob))
        finally:
            _ACTIVE["delay"] = 0.0
            _hogs_off(hogs_state)
        # host probes of every rank to the coordinator: through the filesystem-free path, a gloo/nccl object gather
        import torch.distributed as dist
        allp = [None] * env.world_size
        dist.all_gather_object(allp, [p.summary() if isinstance(p, HostProbe) else p for p in probes])
    if env.rank != COORDINATOR:
        return None
    out = []
    for i, (w, raw) in enumerate(zip(job.workloads, results)):
        reqs = raw["requests"]
        m = raw["metrics"]
        out.append({"name": w.name, "system": w.system, "scenario": w.scenario, "report": w.report,
                    "wall_s": m.get("elapsed_s"),
                    "requests": [{"rid": q.rid, "home": q.home, "output": list(q.output),
                                  "token_times": list(q.token_times), "t_finish": q.t_finish,
                                  "prompt_len": len(q.prompt)} for q in reqs],
                    "batches": merge_probes([rank_p[i] for rank_p in allp], copy_bps),
                    **({"timeline": [rank_p[i].get("_timeline") for rank_p in allp]}
                       if any("_timeline" in rank_p[i] for rank_p in allp) else {}),
                    "engine": {k2: m.get(k2) for k2 in ("attn_mean_batch", "expert_mean_batch", "attn_batches",
                                                        "expert_batches", "messages", "max_queue_delay_s")}})
    return {"workloads": out, "hogs": hogs_state["log"]}


# ------------------------------------------------------------------------------ launcher side
def run_dist(target: str, job: DistJob, world: int, timeout: float, env: Optional[dict] = None) -> dict:
    """Launch `world` rank processes of `target` ("stream" | "barrier"); rank 0's result."""
    from runtime.drivers.launch import launch_local
    fn = stream_rank_main if target == "stream" else barrier_dist_rank_main
    child_env = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
    child_env.update(env or {})
    res = launch_local(world, fn, (job,), timeout=timeout, grace_s=job.peer_timeout_s + 5.0, env=child_env)
    if not res.ok:
        lines = [res.first_error or "failed"] + [f"rank {r}: {m}" for r, m in sorted(res.errors.items())]
        raise RuntimeError("; ".join(lines)[:2000])
    return res.results[0]


def token_stats(requests: list, wall: float) -> dict:
    """tokens/s over the run, ITL p50/p99 (ms)."""
    itl = sorted(b - a for r in requests for a, b in zip(r["token_times"], r["token_times"][1:]))
    toks = sum(len(r["output"]) for r in requests)

    def pct(q):
        return None if not itl else 1e3 * itl[min(len(itl) - 1, int(round(q / 100 * (len(itl) - 1))))]
    return {"tokens": toks, "wall_s": wall, "tokens_per_s": toks / wall if wall else None,
            "itl_p50_ms": pct(50), "itl_p99_ms": pct(99),
            "unfinished": sum(1 for r in requests if r.get("t_finish") is None)}


def dumps(obj) -> str:
    return json.dumps(obj, indent=1, default=lambda o: dataclasses.asdict(o) if dataclasses.is_dataclass(o) else str(o))


_ = math  # noqa: F841
