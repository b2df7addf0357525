"""One rank process's driver: `RankNode`, the serving loop over its engine (one engine per workload, one transport for
the whole launch), the start-up barrier of each workload, and the control messages every rank answers
(runtime/drivers/control.py). On rank 0 it also runs the workload's Coordinator (runtime/drivers/coordinator.py).

Failures end the run, they never hang it: a dead or wedged peer, an abort notice, or a failed transfer raise
PeerFailure from the transport (naming the rank and what this rank was waiting for, from `_describe_wait`); every
heartbeat carries this loop's and its batches' counters (runtime/transport/health.py), so a rank whose main thread is
stuck is named by its peers.
"""
from __future__ import annotations

import dataclasses
import json
import os
import sys
import time
from typing import TYPE_CHECKING, Optional

from runtime import settings
from runtime.drivers.admission import request_from_wire
from runtime.drivers.control import (COORDINATOR, CTRL_ADMIT, CTRL_CANCEL, CTRL_DONE, CTRL_FIN, CTRL_READY, CTRL_STOP,
                                     CTRL_SYNC, CTRL_SYNCED)
from runtime.drivers.coordinator import Coordinator
from runtime.drivers.gc_settle import settle_heap, thaw_heap
from runtime.drivers.startup import StartupTimes
from runtime.observability.rank_profile import PhaseTimes as _PhaseTimes, timed as _timed

if TYPE_CHECKING:
    from runtime.drivers.launch import RankEnv
    from runtime.drivers.multiproc import RankJob

_DEFERRED_POLL_S = 0.0002  # idle wait while a deferred batch's sampled tokens are being copied to the host
_IDLE_WAIT_S = 0.002  # longest blocking poll when idle (the coordinator's next arrival may be sooner)


class SyncedClock:
    """Wall clock (perf_counter, CLOCK_MONOTONIC) shifted onto the coordinator's time base by `sync`."""

    def __init__(self) -> None:
        self._offset = -time.perf_counter()

    def now(self) -> float:
        return time.perf_counter() + self._offset

    def sync(self, coordinator_now: float) -> None:
        self._offset = coordinator_now - time.perf_counter()


class RankNode:
    """One rank's driver loop over its engine(s); the coordinator's duties too on rank 0."""

    def __init__(self, env: RankEnv, plan, executor, transport, clock: SyncedClock, job: RankJob,
                 startup: Optional[StartupTimes] = None) -> None:
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
        self.verbose = settings.current().verbose
        self.phases: Optional[_PhaseTimes] = None  # set by rank_profile.profiled (the profile_ranks option) only
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
        if self.engine is not None:
            self.executor.detach(self.engine.kv)  # its device pool and graphs go before the next one's
        cfg = config_from_plan(self.plan, self.rank, options.kv_blocks)
        cfg.num_blocks = min(cfg.num_blocks, self.kv_fit)
        st.lap("other")
        self.engine = Engine(cfg, self.executor,
                             self.transport, self.clock, make_policy(options.policy, **options.policy_params),
                             self.trace, batch_log=options.batch_log)
        self.engine.on_control = self._on_control
        if options.engine_setup is not None:
            options.engine_setup(self.engine)
        self.transport.queued_fn = self.engine.queued_items  # (heartbeats carry it: the serving front's /metrics)
        if self.front is not None:
            self.engine.sampled = []  # each sample batch's requests: their new tokens stream to the front
        st.lap("kv_alloc")
        # Capture every CUDA graph of this workload's KV store before serving, so no capture
        # runs while messages flow (and no timed batch pays for one). No-op on the CPU. The host-routed
        # expert graphs only for a host-routed engine: a device-routed one replays the routed kind only.
        self.executor.prepare(self.engine.kv, owned=self.engine.owned_experts,
                              host_experts=not self.engine.device_routed)
        st.lap("capture")
        # (the KV pool is allocated inside prepare, before the first capture: the executor times it)
        kv_s = min((self.executor.last_prepare or {}).get("kv_alloc_s", 0.0), st.phases["capture"])
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
        # Between a batch's launch and its bookkeeping: receives for headers that came meanwhile, so their transfers run
        # during the bookkeeping and the next poll delivers them (a batch earlier than if that poll posted them)
        post_receives = tr.post_receives
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
        while not self.stopped:
            tr.progress += 1  # the heartbeat carries it: peers see this loop turn (runtime/transport/health.py)
            if ph is not None:
                ph.iterations += 1
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
            # Idle with a deferred batch (its tokens on their way from the device): wait for that copy, as a
            # synchronous rank would, rather than poll for a fixed time (which adds up to that long to every
            # deferred batch, and measured slower than waiting). It completes next round.
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
                                     "token_times": list(req.token_times), "tokens": e.metrics.tokens})

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

