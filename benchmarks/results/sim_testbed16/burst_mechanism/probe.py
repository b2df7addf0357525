"""Session 25 probe: run a testbed bench config with the NIC model's receive-port booking instrumented or changed.

    PYTHONPATH=. python benchmarks/results/sim_testbed16/burst_mechanism/probe.py CONFIG OUT [--mode base|after]
        [--systems a,b] [--scenarios clean,nic-bursts]

--mode base : lab/network.py as is (a burst's extra delay is added before the receive port: the delayed message books
              the far node's receive port at its late arrival, and every later message into that node queues behind it)
--mode after: the extra delay is added after the ports (the delayed message books the ports when it would have
              arrived undisturbed, then lands `extra` later; other flows into the node pass it)
Prints tok/s per cell, and for each cell the receive-port wait (first - own arrival) summed over cross-node messages,
split by whether the message itself was disturbed, and by destination node.
"""
import argparse
import sys
from collections import defaultdict

import lab.network as ln
from lab.interference import transfer_s

ap = argparse.ArgumentParser()
ap.add_argument("config"); ap.add_argument("out")
ap.add_argument("--mode", default="base")
ap.add_argument("--systems"); ap.add_argument("--scenarios")
ap.add_argument("--requests", type=int); ap.add_argument("--rate", type=float)
ap.add_argument("--max-new", type=int); ap.add_argument("--peak-window", type=float)
ap.add_argument("--far", action="store_true", help="every expert's copy on the far half (as replicas_far/far_copies.py)")
ap.add_argument("--oracle", default="none", help="none | always | burst: homes off node 1 never pick a copy on ranks "
                "2-3 (always, or while a burst is on, from 3 ms before it starts)")
a = ap.parse_args()

import numpy as np
import lowering.plan as lp
if a.far:
    _compile = lp.compile_plan

    def compile_far(spec, ranks, *args, **kw):
        plan = _compile(spec, ranks, *args, **kw)
        if kw.get("replicas"):
            er = plan.placement.expert_rank
            plan.placement.replicas = [[[(o + ranks // 2) % ranks] for o in owners] if owners else [] for owners in er]
        return plan
    lp.compile_plan = compile_far
if a.oracle != "none":
    import runtime.core.replica_choice as rc
    _owners = rc.ReplicaChoice.owners

    def owners(self, layer, now):
        if self.rank not in (2, 3) and (a.oracle == "always" or ((now + 0.003) % 0.02) < 0.009):
            held = self.copies.get(layer)
            if held is not None:
                saved = self.turnaround[[2, 3]].copy()
                self.turnaround[[2, 3]] = 1e9
                try:
                    return _owners(self, layer, now)
                finally:
                    self.turnaround[[2, 3]] = saved
        return _owners(self, layer, now)
    rc.ReplicaChoice.owners = owners

if a.mode != "base":   # the closed-form ring mirrors lab/network.py's floats: price ring collectives message by message
    import lab.ring_collective as lrc
    lrc.RingPricer.supports = staticmethod(lambda network: False)

RESULTS = []
import runtime.drivers.cluster as rdc
_run = rdc.Cluster.run


def run(self, requests):
    res = _run(self, requests)
    RESULTS.append(res.requests)
    return res
rdc.Cluster.run = run


def per_request(reqs):
    """tok/s over the run and over its steady window, and ITL / finish by where the request's home is."""
    times = np.sort(np.concatenate([np.asarray(r.token_times) for r in reqs]))
    end = times[-1]
    lo, hi = 0.1 * end, 0.6 * end   # a window inside the run, before the tail
    steady = ((times >= lo) & (times < hi)).sum() / (hi - lo)
    out = {"end_ms": round(end * 1e3, 1), "steady_tok_s": round(steady)}
    for name, sel in (("node1", lambda h: h in (2, 3)), ("far", lambda h: h not in (2, 3))):
        rs = [r for r in reqs if sel(r.home)]
        itl = np.concatenate([np.diff(r.token_times) for r in rs if len(r.token_times) > 1])
        out[name] = {"n": len(rs), "itl_p50_ms": round(float(np.median(itl)) * 1e3, 2),
                     "itl_mean_ms": round(float(itl.mean()) * 1e3, 2),
                     "finish_p50_ms": round(float(np.median([r.t_finish for r in rs])) * 1e3, 1),
                     "finish_max_ms": round(float(max(r.t_finish for r in rs)) * 1e3, 1)}
    return out

STATS = []   # one dict per Network built (one per cell run)
_init = ln.Network.__init__


def init(self, topology, link, ranks):
    _init(self, topology, link, ranks)
    self.st = defaultdict(float)
    STATS.append(self.st)


def delay(self, src, dst, nbytes, t):
    if src == dst:
        return 0.0
    topo = self.topology
    extra, cap = self.link.disturbance(src, dst, t)
    ns, nd = topo.node(src), topo.node(dst)
    if ns == nd:
        return topo.intra_latency_s + extra + transfer_s(nbytes, min(topo.intra_gbps, cap))
    tx = transfer_s(nbytes, min(topo.nic_gbps, cap))
    start = max(t, self.send_free[ns])
    self.send_free[ns] = start + tx
    st = self.st
    st["send_wait"] += start - t
    if a.mode == "after":
        own = start + topo.nic_latency_s
        first = max(own, self.recv_free[nd])
        self.recv_free[nd] = first + tx
        wait = first - own
        d = first + tx + extra - t
    else:
        own = start + topo.nic_latency_s + extra
        first = max(own, self.recv_free[nd])
        self.recv_free[nd] = first + tx
        wait = first - own
        d = first + tx - t
    key = "dist" if extra else "clean"
    st[f"recv_wait_{key}"] += wait
    st[f"n_{key}"] += 1
    if nd == 1:
        st["recv_wait_into_node1"] += wait
    else:
        st["recv_wait_into_other"] += wait
    st["n_into_node1" if nd == 1 else "n_into_other"] += 1
    if wait > 1e-4:
        st["n_wait_over_100us"] += 1
    return d


ln.Network.__init__ = init
ln.Network.delay = delay
import lab.bench as lb
lb.Network = ln.Network

from graph_ir.spec import load_spec
from lab.bench import run_bench
from lab.bench_config import BenchConfig, load_config

cfg = load_config(a.config)
upd = {}
if a.systems:
    upd["systems"] = a.systems.split(",")
    if cfg.baseline not in upd["systems"]:
        upd["baseline"] = upd["systems"][0]
if a.scenarios:
    upd["scenarios"] = {k: v for k, v in cfg.scenarios.items() if k in a.scenarios.split(",")}
wl = {k: v for k, v in (("requests", a.requests), ("rate", a.rate), ("max_new_tokens", a.max_new)) if v}
if wl:
    upd["workload"] = cfg.workload.model_copy(update=wl).model_dump()
if a.peak_window:
    upd["peak_window_s"] = a.peak_window
if upd:
    cfg = BenchConfig.model_validate({**cfg.model_dump(), **upd})
doc = run_bench(cfg, load_spec(cfg.model), a.out)
streaming = iter(RESULTS)
for r, st in zip(doc["results"], STATS if STATS else [{}] * len(doc["results"])):
    s = {k: (round(v * 1e3, 1) if "wait" in k and not k.startswith("n_") else int(v)) for k, v in sorted(st.items())}
    print(r["label"], r["scenario"], "tok/s", round(r["tokens_per_s"], 1), "peak", r["peak_tokens_per_s"],
          "loss", round(r.get("loss_vs_clean") or 0, 4), "busy", round(r["busy_fraction"], 3),
          "live", round(r["mean_live_requests"], 1), "itl p50", round(r["itl_p50_ms"], 2),
          "dur", round(r["duration_s"], 3), "xbatch", round(r["batches"]["expert"]["mean_size"], 1))
    print("   port waits (ms):", s)
    if r["system"].startswith("streaming"):
        print("   per request:", per_request(next(streaming)))
