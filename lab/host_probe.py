"""Host time per batch of a GPU bench, and how much of it the device hid: the probe a rank's executor and engine
report to (HostProbe), its wiring into an engine (probe_engine) and the merge of every rank's summary
(merge_probes). Used by the distributed EP bench (lab/barrier_dist.py, lab/stream_dist.py) and benchmarks/gpu_bench.py."""
from __future__ import annotations

import itertools
import time
from typing import Optional

import numpy as np
import torch

from lab.busy_timeline import BusyTimeline
from lab.floors import expert_batch_bytes
from runtime.core.routed_rows import ids_of
from runtime.executors.cuda_stream import current_stream


def _waited(inner) -> float:
    """Seconds the executor spent blocked on the device (CudaExecutor exposes it; others: 0). Every such wait
    goes through its pinned staging (a routing or token copy, a ring slot), which counts it in `wait_s`.
    (`stats.route_wait_s` is the routing's share of that same time: until session 7 it was added too, so a
    routing wait was subtracted twice from a batch's host time; NOTES §22 item 10.)"""
    return float(getattr(getattr(inner, "staging", None), "wait_s", 0.0) or 0.0)


TIMING_EVENTS = 16384  # timing events a probe's executor makes before the run (more are made as needed)
TIMELINE_MAX = 6000  # HostProbe(timeline=True): records a probe keeps per workload (the middle of the run)


class HostProbe:
    """Per batch kind, what issue 7 asks a GPU bench to print: host time per batch (wall of the batch's
    executor work minus the time blocked on the device), device time (the CUDA events the executor
    records around its attention and expert calls while its `profile` is a list; `__init__` turns that
    on), the share of the host time hidden behind device work, two ways (lab/busy_timeline.py):
    behind the batch's own device work (NOTES §5: per batch exposed = max(0, wall - device time); hidden =
    1 - sum(exposed) / sum(host)) and behind any of the rank's device work (the paper's: per batch exposed =
    the part of its wall during which the GPU ran none of the recorded graphs), and for expert batches the
    bytes they cannot avoid (lab/floors.py) for their achieved bandwidth.

        t = probe.start(); <batch work>; probe.add(kind, rows, t, expert_ids)
        probe.summary()   # after the device finished (reads the events): sums, merged by merge_probes
    """

    def __init__(self, inner=None, expert_bytes=None, timeline: bool = False) -> None:
        self.inner = inner
        self.expert_bytes = expert_bytes  # (active experts, rows) -> bytes; None: no bandwidth column
        if inner is not None and getattr(inner, "device", torch.device("cpu")).type == "cuda":
            inner.profile = []
            reserve = getattr(inner, "reserve_timing_events", None)
            if reserve is not None:  # 2 per executor call; a 20B-L8 bench rank makes ~5k calls
                reserve(TIMING_EVENTS)
        self.recs: list = []  # (kind, rows, host_s, wall_s, events, expert ids, host start, first part of its batch)
        self._anchor: Optional[tuple] = None  # (CUDA event, perf_counter when it ran): maps device time to host time
        # timeline: also every batch's layer and homes and every data message's handling, for
        # benchmarks/wave_timeline.py (a layer's round trip split across both ranks; perf_counter is one clock per host)
        self.timeline: Optional[list] = [] if timeline else None

    def _make_anchor(self) -> tuple:
        torch.cuda.synchronize(self.inner.device)  # once, before the first timed batch: the event runs at once
        ev = torch.cuda.Event(enable_timing=True)
        t = time.perf_counter()
        ev.record(current_stream(self.inner.device))  # the stream the executor records its graphs' events on
        return ev, t

    def _events(self) -> Optional[list]:
        return getattr(self.inner, "profile", None) if self.inner is not None else None

    def start(self) -> tuple:
        ev = self._events()
        if ev is not None and self._anchor is None:
            self._anchor = self._make_anchor()
        return time.perf_counter(), _waited(self.inner), len(ev) if ev is not None else 0

    def add(self, kind: str, rows: int, started: tuple, experts=None, first: bool = True, layer: int = -1,
            homes: tuple = ()) -> None:
        """`experts`: the batch's expert ids (arrays or tensors; their distinct count is taken in
        summary(), off the timed path), or a callable returning them, called after the batch's wall is taken
        (a copy that must not count); an item may be (ids, owned): a device-routed item's ids of every slot and
        the bool [E] mask of this rank's experts, of which only the owned slots are this batch's rows.
        `first=False`: a later part of a batch already counted (the completion of a deferred batch): its host
        time adds to the kind's, not its batch count."""
        t0, w0, i0 = started
        wall = time.perf_counter() - t0
        if callable(experts):
            experts = experts()
        ev = self._events()
        self.recs.append((kind, rows if first else 0, max(wall - (_waited(self.inner) - w0), 0.0), wall,
                          ev[i0:] if ev is not None else [], experts if first else None, t0, first))
        if self.timeline is not None:
            self.timeline.append((kind, layer, homes, rows, t0, wall, len(self.recs) - 1))

    def message(self, t0: float, src: int, meta: dict) -> None:
        """With a timeline: a data message handed to the engine at t0 (perf_counter), handled until now."""
        if self.timeline is not None:
            self.timeline.append(("msg", meta.get("layer", -1), (meta.get("home", -1),), meta.get("t"), t0,
                                  time.perf_counter() - t0, src))

    def _timeline_records(self, to_host) -> list:
        """The timeline's middle half (at most TIMELINE_MAX records), device intervals on the host clock:
        [kind, layer, homes, rows | message kind, start s, wall s, device start s, device end s | src]."""
        tl = self.timeline
        a = len(tl) // 4
        b = min(len(tl) - a, a + TIMELINE_MAX)
        out = []
        for kind, layer, homes, rows, t0, wall, ref in tl[a:b]:
            if kind == "msg":
                out.append([kind, layer, list(homes), rows, t0, wall, None, None, ref])
                continue
            evs = [(s, e) for _, s, e in self.recs[ref][4] if s is not None and e is not None]
            d = [to_host(evs[0][0]), to_host(evs[-1][1])] if evs and to_host is not None else [None, None]
            out.append([kind, layer, list(homes), rows, t0, wall] + d + [None])
        return out

    def summary(self) -> dict:
        """Per kind: sums (batches, rows, host_s, device_s, exposed_s, exposed_any_s, timed, expert_bytes,
        expert_device_s), and with device events the rank's gpu_busy_s / gpu_span_s (in every kind)."""
        out: dict = {}
        if torch.cuda.is_available() and any(r[4] for r in self.recs):
            torch.cuda.synchronize()  # the events of the last batches may still be pending
        busy = to_host = None
        if self._anchor is not None:
            ref, t_ref = self._anchor
            to_host = lambda ev: t_ref + ref.elapsed_time(ev) / 1e3  # noqa: E731
            busy = BusyTimeline((to_host(s), to_host(e)) for r in self.recs for _, s, e in r[4]
                                if s is not None and e is not None)
        for kind, rows, host, wall, evs, experts, t0, first in self.recs:
            a = out.setdefault(kind, dict(batches=0, rows=0, host_s=0.0, device_s=0.0, exposed_s=0.0, exposed_any_s=0.0,
                                          timed=0, expert_bytes=0, expert_device_s=0.0))
            a["batches"] += first
            a["rows"] += rows
            a["host_s"] += host
            if evs or (not first and busy is not None):  # a deferred batch's completion: no device work of its own
                dev = sum(s.elapsed_time(e) for _, s, e in evs if s is not None and e is not None) / 1e3
                a["device_s"] += dev
                a["exposed_s"] += min(host, max(0.0, wall - dev))
                a["exposed_any_s"] += min(host, max(0.0, wall - busy.busy(t0, t0 + wall))) if busy is not None else 0.0
                a["timed"] += bool(evs)
                if kind == "expert" and self.expert_bytes is not None and experts is not None and rows:
                    ids = np.concatenate([_rows_experts(e) for e in experts])
                    a["expert_bytes"] += self.expert_bytes(len(np.unique(ids)), len(ids))
                    a["expert_device_s"] += dev
        if busy is not None and self.recs:
            # The rank's GPU busy share over its batches' span (the same in every kind, so merge_probes can sum
            # it over ranks per kind): low means the host is the bottleneck, high the device.
            a0 = min(r[6] for r in self.recs)
            b0 = max(r[6] + r[3] for r in self.recs)
            for a in out.values():
                a["gpu_busy_s"], a["gpu_span_s"] = busy.busy(a0, b0), b0 - a0
        if self.timeline:
            out["_timeline"] = self._timeline_records(to_host)
        return out


def _rows_experts(e) -> np.ndarray:
    """The expert id of each row an expert batch ran: an item's ids, or (device-routed) its owned slots' ids."""
    if type(e) is tuple:
        ids, owned = e
        ids = ids.cpu().numpy().reshape(-1).astype(np.int64)
        return ids[owned.cpu().numpy()[ids]]
    return np.asarray(e).reshape(-1)


def new_probe(inner, spec, dtype: str, timeline: bool = False) -> HostProbe:
    """A probe counting expert-batch bytes for `spec`'s expert shapes in `dtype` (ExecSpec.dtype); `timeline`:
    HostProbe's."""
    es = torch.finfo(getattr(torch, dtype)).bits // 8
    H, I = spec.hidden_size, spec.experts.intermediate_size
    return HostProbe(inner, lambda active, rows: expert_batch_bytes(active, rows, H, I, es), timeline)


ROUTED_SAMPLE = 8  # probe_engine: one device-routed expert batch in this many copies its ids for the GB/s column


def probe_engine(engine, probe: HostProbe) -> None:
    """Time every batch of a streaming engine into `probe`: wraps its execute/complete (the wall of
    both, the device events of its executor calls in between, the expert ids of expert batches). A
    deferred batch (Engine.async_sample / async_route) is completed later by the engine, through this
    wrapper again: that call's host time is added to the batch's kind as a second part."""
    ex_exec, ex_comp = engine.execute, engine.complete
    routed_sample = itertools.cycle(range(ROUTED_SAMPLE))

    def execute(batch):
        batch.out["_hp"] = probe.start()
        ex_exec(batch)

    def complete(batch):
        started = batch.out.pop("_hp", None)
        first = started is not None
        if not first:
            started = probe.start()
        ex_comp(batch)
        items = batch.items
        experts = None
        if batch.stage.kind == "expert":
            if hasattr(items[0], "expert"):
                experts = [it.expert for it in items]
            elif next(routed_sample) == 0:
                # Device-routed: the ids of every slot are on the device; one batch in ROUTED_SAMPLE keeps a copy
                # (after its wall is taken) for the bandwidth column, whose bytes and device time then both come
                # from the sampled batches.
                owned = engine.owned_experts(batch.stage.layer, items[0].payload.device)
                k = engine.cfg.top_k
                experts = lambda: [(ids_of(it.payload, k).clone(), owned) for it in items]  # noqa: E731
        if probe.timeline is None:
            probe.add(batch.stage.kind, batch.rows, started, experts, first)
        else:
            probe.add(batch.stage.kind, batch.rows, started, experts, first, batch.stage.layer,
                      tuple(sorted({getattr(it, "home", engine.rank) for it in items})))
    engine.execute, engine.complete = execute, complete
    if probe.timeline is not None:
        ex_msg = engine.on_message

        def on_message(src, meta, tensor):
            t0 = time.perf_counter()
            ex_msg(src, meta, tensor)
            if "layer" in meta:  # a data message (expert rows in or out), not the coordinator's control
                probe.message(t0, src, meta)
        engine.on_message = on_message


def merge_probes(summaries: list, copy_bps: Optional[float] = None) -> dict:
    """Per kind over ranks: batches, mean_rows, host_us, device_us, hidden_share and busy_share (behind the
    batch's own / any device work; None when no batch had device events), gpu_busy_share (the ranks' GPUs busy
    over their batches' span, the same in every kind), and for expert batches GBps and pct_copy (of the measured
    copy ceiling)."""
    tot: dict = {}
    for summ in summaries:
        for kind, a in summ.items():
            if kind.startswith("_"):  # not a batch kind (the timeline)
                continue
            t = tot.setdefault(kind, {k: 0 for k in a})
            for k, v in a.items():
                t[k] = t.get(k, 0) + v
    out = {}
    for kind, t in tot.items():
        n = t["batches"]
        r = {"batches": n, "mean_rows": t["rows"] / n if n else 0.0, "host_us": 1e6 * t["host_s"] / n if n else 0.0,
             "device_us": 1e6 * t["device_s"] / t["timed"] if t["timed"] else None,
             "hidden_share": max(0.0, 1 - t["exposed_s"] / t["host_s"]) if t["timed"] and t["host_s"] else None,
             "busy_share": max(0.0, 1 - t.get("exposed_any_s", 0.0) / t["host_s"]) if t["timed"] and t["host_s"] else None,
             "gpu_busy_share": t["gpu_busy_s"] / t["gpu_span_s"] if t.get("gpu_span_s") else None}
        if t["expert_device_s"]:
            r["GBps"] = t["expert_bytes"] / t["expert_device_s"] / 1e9
            r["pct_copy"] = 100 * t["expert_bytes"] / t["expert_device_s"] / copy_bps if copy_bps else None
        out[kind] = r
    return out


# ------------------------------------------------------------------------------ interference
