"""The real transport: metadata over ZeroMQ, tensors over torch.distributed point-to-point.

Two-phase exchange (StreamEP): batch sizes change every step and a point-to-point receive needs a
buffer of the right size, so
  phase 1: the sender pushes a small header (kind, src, per-(src,dst) sequence number, the meta dict
           of plain values, the tensor's shape and dtype) to the receiver's ZeroMQ PULL socket, as one
           authenticated msgpack frame (runtime/transport/wire.py: never pickle, bounded, signed with
           the run's secret; a stray or hostile frame is dropped and counted, never fatal);
  phase 2: it posts `isend` of the tensor; the receiver's receptor thread, on seeing the header,
           takes a buffer of that shape from a pool and posts the matching `irecv`.
           On CUDA the default (DATAFLOW_NCCL_P2P=lib) skips torch.distributed here: ncclSend /
           ncclRecv through ctypes on one 2-rank NCCL communicator per directed pair (nccl_lib.py),
           ~10-20 us per call instead of c10d's ~100-130 us in a busy rank; DATAFLOW_NCCL_P2P=c10d
           keeps dist.isend/irecv on per-pair process groups.
Meta-only messages (tensor None) skip phase 2. Sends to self are handed over locally, no copy.

Ordering. Each directed pair (a -> b) has its own process group (lib: its own NCCL communicator),
so the sends of a to b and the receives of a from b never share a communicator or a stream (with
NCCL, one communicator for both directions would serialise a's send behind its receive and can
deadlock). ZeroMQ keeps one connection's messages in order, and within one group gloo/NCCL match
sends and receives in posting order, so the header order is the data order. Completions go through
one lane per peer direction (completion.py), which preserves that order up to `poll()`. Sequence
numbers are checked on receipt: loss or duplication is an error, not silent corruption.

Flow control. At most `inflight_limit` tensor sends per destination are posted at once; the excess
waits in that destination's backlog (in order, meta-only messages behind queued tensors included),
so one slow peer never holds up sends to the others. A send keeps its tensor alive until the send
completed. Backlogs are pumped from `poll()`.

Threads. The engine thread calls send/poll/pending/close (ZeroMQ sockets are not thread-safe: the
data PUSH sockets belong to it). Gloo: a receptor thread owns the PULL socket and posts receives, so
transfers progress while the engine computes, and one waiter thread per peer direction completes
Work objects (they cannot be polled). NCCL: ops run on a dedicated stream per direction and record
an event the engine thread queries; no waiter threads, and by default no receptor either: the engine
thread reads headers and posts receives inside poll() (`receive_on`), because a second Python thread
making CUDA calls costs the engine more in GIL waits than the earlier receive posting saves. A
heartbeat thread with its own sockets beats every `heartbeat_s` (runtime/transport/health.py); a peer silent for
`peer_timeout_s`, a failed transfer or an abort notice makes `poll()` raise PeerFailure naming the rank
and what this rank was waiting for.

Receive buffers come from a size-keyed pool; give them back with `release(tensor)` when done.

Measured (benchmarks/NOTES.md section 8; `dataflow transport-bench --ranks 2 --sizes 0,4K,184K,1M`):
gloo on a 2-core VM, 4 KB one-way ~160-220 us p50: ZeroMQ header ~60-80, receptor -> waiter hand-off
~40 (up to 1 ms under load), gloo transfer with its rendezvous ~60-100, hand-off to poll() ~20;
CPU ~215 us per message sent + received, most of it in gloo's loop threads and the engine thread.
On NCCL, poll(timeout) used to sleep 500 us without re-querying lane events (~500 us one-way on
2 x H200 for every tensor size); it now re-queries them while it waits (_wait_nccl).
"""
from __future__ import annotations

import itertools
import os
import queue
import sys
import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist
import zmq

from runtime.executors.cuda_stream import current_stream
from runtime.transport.health import (DEFAULT_HEARTBEAT_S, DEFAULT_PEER_TIMEOUT_S, DEFAULT_STALL_TIMEOUT_S, Heartbeat,
                            PeerFailure, PeerHealth, register_abort_hook)
from runtime.observability.step_timer import StepTimer
from runtime.transport.base import Arrival
from runtime.transport.buffer_pool import BufferPool
from runtime.transport.chaos import ChaosDelays
from runtime.transport.completion import EventLane, Item, WaiterLane
from runtime.transport.rendezvous import (DEFAULT_TIMEOUT_S, current_store, exchange_endpoints, host_address,
                                          init_distributed, run_secret, wait_keys)
from runtime.transport.wire import ABORT, BYE, DATA, DEFAULT_MAX_FRAME_BYTES, HEARTBEAT, Codec, WireError

__all__ = ["ZmqDistTransport", "init_distributed", "PeerFailure", "ChaosDelays"]

# Header kinds (DATA, HEARTBEAT, BYE, ABORT) and the frame layout: runtime/transport/wire.py.
DEFAULT_INFLIGHT_LIMIT = 16
_HEALTH_CHECK_EVERY_S = 0.05  # poll() is called in a tight loop; checking peers each time is waste
# NCCL: poll(timeout) re-queries the busy lanes' events while it waits: while a receive is
# outstanding it yields (GIL released) between queries for up to _NCCL_SPIN_S, then sleeps in
# _NCCL_SLICE_S slices; see _wait_nccl.
_NCCL_SPIN_S = 0.001
_NCCL_SLICE_S = 0.0002
_WAKE = object()  # put into `done` by the receptor after it gave an EventLane work (NCCL)
# pyzmq's option and flag constants are enums: `int & zmq.POLLIN` goes through enum.Flag's Python __and__ (~0.5 us here,
# 5-10% of the engine thread's header polls, run 108's cProfile). Their plain values cost a C-level int op.
_ZMQ_EVENTS, _ZMQ_POLLIN, _ZMQ_NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)

# Transports are built in the same order on every rank, so a per-process counter gives matching
# store namespaces when a process creates more than one (tests, benchmarks).
_instances = itertools.count()


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"unknown dtype in message header: {name!r}")
    return dtype


def _summary(meta, limit: int = 160) -> str:
    text = repr(meta)
    return text if len(text) <= limit else text[:limit] + "...}"


def _pair_groups(world_size: int, backend: str) -> dict[tuple[int, int], object]:
    """One process group per directed pair (src, dst). new_group is collective over the whole world:
    every rank creates every group in the same order and keeps the ones it belongs to."""
    groups = {}
    for a in range(world_size):
        for b in range(world_size):
            if a != b:
                groups[(a, b)] = dist.new_group([a, b], backend=backend)
    return groups


def _stream_event(stream, tm: StepTimer):
    """An event marking the end of what is posted on `stream` so far, for the engine thread to query
    (EventLane). With DATAFLOW_NCCL_P2P=lib the ncclSend/ncclRecv ran on `stream` itself."""
    event = torch.cuda.Event()
    event.record(stream)
    tm.lap("event")
    return event


# dtypes c10d's NCCL process group accepts for point-to-point (it refuses int16, unsigned 16-64 bit, complex...)
_C10D_NCCL_DTYPES = frozenset({torch.int8, torch.uint8, torch.int32, torch.int64, torch.float16, torch.float32,
                               torch.float64, torch.bfloat16})


def _c10d_wire(t: torch.Tensor) -> torch.Tensor:
    """What c10d's NCCL group is given for a contiguous tensor: itself, or its bytes for a dtype it refuses
    (point-to-point copies bytes; both sides apply the same rule, as the direct path does)."""
    return t if t.dtype in _C10D_NCCL_DTYPES else t.reshape(-1).view(torch.uint8)


def _end_event(work, stream, tm: StepTimer):
    """c10d path: the NCCL operation `work` was posted under `stream` but runs on c10d's own stream;
    Work.wait() makes `stream` wait for it (the host does not block), then the event marks that point."""
    work.wait()
    tm.lap("work.wait")
    return _stream_event(stream, tm)


def _p2p_mode(nccl: bool) -> tuple[str, Optional[object]]:
    """How NCCL tensors move: ("lib", NcclLib) calls ncclSend/ncclRecv through ctypes (nccl_lib.py),
    ("c10d", None) uses dist.isend/irecv. DATAFLOW_NCCL_P2P picks; unset means lib when the library
    loads (c10d with a note otherwise), and an explicit "lib" that cannot load is an error."""
    if not nccl:
        return "gloo", None
    want = os.environ.get("DATAFLOW_NCCL_P2P", "").strip().lower()
    if want not in ("", "lib", "c10d"):
        raise ValueError(f"DATAFLOW_NCCL_P2P must be 'lib' or 'c10d', got {want!r}")
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


def spin_from_env() -> Optional[bool]:
    """DATAFLOW_SPIN: unset (busy-poll on NCCL ranks only), 1 (busy-poll, on CPU ranks too), 0 (sleep); anything
    else is an error."""
    spin = os.environ.get("DATAFLOW_SPIN")
    if spin is None or spin == "":
        return None
    if spin not in ("0", "1"):
        raise ValueError(f"DATAFLOW_SPIN={spin!r}: valid values are 1 (busy-poll), 0 (sleep), or unset "
                         f"(busy-poll on NCCL ranks, the default)")
    return spin == "1"


class ZmqDistTransport:
    def __init__(self, rank: int, world_size: int, device="cpu", *, store: Optional[dist.Store] = None,
                 inflight_limit: int = DEFAULT_INFLIGHT_LIMIT, heartbeat_s: float = DEFAULT_HEARTBEAT_S,
                 peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S, chaos: Optional[ChaosDelays] = None,
                 timeout_s: float = DEFAULT_TIMEOUT_S, pool_per_size: int = 8, receive_on: Optional[str] = None,
                 secret: Optional[bytes] = None, max_frame_bytes: int = DEFAULT_MAX_FRAME_BYTES,
                 stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S):
        if not dist.is_initialized():
            raise RuntimeError("call runtime.transport.zmq_dist.init_distributed(rank, world, backend) first")
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.inflight_limit = inflight_limit
        self._nccl = self.device.type == "cuda"
        # Who reads headers and posts receives: a receptor thread ("thread"), or the engine thread inside
        # poll() ("engine"). NCCL defaults to "engine": there every completion is already an event the
        # engine thread queries, and a second Python thread making CUDA/NCCL calls only contends for the
        # GIL (profile on 2 x H200, NOTES section 13: ~230 us median per send, most of it waiting for the
        # GIL held by the receptor). Gloo needs its waiter threads anyway and keeps "thread", so receives
        # are posted while the engine computes. DATAFLOW_RECEIVE_ON overrides (for A/B runs).
        receive_on = receive_on or os.environ.get("DATAFLOW_RECEIVE_ON") or ("engine" if self._nccl else "thread")
        if receive_on not in ("engine", "thread"):
            raise ValueError(f"receive_on must be 'engine' or 'thread', got {receive_on!r}")
        self._engine_receives = receive_on == "engine"
        # NCCL with engine receives: an idle poll(timeout) busy-polls the header socket and the lanes' events
        # instead of sleeping or blocking, so the engine thread's core stays awake: on 2 x H200 every torch
        # call of the loop got ~25% cheaper and streaming +43% tok/s (run 39, benchmarks/NOTES.md §20). It
        # costs one core per rank at 100%, as in other serving engines' busy loops. DATAFLOW_SPIN=0: sleep;
        # DATAFLOW_SPIN=1: busy-poll on CPU ranks too.
        spin = spin_from_env()
        # By default CPU ranks sleep: they share their cores with their math.
        self._spin = self._engine_receives and (self._nccl if spin is None else spin)
        # DATAFLOW_PROFILE_TRANSPORT=1: wall time of each step of posting a send / receive, printed at close.
        profile = bool(os.environ.get("DATAFLOW_PROFILE_TRANSPORT"))
        self._post_timer = StepTimer(f"rank {rank} send post", profile)
        self._recv_timer = StepTimer(f"rank {rank} recv post", profile)
        # Optional hook set by the engine: peer -> what it is waiting for from that peer, in its own
        # words (stage, layer, request ids). Used only in failure messages.
        self.describe_wait: Optional[Callable[[int], Optional[str]]] = None
        # Receive in place (phase 2 knows the shape and the meta before the tensor): called with
        # (src, meta, shape, torch dtype) before a receive is posted; returns (a contiguous tensor of
        # that shape and dtype to receive into, a CUDA event the receive must wait for or None), or None
        # for a pool buffer. May run on the receptor thread. The engine uses it for expert outputs.
        self.recv_into: Optional[Callable[[int, dict, tuple, torch.dtype], Optional[tuple]]] = None
        self.stats = {"sent": 0, "received": 0, "sent_bytes": 0, "received_bytes": 0, "local": 0, "in_place": 0,
                      "dropped": 0}
        self._drop_logged: set[str] = set()
        # Liveness of this rank's serving loop, carried by every heartbeat (runtime/transport/health.py): `progress` counts
        # loop iterations (0: not in a serving loop, e.g. loading weights or capturing graphs: not judged), `work`
        # batches run. The engine thread writes them; the heartbeat thread reads them (int stores are atomic).
        self.progress = 0
        self.work = 0
        self.tokens = 0  # tokens this rank sampled (the coordinator's progress display adds them up)
        self.queued_fn: Optional[Callable[[], int]] = None  # rows queued here (read by the heartbeat thread)
        peers = [p for p in range(world_size) if p != rank]
        self._peers = peers

        # Phase-1 sockets. HWM 0 (unbounded) because data volume is bounded by the in-flight cap and
        # headers are small; a bounded HWM would make send() block or drop.
        store = store or current_store()
        namespace = f"zmq{next(_instances)}"
        secret = secret or run_secret(store, rank, timeout_s)
        self.secret = secret  # (the serving front's channel signs with it too: runtime/drivers/front_link.py)
        self._codec = Codec(secret, rank, world_size, max_frame_bytes)
        self._hb_codec = Codec(secret, rank, world_size, max_frame_bytes)  # the heartbeat thread's own
        self._ctx = zmq.Context()
        self._pull = self._ctx.socket(zmq.PULL)
        self._pull.setsockopt(zmq.RCVHWM, 0)
        # A frame over the cap never reaches us: ZeroMQ drops it (and that connection) while reading its size.
        self._pull.setsockopt(zmq.MAXMSGSIZE, max_frame_bytes)
        addr = host_address(os.environ.get("MASTER_ADDR", "127.0.0.1"), int(os.environ.get("MASTER_PORT", "29500")))
        port = self._pull.bind_to_random_port(f"tcp://{addr}")
        self.endpoints = exchange_endpoints(store, namespace, rank, world_size, f"tcp://{addr}:{port}", timeout_s)
        self._push: list[Optional[zmq.Socket]] = [None] * world_size
        for p in peers:
            sock = self._ctx.socket(zmq.PUSH)
            sock.setsockopt(zmq.SNDHWM, 0)
            sock.setsockopt(zmq.LINGER, 2000)  # let BYE/ABORT reach peers after close()
            sock.connect(self.endpoints[p])
            self._push[p] = sock

        # Phase-2 groups (gloo, c10d NCCL) or direct NCCL pair communicators (lib), and per-direction
        # completion lanes. Every rank must move tensors the same way (the groups are collective).
        self.p2p, nccl_lib = _p2p_mode(self._nccl)
        if self._nccl:
            self._agree_on_p2p(store, namespace, timeout_s)
            self._post_timer.name += f" ({self.p2p})"  # the step names differ by path
            self._recv_timer.name += f" ({self.p2p})"
        self._comms: list = []  # NcclPairComm, in the global pair order (creation and teardown)
        self.comm_teardown: Optional[str] = None  # how close() ended them: "destroyed", "aborted", "... timed out"
        if self.p2p != "lib":
            groups = _pair_groups(world_size, "nccl" if self._nccl else "gloo")
            self._send_group = {p: groups[(rank, p)] for p in peers}
            self._recv_group = {p: groups[(p, rank)] for p in peers}
        self._done: "queue.SimpleQueue[Item]" = queue.SimpleQueue()
        Lane = EventLane if self._nccl else WaiterLane
        self._send_lanes = {p: Lane(f"send->{p}", self._done) for p in peers}
        self._recv_lanes = {p: Lane(f"recv<-{p}", self._done) for p in peers}
        if self._nccl:
            self._send_streams = {p: torch.cuda.Stream(self.device) for p in peers}
            self._recv_streams = {p: torch.cuda.Stream(self.device) for p in peers}
            self._produced = {p: torch.cuda.Event() for p in peers}  # _post: compute stream -> send stream
        self._pool = BufferPool(self.device, per_key=pool_per_size)
        if self.p2p == "lib":
            self._init_pair_comms(nccl_lib, store, namespace, timeout_s)
        elif self._nccl:
            self._connect_pairs(peers)
        self._send_delay = {p: chaos.lane("send", rank, p) for p in peers} if chaos else None
        self._recv_delay = {p: chaos.lane("recv", rank, p) for p in peers} if chaos else None

        # Engine-thread state.
        self._send_seq = [0] * world_size
        self._recv_seq = [0] * world_size  # receptor thread only
        self._inflight = [0] * world_size
        self._backlog: dict[int, list[Item]] = {p: [] for p in peers}
        self._pending = 0
        self._local: list[Arrival] = []
        self._failure: Optional[PeerFailure] = None
        self._receptor_error: Optional[tuple[int, str, BaseException]] = None
        self._next_check = 0.0
        self._closed = False
        self._aborted = False

        self._health = PeerHealth(rank, world_size, peer_timeout_s, stall_timeout_s)
        self._closing = threading.Event()
        self._receptor: Optional[threading.Thread] = None
        if not self._engine_receives:
            self._receptor = threading.Thread(target=self._receive_loop, name=f"receptor-{rank}", daemon=True)
            self._receptor.start()
        self._hb_socks: list[zmq.Socket] = []
        self._heartbeat = Heartbeat(heartbeat_s, self._beat, self._beat_exit, name=f"heartbeat-{rank}")
        register_abort_hook(self)

    def _agree_on_p2p(self, store, namespace: str, timeout_s: float) -> None:
        """Refuse to start when ranks chose different NCCL paths (one loaded the library, another did
        not): their pair setups would wait for each other forever."""
        keys = {r: f"dataflow/{namespace}/p2p/{r}" for r in range(self.world_size)}
        store.set(keys[self.rank], self.p2p)
        wait_keys(store, keys, timeout_s, f"the NCCL point-to-point mode (DATAFLOW_NCCL_P2P, {namespace})")
        modes = [store.get(keys[r]).decode() for r in range(self.world_size)]
        if len(set(modes)) > 1:
            raise RuntimeError(f"rank {self.rank}: ranks disagree on the NCCL point-to-point path "
                               f"(rank: mode {dict(enumerate(modes))}); set DATAFLOW_NCCL_P2P the same on every rank")

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
                self._comms.append(comm)
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

    def _close_comms(self, clean: bool, timeout_s: float) -> None:
        """Destroy the pair communicators after a clean close (NCCL waits for their outstanding
        operations and for the peer's destroy), abort them otherwise (stops what is in flight, waits
        for nobody). Runs on a helper thread joined with a bound, so close() never hangs on a peer
        that neither closes nor dies."""
        comms, self._comms = self._comms, []
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
        self.comm_teardown = "destroyed" if clean else "aborted"
        if th.is_alive():
            self.comm_teardown += " timed out"
            print(f"rank {self.rank}: NCCL communicator {'destroy' if clean else 'abort'} still running after "
                  f"{bound:g} s (a peer has not closed its transport); left to process exit", file=sys.stderr)
        for e in errors:
            self.comm_teardown += " with errors"
            print(f"rank {self.rank}: NCCL teardown: {e}", file=sys.stderr)

    def _connect_pairs(self, peers: list[int]) -> None:
        """Create every pair communicator now, with one tiny transfer per direction. NCCL builds a
        group's communicator inside its first operation, blocking the calling thread until the peer
        makes its first call on that group too. When the engine thread posts receives
        (receive_on="engine"), two ranks whose first sends cross would each block in isend waiting for
        the other's irecv (seen on 2 x H200: a 60 s store timeout). Visiting the pairs in one global
        order on every rank (sender's first op on (a->b) meets the receiver's) leaves no cycle."""
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

    # ------------------------------------------------------------------ engine-facing API
    def send(self, dst: int, meta: dict, tensor: Optional[torch.Tensor] = None) -> None:
        """Queue a message; never blocks on the network."""
        if self._failure is not None:
            raise self._failure
        if self._closed:
            raise RuntimeError(f"rank {self.rank}: send on a closed transport")
        if dst == self.rank:
            self._local.append(Arrival(dst, meta, tensor))  # same object: no copy, no wire
            self.stats["local"] += 1
            return
        if self._health.is_closed(dst):
            raise RuntimeError(f"rank {self.rank}: rank {dst} already closed its transport; message {_summary(meta)} "
                               f"cannot be delivered (the engine's termination protocol is out of step)")
        if tensor is not None and tensor.device.type != self.device.type:
            raise ValueError(f"tensor on {tensor.device} sent through a transport for {self.device}")
        seq = self._send_seq[dst]
        self._send_seq[dst] = seq + 1
        item = Item(True, dst, seq, meta, tensor)
        self._pending += 1
        backlog = self._backlog[dst]
        if backlog or (tensor is not None and self._inflight[dst] >= self.inflight_limit):
            backlog.append(item)  # FIFO per destination: anything behind a queued message queues too
            return
        self._post(item)

    def poll(self, timeout: float = 0.0) -> list[Arrival]:
        """Arrivals completed since the last poll, FIFO per source. With `timeout` > 0 and nothing
        ready, block up to that long for the first one (releases the GIL to the transport's threads,
        unlike spinning). Raises PeerFailure when a peer died, wedged or aborted."""
        if self._failure is not None:
            raise self._failure
        if self._engine_receives:
            self._receive_headers()  # before the health check: queued heartbeats count
        now = time.monotonic()
        if now >= self._next_check:
            self._next_check = now + _HEALTH_CHECK_EVERY_S
            self._check_health()
        if self._nccl:
            self._drain_lanes()
        out = self._local
        self._local = []
        done = self._done
        if not out and timeout > 0 and done.empty():
            if self._engine_receives:
                self._wait_engine(timeout, out)
            elif self._nccl:
                self._wait_nccl(timeout, out)  # NCCL lanes complete only when this thread queries them
            else:
                try:
                    self._complete(done.get(timeout=timeout), out)
                except queue.Empty:
                    pass
        while not done.empty():  # (one consumer: a non-empty queue stays non-empty; no Empty raised per poll)
            self._complete(done.get_nowait(), out)
        if self._failure is not None:
            raise self._failure
        self._pump()
        return out

    def post_receives(self) -> None:
        """Start the transfers of the messages whose headers came since the last poll (the engine thread reads them:
        receive_on="engine"; a receptor thread posts receives as headers come, and this does nothing). A busy rank
        calls it between a batch's launch and its bookkeeping: each transfer then runs meanwhile and the next poll()
        delivers it, where a receive first posted by that poll() is delivered by the one after, a batch later.
        Errors are kept for poll() to raise, as there."""
        if self._engine_receives and self._failure is None:
            self._receive_headers()

    def peer_work(self) -> list[int]:
        """Batches each peer ran as of its last heartbeat (this rank's own: `work`)."""
        work = list(self._health.work)
        work[self.rank] = self.work
        return work

    def peer_queued(self) -> list[int]:
        """Rows queued on each rank as of its last heartbeat (this rank's own: now)."""
        queued = list(self._health.queued)
        queued[self.rank] = self._queued()
        return queued

    def peer_tokens(self) -> list[int]:
        """Tokens each peer sampled as of its last heartbeat (this rank's own: `tokens`)."""
        tokens = list(self._health.tokens)
        tokens[self.rank] = self.tokens
        return tokens

    def pending(self) -> int:
        """Messages this rank sent to peers whose delivery has not completed yet (tensor messages in
        flight or queued; meta-only messages count until handed to ZeroMQ)."""
        return self._pending

    def release(self, tensor: torch.Tensor) -> None:
        """Return a received tensor's buffer to the receive pool (optional; see buffer_pool.py)."""
        self._pool.release(tensor)

    def abort(self, reason: str, culprit: Optional[int] = None) -> None:
        """Tell every peer this run is over because of `reason` (culprit: the rank at fault, if known)
        so they raise PeerFailure at once instead of after their heartbeat timeout."""
        if self._aborted or self._ctx.closed:
            return
        self._aborted = True
        from runtime.transport.wire import MAX_REASON_CHARS
        culprit = culprit if isinstance(culprit, int) and 0 <= culprit < self.world_size else None
        header = Codec(self._codec._key, self.rank, self.world_size).encode(  # any thread: a codec of its own
            ABORT, -1, {"reason": str(reason)[:MAX_REASON_CHARS], "culprit": culprit})
        for p in self._peers:
            try:
                self._push[p].send(header, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def close(self, timeout_s: float = 10.0) -> None:
        """Flush queued and in-flight sends (up to `timeout_s`), say goodbye, stop threads. Idempotent."""
        if self._closed:
            return
        if not self._aborted and self._failure is None:
            deadline = time.monotonic() + timeout_s
            try:
                while self._pending and time.monotonic() < deadline:
                    self.poll(timeout=0.01)
            except PeerFailure:
                pass
            if self._pending:
                print(f"rank {self.rank}: closing with {self._pending} undelivered message(s) after "
                      f"{timeout_s:g} s: {self._describe_outstanding()}", file=sys.stderr)
        self._closed = True
        if not self._aborted:
            bye = self._codec.encode(BYE, -1)
            for p in self._peers:
                try:
                    self._push[p].send(bye, zmq.NOBLOCK)
                except zmq.ZMQError:
                    pass
        self._heartbeat.stop()
        self._closing.set()
        if self._post_timer.enabled:
            print(self._post_timer.report(), file=sys.stderr)
            print(self._recv_timer.report(), file=sys.stderr)
        if self._receptor is not None:
            self._receptor.join(2.0)
        else:
            self._pull.close(linger=0)
        # After a failure a waiter may be stuck in a gloo wait on the dead peer: don't wait for it.
        join_s = 0.5 if self._failure is None and not self._aborted else 0.01
        # Before the lanes forget their items: a destroy is clean only with nothing still in flight.
        clean = (self._failure is None and not self._aborted and not self._pending
                 and not any(lane.busy() for lane in itertools.chain(self._send_lanes.values(),
                                                                     self._recv_lanes.values())))
        for lane in itertools.chain(self._send_lanes.values(), self._recv_lanes.values()):
            lane.close(join_s)
        self._close_comms(clean, timeout_s)
        for p in self._peers:
            self._push[p].close(linger=1000 if not self._aborted else 200)
        if (self._receptor is None or not self._receptor.is_alive()) and not self._heartbeat._thread.is_alive():
            self._ctx.term()  # blocks until lingering BYE/ABORT messages went out (bounded by LINGER)

    def __enter__(self) -> "ZmqDistTransport":
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc is not None:
            if isinstance(exc, PeerFailure):
                # Pass on the root cause, not our own "waiting for": receivers add theirs.
                self.abort(f"{exc.reason} (rank {self.rank} was waiting for: {exc.waiting_for})", exc.rank)
            else:
                self.abort(f"{exc_type.__name__}: {exc}", self.rank)
        self.close()

    # ------------------------------------------------------------------ send side
    def _post(self, item: Item) -> None:
        dst = item.peer
        t = item.tensor
        tm = self._post_timer
        tm.start()
        if t is None:
            self._push[dst].send(self._codec.encode(DATA, item.seq, item.meta))
            self._pending -= 1  # ZeroMQ owns it now; nothing to complete
            self.stats["sent"] += 1
            return
        if not t.is_contiguous():
            t = item.tensor = t.contiguous()  # the copy is what we send; kept alive by the item
        self._push[dst].send(self._codec.encode(DATA, item.seq, item.meta, tuple(t.shape), str(t.dtype)[6:]))
        tm.lap("header")
        self._inflight[dst] += 1
        if self._nccl:
            stream = self._send_streams[dst]
            produced = self._produced[dst]  # the tensor is produced on the compute stream (one event per peer:
            produced.record(current_stream(self.device))  # a wait uses the record made before it)
            stream.wait_event(produced)
            tm.lap("wait_stream")
            if self.p2p == "lib":
                self._send_comm[dst].send(t, stream)
                tm.lap("ncclSend")
                # The item holds `t` until its event completed (_complete drops it); this also keeps the
                # caching allocator from reusing it early if the item is dropped sooner (close, failure).
                t.record_stream(stream)
                tm.lap("record_stream")
                item.event = _stream_event(stream, tm)
            else:
                with torch.cuda.stream(stream):
                    work = dist.isend(_c10d_wire(t), dst, group=self._send_group[dst])
                    tm.lap("isend")
                    item.event = _end_event(work, stream, tm)
        else:
            item.work = dist.isend(t, dst, group=self._send_group[dst])
        if self._send_delay is not None:
            item.delay_s = self._send_delay[dst]()
        self.stats["sent"] += 1
        self.stats["sent_bytes"] += t.numel() * t.element_size()
        self._send_lanes[dst].submit(item)
        tm.lap("submit")

    def _pump(self) -> None:
        for dst, backlog in self._backlog.items():
            if not backlog:
                continue
            n = 0
            while n < len(backlog) and (backlog[n].tensor is None or self._inflight[dst] < self.inflight_limit):
                self._post(backlog[n])
                n += 1
            if n:
                del backlog[:n]

    # ------------------------------------------------------------------ completion (engine thread)
    def _drain_lanes(self) -> None:
        for lane in self._send_lanes.values():
            lane.drain()
        for lane in self._recv_lanes.values():
            lane.drain()

    def _wait_nccl(self, timeout: float, out: list[Arrival]) -> None:
        """Block up to `timeout` for the first completion (NCCL). Completions exist only as CUDA events
        this thread queries (EventLane.drain), so: while a receive is outstanding, re-query between
        GIL-releasing yields for up to _NCCL_SPIN_S, then between _NCCL_SLICE_S sleeps on `done`;
        while only sends are outstanding, sleep in slices; with nothing outstanding, block on `done`
        for the whole timeout; the receptor wakes it (a meta-only item, or _WAKE after it gave a lane
        a receive). Before 2026-11-30 this was one 500 us sleep on `done` with no re-query in
        between: a transfer that finished during it was seen only at its end (p50 one-way ~500 us on
        2 x H200 for every tensor size, benchmarks/results/h200/README.md run 2)."""
        done = self._done
        now = time.monotonic()
        deadline = now + timeout
        spin_until = now + _NCCL_SPIN_S
        while True:
            if now < spin_until and any(lane.busy() for lane in self._recv_lanes.values()):
                time.sleep(0)  # releases the GIL to the receptor / heartbeat threads
                progressed = False
            else:
                busy = any(lane.busy() for lane in itertools.chain(self._send_lanes.values(), self._recv_lanes.values()))
                wait_s = min(_NCCL_SLICE_S, deadline - now) if busy else deadline - now
                try:
                    item = done.get(timeout=max(0.0, wait_s))
                except queue.Empty:
                    progressed = False
                else:
                    if item is _WAKE:  # a receive was just posted: query it closely again
                        spin_until = time.monotonic() + _NCCL_SPIN_S
                    progressed = self._complete(item, out)
            self._drain_lanes()
            if progressed or out or not done.empty():
                return  # poll() collects the rest of `done`
            now = time.monotonic()
            if now >= deadline:
                return

    def _wait_engine(self, timeout: float, out: list[Arrival]) -> None:
        """Block up to `timeout` for the first arrival or completion when this thread also reads the
        headers (receive_on="engine"). A ZeroMQ poll of the PULL socket is the blocking wait (it
        releases the GIL) when nothing is outstanding; while a receive is outstanding its event is
        re-queried with plain yields for up to _NCCL_SPIN_S after the last header, then every
        _NCCL_SLICE_S; with only sends outstanding, every _NCCL_SLICE_S."""
        done = self._done
        now = time.monotonic()
        deadline = now + timeout
        spin_until = now + _NCCL_SPIN_S
        while True:
            if self._receive_headers():
                spin_until = time.monotonic() + _NCCL_SPIN_S
            self._drain_lanes()
            if out or not done.empty():
                return  # poll() collects `done`
            now = time.monotonic()
            if now >= deadline:
                return
            lanes = itertools.chain(self._send_lanes.values(), self._recv_lanes.values())
            if self._spin:
                continue  # busy-poll: the core never sleeps (see `spin` in __init__)
            if now < spin_until and any(lane.busy() for lane in self._recv_lanes.values()):
                time.sleep(0)
            elif any(lane.busy() for lane in lanes):
                time.sleep(min(_NCCL_SLICE_S, deadline - now))
            else:
                self._pull.poll(max(1, int((deadline - now) * 1000)))  # ms; returns at the first header

    def _complete(self, item: Item, out: list[Arrival]) -> bool:
        """Account for one item from `done`; False for a _WAKE token (nothing completed)."""
        if item is _WAKE:
            return False
        if item.error is not None:
            waiting = self._describe_item(item)
            extra = self.describe_wait(item.peer) if self.describe_wait is not None else None
            self._failure = PeerFailure(item.peer, f"{waiting}; {extra}" if extra else waiting,
                                        f"transfer failed: {type(item.error).__name__}: {item.error}")
            return True
        if item.is_send:
            self._inflight[item.peer] -= 1
            self._pending -= 1
            item.tensor = None  # the send buffer may be recycled only now
            return True
        t = item.tensor
        if t is not None:
            if self._nccl:
                t.record_stream(current_stream(self.device))  # it will be read on the engine's stream
            self.stats["received_bytes"] += t.numel() * t.element_size()
        self.stats["received"] += 1
        out.append(Arrival(item.peer, item.meta, t))
        return True

    def _check_health(self) -> None:
        if self._receptor_error is not None:
            src, what, err = self._receptor_error
            self._failure = PeerFailure(src, what, f"{type(err).__name__}: {err}")
            raise self._failure
        try:
            self._health.check(self._waiting_for)
        except PeerFailure as failure:
            self._failure = failure
            raise
        if self.p2p == "lib":  # a transfer NCCL saw fail (its event would never complete)
            for peers, side in ((self._send_comm, "send to"), (self._recv_comm, "receive from")):
                for p, comm in peers.items():
                    err = comm.error()
                    if err is not None:
                        self._failure = PeerFailure(p, self._waiting_for(p), f"NCCL error on the {side} rank {p} "
                                                    f"communicator ({comm.name}): {err}")
                        raise self._failure

    # ------------------------------------------------------------------ receptor thread
    def _receive_loop(self) -> None:
        try:
            while not self._closing.is_set() and self._receptor_error is None:
                if self._pull.poll(50):
                    self._receive_headers()
        finally:
            self._pull.close(linger=0)

    def _receive_headers(self) -> int:
        """Handle every header waiting on the PULL socket (receptor thread, or the engine thread in
        poll() when receive_on="engine"); returns how many. A frame that is not this run's (bad size,
        tag or prefix) is dropped and counted; an error in a frame of a peer (its tag verified) is kept
        for the engine thread's next health check, naming that peer and the message."""
        if self._receptor_error is not None:
            return 0
        pull, n, decode = self._pull, 0, self._codec.decode
        src, seq, meta = -1, -1, None
        try:
            while True:
                # Most polls find nothing: asking ZMQ_EVENTS is ~1 us where a NOBLOCK recv raising zmq.Again
                # costs ~2.5 us here and more on the H200 host (py-spy, run 37: ~3% of a rank's loop).
                if not pull.getsockopt(_ZMQ_EVENTS) & _ZMQ_POLLIN:
                    return n
                try:
                    raw = pull.recv(_ZMQ_NOBLOCK)
                except zmq.Again:  # EVENTS said ready; never seen, but not an error
                    return n
                try:
                    f = decode(raw)
                except WireError as err:
                    if not err.authenticated:
                        self._drop(str(err))
                        continue
                    src, seq, meta = err.src if err.src is not None else -1, -1, None
                    raise
                src, seq, meta = f.src, f.seq, f.meta
                self._on_header(f.kind, src, seq, meta, f.shape, f.dtype)
                n += 1
        except BaseException as err:  # reported by the engine thread's next poll()
            if isinstance(err, WireError):
                self._receptor_error = (src, f"a well-formed frame from rank {src}", err)
                self._next_check = 0.0
                return n
            self._receptor_error = (src, f"message #{seq} from rank {src} ({_summary(meta)})", err)
            self._next_check = 0.0
            return n

    def _drop(self, why: str) -> None:
        """A frame that is not this run's: counted, logged once per reason, never fatal."""
        self.stats["dropped"] += 1
        key = why.split(" (")[0][:40]
        if key not in self._drop_logged:
            self._drop_logged.add(key)
            print(f"rank {self.rank}: dropped a frame on its message socket: {why} (later ones like it are counted, "
                  f"not logged)", file=sys.stderr, flush=True)

    def _on_header(self, kind: int, src: int, seq: int, meta, shape, dtype) -> None:
        self._health.saw(src)
        if kind == HEARTBEAT:
            self._health.saw_progress(src, meta["p"], meta["w"], meta["k"], meta["q"])
            return
        if kind == BYE:
            self._health.closed(src)
            return
        if kind == ABORT:
            self._health.aborted(src, meta.get("culprit"), meta["reason"])
            return
        expected = self._recv_seq[src]
        if seq < expected:  # a replay of a frame already delivered (or a duplicate): its content is known
            self._drop(f"message #{seq} from rank {src} again (next expected #{expected}): replayed or duplicated")
            return
        if seq != expected:
            raise RuntimeError(f"rank {self.rank} got message #{seq} from rank {src} but expected #{expected}: "
                               f"lost message")
        self._recv_seq[src] = seq + 1
        item = Item(False, src, seq, meta, shape=shape, dtype=dtype)
        lane = self._recv_lanes[src]
        if shape is not None:
            torch_dtype = _dtype_from_name(dtype)
            target = self.recv_into(src, meta, tuple(shape), torch_dtype) if self.recv_into is not None else None
            if target is not None:
                self.stats["in_place"] += 1
            if self._nccl:
                tm = self._recv_timer
                tm.start()
                stream = self._recv_streams[src]
                if target is None:  # fenced behind its last read / allocated on the receive stream
                    buf = self._pool.take(tuple(shape), torch_dtype, stream)
                else:  # in place: after the work that allocated the target on its own stream
                    buf, ready = target
                    if ready is not None:
                        stream.wait_event(ready)
                tm.lap("pool")
                if self.p2p == "lib":  # the stream is an argument: no stream context (~15 us a message)
                    self._recv_comm[src].recv(buf, stream)
                    tm.lap("ncclRecv")
                    item.event = _stream_event(stream, tm)
                else:
                    with torch.cuda.stream(stream):  # c10d orders its op after the current stream
                        work = dist.irecv(_c10d_wire(buf), src, group=self._recv_group[src])
                        tm.lap("irecv")
                        item.event = _end_event(work, stream, tm)
            else:
                buf = self._pool.take(tuple(shape), torch_dtype) if target is None else target[0]
                item.work = dist.irecv(buf, src, group=self._recv_group[src])
            item.tensor = buf
        if self._recv_delay is not None:
            item.delay_s = self._recv_delay[src]()
        elif shape is None and lane.busy() == 0:
            # Fast path: nothing from src is still completing, so handing the meta-only message over
            # directly keeps FIFO and saves a thread hop.
            self._done.put(item)
            return
        lane.submit(item)
        if self._nccl and not self._engine_receives:
            self._done.put(_WAKE)  # a poll() blocked on `done` must start querying this lane's events

    # ------------------------------------------------------------------ heartbeat thread
    def _beat(self) -> None:
        if not self._hb_socks:  # sockets are created on the heartbeat thread, which alone uses them
            for p in self._peers:
                sock = self._ctx.socket(zmq.PUSH)
                sock.setsockopt(zmq.SNDHWM, 16)  # a dead peer must not make beats pile up
                sock.setsockopt(zmq.LINGER, 0)
                sock.connect(self.endpoints[p])
                self._hb_socks.append(sock)
        beat = self._hb_codec.encode(HEARTBEAT, -1, {"p": self.progress, "w": self.work, "k": self.tokens,
                                                     "q": self._queued()})
        for sock in self._hb_socks:
            try:
                sock.send(beat, zmq.NOBLOCK)
            except zmq.Again:
                pass  # that peer is not draining; its silence is its own problem

    def _queued(self) -> int:
        """Rows queued on this rank (the engine's queues, read from the heartbeat thread: lengths only, under the
        GIL; a count caught mid-update is a heartbeat's worth stale, no worse)."""
        fn = self.queued_fn
        try:
            return int(fn()) if fn is not None else 0
        except Exception:  # noqa: BLE001 (a queue list replaced under us: report nothing this beat)
            return 0

    def _beat_exit(self) -> None:
        for sock in self._hb_socks:
            sock.close(linger=0)

    # ------------------------------------------------------------------ failure descriptions
    def _describe_item(self, item: Item) -> str:
        if item.is_send:
            what = f"completion of send #{item.seq} to rank {item.peer}"
        else:
            what = f"the tensor of message #{item.seq} from rank {item.peer}"
        t = item.tensor
        shape = f"{tuple(t.shape)} {str(t.dtype)[6:]}" if t is not None else "no tensor"
        return f"{what} ({shape}, meta {_summary(item.meta)})"

    def _waiting_for(self, peer: int) -> str:
        if peer not in self._recv_lanes:  # this rank itself (an abort about us came back to us)
            return "nothing from itself"
        parts = []
        head = self._recv_lanes[peer].oldest()
        if head is not None:
            parts.append(f"{self._describe_item(head)}, {self._recv_lanes[peer].busy()} receive(s) outstanding")
        head = self._send_lanes[peer].oldest()
        if head is not None:
            parts.append(f"{self._describe_item(head)}, {self._inflight[peer]} send(s) in flight")
        if self._backlog[peer]:
            parts.append(f"{len(self._backlog[peer])} queued send(s) to rank {peer}")
        if self.describe_wait is not None:
            extra = self.describe_wait(peer)
            if extra:
                parts.append(extra)
        if not parts:
            parts.append(f"message #{self._recv_seq[peer]} from rank {peer} (all earlier ones arrived, "
                         f"no transfer in progress)")
        return "; ".join(parts)

    def _describe_outstanding(self) -> str:
        return "; ".join(f"rank {p}: {self._inflight[p]} in flight, {len(self._backlog[p])} queued"
                         for p in self._peers if self._inflight[p] or self._backlog[p])
