"""How tensors cross between ranks: phase 2 of the transport (zmq_dist.py), after the header told the receiver
the tensor's shape and dtype.

Two ways, one per rank for the whole run (the set-up is collective):
- gloo (CPU ranks): dist.isend / dist.irecv on one process group per directed pair; the Work objects are
  completed by waiter threads (completion.WaiterLane).
- NCCL (CUDA ranks): ncclSend / ncclRecv through ctypes (nccl_lib.py) on one 2-rank NCCL communicator per
  directed pair, each op on a dedicated stream per direction, recording an event the engine thread queries
  (completion.EventLane): no waiter threads, no host blocking. Inside a busy rank that is ~10-20 us of host
  time per call, where torch.distributed's isend / irecv on NCCL groups cost ~100-130 us (its Work object, its
  stream bookkeeping; benchmarks/NOTES.md section 13 item 6, runs 22-23: send post 155 vs 305 us, so that path
  was deleted).

Ordering. Each directed pair (a -> b) has its own group or communicator, so the sends of a to b and the
receives of a from b never share a communicator or a stream (with NCCL, one communicator for both directions
would serialise a's send behind its receive and can deadlock). Within one group gloo / NCCL match sends and
receives in posting order, and the headers travel in order on one ZeroMQ connection, so the header order is
the data order.
"""
from __future__ import annotations

import sys
import threading
from typing import Optional

import torch
import torch.distributed as dist

from runtime.executors.cuda_stream import current_stream
from runtime.observability.step_timer import StepTimer
from runtime.transport.completion import Item
from runtime.transport.nccl_lib import NcclPairComm
from runtime.transport.nccl_lib import load as load_nccl
from runtime.transport.rendezvous import wait_keys


def stream_event(stream, tm: StepTimer):
    """An event marking the end of what is posted on `stream` so far (the ncclSend/ncclRecv ran on `stream`
    itself), for the engine thread to query (EventLane)."""
    event = torch.cuda.Event()
    event.record(stream)
    tm.lap("event")
    return event


class TensorLinks:
    """One rank's tensor links to each peer: the gloo groups or NCCL pair communicators, the per-direction CUDA
    streams, and posting one send or receive on them. Collective at construction: every rank builds its links
    in the same order."""

    def __init__(self, rank: int, world_size: int, device: torch.device, store, namespace: str, timeout_s: float,
                 post_timer: StepTimer, recv_timer: StepTimer):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.nccl = device.type == "cuda"
        self._post_timer = post_timer
        self._recv_timer = recv_timer
        peers = [p for p in range(world_size) if p != rank]
        self.comms: list = []  # NcclPairComm, in the global pair order (creation and teardown)
        self.teardown: Optional[str] = None  # how close() ended them: "destroyed", "aborted", "... timed out"
        self._send_comm: dict = {}
        self._recv_comm: dict = {}
        if not self.nccl:
            # One gloo group per directed pair (src, dst). new_group is collective over the whole world:
            # every rank creates every group in the same order and keeps the ones it belongs to.
            groups = {(a, b): dist.new_group([a, b], backend="gloo")
                      for a in range(world_size) for b in range(world_size) if a != b}
            self._send_group = {p: groups[(rank, p)] for p in peers}
            self._recv_group = {p: groups[(p, rank)] for p in peers}
            return
        self._send_streams = {p: torch.cuda.Stream(device) for p in peers}
        self._recv_streams = {p: torch.cuda.Stream(device) for p in peers}
        self._produced = {p: torch.cuda.Event() for p in peers}  # post_send: compute stream -> send stream
        self._init_pair_comms(load_nccl(), store, namespace, timeout_s)

    # ------------------------------------------------------------------ set-up and teardown
    def _init_pair_comms(self, lib, store, namespace: str, timeout_s: float) -> None:
        """One 2-rank NCCL communicator per directed pair (a -> b): a is its rank 0 and makes the unique
        id, published in the store; b reads it. ncclCommInitRank blocks until both ranks called it, and
        a communicator's first send/recv blocks until the peer's first op on it (NCCL connects the
        pair then): when the engine thread posts receives, two ranks whose first sends cross would each
        block in the send waiting for the other's receive (seen on 2 x H200 with torch.distributed's lazy
        communicators: a 60 s store timeout). So each pair is initialised and exercised with one tiny
        transfer right away, the pairs visited in one global order on every rank: no cycle of waits.
        The store handshake (id, then the receiver's "joined") bounds each wait by `timeout_s` and
        names the missing rank, since ncclCommInitRank itself would wait forever for a dead peer."""
        me, bufs = self.rank, []
        for a in range(self.world_size):
            for b in range(self.world_size):
                if a == b or me not in (a, b):
                    continue
                key = f"dataflow/{namespace}/nccl-id/{a}-{b}"
                if me == a:
                    uid = lib.unique_id()
                    store.set(key, uid)
                    wait_keys(store, {b: key + "/joined"}, timeout_s,
                              f"joining the NCCL communicator {a}->{b} (rank {a} created it)")
                else:
                    wait_keys(store, {a: key}, timeout_s, f"the NCCL unique id of the communicator {a}->{b}")
                    uid = store.get(key)
                    store.set(key + "/joined", "1")
                comm = NcclPairComm(lib, uid, 0 if me == a else 1, self.device, name=f"{a}->{b}")
                self.comms.append(comm)
                t = torch.zeros(1, device=self.device)
                if me == a:
                    self._send_comm[b] = comm
                    comm.send(t, self._send_streams[b])
                else:
                    self._recv_comm[a] = comm
                    comm.recv(t, self._recv_streams[a])
                bufs.append(t)
        torch.cuda.synchronize(self.device)

    def close(self, clean: bool, timeout_s: float) -> None:
        """Destroy the pair communicators after a clean close (NCCL waits for their outstanding
        operations and for the peer's destroy), abort them otherwise (stops what is in flight, waits
        for nobody). Runs on a helper thread joined with a bound, so close() never hangs on a peer
        that neither closes nor dies."""
        comms, self.comms = self.comms, []
        if not comms:
            return
        errors: list[str] = []

        def run() -> None:
            for comm in comms:  # global pair order, as at creation: the destroys pair up without a cycle
                try:
                    comm.destroy() if clean else comm.abort()
                except RuntimeError as err:
                    errors.append(f"{comm.name}: {err}")

        bound = timeout_s if clean else min(timeout_s, 2.0)
        th = threading.Thread(target=run, name=f"nccl-teardown-{self.rank}", daemon=True)
        th.start()
        th.join(bound)
        self.teardown = "destroyed" if clean else "aborted"
        if th.is_alive():
            self.teardown += " timed out"
            print(f"rank {self.rank}: NCCL communicator {'destroy' if clean else 'abort'} still running after "
                  f"{bound:g} s (a peer has not closed its transport); left to process exit", file=sys.stderr)
        for e in errors:
            self.teardown += " with errors"
            print(f"rank {self.rank}: NCCL teardown: {e}", file=sys.stderr)

    def failed_comm(self) -> Optional[tuple[int, str]]:
        """(peer, what failed) for a pair communicator on which NCCL saw a transfer fail (its event would never
        complete, so only asking NCCL tells), else None."""
        for peers, side in ((self._send_comm, "send to"), (self._recv_comm, "receive from")):
            for p, comm in peers.items():
                err = comm.error()
                if err is not None:
                    return p, f"NCCL error on the {side} rank {p} communicator ({comm.name}): {err}"
        return None

    # ------------------------------------------------------------------ posting
    def post_send(self, item: Item, t: torch.Tensor) -> None:
        """Start sending the contiguous tensor `t` of `item` to `item.peer`; sets the item's event (CUDA) or
        Work (gloo). Engine thread; its header is already on its way."""
        dst, tm = item.peer, self._post_timer
        if not self.nccl:
            item.work = dist.isend(t, dst, group=self._send_group[dst])
            return
        stream = self._send_streams[dst]
        produced = self._produced[dst]  # the tensor is produced on the compute stream (one event per peer:
        produced.record(current_stream(self.device))  # a wait uses the record made before it)
        stream.wait_event(produced)
        tm.lap("wait_stream")
        self._send_comm[dst].send(t, stream)
        tm.lap("ncclSend")
        # The item holds `t` until its event completed (the transport drops it then); this also keeps
        # the caching allocator from reusing it early if the item is dropped sooner (close, failure).
        t.record_stream(stream)
        tm.lap("record_stream")
        item.event = stream_event(stream, tm)

    def post_recv(self, item: Item, shape: tuple, dtype: torch.dtype, target: Optional[tuple]) -> torch.Tensor:
        """Start receiving the tensor of `item` from `item.peer` into `target` (a (tensor, CUDA event to wait
        for or None) pair from the transport's recv_into) or a new buffer; returns the buffer and sets the
        item's event or Work. Engine thread, inside poll() / post_receives()."""
        src = item.peer
        if not self.nccl:
            buf = torch.empty(shape, dtype=dtype) if target is None else target[0]
            item.work = dist.irecv(buf, src, group=self._recv_group[src])
            return buf
        tm = self._recv_timer
        tm.start()
        stream = self._recv_streams[src]
        if target is None:  # allocated on the receive stream: the caching allocator hands out blocks free in its order
            with torch.cuda.stream(stream):
                buf = torch.empty(shape, dtype=dtype, device=self.device)
        else:  # in place: after the work that allocated the target on its own stream
            buf, ready = target
            if ready is not None:
                stream.wait_event(ready)
        tm.lap("alloc")
        self._recv_comm[src].recv(buf, stream)  # the stream is an argument: no stream context (~15 us a message)
        tm.lap("ncclRecv")
        item.event = stream_event(stream, tm)
        return buf
