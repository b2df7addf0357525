"""Failure detection between ranks: heartbeats, silence timeouts and abort notices -> PeerFailure.

A distributed run must never hang when one rank dies or wedges. Every rank sends a heartbeat to every
peer at a fixed interval (on its own thread, so a rank busy in a long kernel still beats). Each rank
remembers when it last heard anything from each peer; a peer silent for longer than `timeout_s`, or
one that sent an explicit abort, turns into a `PeerFailure` the next time the engine polls its
transport. The engine lets it propagate, the rank broadcasts its own abort (`abort_all`) so the other
ranks do not have to wait for their own timeouts, and the process exits non-zero.

A heartbeat thread beats even when the rank's main thread is stuck (a deadlock, an endless loop, a
blocking call that never returns), so every heartbeat also carries the rank's progress: its serving
loop's iteration count (0 while it is not in a serving loop: loading weights, capturing graphs) and
the batches it ran. A peer whose loop count has not moved for longer than its bound while it keeps
beating is wedged, and named. The bound follows the run's own pace: the larger of a floor
(`stall_timeout_s`, `dataflow run --stall-timeout`) and STALL_FACTOR times the longest pause between
advances seen from that peer so far, so a slow but progressing rank (long CPU prefills, a loaded
host) is never called wedged, and a fast one is caught at the floor.

This module knows nothing about sockets: the transport feeds it (`saw`, `closed`, `aborted`) and
gives the heartbeat thread a function that sends one beat. It imports no torch so the launcher can
use `abort_all` cheaply.
"""
from __future__ import annotations

import threading
import time
import weakref
from typing import Callable, Optional

DEFAULT_HEARTBEAT_S = 0.5
DEFAULT_PEER_TIMEOUT_S = 10.0
DEFAULT_STALL_TIMEOUT_S = 60.0
STALL_FACTOR = 10.0


class ProgressWatch:
    """When a counter last advanced, and the bound on how long it may stand still: max(floor, STALL_FACTOR x the
    longest pause between advances seen so far). Only the thread that calls `update` writes."""

    def __init__(self, floor_s: float, now: float) -> None:
        self.floor_s = floor_s
        self.value: Optional[int] = None
        self.since = now
        self.longest = 0.0

    def update(self, value: int, now: float) -> None:
        if value != self.value:
            if self.value:  # a pause counts only from a live value (0: not serving, e.g. starting up)
                self.longest = max(self.longest, now - self.since)
            self.value, self.since = value, now

    def bound(self) -> float:
        return max(self.floor_s, STALL_FACTOR * self.longest)

    def stalled_for(self, now: float) -> Optional[float]:
        """Seconds it stood still, if that is over its bound; else None."""
        quiet = now - self.since
        return quiet if quiet > self.bound() else None


class PeerFailure(RuntimeError):
    """A peer died, wedged or aborted. `rank` is the rank at fault (the root cause when another rank
    reported it), `waiting_for` what this rank still expected from it, `reason` how it was noticed."""

    def __init__(self, rank: int, waiting_for: str, reason: str, reported_by: Optional[int] = None):
        self.rank = rank
        self.waiting_for = waiting_for
        self.reason = reason
        self.reported_by = reported_by
        via = f" (reported by rank {reported_by})" if reported_by is not None else ""
        super().__init__(f"rank {rank} failed{via}: {reason}; this rank was waiting for: {waiting_for}")


class PeerHealth:
    """What this rank knows about the liveness of each peer. The engine thread feeds it (`saw` for every
    message, heartbeats included, as poll() reads the headers) and calls `check` in poll()."""

    def __init__(self, rank: int, world_size: int, timeout_s: float = DEFAULT_PEER_TIMEOUT_S,
                 stall_timeout_s: float = DEFAULT_STALL_TIMEOUT_S):
        self.rank = rank
        self.world_size = world_size
        self.timeout_s = timeout_s
        now = time.monotonic()
        self._loop = [ProgressWatch(stall_timeout_s, now) for _ in range(world_size)]  # serving-loop iterations
        self.work = [0] * world_size  # batches each peer ran, as of its last heartbeat
        self.tokens = [0] * world_size  # tokens each peer sampled, likewise
        self.queued = [0] * world_size  # rows queued on each peer, likewise
        # Start every clock at construction: the transport is built after the rendezvous, so every
        # peer is known to be alive at this moment.
        self._last_seen = [now] * world_size
        self._closed: set[int] = set()
        self._abort: Optional[tuple[int, Optional[int], str]] = None  # (sender, culprit, reason)

    def saw(self, src: int) -> None:
        self._last_seen[src] = time.monotonic()

    def saw_progress(self, src: int, loop: int, work: int, tokens: int, queued: int = 0) -> None:
        """A heartbeat's progress: `loop` iterations of its serving loop (0: not serving), `work` batches run,
        `tokens` sampled, `queued` rows waiting in its mu-queues."""
        self._loop[src].update(loop, time.monotonic())
        self.work[src] = work
        self.tokens[src] = tokens
        self.queued[src] = queued

    def closed(self, src: int) -> None:
        """`src` shut down cleanly: its silence from now on is not a failure."""
        self._closed.add(src)

    def is_closed(self, src: int) -> bool:
        return src in self._closed

    def aborted(self, src: int, culprit: Optional[int], reason: str) -> None:
        if self._abort is None:  # the first notice is the closest to the root cause
            self._abort = (src, culprit, reason)

    def check(self, waiting_for: Callable[[int], str]) -> None:
        """Raise PeerFailure if a peer aborted or has been silent for longer than the timeout."""
        if self._abort is not None:
            src, culprit, reason = self._abort
            if culprit is None or culprit == src:
                raise PeerFailure(src, waiting_for(src), f"rank {src} aborted: {reason}")
            raise PeerFailure(culprit, waiting_for(culprit), reason, reported_by=src)
        now = time.monotonic()
        for peer in range(self.world_size):
            if peer == self.rank or peer in self._closed:
                continue
            quiet = now - self._last_seen[peer]
            if quiet > self.timeout_s:
                raise PeerFailure(peer, waiting_for(peer),
                                  f"no message or heartbeat from rank {peer} for {quiet:.1f} s "
                                  f"(timeout {self.timeout_s:g} s): dead or wedged")
            watch = self._loop[peer]
            if watch.value:  # 0 / None: not in a serving loop (starting, capturing): not judged here
                stuck = watch.stalled_for(now)
                if stuck is not None:
                    raise PeerFailure(peer, waiting_for(peer),
                                      f"rank {peer}'s serving loop has not advanced for {stuck:.1f} s while its "
                                      f"heartbeat goes on (bound {watch.bound():.1f} s: the larger of "
                                      f"--stall-timeout and {STALL_FACTOR:g}x its longest pause so far): its main "
                                      f"thread is wedged")


class Heartbeat:
    """Calls `beat()` every `interval_s` on its own daemon thread until `stop()`. `beat` runs on that
    thread only (it may own sockets that are not thread-safe); `on_exit` runs there last, to close
    them. Errors in `beat` are dropped, not raised: the peers' timeouts are the failure signal."""

    def __init__(self, interval_s: float, beat: Callable[[], None], on_exit: Callable[[], None] = lambda: None,
                 name: str = "heartbeat"):
        self.interval_s = interval_s
        self._beat = beat
        self._on_exit = on_exit
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while not self._stop.is_set():
                try:
                    self._beat()
                except Exception:  # keep beating: one failed send is not a dead rank
                    pass
                self._stop.wait(self.interval_s)
        finally:
            self._on_exit()

    def stop(self, timeout_s: float = 2.0) -> None:
        self._stop.set()
        if self._thread is not threading.current_thread():
            self._thread.join(timeout_s)


# Abort broadcast. Transports register a callback here; a rank that fails (uncaught exception in its
# target, see runtime/drivers/launch.py) calls abort_all so every peer learns at once instead of after its
# heartbeat timeout. Weak references: a closed and dropped transport must not be kept alive.
_abort_hooks: "weakref.WeakSet" = weakref.WeakSet()


def register_abort_hook(obj) -> None:
    """`obj.abort(reason: str, culprit: int | None)` will be called by abort_all."""
    _abort_hooks.add(obj)


def abort_all(reason: str, culprit: Optional[int] = None) -> None:
    for obj in list(_abort_hooks):
        try:
            obj.abort(reason, culprit)
        except Exception:  # best effort: we are already failing
            pass
