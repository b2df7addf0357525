"""A cluster's network on the virtual clock: nodes of G GPUs, point-to-point links inside a node, one shared NIC per
node between nodes, and the queues that make incast cost what it costs.

The scenario's link model (lab/interference.py) is a pure function of (link, time): it prices one message as if it
had its link to itself. On a real cluster a node's GPUs share one NIC (the paper's testbed: 8 nodes x 2 GPUs, one
200 Gbit/s NIC each), so every message that leaves a node queues behind the node's earlier ones at its send port,
and every message into a node queues at that node's receive port. That receive queue is what a barrier's hot rank
pays: a collective's messages from every peer arrive at one port at once and leave it one after another. Without
it, many senders into one receiver cost nothing extra, for every system alike.

Per message of `nbytes` from `src` to `dst` sent at `t` (node n = rank // gpus_per_node; extra delay and bandwidth
caps from the scenario's effects on the (src, dst) link):

    same node:  delay = intra_latency + extra + nbytes / min(intra_bw, cap)             (no shared port)
    two nodes:  tx    = nbytes / min(nic_bw, cap)
                start = max(t, send_free[n_src]);           send_free[n_src] = start + tx
                first = max(start + nic_latency, recv_free[n_dst]);   recv_free[n_dst] = first + tx
                delay = first + tx + extra - t

(bytes stream through: the receiver's port takes the message while the sender's still sends it, so an idle path
costs latency + tx once, not twice). Full duplex: a NIC's send and receive queues are separate. A disturbance's
extra delay lies between the ports (a congested switch, a paused path): the message books both ports as it would
have and lands `extra` later, so it holds up only its own link (whose FIFO keeps later messages behind it), not the
receiving node's port. Adding it before the receive port (until session 25) booked that port at the late arrival,
in send order: every message into a node that got one delayed message from a disturbed node waited behind it,
so a latency burst on one node's NIC stalled every node (benchmarks/results/sim_testbed16/README.md, session 25). A `Network` keeps
its ports' state, so each run builds its own, and its calls come in time order, as the virtual clock
makes them. The barrier baselines send their collectives as point-to-point messages through the same function
(lab/barrier.py), so a collective is priced by its algorithm over this topology.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

from lab.interference import ANY, LinkSchedule, transfer_s


@dataclass(frozen=True)
class Topology:
    gpus_per_node: int
    intra_latency_s: float
    intra_gbps: float
    nic_latency_s: float
    nic_gbps: float

    def node(self, rank: int) -> int:
        return rank // self.gpus_per_node


class Network:
    """One run's network: a topology's ports with their queues, and the scenario's disturbances on top."""

    def __init__(self, topology: Topology, link: LinkSchedule, ranks: int) -> None:
        self.topology, self.link = topology, link
        nodes = math.ceil(ranks / topology.gpus_per_node)
        self.send_free = [0.0] * nodes
        self.recv_free = [0.0] * nodes
        # bits per second of a healthy link (transfer_s's divisor; None: unbounded, no transfer time)
        self._intra_bps = topology.intra_gbps * 1e9 if math.isfinite(topology.intra_gbps) else None
        self._nic_bps = topology.nic_gbps * 1e9 if math.isfinite(topology.nic_gbps) else None
        # Ranks no effect can touch: every effect names its links, and none names this rank (as a source or a
        # destination, ANY aside). A message between two of them has no disturbance; its effects are not asked.
        named = [getattr(e, "links", None) for e in link.effects]
        self._quiet = None
        if all(ls is not None and (ANY, ANY) not in ls for ls in named):
            touched = {r for ls in named for pair in ls for r in pair}
            self._quiet = [r not in touched for r in range(ranks)]

    def delay(self, src: int, dst: int, nbytes: int, t: float) -> float:
        """Seconds from `send` at time `t` until the message is fully at `dst`; books the ports it crosses."""
        d = self.depart(src, dst, nbytes, t)
        return self.land(*d) - t if type(d) is tuple else d

    def depart(self, src: int, dst: int, nbytes: int, t: float):
        """The sender's half of `delay`: the seconds of a message that crosses no receive port, or, for one between
        two nodes, its send port booked and `(receiving node, arrival at its port, tx, extra)` for `land`, which the
        receiver's side calls in send order (a simulation split over processes lands each message in the process
        of its receiver: runtime/drivers/partitions.py). (Called for every message of a simulation: transfer_s
        inlined, max() as comparisons, the same float operations as one call.)"""
        if src == dst:
            return 0.0
        topo, quiet = self.topology, self._quiet
        ns, nd = src // topo.gpus_per_node, dst // topo.gpus_per_node
        if quiet is not None and quiet[src] and quiet[dst]:  # no disturbance: the healthy bandwidth (extra 0.0 adds
            if ns == nd:                                     # nothing to a sum's bits)
                return topo.intra_latency_s + (nbytes * 8.0 / self._intra_bps if self._intra_bps is not None else 0.0)
            extra, tx = 0.0, nbytes * 8.0 / self._nic_bps if self._nic_bps is not None else 0.0
        else:
            extra, cap = self.link.disturbance(src, dst, t)
            if ns == nd:
                return topo.intra_latency_s + extra + transfer_s(nbytes, min(topo.intra_gbps, cap))
            tx = transfer_s(nbytes, min(topo.nic_gbps, cap))
        start = self.send_free[ns]
        if t > start:
            start = t
        self.send_free[ns] = start + tx
        return nd, start + topo.nic_latency_s, tx, extra

    def land(self, nd: int, arrive: float, tx: float, extra: float) -> float:
        """The receiver's half of `delay`: the message books node `nd`'s receive port from `arrive`; the time it is
        fully there."""
        first = self.recv_free[nd]
        if arrive > first:
            first = arrive
        self.recv_free[nd] = first + tx
        return first + tx + extra
