"""How tensors cross between ranks: phase 2 of the transport (zmq_dist.py), after the header told the receiver
the tensor's shape and dtype.

Three ways, one per rank for the whole run (every rank must choose the same: the set-up is collective):
- gloo (CPU ranks): dist.isend / dist.irecv on one process group per directed pair; the Work objects are
  completed by waiter threads (completion.WaiterLane).
- lib (CUDA ranks, the `nccl_p2p` option's default when libnccl loads): ncclSend / ncclRecv through ctypes
  (nccl_lib.py) on one 2-rank NCCL communicator per directed pair. Inside a busy rank that is ~10-20 us of
  host time per call, where c10d's isend / irecv cost ~100-130 us (its Work object, its stream bookkeeping).
- c10d (CUDA ranks when the library does not load, or `nccl_p2p=c10d`): dist.isend / dist.irecv on
  per-pair NCCL process groups.
On CUDA each op runs on a dedicated stream per direction and records an event the engine thread queries
(completion.EventLane): no waiter threads, no host blocking.

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

from runtime import settings
from runtime.executors.cuda_stream import current_stream
from runtime.observability.step_timer import StepTimer
from runtime.transport.buffer_pool import BufferPool
from runtime.transport.completion import Item
from runtime.transport.rendezvous import wait_keys

# dtypes c10d's NCCL process group accepts for point-to-point (it refuses int16, unsigned 16-64 bit, complex...)
_C10D_NCCL_DTYPES = frozenset({torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16, torch.float32,
                               torch.float64, torch.bfloat16})


def p2p_mode(nccl: bool) -> tuple[str, Optional[object]]:
    """How tensors move: ("gloo", None) on CPU; on CUDA ("lib", NcclLib) calls ncclSend/ncclRecv through ctypes
    (nccl_lib.py), ("c10d", None) uses dist.isend/irecv. The `nccl_p2p` option picks; "auto" means lib when
    the library loads (c10d with a note otherwise), and an explicit "lib" that cannot load is an error."""
    if not nccl:
        return "gloo", None
    want = settings.current().nccl_p2p
    if want == "c10d":
        return "c10d", None
    from runtime.transport import nccl_lib
    try:
        return "lib", nccl_lib.load()
    except RuntimeError as err:
        if want == "lib":
            raise
        print(f"transport: NCCL point-to-point through torch.distributed ({err})", file=sys.stderr)
        return "c10d", None


def pair_groups(world_size: int, backend: str) -> dict[tuple[int, int], object]:
    """One process group per directed pair (src, dst). new_group is collective over the whole world:
    every rank creates every group in the same order and keeps the ones it belongs to."""
    groups = {}
    for a in range(world_size):
        for b in range(world_size):
            if a != b:
                groups[(a, b)] = dist.new_group([a, b], backend=backend)
    return groups


def stream_event(stream, tm: StepTimer):
    """An event marking the end of what is posted on `stream` so far, for the engine thread to query
    (EventLane). On the lib path the ncclSend/ncclRecv ran on `stream` itself."""
    event = torch.cuda.Event()
    event.record(stream)
    tm.lap("event")
    return event


def c10d_wire(t: torch.Tensor) -> torch.Tensor:
    """What c10d's NCCL group is given for a contiguous tensor: itself, or its bytes for a dtype it refuses
    (point-to-point copies bytes; both sides apply the same rule, as the lib path does)."""
    return t if t.dtype in _C10D_NCCL_DTYPES else t.reshape(-1).view(torch.uint8)


def end_event(work, stream, tm: StepTimer):
    """c10d path: the NCCL operation `work` was posted under `stream` but runs on c10d's own stream;
    Work.wait() makes `stream` wait for it (the host does not block), then the event marks that point."""
    work.wait()
    tm.lap("work.wait")
    return stream_event(stream, tm)


class TensorLinks:
    """One rank's tensor links to each peer: the groups or communicators of its mode (`mode`: gloo, lib or
    c10d), the per-direction CUDA streams, and posting one send or receive on them. Collective at
    construction: every rank builds its links in the same order."""

    def __init__(self, rank: int, world_size: int, device: torch.device, store, namespace: str, timeout_s: float,
                 pool: BufferPool, post_timer: StepTimer, recv_timer: StepTimer):
        self.rank = rank
        self.world_size = world_size
        self.device = device
        self.nccl = device.type == "cuda"
        self._pool = pool
        self._post_timer = post_timer
        self._recv_timer = recv_timer
        peers = [p for p in range(world_size) if p != rank]
        self.mode, lib = p2p_mode(self.nccl)
        if self.nccl:
            self._agree_on_mode(store, namespace, timeout_s)
        self.comms: list = []  # NcclPairComm, in the global pair order (creation and teardown)
        self.teardown: Optional[str] = None  # how close() ended them: "destroyed", "aborted", "... timed out"
        if self.mode != "lib":
            groups = pair_groups(world_size, "nccl" if self.nccl else "gloo")
            self._send_group = {p: groups[(rank, p)] for p in peers}
            self._recv_group = {p: groups[(p, rank)] for p in peers}
        if self.nccl:
            self._send_streams = {p: torch.cuda.Stream(device) for p in peers}
            self._recv_streams = {p: torch.cuda.Stream(device) for p in peers}
            self._produced = {p: torch.cuda.Event() for p in peers}  # post_send: compute stream -> send stream
        if self.mode == "lib":
            self._init_pair_comms(lib, store, namespace, timeout_s)
        elif self.nccl:
            self._connect_pairs(peers)

    # ------------------------------------------------------------------ set-up and teardown
    def _agree_on_mode(self, store, namespace: str, timeout_s: float) -> None:
        """Refuse to start when ranks chose different NCCL paths (one loaded the library, another did
        not): their pair setups would wait for each other forever."""
        keys = {r: f"dataflow/{namespace}/p2p/{r}" for r in range(self.world_size)}
        store.set(keys[self.rank], self.mode)
        wait_keys(store, keys, timeout_s, f"the NCCL point-to-point mode (option nccl_p2p, {namespace})")
        modes = [store.get(keys[r]).decode() for r in range(self.world_size)]
        if len(set(modes)) > 1:
            raise RuntimeError(f"rank {self.rank}: ranks disagree on the NCCL point-to-point path "
                               f"(rank: mode {dict(enumerate(modes))}); set nccl_p2p the same on every rank "
                               f"(lib needs libnccl to load on each)")

    def _init_pair_comms(self, lib, store, namespace: str, timeout_s: float) -> None:
        """One 2-rank NCCL communicator per directed pair (a -> b): a is its rank 0 and makes the unique
        id, published in the store; b reads it. ncclCommInitRank blocks until both ranks called it, and
        a communicator's first send/recv blocks until the peer's first op on it (NCCL connects the
        pair then), so each pair is initialised and exercised with one tiny transfer right away, the
        pairs visited in one global order on every rank: no cycle of waits (as in _connect_pairs).
        The store handshake (id, then the receiver's "joined") bounds each wait by `timeout_s` and
        names the missing rank, since ncclCommInitRank itself would wait forever for a dead peer."""
        from runtime.transport.nccl_lib import NcclPairComm
        me, send_comm, recv_comm, bufs = self.rank, {}, {}, []
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
                    send_comm[b] = comm
                    comm.send(t, self._send_streams[b])
                else:
                    recv_comm[a] = comm
                    comm.recv(t, self._recv_streams[a])
                bufs.append(t)
        torch.cuda.synchronize(self.device)
        self._send_comm, self._recv_comm = send_comm, recv_comm

    def _connect_pairs(self, peers: list[int]) -> None:
        """c10d: create every pair communicator now, with one tiny transfer per direction. NCCL builds a
        group's communicator inside its first operation, blocking the calling thread until the peer
        makes its first call on that group too. When the engine thread posts receives, two ranks whose
        first sends cross would each block in isend waiting for the other's irecv (seen on 2 x H200: a
        60 s store timeout). Visiting the pairs in one global order on every rank (sender's first op on
        (a->b) meets the receiver's) leaves no cycle."""
        me, bufs = self.rank, []
        for a in range(self.world_size):
            for b in range(self.world_size):
                if a == b or me not in (a, b):
                    continue
                t = torch.zeros(1, device=self.device)
                if me == a:
                    bufs.append(dist.isend(t, b, group=self._send_group[b]))
                else:
                    bufs.append(dist.irecv(t, a, group=self._recv_group[a]))
        for work in bufs:
            work.wait()
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
        if self.mode != "lib":
            return None
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
        if self.nccl:
            stream = self._send_streams[dst]
            produced = self._produced[dst]  # the tensor is produced on the compute stream (one event per peer:
            produced.record(current_stream(self.device))  # a wait uses the record made before it)
            stream.wait_event(produced)
            tm.lap("wait_stream")
            if self.mode == "lib":
                self._send_comm[dst].send(t, stream)
                tm.lap("ncclSend")
                # The item holds `t` until its event completed (the transport drops it then); this also keeps
                # the caching allocator from reusing it early if the item is dropped sooner (close, failure).
                t.record_stream(stream)
                tm.lap("record_stream")
                item.event = stream_event(stream, tm)
            else:
                with torch.cuda.stream(stream):
                    work = dist.isend(c10d_wire(t), dst, group=self._send_group[dst])
                    tm.lap("isend")
                    item.event = end_event(work, stream, tm)
        else:
            item.work = dist.isend(t, dst, group=self._send_group[dst])

    def post_recv(self, item: Item, shape: tuple, dtype: torch.dtype, target: Optional[tuple]) -> torch.Tensor:
        """Start receiving the tensor of `item` from `item.peer` into `target` (a (tensor, CUDA event to wait
        for or None) pair from the transport's recv_into) or a pool buffer; returns the buffer and sets the
        item's event or Work. Runs on whichever thread reads the headers."""
        src = item.peer
        if self.nccl:
            tm = self._recv_timer
            tm.start()
            stream = self._recv_streams[src]
            if target is None:  # fenced behind its last read / allocated on the receive stream
                buf = self._pool.take(shape, dtype, stream)
            else:  # in place: after the work that allocated the target on its own stream
                buf, ready = target
                if ready is not None:
                    stream.wait_event(ready)
            tm.lap("pool")
            if self.mode == "lib":  # the stream is an argument: no stream context (~15 us a message)
                self._recv_comm[src].recv(buf, stream)
                tm.lap("ncclRecv")
                item.event = stream_event(stream, tm)
            else:
                with torch.cuda.stream(stream):  # c10d orders its op after the current stream
                    work = dist.irecv(c10d_wire(buf), src, group=self._recv_group[src])
                    tm.lap("irecv")
                    item.event = end_event(work, stream, tm)
        else:
            buf = self._pool.take(shape, dtype) if target is None else target[0]
            item.work = dist.irecv(buf, src, group=self._recv_group[src])
        return buf
