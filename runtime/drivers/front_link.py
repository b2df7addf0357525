"""A rank's side of the serving front's channel (`dataflow serve`, runtime/drivers/front.py).

The front (the HTTP server's process) binds two ZeroMQ sockets on loopback and starts the ranks with their
addresses (RankJob.front):
  commands  front -> coordinator (rank 0) only:  fsub (a request to admit), fcan (a client went away), fbye
  events    every rank -> front:                  fready (serving), ftok (new tokens of requests homed here),
                                                  ffin (a request finished: reason, tokens), fstat (rank 0's
                                                  admission state, every second)
Frames are the wire's (runtime/transport/wire.py: msgpack, signed with the run's secret, schema-checked); on this
channel the front is rank `world_size` of a world of `world_size + 1`. Tokens go from each home straight to the
front, not through rank 0: one hop, and rank 0's loop is not every stream's relay. A home sends a request's tokens
in order on one socket, then its ffin, so the front sees them in that order.
"""
from __future__ import annotations

from typing import Optional

import zmq

from runtime.transport.wire import DATA, Codec, WireError

CMD_SUBMIT, CMD_CANCEL, CMD_BYE = "fsub", "fcan", "fbye"
EV_READY, EV_TOKENS, EV_FINISHED, EV_STATS = "fready", "ftok", "ffin", "fstat"


class FrontLink:
    def __init__(self, endpoints: tuple[str, str], secret: bytes, rank: int, world_size: int) -> None:
        commands, events = endpoints
        self.rank = rank
        self._codec = Codec(secret, rank, world_size + 1)
        self._ctx = zmq.Context()
        self._events = self._ctx.socket(zmq.PUSH)
        self._events.setsockopt(zmq.LINGER, 2000)
        self._events.connect(events)
        self._commands: Optional[zmq.Socket] = None
        if rank == 0:
            self._commands = self._ctx.socket(zmq.PULL)
            self._commands.setsockopt(zmq.MAXMSGSIZE, self._codec.max_frame_bytes)
            self._commands.connect(commands)
        self._seq = 0
        self._sent: dict[int, int] = {}  # rid -> tokens already streamed

    def send(self, meta: dict) -> None:
        self._events.send(self._codec.encode(DATA, self._seq, meta))
        self._seq += 1

    def stream(self, reqs: list) -> None:
        """New tokens of these requests (a sample batch's, in order), one frame for all of them."""
        rids, toks = [], []
        sent = self._sent
        for req in reqs:
            n, have = len(req.output), sent.get(req.rid, 0)
            if n > have:
                rids.append(req.rid)
                toks.append(tuple(req.output[have:n]))
                sent[req.rid] = n
        if rids:
            self.send({"t": EV_TOKENS, "rid": tuple(rids), "toks": tuple(toks)})

    def finished(self, req) -> None:
        """Its last tokens (if any are unsent), then its end."""
        self.stream([req])
        self._sent.pop(req.rid, None)
        self.send({"t": EV_FINISHED, "rid": req.rid, "reason": req.finish_reason, "n": len(req.output)})

    def commands(self) -> list[dict]:
        """The front's commands waiting (rank 0); a frame that is not this run's is dropped."""
        out = []
        sock = self._commands
        while sock is not None and sock.poll(0):
            raw = sock.recv()
            try:
                frame = self._codec.decode(raw)
            except WireError:
                continue
            if frame.src == self._codec.world_size - 1 and type(frame.meta) is dict:
                out.append(frame.meta)
        return out

    def close(self) -> None:
        for s in (self._events, self._commands):
            if s is not None:
                s.close(linger=1000)
        self._ctx.term()
