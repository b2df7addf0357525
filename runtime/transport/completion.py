"""Completion lanes: turn posted torch.distributed operations into ordered "done" notices.

One lane per peer direction (sends to rank d, receives from rank s). Items leave a lane in the order
they entered it, so per-peer FIFO survives completion, and one slow peer's lane never holds up
another's. Completed items go into one thread-safe queue the engine drains in `poll()`.

Two kinds, one interface (`submit`, `drain`, `busy`):
- `WaiterLane` (gloo): gloo Work objects cannot be polled (`is_completed()` stays False until
  `wait()`, and a `wait(timeout)` that expires poisons the group), so a daemon thread per lane calls
  the blocking `wait()` (which releases the GIL) and forwards the item.
- `EventLane` (NCCL): the op ran on a dedicated CUDA stream and recorded an event; the engine thread
  queries head events in `drain()`: no threads, no host blocking, as in the StreamEP design.

An optional per-item `delay_s` (chaos testing: lab/chaos.py; link disturbances in the bench) holds
the item back until `delay_s` after it entered the lane, and at least until the item before it left:
an added link latency (not cumulative over a backlog), it changes timing only, never order.
"""
from __future__ import annotations

import collections
import queue
import threading
import time
from dataclasses import dataclass
from typing import Any, Optional


@dataclass(slots=True, eq=False)
class Item:
    """One message in a lane. `work`: a torch.distributed Work to wait on (gloo) or None; `event`: a
    CUDA event to query (NCCL) or None; `error`: set when the operation failed."""
    is_send: bool
    peer: int
    seq: int
    meta: Any
    tensor: Any = None
    shape: Optional[tuple] = None
    dtype: Optional[str] = None
    work: Any = None
    event: Any = None
    delay_s: float = 0.0
    error: Optional[BaseException] = None
    ready_at: float = 0.0


def summary(meta: Any, limit: int = 160) -> str:
    """A message's meta for an error message, cut at `limit` characters."""
    text = repr(meta)
    return text if len(text) <= limit else text[:limit] + "...}"


def describe(item: Item) -> str:
    """What a failure message says about an outstanding item: which transfer, its tensor and its meta."""
    what = (f"completion of send #{item.seq} to rank {item.peer}" if item.is_send
            else f"the tensor of message #{item.seq} from rank {item.peer}")
    t = item.tensor
    shape = f"{tuple(t.shape)} {str(t.dtype)[6:]}" if t is not None else "no tensor"
    return f"{what} ({shape}, meta {summary(item.meta)})"


_STOP = object()


class _Lane:
    """What both lanes share: the items submitted and not yet forwarded to `done`, in order (deque append,
    popleft and len are atomic, so the waiter thread and the engine thread need no lock)."""

    def __init__(self, name: str, done: "queue.SimpleQueue[Item]"):
        self.name = name
        self._done = done
        self._items: "collections.deque[Item]" = collections.deque()

    def submit(self, item: Item) -> None:
        if item.delay_s > 0:
            item.ready_at = time.monotonic() + item.delay_s
        self._items.append(item)

    def busy(self) -> int:
        return len(self._items)

    def oldest(self) -> Optional[Item]:
        try:
            return self._items[0]
        except IndexError:
            return None


class WaiterLane(_Lane):
    def __init__(self, name: str, done: "queue.SimpleQueue[Item]"):
        super().__init__(name, done)
        self._q: "queue.SimpleQueue" = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def submit(self, item: Item) -> None:
        super().submit(item)
        self._q.put(item)

    def drain(self) -> None:
        """Nothing to do: the waiter thread forwards items itself."""

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is _STOP:
                return
            try:
                if item.work is not None:
                    item.work.wait()
                if item.ready_at:
                    time.sleep(max(0.0, item.ready_at - time.monotonic()))
            except BaseException as err:  # peer died mid-transfer: the engine turns it into PeerFailure
                item.error = err
            item.work = None  # drop the Work (and its hold on the buffer) as soon as it is done
            # Forward before un-counting: a fast-path delivery that sees busy()==0 is then known to
            # come after this item in `done` (see ZmqDistTransport receive path).
            self._done.put(item)
            self._items.popleft()

    def close(self, timeout_s: float = 1.0) -> None:
        """Stop after the items already submitted. A thread stuck in wait() on a dead peer cannot be
        interrupted; it is a daemon and dies with the process."""
        self._q.put(_STOP)
        self._thread.join(timeout_s)


class EventLane(_Lane):
    def drain(self) -> None:
        """Forward the completed head items (engine thread only)."""
        now = None
        while self._items:
            item = self._items[0]
            if item.event is not None and not item.event.query():
                return
            if item.ready_at:
                now = now or time.monotonic()
                if now < item.ready_at:
                    return
            item.event = None
            self._done.put(item)  # forward before removing, same reason as WaiterLane
            self._items.popleft()

    def close(self, timeout_s: float = 1.0) -> None:
        self._items.clear()
