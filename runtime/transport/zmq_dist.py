"""The real transport: metadata over ZeroMQ, tensors over NCCL or torch.distributed point-to-point.

Two-phase exchange (StreamEP): batch sizes change every step and a point-to-point receive needs a
buffer of the right size, so
  phase 1: the sender pushes a small header (kind, src, per-(src,dst) sequence number, the meta dict
           of plain values, the tensor's shape and dtype) to the receiver's ZeroMQ PULL socket
           (metadata_channel.py; the frame: wire.py; a stray or hostile frame is dropped and counted,
           never fatal);
  phase 2: it posts the tensor's send; the receiver, on seeing the header, makes a buffer of that shape
           (or takes the engine's `recv_into` target) and posts the matching receive, over gloo
           or our own NCCL pair communicators (tensor_links.py).
Meta-only messages (tensor None) skip phase 2. Sends to self are handed over locally, no copy.

Ordering. The header order is the data order (tensor_links.py says why). Completions go through one
lane per peer direction (completion.py), which preserves that order up to `poll()`. Sequence numbers
are checked on receipt: loss or duplication is an error, not silent corruption.

Flow control. At most `inflight_limit` tensor sends per destination are posted at once; the excess
waits in that destination's backlog (in order, meta-only messages behind queued tensors included),
so one slow peer never holds up sends to the others. A send keeps its tensor alive until the send
completed. Backlogs are pumped from `poll()`.

Threads. The engine thread calls send/poll/pending/close. Who reads the headers and posts the receives
(header_receiver.py): on NCCL the engine thread, inside poll() and post_receives(), because a second Python
thread making CUDA calls cost the engine more in GIL waits than the earlier receive posting saved (profiled on
2 x H200: ~230 us median per send, most of it waiting for the GIL held by the receptor; benchmarks/NOTES.md
section 13 item 1). On gloo a receptor thread, so a receive is posted as its header comes while the engine
computes: equal tok/s clean (NOTES section 18), and streaming 8.5% faster under 10 ms link bursts in 4 CPU
processes (session 23, benchmarks/results/session23_gloo_receptor.md: the engine-thread reading was tried and
measured slower). Gloo: one waiter thread per peer direction completes Work objects (they cannot be polled).
NCCL: ops record an event the engine thread queries; no waiter threads. A heartbeat thread beats every
DEFAULT_HEARTBEAT_S (health.py); a peer silent for `peer_timeout_s`, a failed transfer or an abort notice makes `poll()`
raise PeerFailure naming the rank and what this rank was waiting for.

A received tensor is a new buffer (or the engine's `recv_into` target), the engine's to keep: a pool that reused
buffers the engine handed back was deleted, as the engine never handed one back (it cannot know when the last
kernel reading a row block is done without an event per block).

Cost (`python benchmarks/transport_bench.py --ranks 2 --sizes 0,4K,184K,1M`, measured with the receptor thread
gloo ranks then had): gloo on a 2-core VM, 4 KB one-way
~160-220 us p50: ZeroMQ header ~60-80, receptor -> waiter hand-off ~40 (up to 1 ms under load), gloo
transfer with its rendezvous ~60-100, hand-off to poll() ~20; CPU ~215 us per message sent + received,
most of it in gloo's loop threads and the engine thread.
"""
from __future__ import annotations

import itertools
import queue
import sys
import threading
import time
from typing import Callable, Optional

import torch
import torch.distributed as dist

from runtime import settings
from runtime.executors.cuda_stream import current_stream
from runtime.observability.step_timer import StepTimer
from runtime.transport.base import Arrival, LinkDelays, Transport
from runtime.transport.completion import EventLane, Item, WaiterLane, describe, summary
from runtime.transport.header_receiver import HeaderReceiver
from runtime.transport.health import (DEFAULT_HEARTBEAT_S, DEFAULT_PEER_TIMEOUT_S, DEFAULT_STALL_TIMEOUT_S, Heartbeat,
                                      PeerFailure, PeerHealth, register_abort_hook)
from runtime.transport.metadata_channel import MetaChannel
from runtime.transport.rendezvous import DEFAULT_TIMEOUT_S, current_store, init_distributed, run_secret
from runtime.transport.tensor_links import TensorLinks
from runtime.transport.wire import BYE, DATA

__all__ = ["ZmqDistTransport", "init_distributed", "PeerFailure"]

DEFAULT_INFLIGHT_LIMIT = 16
_HEALTH_CHECK_EVERY_S = 0.05  # poll() is called in a tight loop; checking peers each time is waste

# Transports are built in the same order on every rank, so a per-process counter gives matching
# store namespaces when a process creates more than one (tests, benchmarks).
_instances = itertools.count()


class ZmqDistTransport(HeaderReceiver, Transport):
    def __init__(self, rank: int, world_size: int, device="cpu", *, inflight_limit: int = DEFAULT_INFLIGHT_LIMIT,
                 peer_timeout_s: float = DEFAULT_PEER_TIMEOUT_S, stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S,
                 chaos: Optional[LinkDelays] = None, spin: Optional[bool] = None, engine_receives: bool = False):
        if not dist.is_initialized():
            raise RuntimeError("call runtime.transport.zmq_dist.init_distributed(rank, world, backend) first")
        self.rank = rank
        self.world_size = world_size
        self.device = torch.device(device)
        self.inflight_limit = inflight_limit
        self._nccl = self.device.type == "cuda"
        # On NCCL an idle poll(timeout) busy-polls the header socket and the lanes' events instead of sleeping,
        # so the engine thread's core stays awake: on 2 x H200 every torch call of the loop got ~25% cheaper and
        # streaming +43% tok/s, for one core per rank at 100% (as in other serving engines' busy loops). CPU
        # ranks sleep: they share their cores with their math. `spin` (None: that rule) lets CPU tests busy-poll.
        self._spin = self._nccl if spin is None else spin
        # Headers read by the engine thread (NCCL; `engine_receives` lets CPU tests run that path) or by a receptor
        # thread (gloo): module docstring.
        self._engine_receives = self._nccl or engine_receives
        # Option profile_steps: wall time of each step of posting a send / receive, printed at close.
        profile = settings.current().profile_steps
        self._post_timer = StepTimer(f"rank {rank} send post", profile)
        self._recv_timer = StepTimer(f"rank {rank} recv post", profile)
        # Optional hook set by the engine: peer -> what it is waiting for from that peer, in its own
        # words (stage, layer, request ids). Used only in failure messages.
        self.describe_wait: Optional[Callable[[int], Optional[str]]] = None
        self.stats = {"sent": 0, "received": 0, "local": 0, "in_place": 0, "dropped": 0}
        self._drop_logged: set[str] = set()
        # Liveness of this rank's serving loop, carried by every heartbeat (health.py): `progress` counts loop
        # iterations (0: not in a serving loop, e.g. loading weights or capturing graphs: not judged), `work`
        # batches run. The engine thread writes them; the heartbeat thread reads them (int stores are atomic).
        self.progress = 0
        self.work = 0
        self.tokens = 0  # tokens this rank sampled (the coordinator's progress display adds them up)
        self.queued_fn: Optional[Callable[[], int]] = None  # rows queued here (read by the heartbeat thread)
        self._peers = peers = [p for p in range(world_size) if p != rank]

        # Phase 1: the ZeroMQ sockets (the hot paths use them directly).
        store, namespace, timeout_s = current_store(), f"zmq{next(_instances)}", DEFAULT_TIMEOUT_S
        # (the serving front's channel signs with the secret too: runtime/drivers/front_link.py)
        self.secret = run_secret(store, rank, timeout_s)
        self._channel = channel = MetaChannel(rank, world_size, store, namespace, self.secret, timeout_s)
        self._codec, self._pull, self._push = channel.codec, channel.pull, channel.push

        # Phase 2: the tensor links and the per-direction completion lanes. Every rank must move tensors the
        # same way (the set-up is collective).
        self._links = TensorLinks(rank, world_size, self.device, store, namespace, timeout_s, self._post_timer,
                                  self._recv_timer)
        self._done: "queue.SimpleQueue[Item]" = queue.SimpleQueue()
        Lane = EventLane if self._nccl else WaiterLane
        self._send_lanes = {p: Lane(f"send->{p}", self._done) for p in peers}
        self._recv_lanes = {p: Lane(f"recv<-{p}", self._done) for p in peers}
        self._lanes = [*self._send_lanes.values(), *self._recv_lanes.values()]
        self._send_delay = {p: chaos.lane("send", rank, p) for p in peers} if chaos else None
        self._recv_delay = {p: chaos.lane("recv", rank, p) for p in peers} if chaos else None

        # Engine-thread state.
        self._send_seq = [0] * world_size
        self._recv_seq = [0] * world_size
        self._inflight = [0] * world_size
        self._backlog: dict[int, list[Item]] = {p: [] for p in peers}
        self._pending = 0
        self._local: list[Arrival] = []
        self._failure: Optional[PeerFailure] = None
        self._next_check = 0.0
        self._closed = False
        self._aborted = False

        self._health = PeerHealth(rank, world_size, peer_timeout_s, stall_timeout_s)
        self._heartbeat = Heartbeat(DEFAULT_HEARTBEAT_S, self._beat, channel.beat_exit, name=f"heartbeat-{rank}")
        self._closing = threading.Event()
        self._receptor: Optional[threading.Thread] = None
        if not self._engine_receives:
            self._receptor = threading.Thread(target=self._receive_loop, name=f"receptor-{rank}", daemon=True)
            self._receptor.start()
        register_abort_hook(self)

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
            raise RuntimeError(f"rank {self.rank}: rank {dst} already closed its transport; message {summary(meta)} "
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
        ready, block up to that long for the first one (header_receiver.py's _wait_engine). Raises PeerFailure
        when a peer died, wedged or aborted."""
        if self._failure is not None:
            raise self._failure
        if self._engine_receives:
            self._receive_headers()  # before the health check: queued heartbeats count
        if self._failure is not None:  # a peer's malformed frame
            raise self._failure
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
            else:  # gloo: the receptor and the waiter threads complete items into `done`
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
        """Start the transfers of the messages whose headers came since the last poll. A busy rank calls it between a
        batch's launch and its bookkeeping: each transfer then runs meanwhile and the next poll() delivers it, where
        a receive first posted by that poll() is delivered by the one after, a batch later. Errors are kept for
        poll() to raise, as there. (Gloo's receptor thread posts receives as headers come: nothing to do.)"""
        if self._engine_receives and self._failure is None:
            self._receive_headers()

    def peer_work(self) -> list[int]:
        """Batches each peer ran as of its last heartbeat (this rank's own: `work`)."""
        return self._with_own(self._health.work, self.work)

    def peer_queued(self) -> list[int]:
        """Rows queued on each rank as of its last heartbeat (this rank's own: now)."""
        return self._with_own(self._health.queued, self._queued())

    def peer_tokens(self) -> list[int]:
        """Tokens each peer sampled as of its last heartbeat (this rank's own: `tokens`)."""
        return self._with_own(self._health.tokens, self.tokens)

    def _with_own(self, per_rank: list[int], own: int) -> list[int]:
        out = list(per_rank)
        out[self.rank] = own
        return out

    def pending(self) -> int:
        """Messages this rank sent to peers whose delivery has not completed yet (tensor messages in
        flight or queued; meta-only messages count until handed to ZeroMQ)."""
        return self._pending

    def abort(self, reason: str, culprit: Optional[int] = None) -> None:
        """Tell every peer this run is over because of `reason` (culprit: the rank at fault, if known)
        so they raise PeerFailure at once instead of after their heartbeat timeout."""
        if self._aborted or self._channel.ctx.closed:
            return
        self._aborted = True
        self._channel.broadcast(self._channel.abort_frame(reason, culprit))

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
            self._channel.broadcast(self._codec.encode(BYE, -1))
        self._heartbeat.stop()
        if self._post_timer.enabled:
            print(self._post_timer.report(), file=sys.stderr)
            print(self._recv_timer.report(), file=sys.stderr)
        self._closing.set()
        if self._receptor is not None:
            self._receptor.join(2.0)  # it closes the PULL socket it owns
        else:
            self._pull.close(linger=0)
        # After a failure a waiter may be stuck in a gloo wait on the dead peer: don't wait for it.
        join_s = 0.5 if self._failure is None and not self._aborted else 0.01
        # Before the lanes forget their items: a destroy is clean only with nothing still in flight.
        clean = (self._failure is None and not self._aborted and not self._pending
                 and not any(lane.busy() for lane in self._lanes))
        for lane in self._lanes:
            lane.close(join_s)
        self._links.close(clean, timeout_s)
        self._channel.close(self._aborted, not self._heartbeat._thread.is_alive()
                            and (self._receptor is None or not self._receptor.is_alive()))

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
        self._links.post_send(item, t)  # _complete drops `t` once the send completed
        if self._send_delay is not None:
            item.delay_s = self._send_delay[dst]()
        self.stats["sent"] += 1
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
            del backlog[:n]

    # ------------------------------------------------------------------ completion (engine thread)
    def _drain_lanes(self) -> None:
        for lane in self._lanes:
            lane.drain()

    def _complete(self, item: Item, out: list[Arrival]) -> None:
        """Account for one item from `done`."""
        if item.error is not None:
            waiting = describe(item)
            extra = self.describe_wait(item.peer) if self.describe_wait is not None else None
            self._failure = PeerFailure(item.peer, f"{waiting}; {extra}" if extra else waiting,
                                        f"transfer failed: {type(item.error).__name__}: {item.error}")
            return
        if item.is_send:
            self._inflight[item.peer] -= 1
            self._pending -= 1
            item.tensor = None  # the send buffer may be recycled only now
            return
        t = item.tensor
        if t is not None and self._nccl:
            t.record_stream(current_stream(self.device))  # it will be read on the engine's stream
        self.stats["received"] += 1
        out.append(Arrival(item.peer, item.meta, t))

    def _check_health(self) -> None:
        try:
            self._health.check(self._waiting_for)
        except PeerFailure as failure:
            self._failure = failure
            raise
        failed = self._links.failed_comm()  # a transfer NCCL saw fail (its event would never complete)
        if failed is not None:
            self._failure = PeerFailure(failed[0], self._waiting_for(failed[0]), failed[1])
            raise self._failure

    # ------------------------------------------------------------------ heartbeat thread
    def _beat(self) -> None:
        self._channel.beat({"p": self.progress, "w": self.work, "k": self.tokens, "q": self._queued()})

    def _queued(self) -> int:
        """Rows queued on this rank (the engine's queues, read from the heartbeat thread: lengths only, under the
        GIL; a count caught mid-update is a heartbeat's worth stale, no worse)."""
        fn = self.queued_fn
        try:
            return int(fn()) if fn is not None else 0
        except Exception:  # noqa: BLE001 (a queue list replaced under us: report nothing this beat)
            return 0

    # ------------------------------------------------------------------ failure descriptions
    def _waiting_for(self, peer: int) -> str:
        if peer not in self._recv_lanes:  # this rank itself (an abort about us came back to us)
            return "nothing from itself"
        parts = []
        head = self._recv_lanes[peer].oldest()
        if head is not None:
            parts.append(f"{describe(head)}, {self._recv_lanes[peer].busy()} receive(s) outstanding")
        head = self._send_lanes[peer].oldest()
        if head is not None:
            parts.append(f"{describe(head)}, {self._inflight[peer]} send(s) in flight")
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
