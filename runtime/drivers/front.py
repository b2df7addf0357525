"""The serving front: the plan's rank processes serving an open workload, driven from asyncio.

`Front(plan, options)` binds two ZeroMQ sockets on loopback, starts one process per rank (runtime/drivers/launch.py, as
`dataflow run` does) with an open workload (RankJob.front: runtime/drivers/coordinator.py takes requests from here
while the ranks serve), and waits for their ready notice. Then

    stream = await front.submit(prompt_ids, max_new_tokens=..., params=..., stop_token_ids=...)
    async for tokens in stream: ...      # each frame's new token ids, in order
    stream.reason                        # when it ended: "eos" | "stop" | "length" | "abort" | "error"
    await front.cancel(stream.rid)       # its client went away: KV freed at its home's next token

The channel (runtime/drivers/front_link.py) carries signed msgpack frames (runtime/transport/wire.py). Admission control
lives here: at most `max_outstanding` requests at once; `submit` beyond that raises Overloaded (the HTTP layer
answers 503), so a burst does not grow an unbounded queue in the ranks. If the ranks fail, every open stream ends
with reason "error" and the failure's message, and new submissions raise Unavailable. Every wait is bounded.
"""
from __future__ import annotations

import asyncio
import itertools
import secrets
import threading
from typing import Optional

import zmq
import zmq.asyncio

from runtime.drivers.front_link import CMD_BYE, CMD_CANCEL, CMD_SUBMIT, EV_FINISHED, EV_READY, EV_STATS, EV_TOKENS
from runtime.core.requests import Request
from runtime.drivers.admission import request_to_wire
from runtime.transport.wire import DATA, Codec, WireError


class Overloaded(RuntimeError):
    """Too many requests outstanding: try again later (HTTP 503)."""


class Unavailable(RuntimeError):
    """The ranks are not serving (starting, failed or shut down)."""


class Stream:
    """One request's tokens as they come (an async iterator of lists of token ids), then its end."""

    def __init__(self, rid: int) -> None:
        self.rid = rid
        self.queue: asyncio.Queue = asyncio.Queue()
        self.reason: Optional[str] = None
        self.error: Optional[str] = None

    def __aiter__(self):
        return self

    async def __anext__(self) -> list[int]:
        if self.reason is not None and self.queue.empty():
            raise StopAsyncIteration
        kind, value = await self.queue.get()
        if kind == "tok":
            return list(value)
        self.reason = value.get("reason", "error")
        self.error = value.get("error")
        raise StopAsyncIteration


class Front:
    def __init__(self, plan, options, *, peer_timeout_s: float = 10.0, max_outstanding: int = 1024,
                 startup_timeout_s: float = 600.0) -> None:
        import dataclasses
        self.plan = plan
        self.world = plan.cluster.ranks
        # Served: rank 0 keeps running totals, not every finished request (flat memory however long it serves).
        self.options = dataclasses.replace(options, progress=None, keep_outputs=False, output_path=None)
        self.peer_timeout_s = peer_timeout_s
        self.max_outstanding = max_outstanding
        self.startup_timeout_s = startup_timeout_s
        self.secret = secrets.token_bytes(32)
        self._codec = Codec(self.secret, self.world, self.world + 1)  # the front is rank `world` on its channel
        self._seq = itertools.count()
        self._rids = itertools.count(1)
        self._streams: dict[int, Stream] = {}
        self.stats: dict = {}
        self.failure: Optional[str] = None
        self.closed = False
        self._ready = asyncio.Event()
        self._launch: Optional[threading.Thread] = None
        self._reader: Optional[asyncio.Task] = None

    # ------------------------------------------------------------------ life cycle
    async def start(self) -> None:
        from runtime.drivers.multiproc import RankJob, _picklable
        self._loop = asyncio.get_running_loop()
        self._ctx = zmq.asyncio.Context()
        self._commands = self._ctx.socket(zmq.PUSH)
        self._events = self._ctx.socket(zmq.PULL)
        self._events.setsockopt(zmq.MAXMSGSIZE, self._codec.max_frame_bytes)
        cmd_port = self._commands.bind_to_random_port("tcp://127.0.0.1")
        ev_port = self._events.bind_to_random_port("tcp://127.0.0.1")
        self.endpoints = (f"tcp://127.0.0.1:{cmd_port}", f"tcp://127.0.0.1:{ev_port}")
        job = RankJob(self.plan, [([], _picklable(self.options))], self.peer_timeout_s, front=self.endpoints)
        env = {"DATAFLOW_RUN_SECRET": self.secret.hex()}
        self._reader = asyncio.create_task(self._read_events())
        self._launch = threading.Thread(target=self._run_ranks, args=(job, env), name="front-ranks", daemon=True)
        self._launch.start()
        try:
            await asyncio.wait_for(self._ready.wait(), self.startup_timeout_s)
        except asyncio.TimeoutError:
            raise Unavailable(f"the ranks did not report ready within {self.startup_timeout_s:g} s") from None
        if self.failure is not None:
            raise Unavailable(self.failure)

    def _run_ranks(self, job, env: dict) -> None:
        """The launcher, on its own thread (it waits for the rank processes); its end is the ranks' end."""
        from runtime.drivers.launch import launch_local
        from runtime.drivers.multiproc import _failure_message, rank_main
        try:
            res = launch_local(self.world, rank_main, (job,), grace_s=self.peer_timeout_s + 5.0, env=env)
            message = None if res.ok else _failure_message(res)
        except BaseException as err:  # noqa: BLE001 (reported to every stream, not lost on this thread)
            message = f"{type(err).__name__}: {err}"
        if message is None and not self.closed:
            message = "the ranks exited"
        if message is not None:
            self._loop.call_soon_threadsafe(self._fail, message)
        else:
            self._loop.call_soon_threadsafe(self._ready.set)

    def _fail(self, message: str) -> None:
        self.failure = self.failure or message
        self._ready.set()
        for s in list(self._streams.values()):
            s.queue.put_nowait(("fin", {"reason": "error", "error": f"the ranks failed: {message}"}))
        self._streams.clear()

    async def close(self, timeout_s: float = 30.0) -> None:
        """Cancel what is outstanding, tell the ranks goodbye, wait (bounded) for them to exit."""
        if self.closed:
            return
        self.closed = True
        if self.failure is None and self._launch is not None:
            for rid in list(self._streams):
                await self._send({"t": CMD_CANCEL, "rid": rid})
            await self._send({"t": CMD_BYE})
            await asyncio.to_thread(self._launch.join, timeout_s)
        if self._reader is not None:
            self._reader.cancel()
        self._commands.close(linger=0)
        self._events.close(linger=0)
        self._ctx.term()

    @property
    def ready(self) -> bool:
        return self._ready.is_set() and self.failure is None and not self.closed

    @property
    def outstanding(self) -> int:
        return len(self._streams)

    # ------------------------------------------------------------------ requests
    async def submit(self, prompt: list[int], max_new_tokens: int, params=None, *, stop_token_ids: tuple = (),
                     ignore_eos: bool = False, name: Optional[str] = None) -> Stream:
        if not self.ready:
            raise Unavailable(self.failure or "the server is not serving (starting up or shutting down)")
        if len(self._streams) >= self.max_outstanding:
            raise Overloaded(f"{len(self._streams)} requests outstanding (--max-outstanding {self.max_outstanding})")
        rid = next(self._rids)
        req = Request(rid, name or f"req-{rid}", list(prompt), max_new_tokens, params=params, ignore_eos=ignore_eos,
                      stop_token_ids=tuple(stop_token_ids))
        stream = self._streams[rid] = Stream(rid)
        await self._send({"t": CMD_SUBMIT, "req": request_to_wire(req)})
        return stream

    async def cancel(self, rid: int) -> None:
        if rid in self._streams and self.ready:
            await self._send({"t": CMD_CANCEL, "rid": rid})

    async def _send(self, meta: dict) -> None:
        await self._commands.send(self._codec.encode(DATA, next(self._seq), meta))

    async def _read_events(self) -> None:
        while True:
            raw = await self._events.recv()
            try:
                frame = self._codec.decode(raw)
            except WireError:  # not this run's frame: dropped
                continue
            meta = frame.meta
            t = meta.get("t")
            if t == EV_TOKENS:
                for rid, toks in zip(meta["rid"], meta["toks"]):
                    s = self._streams.get(rid)
                    if s is not None:
                        s.queue.put_nowait(("tok", toks))
            elif t == EV_FINISHED:
                s = self._streams.pop(meta["rid"], None)
                if s is not None:
                    s.queue.put_nowait(("fin", meta))
            elif t == EV_STATS:
                self.stats = meta
            elif t == EV_READY:
                self._ready.set()
