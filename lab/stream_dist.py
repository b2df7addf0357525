"""The streaming engine's rank main for the distributed EP bench (benchmarks/gpu_ep_bench.py): runtime's
multi-process rank with the bench's executor (lab/barrier_dist.build_executor, the recipe the barrier ranks use),
the interference of each workload's scenario (lab/dist_scenarios.py) and host time per batch (lab/host_probe.py)."""
from __future__ import annotations

from lab.barrier_dist import build_executor
from lab.decode_only import decode_only
from lab.dist_job import DistJob, say, start_rank
from lab.dist_scenarios import ACTIVE, hogs_off, scenario_on
from lab.floors import measure_copy_bps
from lab.host_probe import HostProbe, merge_probes, new_probe, probe_engine


def stream_rank_main(env, job: DistJob):
    """runtime.drivers.rank_process.rank_main with the bench's executor (device-drawn weights, Zipf routing), the
    BurstDelays chaos hook, hogs from rank 0 and host time per batch; one workload per (policy, scenario)."""
    from runtime.drivers.cluster import RunOptions
    from runtime.drivers.control import COORDINATOR
    from runtime.drivers.multiproc import RankJob
    from runtime.drivers.rank_node import RankNode, SyncedClock
    from runtime.drivers.rank_process import serve_rank
    from runtime.transport.zmq_dist import ZmqDistTransport
    device = start_rank(env, job)
    from runtime.core.requests import Request

    def fresh(w):  # the coordinator fills its Request objects in: every workload gets its own
        return [Request(q.rid, q.name, list(q.prompt), q.max_new_tokens, ignore_eos=q.ignore_eos, arrival=q.arrival)
                for q in w.requests]
    works = [(fresh(w), RunOptions(policy=w.system.split("-", 1)[1], clock="wall", kv_blocks=w.kv_blocks,
                                           stall_timeout_s=120.0))
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
                scenario_on(job, job.workloads[w], hogs_state, self.rank)
                super()._start_workload(w, options)
                if job.decode_only and not self.engine.decode_only:
                    decode_only(self.engine)
                if device.type == "cuda" and hasattr(inner, "prepare"):
                    # capture this KV store's graphs before requests come (the barrier does the same
                    # before its start barrier); lazy capture would land inside the timed run
                    try:
                        inner.prepare(self.engine.kv, owned=self.engine.owned_experts)
                    except Exception as err:  # noqa: BLE001
                        say(job, f"prepare failed ({type(err).__name__}: {err}); graphs captured lazily")
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
            ACTIVE["delay"] = 0.0
            hogs_off(hogs_state)
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
