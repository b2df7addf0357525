"""What the distributed EP bench (benchmarks/gpu_ep_bench.py) hands its rank processes, and how it starts them:
the workloads (Workload, DistJob), a rank's start (start_rank), the launch of one system family's ranks
(run_dist: lab/stream_dist.py's or lab/barrier_dist.py's rank main) and the token statistics of a result."""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Optional

import torch

if TYPE_CHECKING:
    from lab.barrier_dist import ExecSpec
    from lab.dist_scenarios import BurstDelays


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


def say(job: DistJob, msg: str) -> None:
    """Progress line from rank 0 when the bench asks (job.log_t0), on the bench's time base."""
    if job.log_t0 is not None:
        print(f"[{time.time() - job.log_t0:7.1f}s {time.strftime('%H:%M:%S')}]   rank 0: {msg}", flush=True)


def start_rank(env, job: DistJob) -> torch.device:
    """This rank process's threads, device (rank r on cuda:r) and process group (nccl, or gloo on the CPU)."""
    from runtime.drivers.launch import set_rank_threads
    from runtime.transport.rendezvous import init_distributed
    set_rank_threads(env, on_gpu=job.plan.cluster.device == "cuda")
    if job.plan.cluster.device == "cuda" and torch.cuda.is_available():
        torch.cuda.set_device(env.local_rank)
        device, backend = torch.device("cuda", env.local_rank), "nccl"
    else:
        device, backend = torch.device("cpu"), "gloo"
    init_distributed(env.rank, env.world_size, backend)
    return device


def run_dist(target: str, job: DistJob, world: int, timeout: float, env: Optional[dict] = None) -> dict:
    """Launch `world` rank processes of `target` ("stream" | "barrier"); rank 0's result."""
    from lab.barrier_dist import barrier_dist_rank_main
    from lab.stream_dist import stream_rank_main
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
