"""A virtual-clock simulation split over processes (`RunOptions.partitions`): each process owns a block of whole
nodes' ranks and runs their events; at the end of every window of W simulated seconds the processes hand each other
the messages that cross. A 1,024-rank simulation is ~10 ms of Python per decoded token whatever is done to it, and
half of that on each of two cores is the only way it gets under 10 minutes on a 2-core machine (issue 34;
benchmarks/results/session22_sim_scaling.md, session 28).

Exact: the same report as one process (tests/test_partitions.py), because
- windows are no longer than the shortest batch (the cost model's `min_duration`), so a batch started in a window ends
  in a later one, and every message sent in window [T, T + W) comes from a batch running at T, whose sends depend only
  on its rank's state at its start (a busy rank receives nothing, and nothing is admitted any more). At T each process
  completes its batches that end in the window, each at its own end time, in (end, rank) order as one process does
  (`Cluster._run_virtual`); their messages depart (the sender's half of the link model: the NIC send port), go to the
  process of their destination, and land there (the NIC receive port) in (send time, source, count) order, the order
  one process sends them in;
- the run ends at the time its last request finishes, before any visit at that time, as in one process (each process
  learns that time at the window's exchange);
- an idle rank's decisions do not count the cluster's events (Cluster._run_virtual's `_spin`).
Only where all of that holds (`why_not`): elsewhere the run stays in one process, and `RunResult.metrics["partitions"]`
says how many it used.

The processes are forks of the one that built the cluster (each keeps its own ranks' state, copy-on-write) and talk over
pipes, not sockets: what crosses is pickled by one fork of this program and unpickled by another.
"""
from __future__ import annotations

import operator
import os
import pickle
import select
import signal
import struct
import time
import traceback
from dataclasses import fields
from typing import Optional

import numpy as np
import torch

from runtime.observability.metrics import BatchRecord

_RECORD = tuple(f.name for f in fields(BatchRecord))
EXCHANGE_TIMEOUT_S = 600.0  # a peer silent this long is dead or stuck: the run fails naming it


def why_not(cluster) -> Optional[str]:
    """None when `cluster`'s run can be split (module doc), else why not."""
    o, cost = cluster.options, cluster.options.cost_model
    checks = [
        (o.clock == "virtual", "a wall-clock run"),
        (not cluster.hub.copy, "an executor whose outputs are not new host tensors (the simulated one's are: they "
                               "cross processes as arrays)"),
        (not o.trace and o.until is None, "a trace or an `until` horizon"),
        (hasattr(os, "fork"), "no fork() on this platform"),
        (cluster.world_size >= 2 * max(1, o.partition_align), "fewer than two nodes"),
        (getattr(cost, "busy_receive", None) is None, "a busy receive (drawn per message in one order)"),
        (getattr(cost, "min_duration", lambda: 0.0)() > 0, "batches with no positive shortest duration"),
        (o.delay is None or hasattr(o.delay, "land"), "a link hook without its two halves (depart, land)"),
        (all(e.policy.hold_fill <= 0 for e in cluster.engines), "a wave hold (a holding rank waits on every event)"),
    ]
    return next((why for ok, why in checks if not ok), None)


def blocks(world: int, parts: int, align: int) -> list[range]:
    """`parts` contiguous blocks of whole nodes of `align` ranks, as even as they go (fewer when there are fewer
    nodes)."""
    nodes = -(-world // align)
    parts = max(1, min(parts, nodes))
    edges = [min(world, (nodes * i // parts) * align) for i in range(parts + 1)]
    return [range(a, b) for a, b in zip(edges, edges[1:])]


class Partition:
    """This process's share of a split run: its ranks, its peers' pipes, the window."""

    def __init__(self, index: int, ranks: list[range], pipes: dict, window: float, children: list[int]) -> None:
        self.index, self.ranks, self.window, self.children = index, ranks, window, children
        self.own = ranks[index]
        self.owner = [0] * ranks[-1].stop  # rank -> partition
        for i, rs in enumerate(ranks):
            for r in rs:
                self.owner[r] = i
        self._out = {j: w for (i, j), (_, w) in pipes.items() if i == index}   # peer -> write fd
        self._in = {i: r for (i, j), (r, _) in pipes.items() if j == index}    # peer -> read fd
        for fd in self._out.values():
            os.set_blocking(fd, False)

    def exchange(self, out: dict, t: float, timeout: float = EXCHANGE_TIMEOUT_S) -> dict:
        """Send `out[peer]` to every peer and return what each sent this process (one round; a wait bounded by
        `timeout`)."""
        frames = {}
        for j, fd in self._out.items():
            b = pickle.dumps(out.get(j), protocol=5)
            frames[fd] = memoryview(struct.pack("<Q", len(b)) + b)
        got: dict[int, bytearray] = {i: bytearray() for i in self._in}
        want: dict[int, Optional[int]] = {i: None for i in self._in}
        peer_of = {fd: i for i, fd in self._in.items()}
        deadline = time.monotonic() + timeout
        while frames or any(want[i] is None or len(got[i]) < want[i] + 8 for i in got):
            left = deadline - time.monotonic()
            reading = [fd for i, fd in self._in.items() if want[i] is None or len(got[i]) < want[i] + 8]
            r, w, _ = select.select(reading, list(frames), [], max(0.0, left))
            if not r and not w:
                raise TimeoutError(f"partition {self.index}: no word from partitions "
                                   f"{sorted(peer_of[fd] for fd in reading)} for {timeout:.0f} s "
                                   f"(window at t={t:.6f})")
            for fd in w:
                mv = frames[fd]
                n = os.write(fd, mv[:1 << 20])
                if n == len(mv):
                    del frames[fd]
                else:
                    frames[fd] = mv[n:]
            for fd in r:
                i = peer_of[fd]  # (no byte past this round's frame: the peer's next one may follow it already)
                chunk = os.read(fd, min(1 << 20, (8 if want[i] is None else want[i] + 8) - len(got[i])))
                if not chunk:
                    raise RuntimeError(f"partition {self.index}: partition {i} ended without a word (window at "
                                       f"t={t:.6f})")
                got[i] += chunk
                if want[i] is None and len(got[i]) >= 8:
                    want[i] = struct.unpack_from("<Q", got[i])[0]
        out_by_peer = {}
        for i, b in got.items():
            msg = pickle.loads(memoryview(b)[8:])
            if isinstance(msg, Failed):
                raise RuntimeError(f"partition {i} failed:\n{msg.text}")
            out_by_peer[i] = msg
        return out_by_peer


class Failed:
    """What a process sends its peers instead of its part when its run raised."""

    def __init__(self, text: str) -> None:
        self.text = text


def split(world: int, parts: int, align: int, window: float) -> Partition:
    """Fork into the processes of a split run (this one is partition 0); each returns its Partition."""
    ranks = blocks(world, parts, align)
    P = len(ranks)
    pipes = {(i, j): os.pipe() for i in range(P) for j in range(P) if i != j}
    children, index = [], 0
    for i in range(1, P):
        pid = os.fork()
        if pid == 0:
            children, index = [], i
            break
        children.append(pid)
    for (i, j), (r, w) in pipes.items():  # keep only this process's ends
        if i != index:
            os.close(w)
        if j != index:
            os.close(r)
    return Partition(index, ranks, pipes, window, children)


def heap_below(heap: list, limit) -> list:
    """The entries of `heap` less than `limit` (a walk down from the root that stops where the heap does: the few
    batches ending in a split run's window, not every busy rank's)."""
    out, todo, n = [], [0], len(heap)
    while todo:
        i = todo.pop()
        if i < n and heap[i] < (limit,):
            out.append(heap[i])
            todo += (2 * i + 1, 2 * i + 2)
    return out


def to_wire(departures: list) -> tuple:
    """Departed messages as they cross: their tensors' rows stacked in one array (pickling a torch tensor costs ~90 us,
    a small array ~5 us to load; one array for all, ~0.5 us a message), the rest as it is."""
    tensors = [m[5] for m in departures if m[5] is not None]
    rows = [t.shape[0] for t in tensors]
    stacked = np.concatenate([t.numpy() for t in tensors]) if tensors else None
    return [m[:5] + (m[5] is not None, m[6]) for m in departures], stacked, rows


def from_wire(wire: tuple) -> list:
    msgs, stacked, rows = wire
    parts = iter(torch.from_numpy(stacked).split(rows) if rows else ())
    return [m[:5] + (next(parts) if m[5] else None, m[6]) for m in msgs]


def pack_metrics(metrics: dict) -> dict:
    """Ranks' metrics as a child hands them back, their batch records as columns (2.7M records pickled one by one took
    ~20 s at 1,024 ranks x 100 tokens, the parent waiting)."""
    get = operator.attrgetter(*_RECORD)
    out = {}
    for r, m in metrics.items():
        batches, m.batches = m.batches, []
        out[r] = m, [list(c) for c in zip(*map(get, batches))]
    return out


def unpack_metrics(packed: dict) -> dict:
    for m, cols in packed.values():
        m.batches = list(map(BatchRecord, *cols)) if cols else []
    return {r: m for r, (m, _) in packed.items()}


def copy_request(into, got) -> None:
    """A request as a child process finished it, into the parent's object (the caller's list holds that one)."""
    for f in fields(into):
        setattr(into, f.name, getattr(got, f.name))


def child_exit(part: Partition, payload) -> None:
    """A child's end: its part to the parent, then exit without running the caller's code after the run."""
    code = 0
    try:
        part.exchange({0: payload}, float("nan"))
    except BaseException:  # (the parent is gone or stuck: nothing more to tell)
        code = 1
    os._exit(code)


def abandon(part: Partition) -> None:
    """A split run failed in this process (the current exception). A child tells its peers why, as far as they listen
    (the parent raises it, naming the partition), and exits: it never returns into the caller's code. The parent ends
    its children."""
    if part.index:
        try:
            part.exchange({j: Failed(traceback.format_exc()) for j in part._out}, float("nan"), timeout=10.0)
        finally:
            os._exit(1)
    reap(part, 0.0)


def reap(part: Partition, grace_s: float = 10.0) -> None:
    """The parent waits for its children to exit (each exits right after handing its part back), at most `grace_s`;
    one still there is killed (a wait that cannot hang)."""
    deadline = time.monotonic() + grace_s
    for pid in part.children:
        try:
            while os.waitpid(pid, os.WNOHANG) == (0, 0):  # (after the kill: until it is reaped)
                if time.monotonic() >= deadline:
                    os.kill(pid, signal.SIGKILL)
                time.sleep(0.01)
        except OSError:  # (gone already)
            pass
    part.children = []
