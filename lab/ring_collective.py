"""A ring collective priced in closed form: the times every rank leaves it, from the times every rank entered it,
without sending its R x (R - 1) messages one by one.

Ring all-gather / reduce-scatter over R ranks (lab/barrier_rank.py `_allgather`, `_reduce_scatter`): at step i
(0 .. R-2) rank r sends one chunk to r+1, then waits for step i's chunk from r-1; so with s[r, i] the time r sends
step i and a[r, i] the time step i's chunk is at r,

    s[r, 0] = start[r]        a[r+1, i] = s[r, i] + delay(r -> r+1, bytes of the chunk, s[r, i])
    s[r, i+1] = max(s[r, i], a[r, i])         leave[r] = max(s[r, R-2], a[r, R-2])

which is what the message-level driver computes (a rank resumes when its chunk is delivered). `delay` is
lab/network.py's model with the scenario's bursts, evaluated the same way (same float operations): inside a node
latency + extra + bytes / bandwidth; across nodes the NIC's send and receive queues. A ring sends every node's
NIC one flow (its last GPU to the next node's first), so each port's queue sees its messages in step order here as
in the message-level run, and the ports, like each link's FIFO, carry their state from one collective to the next.
The recursion is R x (R - 1) float updates in one numba loop: ~11 ms at 1,024 ranks (session 24; ~3x less with the
per-collective tables of session 25), where the message-level driver
took minutes per decode step (session 23: ~14 min for one 64-rank cell).
"""
from __future__ import annotations

import math
from typing import Optional

import numpy as np
from numba import njit

from lab.interference import Bursts


@njit(cache=True)
def _ring(start, chunk_bytes, shift, gpus_per_node, intra_lat, intra_gbps, nic_lat, nic_gbps, send_free, recv_free,
          last, period, duty, extra_s, cap, phase, cover):  # pragma: no cover (compiled)
    R = start.shape[0]
    s = start.copy()
    a = np.empty(R)
    # Per rank and per chunk, what does not change from step to step (the same float operations, done once): the
    # link's nodes, whether a burst may touch it, and each chunk's wire time at the link's healthy bandwidth (what
    # the loop computes with no burst on: min(gbps, inf) is gbps). Integer divisions and modulos out of the R^2 loop.
    node = np.empty(R, dtype=np.int64)
    for r in range(R):
        node[r] = r // gpus_per_node
    touched = np.zeros(R, dtype=np.bool_)
    for b in range(period.shape[0]):
        for r in range(R):
            if cover[b, r]:
                touched[r] = True
    tx_intra = np.empty(R)
    tx_nic = np.empty(R)
    bw_i, bw_n = min(intra_gbps, math.inf), min(nic_gbps, math.inf)
    for c in range(R):
        nb = chunk_bytes[c]
        tx_intra[c] = nb * 8.0 / (bw_i * 1e9) if math.isfinite(bw_i) else 0.0
        tx_nic[c] = nb * 8.0 / (bw_n * 1e9) if math.isfinite(bw_n) else 0.0
    for i in range(R - 1):
        ci = -i - shift          # chunk (r - i - shift) mod R, without a modulo per rank
        while ci < 0:
            ci += R
        for r in range(R):
            d_rank = r + 1 if r + 1 < R else 0
            t = s[r]
            extra, c = 0.0, math.inf
            if touched[r]:
                for b in range(period.shape[0]):     # LinkSchedule.disturbance: effects in order
                    d = 0.0
                    if cover[b, r] and ((t - phase[b]) % period[b]) < duty[b] * period[b]:
                        d = extra_s[b]
                        c = min(c, cap[b])
                    extra += d
            ns, nd = node[r], node[d_rank]
            if ns == nd:
                if c == math.inf:
                    tx = tx_intra[ci]
                else:
                    bw = min(intra_gbps, c)
                    tx = chunk_bytes[ci] * 8.0 / (bw * 1e9) if math.isfinite(bw) else 0.0
                delay = intra_lat + extra + tx
            else:
                if c == math.inf:
                    tx = tx_nic[ci]
                else:
                    bw = min(nic_gbps, c)
                    tx = chunk_bytes[ci] * 8.0 / (bw * 1e9) if math.isfinite(bw) else 0.0
                st = max(t, send_free[ns])
                send_free[ns] = st + tx
                first = max(st + nic_lat, recv_free[nd])
                recv_free[nd] = first + tx
                delay = first + tx + extra - t
            arr = max(t + delay, last[r])          # the link's FIFO (runtime/transport/inproc.py)
            last[r] = arr
            a[d_rank] = arr
            ci += 1
            if ci == R:
                ci = 0
        for r in range(R):
            s[r] = max(s[r], a[r])
    return s


class RingPricer:
    """One run's ring collectives on a network (lab/network.py Network, whose port state it takes over)."""

    def __init__(self, network, ranks: int) -> None:
        topo = network.topology
        self.topo, self.ranks = topo, ranks
        self.send_free = np.array(network.send_free, dtype=np.float64)
        self.recv_free = np.array(network.recv_free, dtype=np.float64)
        self.last = np.zeros(ranks)
        bursts = network.link.effects
        self.period = np.array([b.period_s for b in bursts], dtype=np.float64)
        self.duty = np.array([b.duty for b in bursts], dtype=np.float64)
        self.extra = np.array([b.extra_delay_s for b in bursts], dtype=np.float64)
        self.cap = np.array([math.inf if b.bandwidth_gbps is None else b.bandwidth_gbps for b in bursts])
        self.phase = np.array([b.phase_s for b in bursts], dtype=np.float64)
        from lab.interference import _covers
        self.cover = np.array([[b.collectives == "hops" and _covers(b.links, r, (r + 1) % ranks) for r in range(ranks)]
                               for b in bursts], dtype=np.bool_).reshape(len(bursts), ranks)
        # "stall" bursts: which ranks have a covered link of their own, to or from any peer (Bursts.collectives)
        self.stalls = [(b, np.array([any(_covers(b.links, r, p) or _covers(b.links, p, r) for p in range(ranks) if p != r)
                                     for r in range(ranks)])) for b in bursts if b.collectives == "stall"]

        self.link_bytes = np.zeros(ranks, dtype=np.int64)   # bytes on link r -> r+1 so far
        self.priced = 0
        self._held = {sh: (np.arange(ranks) + 1 - sh) % ranks for sh in (0, 1)}

    def count_bytes(self, chunk_bytes: np.ndarray, shift: int) -> None:
        """One collective's bytes on every link r -> r+1: every chunk but the one r+1 (all-gather, shift 0) or r
        (reduce-scatter, shift 1) already holds."""
        self.link_bytes += int(chunk_bytes.sum()) - chunk_bytes[self._held[shift]]
        self.priced += 1

    def bytes_into(self, link_bytes: dict) -> None:
        """Add the bytes counted so far to `link_bytes` ({"src->dst": bytes}, as the message-level driver counts)."""
        if self.priced:
            R = self.ranks
            for r, b in enumerate(self.link_bytes.tolist()):
                key = f"{r}->{(r + 1) % R}"
                link_bytes[key] = link_bytes.get(key, 0) + b
        self.link_bytes[:] = 0
        self.priced = 0

    def stall(self, start: np.ndarray) -> np.ndarray:
        """When each rank, entering a collective at `start[r]`, is done with the "stall" bursts' waits (the largest
        extra of those active on one of its links then, as BurstDelays.collective)."""
        wait = np.zeros_like(start)
        for b, mine in self.stalls:
            on = mine & (((start - b.phase_s) % b.period_s) < b.duty * b.period_s)
            wait = np.maximum(wait, np.where(on, b.extra_delay_s, 0.0))
        return start + wait

    @staticmethod
    def supports(network) -> bool:
        """Bursts only (jitter and bandwidth traces are priced message by message)."""
        return all(isinstance(e, Bursts) for e in network.link.effects)

    def leave(self, start: np.ndarray, chunk_bytes: np.ndarray, shift: int) -> np.ndarray:
        """Times each rank leaves a ring collective it entered at `start[r]`; at step i rank r sends chunk
        (r - i - shift) mod R of `chunk_bytes` (all-gather: shift 0, its own chunk first; reduce-scatter: 1)."""
        t = self.topo
        return _ring(start, chunk_bytes.astype(np.int64), shift, t.gpus_per_node, t.intra_latency_s,
                     float(t.intra_gbps), t.nic_latency_s, float(t.nic_gbps), self.send_free, self.recv_free,
                     self.last, self.period, self.duty, self.extra, self.cap, self.phase, self.cover)


def ring_reduce(partials: list, offsets: list[int]):
    """Every rank's reduce-scatter result as the ring sums it: chunk c (rows offsets[c]:offsets[c+1]) is
    p[c+1] + p[c+2] + ... + p[c], left to right (lab/barrier_rank.py `_reduce_scatter`), one vectorized add per
    ring step over all chunks at once. Returns the summed rows, all chunks."""
    import torch
    R = len(partials)
    P = torch.stack(partials)                                  # [R, N, ...]
    if not P.any() and not torch.signbit(P).any():
        # every partial +0 (the sim executor's experts): any order of sums gives +0, without the R adds (~10 ms a
        # layer at 1,024 ranks)
        return torch.zeros_like(P[0])
    n = P.shape[1]
    chunk = torch.from_numpy(np.repeat(np.arange(R, dtype=np.int64), np.diff(offsets)))
    rows = torch.arange(n)
    acc = P[(chunk + 1) % R, rows]
    for j in range(2, R + 1):
        acc = acc + P[(chunk + j) % R, rows]
    return acc


def chunk_bytes_of(rows: list[int], row_bytes: Optional[int], real_row_bytes: int) -> np.ndarray:
    return np.array(rows, dtype=np.int64) * (row_bytes if row_bytes is not None else real_row_bytes)
