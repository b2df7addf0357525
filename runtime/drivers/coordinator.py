"""Rank 0's coordinator of one workload: arrivals, home placement, finished requests, progress, the end.

It picks each request's home with the plan's home policy (runtime/drivers/admission.py `Admission`) over a mirror of every
rank's free KV blocks (exact: blocks are reserved at admission and freed at finish, and the coordinator sees both; the
homes also report their real count in every finish notice), sends the admission, and collects the finished requests
(the messages: runtime/drivers/control.py). It also judges progress: when requests are outstanding and no rank ran a
batch for max(`stall_timeout_s`, 10x the longest pause between batches so far) it raises, so a stuck protocol ends the
run while a slow run that progresses is never cut off.
"""
from __future__ import annotations

import dataclasses
import json
import time
from typing import TYPE_CHECKING, Optional

from runtime.drivers.admission import Admission, request_from_wire, request_to_wire
from runtime.drivers.control import COORDINATOR, CTRL_ADMIT, CTRL_CANCEL, CTRL_DONE, CTRL_FIN, CTRL_STOP
from runtime.drivers.startup import write_atomically as _write_atomically

if TYPE_CHECKING:
    from runtime.drivers.rank_node import RankNode

# What a finished request's results are (copied into the caller's Request objects by the launcher); its journal line
# has the first four, and the last two unless the coordinator keeps the outputs itself
RESULT_FIELDS = ("home", "finish_reason", "t_admit", "t_finish", "output", "token_times")
_PROGRESS_EVERY_S = 0.1  # how often the progress callback and the launcher's file are refreshed
_STALL_CHECK_EVERY_S = 0.05  # a stall bound is seconds: building every rank's counts on each tick would be waste


class Coordinator:
    """Rank 0's view of one workload: arrivals, home placement, finished requests, the end.

    A served workload (RankJob.front) is open: its requests arrive from the front while the ranks serve (fsub),
    may be cancelled (fcan: taken out of the admission queue, or finished at the home's next token), are
    forgotten once finished (memory stays flat however long the server runs), and the workload ends only after
    the front said goodbye (fbye) and nothing is outstanding."""

    def __init__(self, node: RankNode, w: int, requests: list, options) -> None:
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
        self.admission = Admission(node.plan.kv.block_size, capacity, options.home_policy
                                   or node.plan.placement.home_policy, node.plan.placement.homes(node.world))
        self.free = list(capacity)  # mirror of every rank's free KV blocks
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
            fields = RESULT_FIELDS if self.stats is None else RESULT_FIELDS[:4]
            rec = {"w": self.w, "rid": req.rid, **{f: getattr(req, f) for f in fields}}
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
        world = self.node.world
        dones = [self.dones[r] for r in range(world)]
        reqs = self.requests
        elapsed = 0.0
        if reqs:
            ends = [r.t_finish for r in reqs if r.done]
            elapsed = max(ends) - min(r.arrival for r in reqs)
        # Start-up phases of this workload (STARTUP_PHASES + other and total, seconds): the slowest rank's per phase
        # (the barrier holds every rank until the slowest is ready), and each rank's own
        by_rank = [dict(d.get("startup") or {}) for d in dones]
        metrics = summarize(reqs, [_metrics_from_wire(d["metrics"]) for d in dones], elapsed, self.stats,
                            messages=sum(d["data_messages"] for d in dones), policy=self.options.policy, ranks=world,
                            processes=world, dispatch=dones[COORDINATOR].get("dispatch"),
                            listening=[a for d in dones for a in d.get("listening") or ()],
                            dropped_frames=sum(d.get("dropped", 0) for d in dones),
                            startup_s={k: max(d.get(k, 0.0) for d in by_rank) for k in by_rank[0]},
                            startup_s_by_rank=by_rank)
        trace = None
        if self.options.trace:
            shift = self.t_begin
            events, decisions = [], []
            for d in dones:
                ev, dec = d["trace"]
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


