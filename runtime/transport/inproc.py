"""In-process transport: N ranks in one Python process, messages through per-rank inboxes.

Used by the tests, the in-process `dataflow run --in-process`, and the simulator. Delivery time is
`clock.now()` at send + an optional delay from a seeded hook, so a virtual-clock driver can inject
per-link latency and jitter reproducibly. Per (src, dst) FIFO order holds even with random delays:
a message never becomes deliverable before the one sent before it on the same link.

Tensors are cloned at send, as a real wire would copy them: the sender may reuse its buffers. `copy=False` (for an
executor whose outputs are all new tensors, which says so with `fresh_outputs = True` as SimExecutor does) sends them
as they are: the engine writes no tensor it sent or received (expert rows are read by the owner's batch, outputs
copied into the home's merge buffer).

The virtual-clock driver takes delivery itself (`mail`, runtime/drivers/cluster.py): each message then goes onto
one heap of (delivery, seq, dst, src, meta, tensor) that the driver pops and hands to the destination's engine at its
visit, instead of into a per-rank inbox plus a wake-up heap that the driver, the transport's poll and the engine's
poll each walked again (a message's trip was ~15 Python calls; session 26). A message's `seq` is (send time, source,
the source's count of sends): the order the driver sends in, whichever process of a split simulation sends it.

A simulation split over processes (runtime/drivers/partitions.py) sets `departures`: a message is then only departed
(the hook's `depart`, the sender's half of its delay) and kept there as (send time, source, count, dst, meta, tensor,
departed) until the driver hands it to the process of its destination, which lands it (`land`).
"""
from __future__ import annotations

import heapq
import random
from functools import partial
from typing import Callable, Optional

import torch

from runtime.transport.base import Arrival, Transport

# delay(src, dst, meta, nbytes, rng) -> seconds. A hook whose receiving side keeps state of its own (the lab's NIC
# receive ports) also has the two halves as attributes, delay == land(depart) where depart gives a tuple:
# `depart(src, dst, meta, nbytes, rng)` -> seconds, or a tuple that `land(departed)` -> seconds finishes at the receiver.
DelayFn = Callable[[int, int, dict, int, random.Random], float]


class InprocHub:
    """The shared 'network' of one in-process cluster."""

    def __init__(self, world_size: int, clock, delay: Optional[DelayFn] = None, seed: int = 0,
                 copy: bool = True) -> None:
        self.world_size, self.copy, self.clock, self.delay = world_size, copy, clock, delay
        self.rng = random.Random(seed)
        self._inbox: list[list] = [[] for _ in range(world_size)]  # heaps of (t, seq, dst, src, meta, tensor)
        # src * world_size + dst -> the link's last delivery time (a list: a dict's get and set per message cost more,
        # its entries scattered over memory)
        self._last = [float("-inf")] * (world_size * world_size)
        self._sends = [0] * world_size  # per source: the last message's count (its seq's third part)
        self._in_flight = [0] * world_size  # per source
        self.departures: Optional[list] = None  # a split simulation's departed messages (module doc)
        self.messages = 0
        self.arrivals: Optional[list] = None  # a virtual-clock driver's heap of (delivery, seq, dst), when it keeps one
        self.mail: Optional[list] = None  # heap of whole messages (module doc), when the driver delivers them

    def transports(self) -> list["InprocTransport"]:
        return [InprocTransport(self, r) for r in range(self.world_size)]

    def _send(self, src: int, dst: int, meta: dict, tensor: Optional[torch.Tensor]) -> None:
        if not 0 <= dst < self.world_size:
            raise ValueError(f"rank {src} sent to rank {dst}, world size is {self.world_size}")
        now = self.clock.now()
        k = self._sends[src] = self._sends[src] + 1
        tensor = tensor.clone() if tensor is not None and self.copy else tensor
        self._in_flight[src] += 1
        self.messages += 1
        nbytes = tensor.nbytes if tensor is not None else 0
        if self.departures is not None:
            self.departures.append((now, src, k, dst, meta, tensor, 0.0 if self.delay is None else
                                    self.delay.depart(src, dst, meta, nbytes, self.rng)))
            return
        self.deliver(now, src, k, dst, meta, tensor,
                     self.delay(src, dst, meta, nbytes, self.rng) if self.delay is not None else 0.0)

    def deliver(self, now: float, src: int, k: int, dst: int, meta: dict, tensor: Optional[torch.Tensor],
                d) -> None:
        """Message `k` of `src`, sent at `now`, `d` seconds on its way (or departed: the hook's `land` finishes it),
        into the destination's inbox or the driver's mail."""
        if type(d) is tuple:
            d = self.delay.land(d)
        d = float(d)
        if d < 0:
            raise ValueError(f"delay hook returned {d} < 0 for {src}->{dst}")
        link = src * self.world_size + dst
        t = self._last[link] = max(now + d, self._last[link])  # per-link FIFO
        seq = (now, src, k)
        heapq.heappush(self._inbox[dst] if self.mail is None else self.mail, (t, seq, dst, src, meta, tensor))
        if self.arrivals is not None:
            heapq.heappush(self.arrivals, (t, seq, dst))

    def _poll(self, dst: int) -> list[Arrival]:
        box, now, out = self._inbox[dst], self.clock.now(), []
        while box and box[0][0] <= now:
            _, _, _, src, meta, tensor = heapq.heappop(box)
            self._in_flight[src] -= 1
            out.append(Arrival(src, meta, tensor))
        return out

    def next_delivery(self) -> Optional[float]:
        """Earliest time any undelivered message becomes deliverable (None when nothing is in flight)."""
        return min((box[0][0] for box in self._inbox if box), default=None)

    def in_flight(self) -> int:
        return sum(self._in_flight)


class InprocTransport(Transport):
    def __init__(self, hub: InprocHub, rank: int) -> None:
        self.hub, self.rank, self.world_size = hub, rank, hub.world_size
        self.send = partial(hub._send, rank)  # send(dst, meta, tensor), without a Python frame of its own per message

    def poll(self) -> list[Arrival]:
        return self.hub._poll(self.rank)

    def pending(self) -> int:
        return self.hub._in_flight[self.rank]

    def close(self) -> None:
        pass
