"""The transport's ZeroMQ sockets: phase 1 of a message (zmq_dist.py), heartbeats, goodbyes and aborts.

Each rank binds one PULL socket and connects one PUSH socket to every peer's. Every frame is one
authenticated msgpack frame (wire.py: never pickle, bounded, signed with the run's secret). ZeroMQ keeps
one connection's frames in order, which is what makes the header order the data order.

Who uses what (ZeroMQ sockets are not thread-safe): the data PUSH sockets belong to the engine thread; the
PULL socket to the engine thread too (it reads the headers inside poll());
the heartbeat thread creates and alone uses its own PUSH sockets and its own codec.
"""
from __future__ import annotations

from typing import Optional

import zmq

from runtime import settings
from runtime.transport.rendezvous import exchange_endpoints, host_address
from runtime.transport.wire import ABORT, DEFAULT_MAX_FRAME_BYTES, HEARTBEAT, MAX_REASON_CHARS, Codec


class MetaChannel:
    def __init__(self, rank: int, world_size: int, store, namespace: str, secret: bytes, timeout_s: float):
        self.rank = rank
        self.world_size = world_size
        self.peers = [p for p in range(world_size) if p != rank]
        self.codec = Codec(secret, rank, world_size)  # the engine thread's
        self._hb_codec = Codec(secret, rank, world_size)  # the heartbeat thread's own
        self._secret = secret
        self.ctx = zmq.Context()
        # HWM 0 (unbounded) because data volume is bounded by the transport's in-flight cap and headers are
        # small; a bounded HWM would make send() block or drop.
        self.pull = self.ctx.socket(zmq.PULL)
        self.pull.setsockopt(zmq.RCVHWM, 0)
        # A frame over the cap never reaches us: ZeroMQ drops it (and that connection) while reading its size.
        self.pull.setsockopt(zmq.MAXMSGSIZE, DEFAULT_MAX_FRAME_BYTES)
        launch = settings.launch_environment()
        addr = host_address(launch.master_addr, launch.master_port)
        port = self.pull.bind_to_random_port(f"tcp://{addr}")
        self.endpoints = exchange_endpoints(store, namespace, rank, world_size, f"tcp://{addr}:{port}", timeout_s)
        self.push: list[Optional[zmq.Socket]] = [None] * world_size
        for p in self.peers:
            self.push[p] = self._push_socket(p, 0, 2000)  # linger: let BYE/ABORT reach peers after close()
        self._hb_socks: list[zmq.Socket] = []

    def _push_socket(self, peer: int, hwm: int, linger_ms: int) -> zmq.Socket:
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.SNDHWM, hwm)
        sock.setsockopt(zmq.LINGER, linger_ms)
        sock.connect(self.endpoints[peer])
        return sock

    def broadcast(self, frame: bytes) -> None:
        """`frame` to every peer without blocking (BYE, ABORT); a peer that cannot take it is not waited for."""
        for p in self.peers:
            try:
                self.push[p].send(frame, zmq.NOBLOCK)
            except zmq.ZMQError:
                pass

    def abort_frame(self, reason: str, culprit: Optional[int]) -> bytes:
        """An ABORT frame; any thread may call it (it signs with a codec of its own)."""
        culprit = culprit if isinstance(culprit, int) and 0 <= culprit < self.world_size else None
        return Codec(self._secret, self.rank, self.world_size).encode(
            ABORT, -1, {"reason": str(reason)[:MAX_REASON_CHARS], "culprit": culprit})

    # ------------------------------------------------------------------ heartbeat thread
    def beat(self, progress: dict) -> None:
        """Send one heartbeat carrying `progress` to every peer (heartbeat thread only)."""
        if not self._hb_socks:  # sockets are created on the heartbeat thread, which alone uses them
            # (HWM 16: a dead peer must not make beats pile up)
            self._hb_socks = [self._push_socket(p, 16, 0) for p in self.peers]
        beat = self._hb_codec.encode(HEARTBEAT, -1, progress)
        for sock in self._hb_socks:
            try:
                sock.send(beat, zmq.NOBLOCK)
            except zmq.Again:
                pass  # that peer is not draining; its silence is its own problem

    def beat_exit(self) -> None:
        for sock in self._hb_socks:
            sock.close(linger=0)

    # ------------------------------------------------------------------ teardown
    def close(self, aborted: bool, threads_done: bool) -> None:
        """Close the data PUSH sockets (after a short linger so BYE / ABORT go out) and, when no other thread
        still holds a socket of this context (`threads_done`), end the context."""
        for p in self.peers:
            self.push[p].close(linger=1000 if not aborted else 200)
        if threads_done:
            self.ctx.term()  # blocks until lingering BYE/ABORT messages went out (bounded by LINGER)
