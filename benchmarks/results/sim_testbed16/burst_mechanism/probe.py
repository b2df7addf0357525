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
ap.add_argument("--choice", default="live", help="live (as shipped) | stuck (outstanding rows' age bounds the turnaround)")
ap.add_argument("--timeline", type=float, help="print 2 ms bins of one 20 ms burst period starting here (ms)")
ap.add_argument("--w0-ms", type=float, default=-3.0, help="oracle burst: mask node 1 from this long after a burst starts")
ap.add_argument("--w1-ms", type=float, default=6.0, help="oracle burst: ... until this long after it starts")
ap.add_argument("--policies", help="semicolon list of policy strings (the config's: defrag)")
ap.add_argument("--periods", action="store_true", help="print expert batches and tokens per 20 ms period")
a = ap.parse_args()
a.w0, a.w1 = a.w0_ms / 1e3, a.w1_ms / 1e3

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
        if self.rank not in (2, 3) and (a.oracle == "always" or ((now - a.w0) % 0.02) < a.w1 - a.w0):
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

if a.choice == "stuck":   # session 24's idea again: the age of a rank's oldest outstanding rows bounds its turnaround
    import runtime.core.expert_dispatch as ed
    import runtime.core.replica_choice as rc
    from runtime.core.merge import TAG_SHIFT as _TS
    _plan = ed.plan_dispatch
    LAST = {}

    def plan_dispatch(ids, weights, owner, world):
        p = _plan(ids, weights, owner, world)
        LAST["counts"] = p.counts
        return p
    ed.plan_dispatch = plan_dispatch
    _sent, _ret, _own = rc.ReplicaChoice.sent, rc.ReplicaChoice.returned, rc.ReplicaChoice.owners

    def sent(self, gid, now):
        _sent(self, gid, now)
        if not hasattr(self, "out_rows"):
            self.out_rows = np.zeros(len(self.turnaround)); self.since = np.full(len(self.turnaround), np.inf)
        c = np.asarray(LAST["counts"], dtype=np.float64)
        c[self.rank] = 0
        fresh = (c > 0) & (self.out_rows[:len(c)] == 0)
        self.since[:len(c)][fresh] = now
        self.out_rows[:len(c)] += c

    def returned(self, rank, rows, now):
        _ret(self, rank, rows, now)
        if rank == self.rank or not hasattr(self, "out_rows"):
            return
        n = rows[1] if type(rows) is tuple else len(rows)
        self.out_rows[rank] = max(0.0, self.out_rows[rank] - n)
        first = rows[0] if type(rows) is tuple else int(rows[0])
        self.since[rank] = np.inf if self.out_rows[rank] == 0 else max(self.since[rank], self._sent_at[(first >> _TS) % (1 << 16)])

    def owners(self, layer, now):
        if not hasattr(self, "out_rows"):
            return _own(self, layer, now)
        saved = self.turnaround.copy(); saved_at = self.measured_at.copy()
        age = np.where(self.out_rows > 0, now - self.since, 0.0)
        bound = age > self.turnaround * 0.5 ** ((now - self.measured_at) / rc.HALF_LIFE_S)
        self.turnaround[bound] = age[bound]; self.measured_at[bound] = now
        try:
            return _own(self, layer, now)
        finally:
            self.turnaround[:] = saved; self.measured_at[:] = saved_at
    rc.ReplicaChoice.sent, rc.ReplicaChoice.returned, rc.ReplicaChoice.owners = sent, returned, owners

RESULTS = []
import runtime.drivers.cluster as rdc
_run = rdc.Cluster.run


def run(self, requests):
    res = _run(self, requests)
    RESULTS.append((res.requests, [b for e in self.engines for b in e.metrics.batches]))
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

STATS = []
LOGS = []    # per Network: (send time, src node, dst node, disturbed, receive-port wait)   # one dict per Network built (one per cell run)
_init = ln.Network.__init__


def init(self, topology, link, ranks):
    _init(self, topology, link, ranks)
    self.st = defaultdict(float)
    self.log = []
    STATS.append(self.st)
    LOGS.append(self.log)


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
    if a.timeline is not None:
        self.log.append((t, ns, nd, extra > 0, wait))
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
if a.policies:
    upd["policies"] = a.policies.split(";")
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
def timeline(reqs, batches, log, t0, step=0.002):
    """One burst period in 2 ms bins: what crosses node 1's NIC, how long undisturbed messages into the far nodes
    wait at their receive port, the expert batches the far ranks start, the tokens each kind of home samples."""
    home = {}
    print(f"   {'bin ms':>11} | {'n1->far':>7} {'far->far':>8} {'port wait us (far->far)':>23} | "
          f"{'far xbatches':>12} {'rows':>5} {'n1 xb':>5} {'rows':>5} | {'tok n1':>6} {'tok far':>7}")
    for i in range(int(round(0.02 / step))):
        lo, hi = t0 + i * step, t0 + (i + 1) * step
        m = [x for x in log if lo <= x[0] < hi]
        n1f = sum(1 for x in m if x[1] == 1 and x[2] != 1)
        ff = [x[4] for x in m if x[1] != 1 and x[2] != 1 and not x[3]]
        xb = [b.rows for b in batches if b.kind == "expert" and lo <= b.t_start < hi and b.rank not in (2, 3)]
        x1 = [b.rows for b in batches if b.kind == "expert" and lo <= b.t_start < hi and b.rank in (2, 3)]
        tn1 = sum(1 for r in reqs if r.home in (2, 3) for t in r.token_times if lo <= t < hi)
        tf = sum(1 for r in reqs if r.home not in (2, 3) for t in r.token_times if lo <= t < hi)
        on = "*" if ((lo % 0.02) < 0.006) else " "
        print(f"   {lo*1e3:5.0f}-{hi*1e3:3.0f}{on} | {n1f:7d} {len(ff):8d} {np.mean(ff)*1e6 if ff else 0:23.0f} | "
              f"{len(xb):12d} {np.mean(xb) if xb else 0:5.1f} {len(x1):5d} {np.mean(x1) if x1 else 0:5.1f} | {tn1:6d} {tf:7d}")


def periods(reqs, batches):
    """Per 20 ms burst period: expert batches (count, mean rows), tokens sampled, and how spread the requests'
    token times are (the distinct 1 ms bins they fall into: a lockstep wave fills 2-3 bins)."""
    end = max(r.t_finish for r in reqs)
    rows = []
    for k in range(int(end / 0.02) + 1):
        lo, hi = k * 0.02, (k + 1) * 0.02
        xb = [b.rows for b in batches if b.kind == "expert" and lo <= b.t_start < hi]
        tt = [t for r in reqs for t in r.token_times if lo <= t < hi]
        bins = len({int(t * 1e3) for t in tt})
        rows.append(f"{k*20:3d}: {len(xb):4d} x {np.mean(xb) if xb else 0:5.1f} rows, {len(tt):5d} tok, {bins:2d} bins")
    for i in range(0, len(rows), 3):
        print("     " + " | ".join(rows[i:i + 3]))


streaming = iter(RESULTS)
for r, st, log in zip(doc["results"], STATS, LOGS):
    s = {k: (round(v * 1e3, 1) if "wait" in k and not k.startswith("n_") else int(v)) for k, v in sorted(st.items())}
    print(r["label"], r["scenario"], "tok/s", round(r["tokens_per_s"], 1), "peak", r["peak_tokens_per_s"],
          "loss", round(r.get("loss_vs_clean") or 0, 4), "busy", round(r["busy_fraction"], 3),
          "live", round(r["mean_live_requests"], 1), "itl p50", round(r["itl_p50_ms"], 2),
          "dur", round(r["duration_s"], 3), "xbatch", round(r["batches"]["expert"]["mean_size"], 1))
    print("   port waits (ms):", s)
    if r["system"].startswith("streaming"):
        reqs, batches = next(streaming)
        print("   per request:", per_request(reqs))
        if a.periods:
            periods(reqs, batches)
        if a.timeline is not None:
            timeline(reqs, batches, log, a.timeline / 1e3)
