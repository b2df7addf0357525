"""A rank process of `dataflow run` from its first line to its results: `rank_main` (the launcher's target, torchrun's
too) sets the threads, imports, starts the device and the transport, builds this rank's weights and executor, and
serves the job's workloads on a RankNode (runtime/drivers/rank_node.py).

Every rank process builds the same weights (seeded random or the checkpoint, deterministic), of the routed experts
only those the plan places on it; one engine per workload and one ZmqDistTransport (runtime/transport/zmq_dist.py)
for the whole launch.
"""
from __future__ import annotations

import sys
import time
from importlib import import_module
from typing import TYPE_CHECKING

from runtime import settings
from runtime.drivers.control import COORDINATOR
from runtime.drivers.launch import set_rank_threads
from runtime.drivers.rank_node import RankNode, SyncedClock
from runtime.drivers.startup import StartupTimes
from runtime.observability.rank_profile import profile_wanted, profiled

if TYPE_CHECKING:
    from runtime.drivers.launch import RankEnv
    from runtime.drivers.multiproc import RankJob


def _device_and_backend(plan, local_rank: int):
    import torch
    if plan.cluster.device == "cuda":
        if not torch.cuda.is_available():
            print(f"note: plan targets cuda but no GPU is visible to local rank {local_rank}; running on CPU (gloo)",
                  file=sys.stderr)
            return torch.device("cpu"), "gloo"
        settings.configure_nccl()
        torch.cuda.set_device(local_rank)
        torch.cuda.init()  # the context now, not inside the first allocation of the weights
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def _import_rank_modules(plan, options) -> None:
    """Import what the rank will use, so the imports phase holds them (and no later phase does), with the numba
    kernels' loads from their cache (each warm_up is once per process: the engine and the policy call it again)."""
    names = ["runtime.drivers.cluster", "runtime.core.engine", "runtime.executors.kv_fit", "runtime.core.scheduler",
             "runtime.observability.trace", "models.weights"]
    if options.executor != "sim":
        cuda = plan.cluster.device == "cuda" or options.executor == "cuda"
        names.append("runtime.executors.cuda_executor" if cuda else "runtime.executors.torch_executor")
    for name in names:
        import_module(name)
    from runtime.core.dispatch_plan import warm_up as warm_dispatch
    from runtime.core.score_kernel import warm_up as warm_scores
    warm_dispatch()
    warm_scores()


def rank_main(env: RankEnv, job: RankJob):
    """One rank of a `dataflow run`. Returns the per-workload results on the coordinator, None elsewhere."""
    startup = StartupTimes()
    if env.rank == COORDINATOR and job.progress_path:
        startup.phase_path = job.progress_path + ".phase"
    set_rank_threads(env, on_gpu=job.plan.cluster.device == "cuda")  # before any torch work

    from runtime.transport.zmq_dist import ZmqDistTransport, init_distributed

    plan = job.plan
    options0 = job.workloads[0][1]
    _import_rank_modules(plan, options0)
    startup.lap("imports")
    if plan.cluster.ranks != env.world_size:
        raise ValueError(f"the plan is compiled for {plan.cluster.ranks} ranks but {env.world_size} processes were "
                         f"started (WORLD_SIZE)")
    device, backend = _device_and_backend(plan, env.local_rank)
    startup.lap("device_init")
    init_distributed(env.rank, env.world_size, backend)
    clock = SyncedClock()
    # Transport first, weights second: its heartbeats keep every rank alive in the others' eyes while
    # a slow rank loads a checkpoint, and the ready barrier (startup_timeout_s) bounds the wait.
    with ZmqDistTransport(env.rank, env.world_size, device, peer_timeout_s=job.peer_timeout_s,
                          stall_timeout_s=options0.stall_timeout_s,
                          chaos=job.chaos) as transport:
        startup.lap("rendezvous")
        executor = _rank_executor(plan, options0, env.rank, device, startup)
        results = serve_rank(RankNode(env, plan, executor, transport, clock, job, startup=startup))
    return results if env.rank == COORDINATOR else None


def serve_rank(node: RankNode) -> list:
    """node.serve(), profiled when the profile_ranks option names this rank; a backend error that hides
    which peer died comes out as that peer's PeerFailure (_peer_failure_behind)."""
    from runtime.transport.zmq_dist import PeerFailure
    try:
        return profiled(node) if profile_wanted(node.rank) else node.serve()
    except PeerFailure:
        raise
    except RuntimeError as err:
        raise _peer_failure_behind(node.transport, err, node.job.peer_timeout_s + 1.0) from None


def _rank_executor(plan, options, rank: int, device, startup: StartupTimes):
    """This rank's executor, over weights holding only the experts the plan places on `rank`: the
    engine never runs another rank's expert, and a big model's experts do not fit on every rank.
    The weights are built (random) or put (checkpoint) straight on `device`, where the executor keeps them
    (the CUDA executor's device: `device` on a GPU rank, the host for its CPU twin)."""
    from models.weights import load_weights
    from runtime.drivers.cluster import build_executor
    if options.executor == "sim":
        return build_executor(plan, options)
    weights = load_weights(plan.spec, experts=plan.placement.held_by(rank), device=device)
    if device.type == "cuda":
        import torch
        torch.cuda.synchronize(device)  # (the draws are queued: their time belongs here)
    startup.lap("weights")
    if settings.current().verbose:
        held = [weights.layers[l]["experts.gate"].shape[0] for l in plan.spec.moe_layers]
        print(f"rank {rank}: weights {weights.num_bytes()} bytes, experts held per MoE layer {held}",
              file=sys.stderr, flush=True)
    executor = build_executor(plan, options, weights)
    startup.lap("executor")
    return executor


def _peer_failure_behind(transport, err: RuntimeError, within_s: float):
    """A backend error raised synchronously (gloo fails every later post on a pair its dead peer
    reset, e.g. "Read error ... Connection reset by peer") does not say which rank died. The
    heartbeats do: keep polling the transport (its health check names the silent rank, or a peer's
    abort notice arrives) for up to `within_s`. Returns that PeerFailure, or `err` if none shows up."""
    from runtime.transport.health import PeerFailure
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        try:
            transport.poll(timeout=0.05)
        except PeerFailure as failure:
            seen = (str(err).splitlines() or [type(err).__name__])[0][:200]
            reason = failure.reason if seen[:80] in failure.reason else f"{failure.reason} (first seen here as: {seen})"
            return PeerFailure(failure.rank, failure.waiting_for, reason, failure.reported_by)
        except RuntimeError:
            time.sleep(0.05)  # the same backend error again (a queued send to the dead peer)
    return err

