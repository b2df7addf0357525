"""In-process N-rank driver: N engines in one process, connected by the in-process transport.

Two loops over the same engines:
- wall clock: every rank in turn receives, picks and runs one batch (execute + complete back to
  back); real time, real tensors. This is what `dataflow run --in-process` uses.
- virtual clock: an event heap in all but name. A batch starts when its rank is idle, its math runs
  at once, and it completes at start + cost-model duration; messages arrive at send time + the
  transport's (seeded) link delay. Deterministic to the bit, so scheduler studies and the failure
  mode tests are reproducible, and exactness tests can stress message orders.

`run_workload(plan, requests, options)` is the one entry point the CLI calls.
"""
from __future__ import annotations

import math
import random
import time
from heapq import heapify, heappop, heappush
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from runtime.core.clock import VirtualClock, WallClock
from runtime.executors.cost_model import CostModel
from runtime.core.engine import Batch, Engine, config_from_plan
from runtime.observability.metrics import BATCH_LOG, summarize
from runtime.core.requests import Request
from runtime.drivers.admission import Admission
from runtime.core.scheduler import Defrag, Policy, make_policy
from runtime.observability.trace import TRACE_BATCHES, TraceRecorder
from runtime.transport.inproc import DelayFn, InprocHub
from runtime.drivers.partitions import from_wire, heap_below, to_wire


@dataclass
class RunOptions:
    policy: str = "defrag"
    policy_params: dict = field(default_factory=dict)
    clock: str = "wall"  # wall | virtual
    executor: str = "torch"  # torch (CudaExecutor on a cuda plan) | cuda (its CPU twin on cpu) | sim (no model)
    cost_model: CostModel = field(default_factory=CostModel)  # batch durations on the virtual clock
    delay: Optional[DelayFn] = None  # in-process link delay hook (seconds), seeded by delay_seed
    delay_seed: int = 0
    trace: bool = False
    kv_blocks: Optional[int] = None  # per-rank KV pool override (None: the plan's)
    home_policy: Optional[str] = None  # None: the plan's
    # Called with each engine before any admission (in a rank process too, so picklable there): an experiment's
    # change to the engine, e.g. the lab's decode-only mode (lab/decode_only.py: random prompt K/V, no prefill
    # compute, the paper's throughput setup, in-process only) or a scenario's slow rank (lab/bench.py WallSlowRanks).
    engine_setup: Optional[Callable[[object], None]] = None
    # Applied to the executor each rank builds, which it returns replaced or changed (an experiment's routing
    # override, say); picklable, so rank processes apply the same one. None: the executor as built.
    executor_wrapper: Optional[Callable[[object], object]] = None
    until: Optional[float] = None  # stop at this clock time; unfinished requests are reported so
    # Wall clock, the floor of the stall bound: a rank's serving loop (peers watch its heartbeat) or, with requests
    # outstanding, every rank's batches standing still for max(this, 10x the longest pause seen) is a bug, not a wait
    # (runtime/transport/health.py ProgressWatch; `dataflow run --stall-timeout`).
    stall_timeout_s: float = 60.0
    progress: Optional[Callable[[int, int, int], None]] = None  # (finished, total, tokens)
    # One JSON line per finished request (runtime/drivers/workload.py output_line), written and
    # flushed as each finishes, in finish order, by whoever collects the finished requests (the in-process driver, or
    # rank 0's coordinator): a run that fails later keeps them. run_workload / run_workloads_multiprocess create the
    # file empty first.
    output_path: Optional[str] = None
    # Multi-process only. False: the coordinator keeps no tokens or times of a finished request once its line is out
    # (RunResult.requests then carry none; the metrics come from running totals, p99 ITL within 1%): flat memory on
    # rank 0 however many requests a long run serves. Needs output_path.
    keep_outputs: bool = True
    batch_log: Optional[int] = BATCH_LOG  # per-batch records an engine keeps (runtime/observability/metrics.py); None: every one
    # Virtual clock: split the run over this many processes once everything is admitted, each a block of whole nodes
    # of `partition_align` ranks (runtime/drivers/partitions.py; where it cannot, one process: metrics["partitions"]).
    # `split_state`: what the caller observes of the run outside the engines (the lab's probes), folded back into this
    # process at the end: split() at the fork in every process, export(ranks) in each child, merge(parts) here.
    partitions: int = 1
    partition_align: int = 1
    split_state: Optional[object] = None


@dataclass
class RunResult:
    requests: list[Request]  # in submission order
    metrics: dict
    trace: Optional[TraceRecorder]
    world_size: int


class Cluster:
    def __init__(self, plan, executor, options: RunOptions):
        self.plan, self.options, self.world_size = plan, options, plan.cluster.ranks
        self.clock = VirtualClock() if options.clock == "virtual" else WallClock()
        if options.clock not in ("wall", "virtual"):
            raise ValueError(f"clock {options.clock!r}; valid: wall, virtual")
        self.hub = InprocHub(self.world_size, self.clock, options.delay, options.delay_seed,  # knows delivery times
                             copy=not getattr(executor, "fresh_outputs", False))
        self.transports = self.hub.transports()
        self.trace = TraceRecorder(TRACE_BATCHES * self.world_size) if options.trace else None
        cfgs = [config_from_plan(plan, r, options.kv_blocks) for r in range(self.world_size)]
        # All ranks share the executor's device here: their pools together must fit its free memory.
        from runtime.executors.kv_fit import executor_kv_fit
        fit = executor_kv_fit(executor, plan, 0, max(c.num_blocks for c in cfgs), pools=self.world_size)
        for c in cfgs:
            c.num_blocks = min(c.num_blocks, fit)
        self.engines = [Engine(cfgs[r], executor, self.transports[r],
                               self.clock, make_policy(options.policy, **options.policy_params), self.trace,
                               batch_log=options.batch_log)
                        for r in range(self.world_size)]
        self._out = None  # OutputWriter while run() streams finished requests to options.output_path
        if options.engine_setup is not None:
            for e in self.engines:
                options.engine_setup(e)
        if options.clock == "virtual":  # simulated batch ends: a batch's results are there when it completes
            for e in self.engines:
                e.async_sample = False
        self.admission = Admission(plan.kv.block_size, [e.cfg.num_blocks for e in self.engines],
                                   options.home_policy or plan.placement.home_policy, plan.placement.homes(len(self.engines)))

    # ------------------------------------------------------------------ shared pieces
    def _release(self, pending: list[Request], now: float) -> list[int]:
        """Admit the requests due by `now` that fit; the ranks they went to."""
        while pending and pending[-1].arrival <= now:
            self.admission.submit(pending.pop())
        if not self.admission.waiting:
            return []  # (a virtual-clock run calls this at every event: no list of every rank's free pages then)
        free = [e.free_blocks() for e in self.engines]
        homes = []
        for req, home in self.admission.admit(free):
            if not self.engines[home].admit(req):
                raise RuntimeError(f"rank {home} refused request {req.name!r} after admission placed it there")
            homes.append(home)
        return homes

    def _collect(self, done: list[Request], total: int, ranks: Optional[list[int]] = None) -> bool:
        before = len(done)
        for e in self.engines if ranks is None else [self.engines[r] for r in ranks]:
            if f := e.take_finished():
                done.extend(f)
                for req in f if self._out is not None else ():
                    self._out.write(req)
        if (got := len(done) > before) and self.options.progress:
            self.options.progress(len(done), total, sum(e.metrics.tokens for e in self.engines))
        return got

    def _stalled(self, why: str) -> RuntimeError:
        states = "\n  ".join(e.state() for e in self.engines)
        return RuntimeError(f"run stalled ({why}) at t={self.clock.now():.6f}; admission waiting="
                            f"{self.admission.waiting}\n  {states}")

    # ------------------------------------------------------------------ a split run (runtime/drivers/partitions.py)
    def _why_not_split(self) -> Optional[str]:
        from runtime.drivers.partitions import why_not
        return why_not(self)

    def _split(self, busy, ends, mail, restless, carry):
        """Fork the run's processes; this one keeps its own ranks' events (every process holds the whole state as it
        was: the others' ranks are left behind, idle forever here)."""
        from runtime.drivers.partitions import split
        o = self.options
        part = split(self.world_size, o.partitions, o.partition_align, o.cost_model.min_duration())
        own = part.own
        ends[:] = [x for x in ends if x[1] in own]
        heapify(ends)
        mail[:] = [m for m in mail if m[2] in own]
        heapify(mail)
        restless.intersection_update(own)
        carry.intersection_update(own)
        self.hub.departures, self._sent_at_split, self._parts, self._part = [], self.hub.messages, len(part.ranks), part
        if part.index:
            o.progress = None  # (the parent reports; this is the child's copy of the options)
        if o.split_state is not None:
            o.split_state.split()
        return part

    def _join(self, part, done: list[Request], n_done: int) -> None:
        """The end of a split run: each child hands the parent what the run's result needs of its ranks (their metrics,
        the requests they finished, the messages they sent, the caller's `split_state`) and exits; the parent folds it
        in, so that run() goes on as after a run in one process."""
        from runtime.drivers.partitions import child_exit, copy_request, pack_metrics, reap, unpack_metrics
        engines, own, o = self.engines, part.own, self.options
        self._collect(done, len(self._requests), list(own))
        if part.index:
            for r in own:  # (run() does this for the parent's ranks)
                engines[r].metrics.max_queue_delay = max(engines[r].metrics.max_queue_delay, engines[r].oldest_wait())
            child_exit(part, (done[n_done:], pack_metrics({r: engines[r].metrics for r in own}),
                              self.hub.messages - self._sent_at_split,
                              o.split_state.export(own) if o.split_state is not None else None))
        parts = part.exchange({}, self.clock.now())
        reap(part)
        by_rid = {q.rid: q for q in self._requests}
        states = []
        for i in sorted(parts):
            finished, metrics, sent, state = parts[i]
            for q in finished:
                copy_request(by_rid[q.rid], q)
                done.append(by_rid[q.rid])
            for r, m in unpack_metrics(metrics).items():
                engines[r].metrics = m
            self.hub.messages += sent
            states.append(state)
            self._remote.update(part.ranks[i])
        done[n_done:] = sorted(done[n_done:], key=lambda q: (q.t_finish, q.rid))  # (finish order, across processes)
        if o.split_state is not None:
            o.split_state.merge(states)

    # ------------------------------------------------------------------ run
    def run(self, requests: list[Request]) -> RunResult:
        if len({r.rid for r in requests}) != len(requests):
            raise ValueError("request ids (rid) must be unique")
        # a split run's share of this process (runtime/drivers/partitions.py), its process count, the ranks another
        # process of it had
        self._requests, self._part, self._parts, self._remote = requests, None, 1, set()
        # Latest arrival first so the next due request is pop()-ed from the end.
        pending = sorted(requests, key=lambda r: (r.arrival, r.rid), reverse=True)
        done: list[Request] = []
        t0 = self.clock.now()
        from runtime.drivers.workload import OutputWriter
        self._out = OutputWriter(self.options.output_path, truncate=True) if self.options.output_path else None
        try:
            if self.options.clock == "virtual":
                self._run_virtual(pending, done, len(requests))
            else:
                self._run_wall(pending, done, len(requests))
        except BaseException as err:
            if self._part is not None:  # a split run: a child never returns into the caller; the parent ends them
                from runtime.drivers.partitions import abandon
                abandon(self._part)
            if not isinstance(err, Exception):
                raise
            # The work done so far goes with the error: `err.finished` (finish order; each already on its line of
            # options.output_path), as RunFailed.finished does for the multi-process runner.
            err.finished = list(done)
            raise
        finally:
            if self._out is not None:
                self._out.close()
                self._out = None
        elapsed = self.clock.now() - t0
        if requests:
            first = min(r.arrival for r in requests)
            ends = [r.t_finish for r in requests if r.done]
            elapsed = (max(ends) if ends and len(ends) == len(requests) else self.clock.now()) - first
        for e in self.engines:
            # Items still queued when a run stops (an `until` horizon) count with their wait so far:
            # a starved item must show up in the max queueing delay, not vanish from it.
            if e.rank not in self._remote:
                e.metrics.max_queue_delay = max(e.metrics.max_queue_delay, e.oldest_wait())
        metrics = summarize(requests, [e.metrics for e in self.engines], elapsed, policy=self.options.policy,
                            ranks=self.world_size, dispatch=self.engines[0].dispatch_name if self.engines else None,
                            messages=self.hub.messages)
        metrics["partitions"] = self._parts  # processes the run used (RunOptions.partitions)
        return RunResult(list(requests), metrics, self.trace, self.world_size)

    def _run_wall(self, pending: list[Request], done: list[Request], total: int) -> None:
        clock, engines, until = self.clock, self.engines, self.options.until
        last_progress = clock.now()
        while len(done) < total:
            now = clock.now()
            if until is not None and now >= until:
                return
            self._release(pending, now)
            ran = False
            for e in engines:
                ran |= e.poll() > 0
                batch = e.next_batch()
                if batch is not None:
                    e.execute(batch)
                    e.complete(batch)
                    ran = True
            if self._collect(done, total):
                ran = True
            if ran:
                last_progress = clock.now()
                continue
            if clock.now() - last_progress > self.options.stall_timeout_s:
                raise self._stalled(f"no progress for {self.options.stall_timeout_s} s")
            # Nothing runnable: wait for the next arrival or delivery, in slices of at most 1 ms.
            wake = ([pending[-1].arrival] if pending else []) + [t for t in [self.hub.next_delivery()] if t is not None]
            wake += [now + e.hold_s for e in engines if e.hold_s > 0]  # wave holds expire
            wake += [now + 0.0002 for e in engines if e.deferred]  # sample tokens or routing on their way to the host
            if not wake and not self.admission.waiting:
                raise self._stalled("nothing queued, nothing in flight, requests unfinished")
            gap = min(wake) - clock.now() if wake else 0.001
            time.sleep(min(max(gap, 0.0), 0.001))

    def _run_virtual(self, pending: list[Request], done: list[Request], total: int) -> None:
        """Events in time order; at each: (1) batches ending now complete, in rank order; (2) arrivals are admitted;
        (3) idle ranks receive and start their next batch, in rank order; (4) the clock jumps to the next batch end,
        delivery to an idle rank, wave-hold expiry or arrival. Step 3 visits only the idle ranks something happened
        to (a batch ended, mail is due, a request admitted, a hold or deferred batch pending, not yet visited), not
        every idle rank at every event (O(ranks) per event: 4.5M next_batch calls, 49 of 120 s under cProfile, for 147k
        events in a 64-rank, 1-request-per-rank simulation; benchmarks/results/session22_sim_scaling.md, session 24).

        An idle rank whose last decision found nothing runnable ("settled") spins until something changes, as a real
        rank's serving loop does, deciding nothing again and again: when next visited, its policy has taken enough of
        those idle decisions for its history to hold only its idle state (`_spin`: Defrag's ring of `history`
        snapshots). Until session 28 it was owed one idle decision per event of the whole cluster since, so a rank's
        history depended on how many other ranks the cluster has and how busy they were, and a simulation split over
        processes (each seeing only its ranks' events) could not reproduce it."""
        clock, engines, hub, cost = self.clock, self.engines, self.hub, self.options.cost_model
        until, R, in_flight = self.options.until, self.world_size, hub._in_flight
        busy: list[Optional[tuple[float, Optional[Batch]]]] = [None] * R
        ends: list[tuple[float, int]] = []       # heap: (end, rank) of every busy rank
        mail = hub.mail = []                     # heap: (delivery, seq, dst, src, meta, tensor): every message sent
        held: list[list] = [[] for _ in range(R)]  # mail of a busy rank, not an event until it is idle
        due: list[list] = [[] for _ in range(R)]  # mail delivered, handed to the rank's engine at its next visit
        settled: set[int] = set()                # idle ranks whose last decision found nothing to do
        restless, touched, carry, finishing = set(range(R)), [], set(), False
        send_cpu, per_expert, duration = getattr(cost, "send_cpu", 0.0), getattr(cost, "expert_per_expert", 0.0), cost.duration
        receive, rng = getattr(cost, "busy_receive", None), random.Random(f"receive {self.options.delay_seed}")

        def completed(r: int, b: tuple) -> float:
            """Rank r's batch b ends now: complete it; the seconds its sends keep the rank busy after it (cost.send_cpu
            each: the rank stays busy for what its device time did not hide)."""
            sent = hub.messages
            engines[r].complete(b[1])
            sent = hub.messages - sent
            if sent and send_cpu:
                device = b[0] - b[1].t_start
                return cost.with_sends(device, sent) - device
            return 0.0

        # A split run (runtime/drivers/partitions.py): this process's share once everything is admitted, the window
        # whose batches are completed, the time the run ends (its last request's finish, learnt at a window's exchange)
        split = self.options.partitions > 1 and self._why_not_split() is None
        part, window_end, stop_at, finished = None, math.inf, math.inf, 0

        def open_window(T: float) -> tuple[float, float]:
            """The window [T, T + W): this process's batches ending in it completed, each at its end (the module
            doc's why), their messages exchanged and landed here in send order; (its end, the run's end or inf)."""
            nonlocal finished
            W, fin, last = part.window, 0, -math.inf
            for t_c, r in sorted(x for x in heap_below(ends, T + W) if busy[x[1]][1] is not None):
                clock.at(t_c)
                n = len(engines[r].finished)
                busy[r] = (t_c, None, completed(r, busy[r]))
                if len(engines[r].finished) > n:
                    fin, last = fin + len(engines[r].finished) - n, t_c
            clock.at(T)
            mine, out = [], {j: [] for j in range(len(part.ranks)) if j != part.index}
            for m in hub.departures:
                (mine if part.owner[m[3]] == part.index else out[part.owner[m[3]]]).append(m)
            hub.departures = []
            for wire, f, t_f in part.exchange({j: (to_wire(v), fin, last) for j, v in out.items()}, T).values():
                mine += from_wire(wire)
                fin, last = fin + f, max(last, t_f)
            mine.sort()  # (send time, source, its count: unique), one process's send order
            for m in mine:
                hub.deliver(*m)
            finished += fin
            return T + W, (last if finished == total else math.inf)

        while True:
            now = clock.now()
            if split and part is None and not pending and not self.admission.waiting:
                part = self._split(busy, ends, mail, restless, carry)
                finished, window_end = len(done) + sum(len(e.finished) for e in engines), now
                n_done = len(done)
            if now >= window_end:
                window_end, stop_at = open_window(now)
            if now >= stop_at:  # the last request finished at this time: no visit at it (as in one process)
                return self._join(part, done, n_done)
            freed = []
            while ends and ends[0][0] <= now:
                freed.append(heappop(ends)[1])
            freed.sort()  # (a rank is in `ends` once at most: no duplicates)
            for r in freed:
                b, busy[r] = busy[r], None
                tail = b[2] if len(b) > 2 else 0.0  # (completed at its window's start)
                if b[1] is not None:
                    tail = completed(r, b)
                    finishing = finishing or bool(engines[r].finished)  # (requests finish in a complete or a visit)
                if tail > 0:
                    busy[r] = (now + tail, None)
                    heappush(ends, (now + tail, r))
                    continue
                for m in held[r]:  # (due now: straight to its visit this pass, as the mail loop would put it)
                    if receive is not None and m[0] <= now and m[3] != r:  # landed during the batch: received from
                        m = (now + receive(rng),) + m[1:]  # now on (cost.busy_receive; again if a batch starts first)
                    due[r].append(m) if m[0] <= now else heappush(mail, m)
                held[r].clear()
            if finishing:  # some rank this event freed or the last one visited has finished requests
                self._collect(done, total, sorted(set(freed).union(touched)))
                finishing = False
            if len(done) == total:
                return
            released = self._release(pending, now) if pending or self.admission.waiting else ()
            todo = [r for r in (sorted(set(freed).union(released, restless, carry)) if released or restless or carry
                                else freed) if busy[r] is None]  # (sorted: a heap)
            carry = set()
            touched = []
            while todo or (mail and mail[0][0] <= now):
                if mail and mail[0][0] <= now:  # mail due: its rank is visited in this pass, or the next
                    m = heappop(mail)
                    due[d := m[2]].append(m)
                    if busy[d] is None:
                        (carry.add(d) if touched and d <= touched[-1] else heappush(todo, d))
                    continue
                r = heappop(todo)
                if touched and r == touched[-1]:
                    continue
                touched.append(r)
                e = engines[r]
                if r in settled:
                    settled.discard(r)
                    _spin(e.policy)
                if box := due[r]:  # what Engine.poll would get, in delivery order (a busy rank's held mail, pushed
                    due[r] = []       # back when it finished, may be earlier than some that came due while it ran)
                    for _, _, _, src, meta, tensor in (sorted(box) if len(box) > 1 else box):
                        in_flight[src] -= 1
                        e.on_message(src, meta, tensor)
                batch = e.next_batch()
                restless.discard(r)
                if batch is not None:
                    e.execute(batch)
                    busy[r] = (now + duration(batch.stage.kind, batch.rows, _experts(batch) if per_expert else 1), batch)
                    if part is not None and busy[r][0] < window_end:  # (a split run's windows rely on it: min_duration)
                        raise RuntimeError(f"rank {r}: a {batch.stage.name} batch of {busy[r][0] - now:.3g} s, shorter "
                                           f"than the split run's window ({part.window:.3g} s)")
                    heappush(ends, (busy[r][0], r))
                elif e._idle_at == e._changes[0] and not e.hold_s and not e.deferred:
                    settled.add(r)
                else:
                    restless.add(r)
                finishing = finishing or bool(e.finished)
            while mail and busy[mail[0][2]] is not None:
                held[mail[0][2]].append(heappop(mail))
            t_next = min(ends[0][0] if ends else math.inf, mail[0][0] if mail else math.inf,
                         pending[-1].arrival if pending else math.inf, window_end, stop_at,
                         *([now + engines[r].hold_s for r in restless if engines[r].hold_s > 0] if restless else ()))
            if t_next == math.inf:
                raise self._stalled("no batch running, nothing in flight, no arrival due")
            if until is not None and t_next > until:
                return
            clock.advance_to(max(t_next, now))


def _spin(policy) -> None:
    """The idle decisions of a settled rank between two visits (Cluster._run_virtual): as many as the policy's history
    holds (Defrag's and Aging's `history`, in one step: repeat_idle takes the count); the base policy's is a no-op; any
    other policy's repeat_idle is called once."""
    rep = policy.repeat_idle
    fn = getattr(rep, "__func__", None)
    if fn is Defrag.repeat_idle:
        rep(policy.history)
    elif fn is not Policy.repeat_idle:
        rep()


def build_executor(plan, options: RunOptions, weights=None):
    """The executor for a run (the torch one over the plan's weights, or the simulated one), passed through
    `options.executor_wrapper` when one is given."""
    ex = _build_executor(plan, options, weights)
    return ex if options.executor_wrapper is None else options.executor_wrapper(ex)


def _build_executor(plan, options: RunOptions, weights=None):
    if options.executor == "sim":
        from runtime.executors.sim_executor import SimExecutor
        return SimExecutor.for_spec(plan.spec)
    if options.executor not in ("torch", "cuda"):
        raise ValueError(f"executor {options.executor!r}; valid: torch, cuda, sim")
    from models.weights import load_weights
    w = weights if weights is not None else load_weights(plan.spec)
    if plan.cluster.device == "cuda" or options.executor == "cuda":
        # CUDA graphs per plan bucket + Triton kernels (runtime/executors/cuda_executor.py). executor="cuda"
        # on a CPU plan runs its CPU twin (same bucketing/padding code, no graphs).
        import torch
        from runtime.executors.cuda_executor import CudaExecutor
        # A cuda plan where no GPU is visible runs the CPU twin (the CLI says so), as the ranks do.
        on_gpu = plan.cluster.device == "cuda" and torch.cuda.is_available()
        return CudaExecutor(plan.spec, w, plan, device="cuda" if on_gpu else "cpu")
    from runtime.executors.torch_executor import TorchExecutor
    return TorchExecutor(plan.spec, w)


def _experts(batch) -> int:
    """Distinct experts of a host-routed expert batch (where the cost model charges them: expert_per_expert); else 1."""
    if batch.stage.kind != "expert" or not hasattr(batch.items[0], "expert"):
        return 1
    return len(np.unique(np.concatenate([it.expert for it in batch.items])))


def run_workload(plan, requests: list[Request], options: Optional[RunOptions] = None, weights=None) -> RunResult:
    """Serve `requests` on `plan` with all ranks in this process and return outputs + metrics."""
    options = options or RunOptions()
    return Cluster(plan, build_executor(plan, options, weights), options).run(requests)
