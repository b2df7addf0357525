"""The paper's experiment in one call: systems x policies x scenarios on one workload, side by side.

Every cell of the matrix gets the same model, plan (placement, KV pool), request list (lengths,
prompts, Poisson arrival times), routing (a keyed router, so each token routes identically in every
system), cost model and straggler scenario. Only the system differs:
- `streaming`: the barrier-free engine (runtime/drivers/cluster.py), once per scheduling policy;
- `ag-ep`, `a2a-ep`: synchronous EP (lab/barrier.py); the policy axis does not apply.

Clocks:
- virtual: batch durations come from the cost model (fixed launch cost + per-row cost), link
  delays from the scenario; runs are deterministic to the bit and independent of the machine, so
  the paper's shape is reproducible on 2 CPU cores. The executor may be `sim` (no model math: fast)
  or `torch` (the real tiny model: real tokens, same timing);
- wall: real tensors on this machine, link delays injected on the in-process transport, a slow
  rank sleeps (factor - 1) x its measured compute.

Repeats (`repeats: N`): the whole matrix is measured N times, round by round (every cell's round r
before any cell's round r + 1, so slow drift of the machine hits every cell alike); the report gives
each cell's median over its N runs, and ratios between medians (lab/report.py).

Injection points, applied identically to every system: the transport's delay hook asks
`Interference.delay(src, dst, nbytes, now)` (and counts bytes per link); compute time is scaled
by `Interference.compute_scale(rank, now)`.
"""
from __future__ import annotations

import gc
import itertools
import math
import random
from array import array
import re
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Optional

import numpy as np

from graph_ir.errors import UserError
from lab.arrivals import PoissonArrivals, sample_requests
from lab.bench_config import BARRIER_SYSTEMS, STREAMING, BenchConfig, check_config, split_system
from lab.decode_only import decode_only
from runtime.executors.cost_model import CostModel
from lab.interference import Interference, from_config
from lab.network import Network

SIM_DEVICE_MEMORY_GIB = 141.0   # an H200: a simulated rank's memory unless the config says otherwise
from lab.lengths import length_distribution
from lab.static_replicas import StaticCopies
from lab.report import QueueDepths, RequestRecord, RunRecord, environment, write_report
from runtime.core.requests import Request


# ---- one matrix cell ------------------------------------------------------------------------------------

@dataclass
class Cell:
    system: str
    policy: str
    scenario: str
    repeat: int = 0      # round of the matrix (0 .. repeats - 1)


class SparseDepths(QueueDepths):
    """Every decision's queue depths, kept sparse: per decision its time and rank, per non-empty stage its depth (a
    list of ~73 depths per decision was ~0.7 kB: ~10 GB for the ~15M decisions of 1,024 ranks x 100 tokens, and the
    report's per-sample arrays of them 1.1G samples). `arrays()` gives one sample per (time bin, rank, stage) of the
    report's heatmap (lab/report.py queue_depth_grid: `bins` equal bins between the first and the last decision): the
    mean depth of that rank's decisions in that bin, at the time of one of them (the first decision's time and the last
    one's are among them, so the heatmap's bins are the same). The heatmap made from them equals the one made from
    every decision bit for bit: each bin's sum runs over the same depths in the same order (np.bincount, as np.add.at
    did), divided by the same count."""
    bins = 100  # report.queue_depth_grid's default

    def __init__(self) -> None:
        super().__init__()
        self._time, self._who, self._count = array("d"), array("q"), array("q")  # per decision
        self._stage, self._depth = array("q"), array("d")  # per non-empty stage of a decision
        self._stages = 0

    def record(self, t: float, rank: int, views) -> None:
        """A decision's views (the engine's StageViews: `active` the non-empty stages, `depths` every stage's)."""
        active, depths = views.active, views.depths
        self._time.append(t)
        self._who.append(rank)
        self._count.append(len(active))
        self._stages = len(depths)
        if active:  # (one or two stages, at every decision: extends, not an append per stage)
            self._stage.extend(active)
            self._depth.extend([depths[sid] for sid in active])

    def __len__(self) -> int:
        return len(self._time) * self._stages

    def mark(self) -> tuple[int, int]:
        """Where the decisions recorded from now on start (a split run's fork: those before are every process's)."""
        return len(self._time), len(self._stage)

    def since(self, mark: tuple[int, int]) -> tuple:
        """The decisions recorded after `mark`, as plain arrays (what a child process of a split run hands back)."""
        d, s = mark
        return (self._time[d:], self._who[d:], self._count[d:], self._stage[s:], self._depth[s:], self._stages)

    def fold(self, mark: tuple[int, int], parts: list[tuple]) -> None:
        """Other processes' decisions after `mark` (`since`) into this one's, in the order one process records them:
        by time, then rank (a rank decides once at a time; ranks are visited in order)."""
        mine = self.since(mark)
        pieces = [mine, *parts]
        t = np.concatenate([np.frombuffer(p[0]) for p in pieces])
        who = np.concatenate([np.frombuffer(p[1], dtype=np.int64) for p in pieces])
        count = np.concatenate([np.frombuffer(p[2], dtype=np.int64) for p in pieces])
        stage = np.concatenate([np.frombuffer(p[3], dtype=np.int64) for p in pieces])
        depth = np.concatenate([np.frombuffer(p[4]) for p in pieces])
        order = np.lexsort((who, t))
        start = np.cumsum(count) - count  # each decision's first stage entry
        take = np.repeat(start[order], count[order]) + (np.arange(int(count.sum())) -
                                                        np.repeat(np.cumsum(count[order]) - count[order], count[order]))
        d, s = mark
        del self._time[d:], self._who[d:], self._count[d:], self._stage[s:], self._depth[s:]
        self._time.extend(t[order].tolist())
        self._who.extend(who[order].tolist())
        self._count.extend(count[order].tolist())
        self._stage.extend(stage[take].tolist())
        self._depth.extend(depth[take].tolist())
        self._stages = max([self._stages] + [p[5] for p in parts])

    def arrays(self) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
        t, rk = np.frombuffer(self._time), np.frombuffer(self._who, dtype=np.int64)
        if not len(t):
            return t, rk, rk, t
        edges = np.linspace(t.min(), t.max() + 1e-12, self.bins + 1)
        b = np.clip(np.searchsorted(edges, t, side="right") - 1, 0, self.bins - 1)
        R, S = int(rk.max()) + 1, self._stages
        cell = b * R + rk  # per decision
        cells, cell_of, n = np.unique(cell, return_inverse=True, return_counts=True)
        # each cell's time: its first decision's in the first bin, its last one's elsewhere (so both ends are there)
        first = np.full(len(cells), len(t))
        np.minimum.at(first, cell_of, np.arange(len(t)))
        last = np.zeros(len(cells), dtype=np.int64)
        np.maximum.at(last, cell_of, np.arange(len(t)))
        at = t[np.where(cells // R == 0, first, last)]
        # the non-empty stages' sums per (cell, stage), in decision order
        key = np.repeat(cell_of, np.frombuffer(self._count, dtype=np.int64)) * S + np.frombuffer(self._stage, dtype=np.int64)
        keys, key_of = np.unique(key, return_inverse=True)
        mean = np.bincount(key_of, weights=np.frombuffer(self._depth), minlength=len(keys)) / n[keys // S]
        c, st = keys // S, keys % S
        # cells with no non-empty stage: one zero sample (their mean is 0; the grid keeps their rank), and one zero
        # sample of the last stage where no cell has it (the grid has every stage)
        empty = np.setdiff1d(np.arange(len(cells)), c)
        c, st, mean = np.concatenate([c, empty]), np.concatenate([st, np.zeros(len(empty), np.int64)]), \
            np.concatenate([mean, np.zeros(len(empty))])
        if S - 1 not in st:
            c, st, mean = np.append(c, 0), np.append(st, S - 1), np.append(mean, 0.0)
        return at[c], cells[c] % R, st, mean


@dataclass
class _Probe:
    """What the bench observes of a run from outside: bytes per link, queue depths over time. Also the cluster's
    `split_state` (RunOptions): a split run's processes each observe their own ranks, and the parent folds their
    observations into its own (runtime/drivers/partitions.py)."""
    clock: object = None
    link_bytes: dict = field(default_factory=dict)
    queue: QueueDepths = field(default_factory=SparseDepths)
    sent_bytes: Optional[list] = None  # src * ranks + dst -> bytes sent (a streaming cell's, counted by its link hook)
    ranks: int = 0
    _mark: tuple = (0, 0)

    def split(self) -> None:
        self._mark = self.queue.mark()

    def export(self, own: range) -> tuple:
        return self.queue.since(self._mark), own, self.sent_bytes[own.start * self.ranks:own.stop * self.ranks]

    def merge(self, parts: list[tuple]) -> None:
        self.queue.fold(self._mark, [p[0] for p in parts])
        for _, own, sent in parts:  # (a source's bytes are counted where it sends: in its own process)
            self.sent_bytes[own.start * self.ranks:own.stop * self.ranks] = sent


class _DepthRecorder:
    """Wraps a rank's policy: records every queue depth the policy is shown, then delegates."""

    def __init__(self, inner, rank: int, probe: _Probe):
        self.inner, self.rank, self.probe = inner, rank, probe
        self.name = inner.name
        # what the engine reads at every decision, as attributes (no __getattr__ call each time)
        self.hold_fill, self.hold_ahead, self.repeat_idle = inner.hold_fill, inner.hold_ahead, inner.repeat_idle

    def __getattr__(self, name: str):
        # everything else (params(), the wave hold's hold_fill that the engine reads) is the policy's
        return getattr(self.inner, name)

    def choose(self, views, next_of):
        t = self.probe.clock.now()
        self.probe.queue.record(t, self.rank, views)
        return self.inner.choose(views, next_of)


def _requests(cfg: BenchConfig, spec, base_dir: Optional[Path] = None) -> list[Request]:
    w = cfg.workload
    if w.prompts:
        from runtime.drivers.workload import load_prompts
        p = Path(w.prompts)
        p = p if p.is_absolute() or base_dir is None or p.exists() else base_dir / p
        loaded = load_prompts(p, spec, w.max_new_tokens or 16, ignore_eos=True)
        import numpy as np
        gaps = np.random.default_rng(cfg.seed + 1).exponential(1.0 / w.rate, len(loaded))
        t = np.cumsum(gaps) - gaps[0]
        return [Request(i, q.name, q.prompt, q.max_new_tokens, ignore_eos=True, arrival=float(t[i]))
                for i, q in enumerate(loaded)]
    sampler = length_distribution(w.lengths, w.max_context)
    specs = sample_requests(sampler, w.requests, spec.vocab_size, cfg.seed, reserved_ids=spec.eos_token_ids)
    timed = PoissonArrivals(specs, w.rate, seed=cfg.seed + 1).release(math.inf)
    out = []
    for i, r in enumerate(timed):
        n = r.max_new_tokens if w.max_new_tokens is None else min(r.max_new_tokens, w.max_new_tokens)
        # ignore_eos: the sampled output length is the request's length, as in the paper's runs.
        out.append(Request(i, r.id, r.prompt_token_ids, n, ignore_eos=True, arrival=r.arrival_time))
    return out


def _router(cfg: BenchConfig, spec):
    from lab.routing_override import RoutingTrace, ZipfRouting
    r = cfg.routing
    if r.kind == "zipf":
        return ZipfRouting(spec.experts.num_experts, spec.experts.top_k, s=r.s, drift_every=r.drift_every,
                           drift_stride=r.drift_stride, seed=cfg.seed)
    if r.kind == "trace":
        if not r.path:
            raise UserError("routing.kind = trace needs routing.path (a .jsonl or .npz trace)")
        return RoutingTrace.load(r.path)
    return None


def run_cell(cell: Cell, cfg: BenchConfig, plan, executor, requests: list[Request], router,
             inter: Interference) -> RunRecord:
    """Run one (system, policy, scenario) on fresh copies of the requests; the raw record."""
    system = split_system(cell.system)[0]
    reqs = [Request(q.rid, q.name, list(q.prompt), q.max_new_tokens, ignore_eos=True, arrival=q.arrival)
            for q in requests]
    probe = _Probe()
    cost = cfg.cost.model()
    wall = cfg.clock == "wall"
    # The links: each on its own (the scenario's pure schedule), or a topology whose ports queue (one per run).
    network = None if cfg.network is None else Network(cfg.network.topology(), inter.link, cfg.ranks)
    link_delay = inter.delay if network is None else network.delay
    # A measured delivery time of the rank processes' transport (CostConfig.message_latency) takes the place of the
    # scenario's base latency for every message, the streaming engine's and the barrier ranks' ring hops alike (the
    # same transport in the process bench); bursts and the rest of the link model still add. (check_config: only
    # without a `network`)
    software = cfg.cost.message_latency if not wall else None
    base = inter.link.latency_s if software is not None else 0.0

    def count(src, dst, nbytes):
        key = f"{src}->{dst}"
        probe.link_bytes[key] = probe.link_bytes.get(key, 0) + nbytes

    if system == STREAMING:
        from runtime.drivers.cluster import Cluster, RunOptions

        host_free = [0.0] * cfg.ranks     # when each rank's host is done issuing its previous sends
        # src * ranks + dst -> bytes, None where nothing was sent (probe.link_bytes's keys made once, at the end; a
        # list: a dict's get and set per message cost more, its entries scattered over memory)
        sent_bytes: list[Optional[int]] = [None] * (cfg.ranks * cfg.ranks)
        probe.sent_bytes, probe.ranks = sent_bytes, cfg.ranks
        R, row_bytes, send_cpu = cfg.ranks, cfg.row_bytes, cost.send_cpu if not wall else 0.0

        link_depart = inter.delay if network is None else network.depart

        def depart(src, dst, meta, nbytes, rng):  # (the sender's half of the in-process transport's hook, on the
            # cluster's clock; called for every message: no call or tuple it can do without)
            if row_bytes is not None:   # rows: merge tags, (first, count) or an array (runtime/core/expert_wire.py)
                rows = meta.get("rows", ())
                nbytes = (rows[1] if type(rows) is tuple else len(rows)) * row_bytes
            sent = sent_bytes[key := src * R + dst]
            sent_bytes[key] = nbytes if sent is None else sent + nbytes
            now = clock.now()
            if not send_cpu:
                lead, at = 0.0, now  # ((depart - now) + ..., depart = now)
            else:  # A batch's messages leave one after the other, send_cpu apart (the cluster charges the same host
                # time to the sender's rank; runtime/executors/cost_model.py).
                at = host_free[src]
                if now >= at:  # (max(now, host_free[src]))
                    at = now
                host_free[src] = at + send_cpu
                lead = at - now
            d = link_depart(src, dst, nbytes, at)
            if type(d) is tuple:  # between two nodes: the receiving node's port is booked by `land`
                return d, lead, at
            d = lead + d
            return d if software is None or src == dst else d + software.draw(rng) - base

        def land(departed):  # the receiver's half (runtime/transport/inproc.py DelayFn): seconds from the send
            port, lead, at = departed
            return lead + (network.land(*port) - at)

        def delay(src, dst, meta, nbytes, rng):
            d = depart(src, dst, meta, nbytes, rng)
            return land(d) if type(d) is tuple else d
        if software is None:  # (a drawn latency is drawn in one process's send order: such a run is not split)
            delay.depart, delay.land = depart, land

        scaled = _ScaledCost(cost, _compute_scale(inter, cfg.cost.batch_sigma, cell.repeat) if not wall else None)
        # delay_seed: each round of a virtual-clock matrix draws its own jitter, message latencies and batch spreads
        # (round 0: seed 0, as before rounds drew apart)
        opts = RunOptions(policy=cell.policy, clock=cfg.clock, cost_model=scaled, kv_blocks=cfg.kv_blocks, delay=delay,
                          delay_seed=cell.repeat, trace=cfg.trace_dir is not None,
                          engine_setup=_setups(decode_only if cfg.workload.decode_only else None,
                                               StaticCopies() if cell.system.endswith("s") else None),
                          batch_log=None,  # the report reads every batch
                          partitions=cfg.processes, split_state=probe,
                          partition_align=cfg.network.gpus_per_node if cfg.network is not None else 1)
        cluster = Cluster(plan, executor, opts)
        probe.clock = clock = cluster.clock
        for e in cluster.engines:
            e.policy = _DepthRecorder(e.policy, e.rank, probe)
            _slow_rank(e, scaled, inter, wall)
        # No cyclic GC during a virtual-clock run: it makes almost no cyclic garbage (153 objects in a 64-rank x 100-token
        # run), and the collections kept scanning the growing batch records: 18% of that run's CPU time. (GC pauses
        # stay part of a wall-clock run's timing.)
        collecting = gc.isenabled()
        if not wall:
            gc.disable()
        try:
            res = cluster.run(reqs)
        finally:
            if collecting:
                gc.enable()
        for key, nbytes in enumerate(sent_bytes):
            if nbytes is not None:
                count(key // R, key % R, nbytes)
        if cfg.trace_dir is not None:  # the streaming schedule as Perfetto shows it (runtime/observability/trace.py)
            name = re.sub(r"[^A-Za-z0-9_.-]+", "_", f"{cell.policy}-{cell.scenario}-r{cell.repeat}")
            Path(cfg.trace_dir).mkdir(parents=True, exist_ok=True)
            res.trace.write(Path(cfg.trace_dir) / f"trace-{name}.json", cfg.ranks)
        ranks = [e.metrics for e in cluster.engines]
        max_q, split = res.metrics.get("max_queue_delay_s"), {"processes": res.metrics["partitions"]}
    else:
        from lab.barrier import run_barrier
        sigma = cfg.cost.batch_sigma if cfg.cost.barrier_batch_sigma is None else cfg.cost.barrier_batch_sigma
        scale = (None if wall else _compute_scale(inter, sigma, cell.repeat)) or inter.compute_scale
        if software is not None:
            hop, rng = link_delay, random.Random(f"latency {cell.repeat}")

            def link_delay(src, dst, nbytes, now):
                return hop(src, dst, nbytes, now) + (software.draw(rng) - base if src != dst else 0.0)
        res = run_barrier(plan, executor, reqs, BARRIER_SYSTEMS[system], clock=cfg.clock,
                          cost_model=cfg.cost.model(barrier=True), router=router, link_delay=link_delay,
                          compute_scale=scale, kv_blocks=cfg.kv_blocks, decode_only=cfg.workload.decode_only,
                          row_bytes=cfg.row_bytes)
        probe.link_bytes = res.link_bytes
        ranks = res.ranks
        max_q, split = None, {}
    batches = [b for m in ranks for b in m.batches]  # (the ranks' own records: the report reads them as they are)
    records = [RequestRecord(q.name, q.arrival, list(q.token_times), len(q.prompt), admit=q.t_admit) for q in reqs]
    stage_names = [f"{s.kind}({s.layer})" if s.kind != "sample" else "sample" for s in plan.stages]
    return RunRecord(cell.system, cell.policy if system == STREAMING else "-", cell.scenario, records, batches,
                     probe.queue, probe.link_bytes, max_q, stage_names,
                     extra={"unfinished": sum(1 for q in reqs if not q.done), **split})


def _setups(*hooks):
    """Several engine_setup hooks as one: those that are not None, in order (None when there is none)."""
    hooks = [h for h in hooks if h is not None]
    return None if not hooks else hooks[0] if len(hooks) == 1 else _Chain(hooks)


@dataclass
class _Chain:
    hooks: list  # (picklable, as RunOptions.engine_setup must be for rank processes)

    def __call__(self, engine) -> None:
        for h in self.hooks:
            h(engine)


class _ScaledCost:
    """The cost model seen by the streaming cluster, times `scale(rank, now)` (_compute_scale) for the rank whose
    batch is being timed (set by the engine's execute wrapper just before the cluster asks, with slow ranks)."""

    def __init__(self, inner: CostModel, scale: Optional[Callable[[int, float], float]]):
        self.inner, self.scale = inner, scale
        self.rank, self.now = 0, 0.0
        self.with_sends = inner.with_sends  # (read at every batch end: an attribute, not a __getattr__ call)
        if scale is None:  # nothing to scale: the cost model's own duration, without a call of this one per batch
            self.duration = inner.duration
        self.min_duration = inner.min_duration if scale is None else lambda: 0.0  # (a drawn scale has no floor)

    def duration(self, kind: str, rows: int, experts: int = 1) -> float:
        return self.inner.duration(kind, rows, experts) * self.scale(self.rank, self.now)

    def __getattr__(self, name):   # send_cpu, with_sends, collective_*: not scaled (not compute)
        return getattr(self.inner, name)


def _compute_scale(inter: Interference, sigma: float, seed: int) -> Optional[Callable[[int, float], float]]:
    """The factor on a batch's cost on the virtual clock, per (rank, time), for every system: the scenario's slow
    ranks, times a mean-1 lognormal of shape `sigma` drawn per batch from the round's seeded stream (cost.batch_sigma:
    the spread of rank processes time-sharing cores). None: neither."""
    if not sigma:
        return inter.compute_scale if inter.slow else None
    gauss, slow = random.Random(f"batch {seed}").gauss, inter.compute_scale if inter.slow else None

    def scale(rank: int, now: float) -> float:
        f = math.exp(sigma * gauss(0.0, 1.0) - sigma * sigma / 2)
        return f * slow(rank, now) if slow is not None else f
    return scale


def _slow_rank(engine, scaled: _ScaledCost, inter: Interference, wall: bool) -> None:
    """Route the scenario's slow-rank multiplier into one engine: on the virtual clock by telling
    the cost model which rank's batch it times next, on the wall clock by stalling after the math."""
    if not inter.slow:
        return
    if wall:
        WallSlowRanks(inter)(engine)
        return
    inner_execute = engine.execute

    def execute(batch):
        scaled.rank, scaled.now = engine.rank, engine.clock.now()
        inner_execute(batch)
    engine.execute = execute


class WallSlowRanks:
    """A scenario's slow ranks on the wall clock: while its schedule says a rank is slow by `factor`, every batch
    that rank computes is followed by a stall of (factor - 1) x the time the batch's math took, so the rank computes
    `factor` times slower by its own measured batch time (a busy or throttled GPU). The stall spins: a CPU rank
    computing slower holds its core longer, and sleeping would hand the core to the other ranks of an oversubscribed
    host (4 rank processes on 2 cores ran as fast with rank 1 "slow" by sleeping as without). The same rule for every
    system: the streaming engines get it as RunOptions.engine_setup (in-process and in rank processes; `__call__`
    wraps the engine's execute), the barrier ranks call `stall` after each compute (lab/barrier_mp.py). The schedule's
    time is the run's clock (the engine's, or the barrier ranks' common time base). A factor below 1 cannot
    speed real math up and is ignored here. Host-measured: on a CUDA rank the time of an asynchronous launch, so
    for the CPU processes. Picklable (it travels to the rank processes)."""

    def __init__(self, inter: Interference) -> None:
        self.inter = inter

    def stall(self, rank: int, t: float, measured_s: float) -> float:
        """Stall after a batch that started at run time `t` and took `measured_s`; returns the stall (s)."""
        extra = (self.inter.compute_scale(rank, t) - 1.0) * measured_s
        if extra <= 0:
            return 0.0
        end = time.perf_counter() + extra
        while time.perf_counter() < end:
            pass
        return extra

    def __call__(self, engine) -> None:
        inner_execute = engine.execute

        def execute(batch):
            t, t0 = engine.clock.now(), time.perf_counter()
            inner_execute(batch)
            self.stall(engine.rank, t, time.perf_counter() - t0)
        engine.execute = execute


# ---- real processes ----------------------------------------------------------------------------------------

class WallLinkDelays:
    """A scenario's link disturbances (bursts, jitter, bandwidth traces: the *extra* delay only) as the
    ZeroMQ + torch.distributed transport's chaos hook. The delay is drawn on the *receiving* side when
    a message's header arrives (`lane("recv", me, src)`, the link src -> me at that moment) and the
    message is handed to the engine that much later, in order: later messages from src queue behind
    it as on a slow link. (Drawn on the send side it would only delay the sender's completion notice,
    not the delivery: the message itself would arrive on time.) Time is the wall clock since `epoch`
    (one host: every process sees one clock). The transport's own latency and bandwidth are real; the
    scenario's healthy latency/bandwidth are not added. Picklable (it travels to the rank processes)."""

    def __init__(self, inter: Interference, epoch: Optional[float] = None) -> None:
        from lab.interference import LinkSchedule
        self.link = LinkSchedule(effects=inter.link.effects)
        self.epoch = time.time() if epoch is None else epoch

    def lane(self, direction: str, me: int, peer: int):
        if direction != "recv" or self.link.clean:
            return lambda: 0.0
        link, epoch = self.link, self.epoch
        return lambda: link.delay(peer, me, 0, time.time() - epoch)


def _in_process_runs(cfg: BenchConfig, spec, plans: dict, requests: list[Request], scenarios: dict, progress, router,
                     weights=None) -> list[RunRecord]:
    """Every cell of the matrix with all ranks in this process (virtual or wall clock), one executor."""
    if cfg.executor == "sim":
        from runtime.executors.sim_executor import SimExecutor
        inner = SimExecutor.for_spec(spec, seed=cfg.seed)
    else:
        from models.weights import load_weights
        from runtime.executors.torch_executor import TorchExecutor
        inner = TorchExecutor(spec, weights if weights is not None else load_weights(spec))
    if router is not None:
        from lab.routing_override import KeyedRoutingExecutor
        executor = KeyedRoutingExecutor(inner, router)
    else:
        executor = inner
    runs: list[RunRecord] = []
    todo = [Cell(c.system, c.policy, c.scenario, r) for r in range(cfg.repeats) for c in cells(cfg)]
    for i, cell in enumerate(todo):
        if progress:
            progress(i, len(todo), cell, None)
        t0 = time.perf_counter()
        run = run_cell(cell, cfg, plans[split_system(cell.system)[1]], executor, requests, router,
                       scenarios[cell.scenario])
        run.extra["bench_wall_s"] = time.perf_counter() - t0
        # The cell's cluster is garbage now, in reference cycles (an engine and its transport's recv_into): free it
        # here, not at whatever full pass of the cyclic GC comes next, so the next cell or the report does not pile up
        # on top of it (at 1,024 ranks the report's peak memory moved by ~0.2 GB with the GC's timing; session 26).
        gc.collect()
        run.repeat = cell.repeat
        runs.append(run)
        if progress:
            from lab.report import summarize
            progress(i + 1, len(todo), cell, summarize(run, cfg.peak_window_s))
    return runs


def _process_runs(cfg: BenchConfig, spec, plans: dict, requests: list[Request], scenarios: dict, progress,
                  router=None) -> list[RunRecord]:
    """The streaming engine in one process per rank (runtime/drivers/multiproc.py), one launch per scenario,
    every policy one workload of that launch; link bursts injected through the transport's chaos hook.
    With repeats, the scenarios' launches are run `repeats` times over, round by round."""
    from lab.routing_override import RoutedBy
    from runtime.drivers.cluster import RunOptions
    from runtime.drivers.multiproc import run_workloads_multiprocess
    if cfg.workload.decode_only:
        raise UserError("clock = process: the multi-process driver does not support decode_only yet")
    barriers = [s for s in cfg.systems if split_system(s)[0] in BARRIER_SYSTEMS]
    streaming = [s for s in cfg.systems if split_system(s)[0] == STREAMING]
    runs, i = [], 0
    todo = cfg.repeats * len(scenarios) * (len(cfg.policies) * len(streaming) + len(barriers))
    stage_names = [f"{s.kind}({s.layer})" if s.kind != "sample" else "sample" for s in plans[0].stages]
    for rnd, (name, inter), system in itertools.product(range(cfg.repeats), scenarios.items(),
                                                        barriers + streaming):
        plan = plans[split_system(system)[1]]
        if system in barriers:
            runs.append(_process_barrier(cfg, plan, requests, system, name, inter, stage_names, router))
            runs[-1].repeat = rnd
            i += 1
            if progress:
                from lab.report import summarize
                progress(i, todo, Cell(system, "-", name, rnd), summarize(runs[-1], cfg.peak_window_s))
            continue
        work = []
        for pol in cfg.policies:
            reqs = [Request(q.rid, q.name, list(q.prompt), q.max_new_tokens, ignore_eos=True, arrival=q.arrival)
                    for q in requests]
            work.append((reqs, RunOptions(policy=pol, clock="wall", kv_blocks=cfg.kv_blocks,
                                          executor_wrapper=None if router is None else RoutedBy(router),
                                          engine_setup=_setups(WallSlowRanks(inter) if inter.slow else None,
                                                               StaticCopies() if system.endswith("s") else None))))
        if progress:
            progress(i, todo, Cell(system, ",".join(cfg.policies), name, rnd), None)
        t0 = time.perf_counter()
        results = run_workloads_multiprocess(plan, work, chaos=WallLinkDelays(inter), timeout=600.0)
        wall = time.perf_counter() - t0
        for (reqs, opts), res in zip(work, results):
            m = res.metrics
            records = [RequestRecord(q.name, q.arrival, list(q.token_times), len(q.prompt), admit=q.t_admit)
                       for q in res.requests]
            run = RunRecord(system, opts.policy, name, records, [], [], {}, m.get("max_queue_delay_s"), stage_names,
                            extra={"unfinished": sum(1 for q in res.requests if not q.done), "bench_wall_s": wall,
                                   "expert_mean_batch": m.get("expert_mean_batch"),
                                   "attn_mean_batch": m.get("attn_mean_batch"), "processes": cfg.ranks},
                            repeat=rnd)
            runs.append(run)
            i += 1
            if progress:
                from lab.report import summarize
                progress(i, todo, Cell(system, opts.policy, name, rnd), summarize(run, cfg.peak_window_s))
    return runs


def _process_barrier(cfg: BenchConfig, plan, requests: list[Request], system: str, scenario: str,
                     inter: Interference, stage_names: list[str], router=None) -> RunRecord:
    """One barrier baseline as one process per rank (lab/barrier_mp.py), same chaos hook."""
    from lab.barrier_mp import BarrierJob, barrier_rank_main
    from runtime.drivers.launch import launch_local
    reqs = [Request(q.rid, q.name, list(q.prompt), q.max_new_tokens, ignore_eos=True, arrival=q.arrival)
            for q in requests]
    job = BarrierJob(plan, BARRIER_SYSTEMS[split_system(system)[0]], reqs, cfg.kv_blocks, cfg.cost.collective_algo,
                     WallLinkDelays(inter), router=router, slow=WallSlowRanks(inter) if inter.slow else None)
    t0 = time.perf_counter()
    res = launch_local(cfg.ranks, barrier_rank_main, (job,), timeout=600.0, grace_s=15.0)
    if not res.ok:
        raise RuntimeError(f"{system} [{scenario}] in {cfg.ranks} processes failed: {res.first_error}")
    out = res.results[0]
    done = {q.rid: q for q in out["requests"]}
    records = [RequestRecord(q.name, q.arrival, list(done[q.rid].token_times) if q.rid in done else [], len(q.prompt),
                             admit=done[q.rid].t_admit if q.rid in done else None) for q in reqs]
    batches = [b for r in res.results for b in r["metrics"].batches]
    return RunRecord(system, "-", scenario, records, batches, [], {}, None, stage_names,
                     extra={"unfinished": len(reqs) - len(done), "bench_wall_s": time.perf_counter() - t0,
                            "processes": cfg.ranks})


# ---- the matrix -------------------------------------------------------------------------------------------

def cells(cfg: BenchConfig) -> list[Cell]:
    out = []
    for sc in cfg.scenarios:
        for system in cfg.systems:
            for policy in (cfg.policies if split_system(system)[0] == STREAMING else ["-"]):
                out.append(Cell(system, policy, sc))
    return out


def run_bench(cfg: BenchConfig, spec, out_dir: str | Path, base_dir: Optional[Path] = None,
              progress: Optional[Callable[[int, int, Cell, Optional[dict]], None]] = None,
              weights=None) -> dict:
    """Run the whole matrix and write the report into `out_dir`. Returns the report document."""
    check_config(cfg)
    from lowering.plan import MAX_CPU_RANKS, compile_plan
    memory = cfg.device_memory_gib if cfg.device_memory_gib or cfg.executor != "sim" else SIM_DEVICE_MEMORY_GIB
    # A simulated cluster beyond the CPU's rank cap (one process per CPU rank) is planned as the GPUs it stands for;
    # up to the cap the plan stays a CPU one, so every recorded bench keeps its plan.
    device = "cuda" if cfg.executor == "sim" and cfg.ranks > MAX_CPU_RANKS else "cpu"
    if device == "cuda" and not cfg.device_memory_gib:
        memory = 1e4   # (as benchmarks/sim_scale.py: at 1,024 ranks a plan's graphs and workspace alone are ~390 GiB)
    # one plan per replica count the systems name (split_system), the same placement otherwise; replicas take the
    # host-routed dispatch (the sim executor runs that one anyway)
    plans = {n: compile_plan(spec, cfg.ranks, device=device, device_memory_gib=memory,
                             **({"replicas": n, "dispatch": "host"} if n else {}))
             for n in sorted({split_system(s)[1] for s in cfg.systems} | {0})}
    router = _router(cfg, spec)  # None: the model's own router
    requests = _requests(cfg, spec, base_dir)
    scenarios = {name: from_config(c or {}, name, base_dir) for name, c in cfg.scenarios.items()}
    if cfg.clock == "process":  # every rank process builds its own executor (and the same router)
        runs = _process_runs(cfg, spec, plans, requests, scenarios, progress, router)
    else:
        runs = _in_process_runs(cfg, spec, plans, requests, scenarios, progress, router, weights)
    heat = [r for r in runs if r.system == STREAMING and r.policy in cfg.heatmap_policies
            and r.scenario == cfg.clean_scenario and r.repeat == 0]
    env = environment(device="cpu", mode=cfg.clock)
    env["executor"] = cfg.executor
    doc = write_report(out_dir, runs, cfg.baseline, env, cfg.peak_window_s, cfg.model_dump(),
                       title=f"lab bench: {cfg.name}", heatmap_runs=heat,
                       targets=lambda results: targets(results, cfg))
    return doc


def targets(results: list[dict], cfg: BenchConfig) -> list[dict]:
    """The issue's done-when numbers, measured: ratio >= 1.5x vs the baseline under interference, EP
    loses >= 20% under interference, streaming loses <= 5%, defrag beats mtfs/flfs on batch size
    and throughput. Printed, never asserted. With repeats, `results` are the cells' medians."""
    out = []
    by = {(r["label"], r["scenario"]): r for r in results}
    disturbed = [s for s in cfg.scenarios if s != cfg.clean_scenario]
    # every defrag variant of the streaming engine ("defrag", "defrag:hold_fill=...") is checked
    from runtime.core.scheduler import parse_policy
    defrags = [f"{s}/{p}" for s in cfg.systems if split_system(s)[0] == STREAMING
               for p in cfg.policies if parse_policy(p)[0] == "defrag"]
    for sc in disturbed:
        b = by.get((cfg.baseline, sc))
        barrier = split_system(cfg.baseline)[0] in BARRIER_SYSTEMS
        if b and barrier:
            out.append({"target": f"{cfg.baseline} loses >= 20% of clean tokens/s [{sc}]", "value": b["loss_vs_clean"],
                        "met": b["loss_vs_clean"] is not None and b["loss_vs_clean"] >= 0.20})
        for best in defrags:
            s = by.get((best, sc))
            if s and b and barrier:
                out.append({"target": f"{best} >= 1.5x {cfg.baseline} tokens/s [{sc}]",
                            "value": s["ratio_vs_baseline"],
                            "met": s["ratio_vs_baseline"] is not None and s["ratio_vs_baseline"] >= 1.5})
            if s:
                out.append({"target": f"{best} loses <= 5% of clean tokens/s [{sc}]", "value": s["loss_vs_clean"],
                            "met": s["loss_vs_clean"] is not None and s["loss_vs_clean"] <= 0.05})
    d = by.get((f"{STREAMING}/defrag", cfg.clean_scenario))
    for other in ("mtfs", "flfs"):
        o = by.get((f"{STREAMING}/{other}", cfg.clean_scenario))
        if d and o:
            db = d["batches"].get("expert", {}).get("mean_size", d.get("expert_mean_batch") or 0.0)
            ob = o["batches"].get("expert", {}).get("mean_size", o.get("expert_mean_batch") or 0.0)
            out.append({"target": f"defrag vs {other}: larger mean expert batch and higher tokens/s [clean]",
                        "value": {"batch": [db, ob], "tokens_per_s": [d["tokens_per_s"], o["tokens_per_s"]]},
                        "met": db > ob and d["tokens_per_s"] > o["tokens_per_s"]})
    return out
