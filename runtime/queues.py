"""Mu-queues: one per stage of the chain on every rank, holding the items waiting for that stage.

Items are plain slotted dataclasses (this is the hot loop) carrying the metadata the paper's CPU-side
record carries (request id, position, home rank, LayerID, slot, routing weight) plus the tensor rows.
Attention items are segments (never split: a segment's rows attend to each other), or blocks of
one-row segments (decode tokens: one item per wave fragment instead of one object per token per
layer); blocks, expert and sample items are blocks of rows (a batch takes whole blocks and splits
the last one only when the cap demands it). Depth is counted in *tokens*: attention and sample items count their rows, expert
rows count 1/k each (a token routed to k experts is one token of work for the layer, as the defragmenting
scheduler's Q(s) defines it). A RoutedItem (the device-routed dispatch) counts its T*k slots as expert rows, though
only the slots of this rank's experts are real work.
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, ClassVar, Iterator, Optional

import numpy as np
import torch


@dataclass(slots=True)
class AttnItem:
    """A segment of one request entering attention of a layer: rows of consecutive positions.

    A prefill chunk is one segment; a decode token is a 1-row segment. At layer 0 the rows are
    `tokens` (embedded inside the batch); deeper layers carry the hidden rows: rows
    `hrow .. hrow+n-1` of `h` (a block shared by the segments one merge completed, so forwarding
    a segment costs no tensor op; batch assembly slices contiguous runs of a block once).
    """

    rid: int
    pos0: int
    n: int
    tokens: Optional[list[int]]
    h: Optional[torch.Tensor]
    t_enq: float
    hrow: int = 0
    segments: ClassVar[int] = 1  # segments this item stands for (queueing-delay metrics)


@dataclass(slots=True)
class AttnBlock:
    """n one-row segments entering attention of a layer together: request rids[i] at position pos[i],
    its token tokens[i] (layer 0: a list, or int64 ids on the device that the host has not read yet, Engine.step_ahead)
    or hidden row h[hrow + i] (deeper layers). What a merge completes or a
    sample batch produces in decode, as one queue item: per token per layer the engine then does no
    object creation, push, take or eligibility call of its own (benchmarks/NOTES.md §19 item 9).
    `ready`: every row was seen eligible (a row stays eligible until it runs: only it moves its
    request's K/V position at this layer), so the check runs once per block, not at every decision."""

    rids: list[int]
    pos: list[int]
    tokens: Optional[list[int] | torch.Tensor]
    h: Optional[torch.Tensor]
    t_enq: float
    n: int
    hrow: int = 0
    ready: bool = False

    @property
    def segments(self) -> int:
        return self.n

    def split(self, m: int) -> tuple["AttnBlock", "AttnBlock"]:
        """(first m rows, the rest): the batch cap cut this block (between rows: each is its own segment)."""
        t = self.tokens
        return (AttnBlock(self.rids[:m], self.pos[:m], None if t is None else t[:m], self.h, self.t_enq, m,
                          self.hrow, self.ready),
                AttnBlock(self.rids[m:], self.pos[m:], None if t is None else t[m:], self.h, self.t_enq,
                          self.n - m, self.hrow + m, self.ready))


@dataclass(slots=True)
class ExpertItem:
    """A block of routed rows for one expert stage: the rows one message (or the local part of one
    attention batch's dispatch) brought, in the order the home sent them.

    `tag[i]` is opaque to the expert side: the home's merge address of row i (runtime/merge.py),
    echoed back with the expert output. `expert[i]` is the expert of row i.
    """

    home: int
    layer: int
    x: torch.Tensor  # [n, H]
    tag: np.ndarray  # int64 [n]
    expert: np.ndarray  # int64 [n]
    t_enq: float
    n: int

    @property
    def out_rows(self) -> int:
        """Rows of expert output it returns to its home (one per routed row)."""
        return self.n

    def split(self, m: int) -> tuple["ExpertItem", "ExpertItem"]:
        """(first m rows, the rest): the batch cap cut this block."""
        return (ExpertItem(self.home, self.layer, self.x[:m], self.tag[:m], self.expert[:m], self.t_enq, m),
                ExpertItem(self.home, self.layer, self.x[m:], self.tag[m:], self.expert[m:], self.t_enq, self.n - m))


@dataclass(slots=True)
class RoutedItem:
    """A home's whole attention batch for one expert stage, routed on the device (DATAFLOW_DISPATCH=device,
    runtime/routed_rows.py): its payload, T token rows with their top-k expert ids and weights packed at the end of
    each row, which the owner maps to its own experts on the device. It counts n = T*k slots in the queue (every
    slot, this rank's or not); the owner returns one row per token, the weighted sum of its own slots' outputs,
    token t's at tag tag0 + t (`tag`, `out_rows`)."""

    home: int
    layer: int
    payload: torch.Tensor  # [T, H + c]: routed_rows.pack's layout
    tag0: int
    t_enq: float
    n: int  # T * k

    @property
    def out_rows(self) -> int:
        return self.payload.shape[0]

    @property
    def tag(self) -> np.ndarray:
        return np.arange(self.tag0, self.tag0 + self.out_rows, dtype=np.int64)

    def split(self, m: int) -> tuple["RoutedItem", "RoutedItem"]:
        """(first tokens up to m slots, the rest): cut between tokens (a token's k slots stay together), at
        least one token."""
        k = self.n // self.payload.shape[0]
        t = max(m // k, 1)
        return (RoutedItem(self.home, self.layer, self.payload[:t], self.tag0, self.t_enq, t * k),
                RoutedItem(self.home, self.layer, self.payload[t:], self.tag0 + t, self.t_enq, self.n - t * k))


@dataclass(slots=True)
class SampleItem:
    """Final hidden rows of requests waiting for logits + sampling: one row per request (its last
    position), a block per merge that completed them."""

    rids: list[int]
    h: torch.Tensor  # [n, H]
    t_enq: float
    n: int

    def split(self, m: int) -> tuple["SampleItem", "SampleItem"]:
        return (SampleItem(self.rids[:m], self.h[:m], self.t_enq, m),
                SampleItem(self.rids[m:], self.h[m:], self.t_enq, self.n - m))


class MuQueue:
    """FIFO of items for one stage. `token_weight` is 1 for attn/sample rows and 1/k for expert rows."""

    __slots__ = ("stage_id", "kind", "layer", "cap", "token_weight", "_items", "rows", "_pushes")

    def __init__(self, stage_id: int, kind: str, layer: int, cap: int, token_weight: float = 1.0,
                 pushes: Optional[list[int]] = None) -> None:
        """`pushes`: a one-element counter that every push increments (shared by a rank's queues: the engine's
        cue that a stage may have become runnable)."""
        self.stage_id = stage_id
        self.kind = kind
        self.layer = layer
        self.cap = cap
        self.token_weight = token_weight
        self._items: deque = deque()
        self.rows = 0  # rows queued (0 exactly when empty: only items with rows are pushed); push and take keep it
        self._pushes = pushes

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator:
        return iter(self._items)

    @property
    def depth(self) -> float:
        """Queue depth in tokens (Q(s) of the scheduler)."""
        return self.rows * self.token_weight

    def oldest_enqueue(self) -> Optional[float]:
        # FIFO: the front item is the one that has waited longest.
        return self._items[0].t_enq if self._items else None

    def push(self, item) -> None:
        if item.n:
            self._items.append(item)
            self.rows += item.n
            if self._pushes is not None:
                self._pushes[0] += 1

    def take(self, eligible: Optional[Callable[[object], bool]] = None) -> list:
        """Pop items in FIFO order up to `cap` rows, skipping ineligible ones (they keep their place).

        Stops at the first eligible item that would overflow the cap rather than searching for a
        smaller one further back: filling the batch is not worth breaking FIFO fairness. A block
        (expert/sample item) that would overflow is split: its first rows fill the batch, the rest
        stays at the front of the queue.
        """
        out, kept, rows = [], [], 0
        items = self._items
        cap = self.cap
        while items:
            item = items[0]
            n = item.n
            if eligible is not None and not eligible(item):
                kept.append(items.popleft())
                continue
            if rows + n > cap:
                if not isinstance(item, AttnItem) and rows < cap:
                    head, rest = item.split(cap - rows)
                    out.append(head)
                    rows += head.n
                    if rest.n:
                        items[0] = rest
                    else:  # a RoutedItem of one token, whose k slots cannot be cut, went whole
                        items.popleft()
                    break
                if out:
                    break  # (a segment larger than the cap alone still runs, so nothing can stick forever)
            out.append(items.popleft())
            rows += n
        # Put skipped items back in front, in their original order.
        items.extendleft(reversed(kept))
        self.rows -= rows
        return out

    def has_eligible(self, eligible: Optional[Callable[[object], bool]] = None) -> bool:
        if not self._items:
            return False
        if eligible is None:
            return True
        return any(eligible(item) for item in self._items)
