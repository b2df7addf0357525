"""`dataflow run` with one process per rank: the rank main, the coordinator protocol, the launcher side.

Every rank process builds the same weights (seeded random or the checkpoint, deterministic), of the
routed experts only those the plan places on it; one engine per workload and one ZmqDistTransport
(runtime/transport/zmq_dist.py) for the whole launch.
Data (expert rows) and control share that transport: control messages are meta-only (no phase 2)
and reach the driver through `engine.on_control`.

Rank 0 is also the coordinator. It alone owns the request list and the arrival times; it picks each
request's home with the plan's home policy (runtime/core/requests.py `Admission`) over a mirror of every
rank's free KV blocks (exact: blocks are reserved at admission and freed at finish, and the
coordinator sees both; the homes also report their real count in every finish notice), sends the
admission, and collects the finished requests. Control protocol (meta["t"]):

  ready  rank -> 0   weights loaded, engine built (startup barrier: a slow loader must not make the
                     first requests look slow)
  sync   0 -> rank   the coordinator's clock reading: every rank offsets its clock to it, so arrival,
                     admission and finish times are on one time base (exact on one host, within one
                     one-way latency across hosts)
  synced rank -> 0   clock shifted; the coordinator admits nothing before every rank said so (a rank
                     must not time-stamp expert rows from a faster peer on its old time base)
  adm    0 -> home   a request (runtime/core/requests.py request_to_wire: plain values) for workload w
  fin    home -> 0   a finished request: tokens, finish reason, times, home's free blocks and tokens
  stop   0 -> rank   every request of workload w finished: report and move on
  done   rank -> 0   this rank's metrics (and trace) of workload w; it is idle

When every request of a workload finished, no data message of it can still be in flight (a request
samples its last token only after all its expert rows came back), so `stop` is a clean cut and the
next workload's engine can start on the same transport. Several workloads per launch (tests run
every policy in one launch: spawning ranks is the expensive part).

Failures end the run, they never hang it: a dead or wedged peer, an abort notice, or a failed
transfer raise PeerFailure from the transport (naming the rank and what this rank was waiting for);
every heartbeat carries its rank's loop and batch counters (runtime/transport/health.py), so a rank whose
main thread is stuck is named by its peers, and the coordinator raises when requests are
outstanding and no rank ran a batch for max(`stall_timeout_s`, 10x the longest pause between
batches so far): a slow run that progresses is never cut off. runtime.drivers.launch turns either
into an abort broadcast and a non-zero exit; `run_workloads_multiprocess` raises RunFailed with
every rank's one-line message.

Weights: every rank loads all of them (attention is needed everywhere; the executor indexes the
stacked expert tensors by global expert id, so keeping only the local experts would need an index
remap in the executor). On the tiny/CPU models this costs nothing worth the complexity.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from dataclasses import dataclass
from typing import Optional

from runtime.drivers.gc_settle import settle_heap, thaw_heap
from runtime.drivers.launch import RankEnv, from_torchrun_env, launch_local, run_rank
from runtime.observability.rank_profile import PhaseTimes as _PhaseTimes, profile_wanted, profiled, timed as _timed
from runtime.core.requests import request_from_wire, request_to_wire
from runtime.drivers.startup import StartupTimes, write_atomically as _write_atomically

CTRL_READY, CTRL_SYNC, CTRL_SYNCED = "ready", "sync", "synced"
CTRL_ADMIT, CTRL_FIN, CTRL_STOP, CTRL_DONE = "adm", "fin", "stop", "done"
CTRL_CANCEL = "cancel"
COORDINATOR = 0
DEFAULT_STARTUP_TIMEOUT_S = 300.0  # loading a real checkpoint can take minutes; liveness is the heartbeat's job
_DEFERRED_POLL_S = 0.0002  # idle wait while a deferred batch's tokens or routing are being copied (engine.async_*)
_IDLE_WAIT_S = 0.002  # longest blocking poll when idle (the coordinator's next arrival may be sooner)
_PROGRESS_EVERY_S = 0.1
_STALL_CHECK_EVERY_S = 0.05


class RunFailed(RuntimeError):
    """A multi-process run ended with failed ranks. The message names each failed rank and why.
    `finished`: the requests that finished before it (the caller's Request objects, results filled in, in finish
    order, every workload's); `unfinished`: the others (submission order). Each finished one is also on its line of
    its workload's RunOptions.output_path, when set."""

    def __init__(self, message: str, finished: Optional[list] = None, unfinished: Optional[list] = None) -> None:
        super().__init__(message)
        self.finished = list(finished or [])
        self.unfinished = list(unfinished or [])


@dataclass
class RankJob:
    """Everything a rank process needs, pickled once by the launcher (or built locally under torchrun)."""
    plan: object  # lowering.plan.Plan
    workloads: list  # [(requests, RunOptions without callables)]; only the coordinator uses the requests
    peer_timeout_s: float
    chaos: object = None  # runtime.transport.chaos.ChaosDelays: seeded per-message delays (tests)
    progress_path: Optional[str] = None  # the coordinator writes "done total tokens" here for the launcher
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    finished_path: Optional[str] = None  # the coordinator appends a JSON line per finished request (_journal)
    # (commands, events) endpoints of a serving front (runtime/drivers/front.py, runtime/drivers/front_link.py): the one workload is
    # open, its requests come from the front while the ranks serve, and tokens stream back to it.
    front: Optional[tuple] = None


class SyncedClock:
    """Wall clock (perf_counter, CLOCK_MONOTONIC) shifted onto the coordinator's time base by `sync`."""

    def __init__(self) -> None:
        self._offset = -time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() + self._offset

    def sync(self, coordinator_now: float) -> None:
        self._offset = coordinator_now - time.perf_counter()


# ------------------------------------------------------------------------------ rank process
def _device_and_backend(plan, local_rank: int):
    import torch
    if plan.cluster.device == "cuda":
        if not torch.cuda.is_available():
            print(f"note: plan targets cuda but no GPU is visible to local rank {local_rank}; running on CPU (gloo)",
                  file=sys.stderr)
            return torch.device("cpu"), "gloo"
        # NVLink SHARP (multicast) buffers are not needed for point-to-point and fail on some lent machines.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank), "nccl"
    return torch.device("cpu"), "gloo"


def _import_rank_modules(plan, options) -> None:
    """Import what the rank will use, so the imports phase holds them (and no later phase does), with the numba
    kernels' loads from their cache (each warm_up is once per process: the engine and the policy call it again)."""
    import runtime.drivers.cluster  # noqa: F401
    import runtime.core.engine  # noqa: F401
    import runtime.executors.kv_fit  # noqa: F401
    import runtime.core.scheduler  # noqa: F401
    import runtime.observability.trace  # noqa: F401
    import models.weights  # noqa: F401
    from runtime.core.dispatch_plan import warm_up as warm_dispatch
    from runtime.core.score_kernel import warm_up as warm_scores
    warm_dispatch()
    warm_scores()
    if options.executor != "sim":
        if plan.cluster.device == "cuda" or options.executor == "cuda":
            import runtime.executors.cuda_executor  # noqa: F401
        else:
            import runtime.executors.torch_executor  # noqa: F401


def rank_main(env: RankEnv, job: RankJob):
    """One rank of a `dataflow run`. Returns the per-workload results on the coordinator, None elsewhere."""
    startup = StartupTimes()
    if env.rank == COORDINATOR and job.progress_path:
        startup.phase_path = job.progress_path + ".phase"
    from runtime.drivers.launch import set_rank_threads
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
    if device.type == "cuda":
        import torch
        torch.cuda.init()  # the context now, not inside the first allocation of the weights
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


def serve_rank(node: "RankNode") -> list:
    """node.serve(), profiled when DATAFLOW_PROFILE_RANK asks for this rank; a backend error that hides
    which peer died comes out as that peer's PeerFailure (_peer_failure_behind)."""
    from runtime.transport.zmq_dist import PeerFailure
    try:
        return profiled(node) if profile_wanted(node.rank) else node.serve()
    except PeerFailure:
        raise
    except RuntimeError as err:
        raise _peer_failure_behind(node.transport, err, node.job.peer_timeout_s + 1.0) from None


def _rank_executor(plan, options, rank: int, device, startup: Optional[StartupTimes] = None):
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
    if startup is not None:
        startup.lap("weights")
    if os.environ.get("DATAFLOW_VERBOSE") == "1":
        held = [weights.layers[l]["experts.gate"].shape[0] for l in plan.spec.moe_layers]
        print(f"rank {rank}: weights {weights.num_bytes()} bytes, experts held per MoE layer {held}",
              file=sys.stderr, flush=True)
    executor = build_executor(plan, options, weights)
    if startup is not None:
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


class RankNode:
    """One rank's driver loop over its engine(s); the coordinator's duties too on rank 0."""

    def __init__(self, env: RankEnv, plan, executor, transport, clock: SyncedClock, job: RankJob,
                 startup: Optional[StartupTimes] = None) -> None:
        self.env = env
        self.rank = env.rank
        self.world = env.world_size
        self.plan = plan
        self.executor = executor
        self.transport = transport
        self.clock = clock
        self.job = job
        self.is_coord = self.rank == COORDINATOR
        self.engine = None
        self.workload = -1
        self.stopped = False
        self.control_sent = 0  # control messages to other ranks (not counted as data messages)
        # Per-workload start barrier (keyed by workload index, so a fast rank's notice for the next
        # workload is never confused with this one's): ready -> sync -> synced.
        self.synced_w = -1
        self.ready: dict[int, set[int]] = {}
        self.synced_acks: dict[int, set[int]] = {}
        self._stash: list = []  # arrivals polled after this workload's stop: they belong to the next one
        self.coord: Optional[Coordinator] = None
        # KV pages this rank's device can hold (runtime/executors/kv_fit.py), measured once before any pool
        # exists: every workload's engine is clamped to it, and so is the coordinator's mirror
        # (each rank's figure travels in its ready notice).
        from runtime.core.engine import config_from_plan
        from runtime.executors.kv_fit import executor_kv_fit
        # Start-up phases (StartupTimes: rank_main's, else counted from here), reported with each workload's
        # CTRL_DONE: the first workload's are the process's whole start, a later one's its KV pool, capture, barrier
        self.startup = startup if startup is not None else StartupTimes()
        self.startup_report: dict = {}
        self.startup.lap("other")
        wanted = max(config_from_plan(plan, self.rank, o.kv_blocks).num_blocks for _, o in job.workloads)
        self.kv_fit = executor_kv_fit(executor, plan, self.rank, wanted)
        self.startup.lap("kv_alloc")
        self.kv_fit_of: dict[int, int] = {}
        self.verbose = os.environ.get("DATAFLOW_VERBOSE") == "1"
        self.phases: Optional[_PhaseTimes] = None  # set by rank_profile.profiled (DATAFLOW_PROFILE_RANK) only
        transport.describe_wait = self._describe_wait
        self.front = None
        if job.front is not None:
            from runtime.drivers.front_link import FrontLink
            self.front = FrontLink(job.front, transport.secret, self.rank, self.world)

    # -------------------------------------------------------------- life cycle
    def serve(self) -> list:
        results = []
        try:
            for w, (requests, options) in enumerate(self.job.workloads):
                self._start_workload(w, options)
                settle_heap()  # no full garbage collection of the startup heap inside the loop (runtime/drivers/gc_settle.py)
                # Every workload starts behind a barrier: on the GPU each rank captures this workload's
                # CUDA graphs in _start_workload, and no peer may send before that is done (a capture
                # that overlaps NCCL traffic failed on the 2 x H200 run).
                self._startup(w)
                if self.is_coord:
                    self.coord = Coordinator(self, w, requests, options)
                if self.verbose:
                    print(f"rank {self.rank} (pid {os.getpid()}): serving workload {w}", file=sys.stderr, flush=True)
                self._loop(options)
                if self.is_coord:
                    results.append(self.coord.result())
        finally:
            thaw_heap()
            if self.front is not None:
                self.front.close()
        return results

    def _start_workload(self, w: int, options) -> None:
        from runtime.core.engine import Engine, config_from_plan
        from runtime.core.scheduler import make_policy
        from runtime.observability.trace import TraceRecorder
        self.workload = w
        self.stopped = False
        st = self.startup
        if w > 0:
            st.restart()
        self.trace = TraceRecorder() if options.trace else None
        if self.engine is not None and hasattr(self.executor, "detach"):
            self.executor.detach(self.engine.kv)  # its device pool and graphs go before the next one's
        cfg = config_from_plan(self.plan, self.rank, options.kv_blocks)
        cfg.num_blocks = min(cfg.num_blocks, self.kv_fit)
        st.lap("other")
        self.engine = Engine(cfg, self.executor,
                             self.transport, self.clock, make_policy(options.policy, **options.policy_params),
                             self.trace, batch_log=options.batch_log)
        self.engine.on_control = self._on_control
        self.transport.queued_fn = self.engine.queued_items  # (heartbeats carry it: the serving front's /metrics)
        if self.front is not None:
            self.engine.sampled = []  # each sample batch's requests: their new tokens stream to the front
        st.lap("kv_alloc")
        if hasattr(self.executor, "prepare"):
            # Capture every CUDA graph of this workload's KV store before serving, so no capture
            # runs while messages flow (and no timed batch pays for one). No-op on the CPU. The host-routed
            # expert graphs only for a host-routed engine: a device-routed one replays the routed kind only.
            self.executor.prepare(self.engine.kv, owned=self.engine.owned_experts,
                                  host_experts=not self.engine.device_routed)
            st.lap("capture")
            # (the KV pool is allocated inside prepare, before the first capture: the executor times it)
            kv_s = min((getattr(self.executor, "last_prepare", None) or {}).get("kv_alloc_s", 0.0),
                       st.phases["capture"])
            st.phases["capture"] -= kv_s
            st.phases["kv_alloc"] += kv_s
        self.sent_at_start = self.transport.stats["sent"]
        self.control_at_start = self.control_sent

    def _startup(self, w: int) -> None:
        """Barrier: every rank has its weights and workload `w`'s engine; then one time base for all."""
        self.startup.lap("other")  # (since _start_workload: the heap settled, runtime/drivers/gc_settle.py)
        self._send(COORDINATOR, {"t": CTRL_READY, "kv_blocks": self.kv_fit, "w": w})
        deadline = time.monotonic() + self.job.startup_timeout_s
        def started() -> bool:
            return len(self.synced_acks.get(w, ())) == self.world if self.is_coord else self.synced_w >= w
        while not started():
            if time.monotonic() > deadline:
                if not self.is_coord:
                    what = f"the coordinator's (rank {COORDINATOR}) clock sync"
                elif len(self.ready.get(w, ())) < self.world:
                    what = (f"ready notices (weights loaded, graphs captured) of rank(s) "
                            f"{sorted(set(range(self.world)) - self.ready.get(w, set()))}")
                else:
                    what = f"clock sync acks of rank(s) {sorted(set(range(self.world)) - self.synced_acks.get(w, set()))}"
                raise TimeoutError(f"rank {self.rank}: waited {self.job.startup_timeout_s:g} s at startup for {what}")
            self._feed(self.transport.poll(timeout=0.01))
        self.startup.lap("barrier")
        self.startup_report = self.startup.report()
        if self.verbose:  # (benchmarks/startup_bench.py reads this line; serving_at: the wall clock, one host)
            print(f"rank {self.rank}: startup of workload {w} {json.dumps(self.startup_report)} "
                  f"serving_at {time.time():.6f}", file=sys.stderr, flush=True)

    def _on_control(self, src: int, meta: dict, _tensor) -> None:
        t = meta["t"]
        if t == CTRL_READY:
            ready = self.ready.setdefault(meta["w"], set())
            ready.add(src)
            self.kv_fit_of[src] = meta["kv_blocks"]
            if len(ready) == self.world:
                now = self.clock.now()
                for r in range(self.world):
                    self._send(r, {"t": CTRL_SYNC, "now": now, "w": meta["w"]})
        elif t == CTRL_SYNC:
            self.clock.sync(meta["now"])
            self.synced_w = max(self.synced_w, meta["w"])
            self._send(COORDINATOR, {"t": CTRL_SYNCED, "w": meta["w"]})
        elif t == CTRL_SYNCED:
            self.synced_acks.setdefault(meta["w"], set()).add(src)
        elif t == CTRL_ADMIT:
            self._check_workload(src, meta)
            req = request_from_wire(meta["req"])
            if not self.engine.admit(req):
                raise RuntimeError(f"rank {self.rank} has {self.engine.free_blocks()} free KV blocks, too few for "
                                   f"request {req.name!r} the coordinator admitted here (its free-block mirror is off)")
        elif t == CTRL_CANCEL:
            self._check_workload(src, meta)
            self.engine.cancel(meta["rid"])  # (finished meanwhile: nothing to do)
        elif t == CTRL_STOP:
            self._check_workload(src, meta)
            e = self.engine
            if e.requests or not e.idle():
                raise RuntimeError(f"told to stop workload {self.workload} with work left: {e.state()}")
            e.metrics.max_queue_delay = max(e.metrics.max_queue_delay, e.oldest_wait())
            trace = (self.trace.events, self.trace.decisions) if self.trace is not None else None
            data_sent = (self.transport.stats["sent"] - self.sent_at_start) - (self.control_sent - self.control_at_start)
            from runtime.transport.rendezvous import listening
            self._send(COORDINATOR, {"t": CTRL_DONE, "w": self.workload, "metrics": dataclasses.asdict(e.metrics),
                                     "trace": trace, "data_messages": data_sent, "dispatch": e.dispatch_name,
                                     "listening": listening(), "dropped": self.transport.stats["dropped"],
                                     "startup": self.startup_report})
            if not self.is_coord:  # the coordinator stops when every rank's report is in
                self.stopped = True
        elif self.is_coord and self.coord is not None:
            self.coord.on_control(src, meta)
        else:
            raise RuntimeError(f"rank {self.rank}: unexpected control message {meta.get('t')!r} from rank {src}")

    def _check_workload(self, src: int, meta: dict) -> None:
        if meta["w"] != self.workload:
            raise RuntimeError(f"rank {self.rank}: message {meta['t']!r} of workload {meta['w']} from rank {src} "
                               f"while in workload {self.workload}: the control protocol is out of step")

    def _send(self, dst: int, meta: dict) -> None:
        if dst != self.rank:
            self.control_sent += 1
        self.transport.send(dst, meta, None)

    def _feed(self, arrivals) -> int:
        if self._stash:
            arrivals, self._stash = self._stash + list(arrivals), []
        for i, a in enumerate(arrivals):
            if self.stopped:  # the rest goes to the next workload's engine
                self._stash = list(arrivals[i:])
                return i
            self.engine.on_message(a.src, a.meta, a.tensor)
        return len(arrivals)

    # -------------------------------------------------------------- the serving loop
    def _loop(self, options) -> None:
        e, tr = self.engine, self.transport
        coord = self.coord
        tick = coord.tick if coord is not None else None
        poll, feed, next_batch, execute, complete = tr.poll, self._feed, e.next_batch, e.execute, e.complete
        # Between a batch's launch and its bookkeeping: receives for headers that came meanwhile (NOTES §31)
        post_receives = getattr(tr, "post_receives", None) or (lambda: None)
        finish = self._send_finished
        ph = self.phases
        if ph is not None:
            tick, poll, feed, next_batch, finish = (
                _timed(ph, n, f) for n, f in (("tick", tick), ("poll", poll), ("feed", feed),
                                             ("next_batch", next_batch), ("finish", finish)))
            execute, complete = _timed(ph, "execute", execute, True), _timed(ph, "complete", complete, True)
            post_receives = _timed(ph, "post_receives", post_receives)
            ph.in_loop = True
        fresh = False  # the idle wait just polled (and fed what came): no second poll before deciding
        from runtime.transport.chaos import ChaosDelays
        chaos = self.job.chaos  # (the lab's delay models travel here too; only ChaosDelays wedges)
        wedge = chaos.wedge_at(self.rank) if isinstance(chaos, ChaosDelays) else None
        while not self.stopped:
            tr.progress += 1  # the heartbeat carries it: peers see this loop turn (runtime/transport/health.py)
            if ph is not None:
                ph.iterations += 1
            if wedge is not None and e.metrics.tokens >= wedge:
                self.job.chaos.wedge()  # fault injection (tests): this thread stops here, the heartbeat goes on
            ran = False
            if tick is not None:
                ran |= tick()
            if not fresh:
                ran |= feed(poll()) > 0
            fresh = False
            batch = next_batch()
            if batch is not None:
                execute(batch)
                post_receives()
                complete(batch)
                tr.work += 1
                tr.tokens = e.metrics.tokens
                if e.sampled:  # serving: the new tokens go to the front now, one frame per batch
                    self.front.stream(e.sampled)
                    e.sampled.clear()
                ran = True
                if ph is not None:
                    ph.batches[batch.stage.kind] = ph.batches.get(batch.stage.kind, 0) + 1
                    if ph.trace is not None:
                        ph.trace.on_batch()
            if e.finished:
                finish()
                ran = True
            if ran or self.stopped:
                continue
            # Idle with a deferred batch (its tokens or routing on their way from the device): wait for that
            # copy, as a synchronous rank would, rather than poll for a fixed time (run 50: asynchronous
            # dispatch with a 200 us idle poll was slower than waiting; NOTES §22). It completes next round.
            if e.deferred and e.wait_deferred():
                continue
            # Idle: block in the transport (releases the GIL to its threads) until a message, or the
            # coordinator's next arrival is due. PeerFailure surfaces from here when a peer dies.
            wait = _IDLE_WAIT_S if coord is None else coord.wait_budget(_IDLE_WAIT_S)
            if e.hold_s > 0:  # a wave hold: look again when its bound expires, message or not
                wait = min(wait, e.hold_s)
            if e.deferred:  # a batch's tokens or routing are on their way to the host: look again soon
                wait = min(wait, _DEFERRED_POLL_S)
            if ph is not None:  # a wave hold's wait is told apart from having nothing to run
                t0 = time.perf_counter()
                arrivals = tr.poll(timeout=wait)
                ph.add("hold_wait" if e.hold_s > 0 else "idle_wait", time.perf_counter() - t0)
                fresh = feed(arrivals) > 0
            else:
                fresh = feed(tr.poll(timeout=wait)) > 0
        tr.progress = 0  # out of the serving loop: not judged by peers until the next one turns
        if ph is not None:
            ph.in_loop = False

    def _send_finished(self) -> None:
        e = self.engine
        for req in e.take_finished():
            if self.front is not None:
                self.front.finished(req)
            self._send(COORDINATOR, {"t": CTRL_FIN, "w": self.workload, "rid": req.rid, "output": list(req.output),
                                     "reason": req.finish_reason, "t_admit": req.t_admit, "t_finish": req.t_finish,
                                     "token_times": list(req.token_times), "free": e.free_blocks(),
                                     "tokens": e.metrics.tokens})

    def _describe_wait(self, peer: int) -> str:
        """What this rank still expects from `peer`, in the engine's words (for failure messages)."""
        e = self.engine
        parts = [f"workload {self.workload}: {e.state()}" if e is not None else "startup"]
        if e is not None and len(e.merge):
            rids = sorted({k[0] for k in e.merge._open})
            parts.append(f"{len(e.merge)} merge(s) waiting for expert outputs (requests {rids[:8]})")
        if peer == COORDINATOR and not self.is_coord:
            parts.append("the coordinator's admissions or stop")
        if self.is_coord and self.coord is not None:
            parts.append(self.coord.describe_wait(peer))
        return "; ".join(p for p in parts if p)


class Coordinator:
    """Rank 0's view of one workload: arrivals, home placement, finished requests, the end.

    A served workload (RankJob.front) is open: its requests arrive from the front while the ranks serve (fsub),
    may be cancelled (fcan: taken out of the admission queue, or finished at the home's next token), are
    forgotten once finished (memory stays flat however long the server runs), and the workload ends only after
    the front said goodbye (fbye) and nothing is outstanding."""

    def __init__(self, node: RankNode, w: int, requests: list, options) -> None:
        from runtime.core.requests import Admission
        from runtime.core.engine import config_from_plan
        rids = [r.rid for r in requests]
        if len(set(rids)) != len(rids):
            raise ValueError("request ids (rid) must be unique")
        self.node = node
        self.w = w
        self.options = options
        self.requests = requests
        self.by_rid = {r.rid: r for r in requests}
        self.pending = sorted(requests, key=lambda r: (r.arrival, r.rid), reverse=True)  # next due at the end
        # The ranks' real pools: the plan's (or --kv-blocks) clamped to what each device holds.
        capacity = [min(config_from_plan(node.plan, r, options.kv_blocks).num_blocks, node.kv_fit_of[r])
                    for r in range(node.world)]
        self.admission = Admission(node.plan.kv.block_size, capacity, options.home_policy or node.plan.placement.home_policy)
        self.free = list(capacity)  # mirror of every rank's free KV blocks
        self.reported_free: list[Optional[int]] = [None] * node.world
        self.rank_tokens = [0] * node.world
        self.finished = 0
        self.dones: dict[int, dict] = {}
        self.stop_sent = False
        self.t_begin = node.clock.now()  # arrivals are relative to this
        from runtime.transport.health import ProgressWatch
        self.work = ProgressWatch(options.stall_timeout_s, time.monotonic())  # batches run on all ranks
        self.next_stall_check = 0.0
        self.last_report = 0.0
        self._open_outputs()
        self.open = node.front is not None
        self.submitted = 0  # requests of an open workload so far
        self.closing = False
        self.last_stat = 0.0
        if self.open:
            from runtime.drivers.front_link import EV_READY
            node.front.send({"t": EV_READY, "ranks": node.world})

    @property
    def total(self) -> int:
        """Requests of this workload so far (all of them, for a closed one)."""
        return self.submitted if self.open else len(self.requests)

    def tick(self) -> bool:
        """Admit what is due and fits; stop the ranks when all finished. True when it did something."""
        node = self.node
        now = node.clock.now()
        did = self._serve_front() if self.open else False
        while self.pending and self.pending[-1].arrival <= now - self.t_begin:
            self.admission.submit(self.pending.pop())
            did = True
        for req, home in self.admission.admit(self.free):  # updates the mirror
            req.home = home
            # A fresh copy travels (sends to self are not copied): the coordinator's object gets the results.
            # The home's copy arrives on the shared clock (every rank's SyncedClock), not relative to this workload's
            # start: its token times are on that clock too (a served request's latencies are measured there).
            wire = request_to_wire(req)
            wire["arrival"] = req.arrival + self.t_begin
            node._send(home, {"t": CTRL_ADMIT, "w": self.w, "req": wire})
            did = True
        if self.finished == self.total and not self.stop_sent and (self.closing or not self.open):
            self.stop_sent = True
            for r in range(node.world):
                node._send(r, {"t": CTRL_STOP, "w": self.w})
        self._check_stall()
        self._progress()  # (at most every _PROGRESS_EVERY_S)
        return did

    def _serve_front(self) -> bool:
        """The front's commands (runtime/drivers/front_link.py); every second, the admission state for its /metrics."""
        from runtime.drivers.front_link import CMD_BYE, CMD_CANCEL, CMD_SUBMIT, EV_FINISHED, EV_STATS
        front = self.node.front
        did = False
        for cmd in front.commands():
            did = True
            t = cmd.get("t")
            if t == CMD_SUBMIT:
                rid = cmd["req"].get("rid") if type(cmd.get("req")) is dict else None
                try:
                    req = request_from_wire(cmd["req"])
                    if req.rid in self.by_rid:
                        raise ValueError(f"request id {req.rid} is in use")
                    req.arrival = self.node.clock.now() - self.t_begin
                    self.admission.submit(req)  # ValueError when no rank could ever hold it
                except (ValueError, KeyError) as err:
                    front.send({"t": EV_FINISHED, "rid": rid if type(rid) is int else -1, "reason": "error", "n": 0,
                                "error": str(err)[:2000]})
                    continue
                self.by_rid[req.rid] = req
                self.submitted += 1
            elif t == CMD_CANCEL:
                self._cancel(cmd["rid"])
            elif t == CMD_BYE:
                self.closing = True
        now = time.monotonic()
        if now - self.last_stat > 1.0:
            self.last_stat = now
            waiting = self.admission.waiting
            front.send({"t": EV_STATS, "waiting": waiting, "running": self.total - self.finished - waiting,
                        "free_kv": tuple(self.free), "tokens": sum(self.node.transport.peer_tokens()),
                        "queued": tuple(self.node.transport.peer_queued())})
        return did

    def _cancel(self, rid: int) -> None:
        """A client went away: a request still waiting for KV ends here; an admitted one at its home's next token."""
        req = self.by_rid.get(rid)
        if req is None or req.done:
            return
        if self.admission.remove(rid) is not None:
            req.finish_reason = "abort"
            self.finished += 1
            self._keep(req)
            del self.by_rid[rid]
            self.node.front.finished(req)
        elif req.home >= 0:
            self.node._send(req.home, {"t": CTRL_CANCEL, "w": self.w, "rid": rid})

    def _check_stall(self) -> None:
        """Requests outstanding while no rank ran a batch for longer than the bound (health.ProgressWatch: the
        larger of stall_timeout_s and 10x the longest pause between batches so far): the protocol is stuck (a
        wedged rank is named by its peers first, from its heartbeat). Waiting for arrivals is not a stall."""
        now = time.monotonic()
        if now < self.next_stall_check:  # (every tick would build the ranks' counts for nothing: a bound is seconds)
            return
        self.next_stall_check = now + _STALL_CHECK_EVERY_S
        self.work.update(sum(self.node.transport.peer_work()), now)
        if self.finished == self.total or not (self.admission.waiting or self._admitted_unfinished()):
            self.work.since = now  # nothing is owed: no clock runs
            return
        stuck = self.work.stalled_for(now)
        if stuck is not None:
            raise RuntimeError(f"run stalled: requests are outstanding and no rank ran a batch for {stuck:.1f} s "
                               f"(bound {self.work.bound():.1f} s, --stall-timeout {self.options.stall_timeout_s:g} "
                               f"s); {self.describe_wait(None)}")

    def _admitted_unfinished(self) -> bool:
        return self.finished < self.total - len(self.pending) - self.admission.waiting

    def wait_budget(self, cap: float) -> float:
        if not self.pending:
            return cap
        gap = self.pending[-1].arrival - (self.node.clock.now() - self.t_begin)
        return min(cap, max(gap, 0.0))

    def on_control(self, src: int, meta: dict) -> None:
        t = meta["t"]
        self.node._check_workload(src, meta)
        if t == CTRL_FIN:
            req = self.by_rid[meta["rid"]]
            if req.done:
                raise RuntimeError(f"request {req.name!r} reported finished twice (by rank {src})")
            req.output = list(meta["output"])
            req.finish_reason = meta["reason"]
            req.t_admit = meta["t_admit"] - self.t_begin
            req.t_finish = meta["t_finish"] - self.t_begin
            req.token_times = [x - self.t_begin for x in meta["token_times"]]
            self.free[src] += self.admission.blocks_needed(req)
            self.reported_free[src] = meta["free"]
            self.rank_tokens[src] = meta["tokens"]
            self.finished += 1
            self._keep(req)
            if self.open:  # served: forgotten once finished (its tokens and end went to the front from its home)
                del self.by_rid[req.rid]
            self._progress()
        elif t == CTRL_DONE:
            self.dones[src] = meta
            if len(self.dones) == self.node.world:
                self.node.stopped = True  # our own done came too: every rank reported
        else:
            raise RuntimeError(f"coordinator: unexpected control message {t!r} from rank {src}")

    def _open_outputs(self) -> None:
        """The finished-request streams: options.output_path (the user's lines; the launcher created it empty) and
        the job's journal (what the launcher gives back with RunFailed.finished when the run fails later)."""
        from runtime.observability.metrics import RequestStats
        from runtime.drivers.workload import OutputWriter
        o = self.options
        self.out = OutputWriter(o.output_path) if o.output_path else None
        path = self.node.job.finished_path
        self.journal = open(path, "a") if path else None
        # keep_outputs=False: totals instead of every request's tokens and times (flat memory however long it runs)
        self.stats = None if o.keep_outputs else RequestStats(exact=False)

    def _keep(self, req) -> None:
        """A finished request's line out (flushed: it survives any rank failing later), then, unless the
        options keep outputs, its tokens and times folded into the totals and dropped."""
        if self.out is not None:
            self.out.write(req)
        if self.journal is not None:
            rec = {"w": self.w, "rid": req.rid, "home": req.home, "reason": req.finish_reason,
                   "t_admit": req.t_admit, "t_finish": req.t_finish}
            if self.stats is None:
                rec.update(output=req.output, token_times=req.token_times)
            self.journal.write(json.dumps(rec) + "\n")
            self.journal.flush()
        if self.stats is not None:
            self.stats.add(req)
            req.output, req.token_times = [], []

    def close_outputs(self) -> None:
        for f in (self.out, self.journal):
            if f is not None:
                f.close()

    def _progress(self, final: bool = False) -> None:
        """Report (finished, total, tokens) to the progress callback and the launcher's file, at most every
        _PROGRESS_EVERY_S (and at the end). Tokens move with every heartbeat (each rank's count), not only with
        finish notices."""
        now = time.monotonic()
        if not final and self.finished < self.total and now - self.last_report <= _PROGRESS_EVERY_S:
            return
        self.last_report = now
        tokens = sum(max(a, b) for a, b in zip(self.rank_tokens, self.node.transport.peer_tokens()))
        if self.options.progress is not None:
            self.options.progress(self.finished, self.total, tokens)
        path = self.node.job.progress_path
        if path:
            _write_atomically(path, f"{self.w} {self.finished} {self.total} {tokens}")

    def describe_wait(self, peer: Optional[int]) -> str:
        live: dict[int, list[str]] = {}
        for r in (self.by_rid.values() if self.open else self.requests):
            if r.home >= 0 and not r.done:
                live.setdefault(r.home, []).append(r.name)
        if peer is not None:
            names = live.get(peer, [])
            what = f"finish notices of {len(names)} request(s) homed on rank {peer} ({', '.join(names[:6])})" \
                if names else ""
            if self.stop_sent and peer not in self.dones:
                what = f"rank {peer}'s report after stop"
            return what
        homes = ", ".join(f"rank {h}: {len(n)} ({', '.join(n[:4])})" for h, n in sorted(live.items()))
        return (f"coordinator: {self.finished}/{self.total} finished, {self.admission.waiting} waiting for KV, "
                f"{len(self.pending)} not yet arrived, unfinished by home [{homes or 'none'}], "
                f"free blocks {self.free}; {self.node.engine.state()}")

    def result(self) -> dict:
        """Outputs and metrics of this workload, shaped like runtime.drivers.cluster.RunResult's."""
        from runtime.observability.metrics import summarize
        ranks = [_metrics_from_wire(self.dones[r]["metrics"]) for r in range(self.node.world)]
        reqs = self.requests
        elapsed = 0.0
        if reqs:
            ends = [r.t_finish for r in reqs if r.done]
            elapsed = max(ends) - min(r.arrival for r in reqs)
        metrics = summarize(reqs, ranks, elapsed, self.stats)
        metrics["messages"] = sum(self.dones[r]["data_messages"] for r in range(self.node.world))
        metrics["policy"] = self.options.policy
        metrics["ranks"] = self.node.world
        metrics["processes"] = self.node.world
        metrics["dispatch"] = self.dones[COORDINATOR].get("dispatch")
        metrics["listening"] = [a for r in range(self.node.world) for a in self.dones[r].get("listening") or ()]
        metrics["dropped_frames"] = sum(self.dones[r].get("dropped", 0) for r in range(self.node.world))
        # Start-up phases of this workload (STARTUP_PHASES + other and total, seconds): the slowest rank's per phase
        # (the barrier holds every rank until the slowest is ready), and each rank's own
        by_rank = [dict(self.dones[r].get("startup") or {}) for r in range(self.node.world)]
        metrics["startup_s"] = {k: max(d.get(k, 0.0) for d in by_rank) for k in by_rank[0]} if by_rank else {}
        metrics["startup_s_by_rank"] = by_rank
        trace = None
        if self.options.trace:
            shift = self.t_begin
            events, decisions = [], []
            for r in range(self.node.world):
                ev, dec = self.dones[r]["trace"]
                for x in ev:
                    x = dict(x, ts=x["ts"] - shift * 1e6)
                    if "t" in x.get("args", {}):
                        x["args"] = dict(x["args"], t=x["args"]["t"] - shift)
                    events.append(x)
                decisions.extend(dict(d, t=d["t"] - shift) for d in dec)
            trace = (events, decisions)
        self._progress(final=True)
        self.close_outputs()
        return {"requests": reqs, "metrics": metrics, "trace": trace}


def _metrics_from_wire(d: dict):
    """A rank's RankMetrics from its end-of-workload report (dataclasses.asdict of it; arrays arrive as tuples)."""
    from runtime.observability.metrics import BatchRecord, RankMetrics
    names = {f.name for f in dataclasses.fields(RankMetrics)}
    m = RankMetrics(**{k: v for k, v in d.items() if k in names and k != "batches"})
    if "batches" in d:
        m.batches = [BatchRecord(**b) if type(b) is dict else b for b in d["batches"]]
    return m


# ------------------------------------------------------------------------------ launcher side
def _picklable(options):
    """RunOptions minus what cannot cross a process boundary (callbacks); checks what is unsupported."""
    if options.clock != "wall":
        raise ValueError("the multi-process runner runs on the wall clock; use the in-process driver for --clock virtual")
    if options.until is not None:
        raise ValueError("`until` (stopping mid-run) is supported by the in-process driver only")
    if options.delay is not None:
        raise ValueError("`delay` is the in-process transport's hook; pass chaos=ChaosDelays(...) for real sockets")
    return dataclasses.replace(options, progress=None)


def _check_fits(plan, requests: list, options) -> None:
    """Refuse a request no rank could ever hold here, as a ValueError (a user mistake), not as a rank's
    failure after every process started."""
    from runtime.core.engine import config_from_plan
    from runtime.core.requests import Admission
    capacity = [config_from_plan(plan, r, options.kv_blocks).num_blocks for r in range(plan.cluster.ranks)]
    adm = Admission(plan.kv.block_size, capacity, options.home_policy or plan.placement.home_policy)
    for req in requests:
        adm.submit(req)  # raises ValueError naming the request when it cannot fit anywhere


def _to_result(raw: dict, original: list, world: int):
    from runtime.drivers.cluster import RunResult
    from runtime.observability.trace import TraceRecorder
    # Results go back into the caller's Request objects, as with the in-process driver.
    for mine, theirs in zip(original, raw["requests"]):
        for f in ("home", "output", "finish_reason", "t_admit", "t_finish", "token_times"):
            setattr(mine, f, getattr(theirs, f))
    trace = None
    if raw["trace"] is not None:
        trace = TraceRecorder()
        trace.events, trace.decisions = raw["trace"]
    return RunResult(list(original), raw["metrics"], trace, world)


def _failure_message(res) -> str:
    """One line per failed rank, the first failure first; each error said once (a survivor's message that quotes
    the first failed rank's error, passed on by its abort notice, points to it instead of repeating it)."""
    lines = [res.first_error or "failed"]
    first = res.errors.get(res.first_failed_rank) if res.first_failed_rank is not None else None
    for rank, msg in sorted(res.errors.items()):
        # "terminated (SIGTERM)" is the launcher ending a rank that had not failed: not a cause.
        if rank != res.first_failed_rank and msg != "terminated (SIGTERM)":
            if first and len(first) > 20 and first in msg:
                msg = msg.replace(first, f"(rank {res.first_failed_rank}'s error above)")
            lines.append(f"rank {rank}: {msg}")
    return "\n".join(lines)


def run_workloads_multiprocess(plan, workloads: list, *, peer_timeout_s: float = 10.0, chaos=None,
                               timeout: Optional[float] = None, env: Optional[dict] = None,
                               progress=None) -> Optional[list]:
    """Serve several workloads [(requests, RunOptions)] one after the other on one launch of
    `plan.cluster.ranks` processes (or, under torchrun, as this process's rank). Returns one
    runtime.drivers.cluster.RunResult per workload (None on ranks other than 0 under torchrun).
    `timeout`: seconds for the whole launch. Raises RunFailed naming the failed ranks, with the requests that
    finished before (`finished`, their results filled in) and the others (`unfinished`). A workload's
    RunOptions.output_path is created empty here, and rank 0 appends each request's line as it finishes."""
    clean = [(list(reqs), _picklable(opts)) for reqs, opts in workloads]
    for reqs, opts in clean:
        _check_fits(plan, reqs, opts)
        if not opts.keep_outputs and not opts.output_path:
            raise ValueError("keep_outputs=False needs an output_path (the outputs would be nowhere)")
    progress = progress or (workloads[0][1].progress if len(workloads) == 1 else None)
    job = RankJob(plan, clean, peer_timeout_s, chaos)
    world = plan.cluster.ranks

    renv = from_torchrun_env()
    torchrun = renv is not None and "DATAFLOW_LAUNCH_DIR" not in os.environ
    if torchrun and renv.rank != COORDINATOR:
        # Started by torchrun, one of the serving ranks: no files here (rank 0 writes them).
        from runtime.transport.health import PeerFailure
        try:
            run_rank(rank_main, renv, (job,))
        except PeerFailure as err:
            raise RunFailed(f"rank {renv.rank}: {err}") from None
        return None
    for path in dict.fromkeys(opts.output_path for _, opts in clean if opts.output_path):
        open(path, "w").close()  # empty before any rank starts: lines of an earlier run never mix in
    from runtime.drivers.launch import make_run_dir, remove_run_dir
    tmpdir = make_run_dir("dataflow-progress-")
    job.finished_path = os.path.join(tmpdir, "finished.jsonl")
    try:
        if torchrun:
            # Started by torchrun: this process is rank 0. run_rank broadcasts an abort if we fail.
            if progress is not None:
                for _, opts in clean:
                    opts.progress = progress
            try:
                raws = run_rank(rank_main, renv, (job,))
            except Exception as err:
                from runtime.transport.health import PeerFailure
                finished, unfinished = _finished_so_far(job.finished_path, workloads)
                if isinstance(err, PeerFailure):
                    raise RunFailed(f"rank {renv.rank}: {err}", finished, unfinished) from None
                err.finished, err.unfinished = finished, unfinished  # what it did before, as with RunFailed
                raise
            return [_to_result(raw, reqs, world) for raw, (reqs, _) in zip(raws, workloads)]
        res = _launch(plan, job, tmpdir, progress, timeout, peer_timeout_s, env)
        if not res.ok:
            raise RunFailed(_failure_message(res), *_finished_so_far(job.finished_path, workloads))
        raws = res.results[COORDINATOR]
        if raws is None:
            raise RunFailed("rank 0 exited 0 but returned no results", *_finished_so_far(job.finished_path, workloads))
        return [_to_result(raw, reqs, world) for raw, (reqs, _) in zip(raws, workloads)]
    finally:
        remove_run_dir(tmpdir)


def _launch(plan, job: RankJob, tmpdir: str, progress, timeout: Optional[float], peer_timeout_s: float,
            env: Optional[dict]):
    job.progress_path = os.path.join(tmpdir, "progress")
    last = [None, None]

    def on_tick() -> None:
        if progress is None:
            return
        for path, i, parse in ((job.progress_path + ".phase", 1, str), (job.progress_path, 0, None)):
            try:
                with open(path) as f:
                    text = f.read()
            except OSError:
                continue
            if text and text != last[i]:
                last[i] = text
                if parse is str:  # rank 0's start-up phase (StartupTimes.NEXT): the display's label, when the
                    phase = getattr(progress, "phase", None)  # progress callable has one (dataflow run's does)
                    if phase is not None:
                        phase(text)
                else:
                    _w, done, total, tokens = (int(x) for x in text.split())
                    progress(done, total, tokens)

    child_env = dict(env or {})
    if plan.cluster.device == "cuda":
        child_env.setdefault("NCCL_NVLS_ENABLE", "0")
    # grace_s > the peer timeout: survivors get to notice a dead rank themselves and say what
    # they were waiting for, instead of being SIGTERMed with nothing to say.
    return launch_local(plan.cluster.ranks, rank_main, (job,), timeout=timeout, grace_s=peer_timeout_s + 5.0,
                        env=child_env, on_tick=on_tick)


def _finished_so_far(path: str, workloads: list) -> tuple[list, list]:
    """The requests rank 0's coordinator reported finished (its journal, Coordinator._keep), results copied into
    the caller's Request objects, in finish order; and the caller's others, in submission order."""
    by_key = {(w, r.rid): r for w, (reqs, _) in enumerate(workloads) for r in reqs}
    finished = []
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except OSError:
        lines = []
    for line in lines:
        try:
            rec = json.loads(line)
        except ValueError:  # a line cut by the coordinator's death mid-write
            continue
        req = by_key.pop((rec["w"], rec["rid"]), None)
        if req is None:
            continue
        req.home, req.finish_reason = rec["home"], rec["reason"]
        req.t_admit, req.t_finish = rec["t_admit"], rec["t_finish"]
        if "output" in rec:
            req.output, req.token_times = rec["output"], rec["token_times"]
        finished.append(req)
    return finished, list(by_key.values())


def run_workload_multiprocess(plan, requests: list, options=None, **kwargs):
    """Same contract as runtime.drivers.cluster.run_workload, with one process per rank (see the module doc)."""
    from runtime.drivers.cluster import RunOptions
    options = options or RunOptions()
    out = run_workloads_multiprocess(plan, [(requests, options)], progress=options.progress, **kwargs)
    return None if out is None else out[0]
