"""The receive side of ZmqDistTransport (zmq_dist.py): reading the headers from the PULL socket, checking their
sequence numbers and posting each tensor's receive: on a receptor thread (gloo ranks) or on the engine thread
inside poll() and post_receives() (NCCL ranks; CPU tests ask for it with engine_receives=True). zmq_dist.py's
module docstring says why each.

A mixin rather than an object of its own: these methods run per message on the hot path and share the
transport's state (its lanes, links, sequence numbers, health and `recv_into` hook), which an
extra object would only reach through one more attribute lookup per use.
"""
from __future__ import annotations

import sys
import time

import torch
import zmq

from runtime.transport.base import Arrival
from runtime.transport.completion import Item, summary
from runtime.transport.health import PeerFailure
from runtime.transport.wire import ABORT, BYE, HEARTBEAT, WireError

# pyzmq's option and flag constants are enums: `int & zmq.POLLIN` goes through enum.Flag's Python __and__ (~0.5 us,
# 5-10% of the engine thread's header polls in a profile). Their plain values cost a C-level int op.
_ZMQ_EVENTS, _ZMQ_POLLIN, _ZMQ_NOBLOCK = int(zmq.EVENTS), int(zmq.POLLIN), int(zmq.NOBLOCK)
# Engine receives without busy polling: an idle poll(timeout) re-queries the busy lanes while it waits: while a
# receive is outstanding it yields (GIL released) between queries for up to _SPIN_S, then sleeps in _SLICE_S
# slices (see _wait_engine).
_SPIN_S = 0.001
_SLICE_S = 0.0002


class HeaderReceiver:
    """Mixed into ZmqDistTransport, whose __init__ sets every attribute used here."""

    def _receive_loop(self) -> None:
        """The receptor thread (gloo ranks): headers read and receives posted as they come; a peer's bad frame
        becomes the transport's failure, which the engine thread's next poll() raises."""
        try:
            while not self._closing.is_set() and self._failure is None:
                if self._pull.poll(50):
                    self._receive_headers()
        finally:
            self._pull.close(linger=0)

    def _receive_headers(self) -> int:
        """Handle every header waiting on the PULL socket; returns how many. A frame that is not this run's (bad
        size, tag or prefix) is dropped and counted; an error in a frame of a peer (its tag verified) becomes the
        transport's failure, naming that peer and the message, for poll() to raise."""
        if self._failure is not None:
            return 0
        pull, n, decode = self._pull, 0, self._codec.decode
        src, seq, meta = -1, -1, None
        try:
            while True:
                # Most polls find nothing: asking ZMQ_EVENTS is ~1 us where a NOBLOCK recv raising zmq.Again
                # costs ~2.5 us here and more on an H200 host (~3% of a rank's loop in py-spy).
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
        except BaseException as err:  # raised by poll()
            what = (f"a well-formed frame from rank {src}" if isinstance(err, WireError) else
                    f"message #{seq} from rank {src} ({summary(meta)})")
            self._failure = PeerFailure(src, what, f"{type(err).__name__}: {err}")
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
            torch_dtype = getattr(torch, dtype)  # one of wire.DTYPES (the codec checked it): torch's dtype names
            target = self.recv_into(src, meta, tuple(shape), torch_dtype) if self.recv_into is not None else None
            if target is not None:
                self.stats["in_place"] += 1
            item.tensor = self._links.post_recv(item, tuple(shape), torch_dtype, target)
        if self._recv_delay is not None:
            item.delay_s = self._recv_delay[src]()
        elif shape is None and lane.busy() == 0:
            # Fast path: nothing from src is still completing, so handing the meta-only message over
            # directly keeps FIFO and saves a thread hop.
            self._done.put(item)
            return
        lane.submit(item)

    def _wait_engine(self, timeout: float, out: list[Arrival]) -> None:
        """Block up to `timeout` for the first arrival or completion (this thread also reads the
        headers). A ZeroMQ poll of the PULL socket is the blocking wait (it
        releases the GIL) when nothing is outstanding; while a receive is outstanding its completion (its
        event on NCCL, the waiter thread's notice on gloo) is looked for with plain yields for up to _SPIN_S
        after the last header, then every _SLICE_S; with only sends outstanding, every _SLICE_S."""
        done = self._done
        now = time.monotonic()
        deadline = now + timeout
        spin_until = now + _SPIN_S
        while True:
            if self._receive_headers():
                spin_until = time.monotonic() + _SPIN_S
            self._drain_lanes()
            if out or not done.empty():
                return  # poll() collects `done`
            now = time.monotonic()
            if now >= deadline:
                return
            if self._spin:
                continue  # busy-poll: the core never sleeps (see `spin` in __init__)
            if now < spin_until and any(lane.busy() for lane in self._recv_lanes.values()):
                time.sleep(0)
            elif any(lane.busy() for lane in self._lanes):
                time.sleep(min(_SLICE_S, deadline - now))
            elif done.empty():  # (a waiter thread un-counts an item only after putting it in `done`)
                self._pull.poll(max(1, int((deadline - now) * 1000)))  # ms; returns at the first header
