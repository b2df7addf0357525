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

import itertools
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
    its token tokens[i] (layer 0: a list, or int64 ids on the device that the host has not read yet: step-ahead,
    runtime/core/sample_stage.py) or hidden row h[hrow + i] (deeper layers). What a merge completes or a
    sample batch produces in decode, as one queue item: per token per layer the engine then does no
    object creation, push, take or eligibility call of its own (per-token Python calls were most of a step's
    host time).
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

    `tag[i]` is opaque to the expert side: the home's merge address of row i (runtime/core/merge.py),
    echoed back with the expert output. `expert[i]` is the expert of row i.
    """

    home: int
    layer: int
    x: torch.Tensor  # [n, H]
    tag: np.ndarray | tuple  # int64 [n], or the run (first, n) as it came (expert_wire's form: no array made and scanned)
    expert: np.ndarray  # int64 [n]
    t_enq: float
    n: int
    decode: bool = False  # its attention batch held decode rows (MuQueue's decode lane)

    @property
    def out_rows(self) -> int:
        """Rows of expert output it returns to its home (one per routed row)."""
        return self.n

    def split(self, m: int) -> tuple["ExpertItem", "ExpertItem"]:
        """(first m rows, the rest): the batch cap cut this block."""
        t = self.tag
        head, rest = ((t[0], m), (t[0] + m, t[1] - m)) if type(t) is tuple else (t[:m], t[m:])
        return (ExpertItem(self.home, self.layer, self.x[:m], head, self.expert[:m], self.t_enq, m, self.decode),
                ExpertItem(self.home, self.layer, self.x[m:], rest, self.expert[m:], self.t_enq, self.n - m, self.decode))


@dataclass(slots=True)
class RoutedItem:
    """A home's whole attention batch for one expert stage, routed on the device (dispatch=device,
    runtime/core/routed_rows.py): its payload, T token rows with their top-k expert ids and weights packed at the end of
    each row, which the owner maps to its own experts on the device. It counts n = T*k slots in the queue (every
    slot, this rank's or not); the owner returns one row per token, the weighted sum of its own slots' outputs,
    token t's at tag tag0 + t (`tag`, `out_rows`)."""

    home: int
    layer: int
    payload: torch.Tensor  # [T, H + c]: routed_rows.pack's layout
    tag0: int
    t_enq: float
    n: int  # T * k
    decode: bool = False  # its attention batch held decode rows (MuQueue's decode lane)

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
        return (RoutedItem(self.home, self.layer, self.payload[:t], self.tag0, self.t_enq, t * k, self.decode),
                RoutedItem(self.home, self.layer, self.payload[t:], self.tag0 + t, self.t_enq, self.n - t * k,
                           self.decode))


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
    """FIFO of items for one stage. `token_weight` is 1 for attn/sample rows and 1/k for expert rows.

    Attention and expert queues have two lanes, each FIFO: items with decode rows (attention: AttnBlocks and one-row
    segments; expert: the rows of an attention batch that held decode rows) and items of prompts alone. A batch takes
    the decode lane first, then fills up from the other: a decode row never waits for the prompt work queued before it
    (a prompt's chunk fills the cap, so FIFO put a batch of it, and its expert rows, ahead of the decode rows per
    prefilling request, at every layer). K/V order is not at stake: a request is in one lane at a time (a prompt's
    one-row last chunk, in the decode lane, waits for its earlier chunks' eligibility), and expert rows have none.
    A sample queue has one lane: every row there is about to give a token."""

    __slots__ = ("stage_id", "kind", "layer", "cap", "token_weight", "_items", "_decode", "rows", "_pushes", "_active")

    def __init__(self, stage_id: int, kind: str, layer: int, cap: int, token_weight: float = 1.0,
                 pushes: Optional[list[int]] = None, active: Optional[set] = None) -> None:
        """`pushes`: a one-element counter that every push increments (shared by a rank's queues: the engine's
        cue that a stage may have become runnable). `active`: a set (shared by a rank's queues) that holds the stage
        ids of the non-empty ones (the engine's views visit only those)."""
        self.stage_id = stage_id
        self.kind = kind
        self.layer = layer
        self.cap = cap
        self.token_weight = token_weight
        self._items: deque = deque()  # (attention and expert queues: the prompts-only lane)
        self._decode: Optional[deque] = deque() if kind in ("attn", "expert") else None
        self.rows = 0  # rows queued (0 exactly when empty: only items with rows are pushed); push and take keep it
        self._pushes = pushes
        self._active = set() if active is None else active

    def _lanes(self) -> tuple:
        return (self._items,) if self._decode is None else (self._decode, self._items)

    def __len__(self) -> int:
        return len(self._items) + (len(self._decode) if self._decode is not None else 0)

    def __iter__(self) -> Iterator:
        return itertools.chain(*self._lanes())

    @property
    def depth(self) -> float:
        """Queue depth in tokens (Q(s) of the scheduler)."""
        return self.rows * self.token_weight

    def oldest_enqueue(self) -> Optional[float]:
        # FIFO lanes: each one's front item is the one of it that has waited longest (read per runnable stage per
        # decision: no list built)
        items, dec = self._items, self._decode
        if not dec:
            return items[0].t_enq if items else None
        return min(dec[0].t_enq, items[0].t_enq) if items else dec[0].t_enq

    def decode_enqueue(self) -> Optional[float]:
        """When the longest-waiting decode row here was queued: the decode lane's front; a sample queue's oldest
        item (every row there is about to give a token)."""
        if self._decode is None:
            return self.oldest_enqueue()
        return self._decode[0].t_enq if self._decode else None

    def push(self, item) -> None:
        if item.n:
            if self._decode is not None and is_decode(item):
                self._decode.append(item)
            else:
                self._items.append(item)
            self.rows += item.n
            self._active.add(self.stage_id)
            if self._pushes is not None:
                self._pushes[0] += 1

    def take(self, eligible: Optional[Callable[[object], bool]] = None) -> list:
        """Pop items in FIFO order up to `cap` rows, skipping ineligible ones (they keep their place); the decode
        lane first, then the prompts' (class docstring).

        Stops at the first eligible item that would overflow the cap rather than searching for a
        smaller one further back: filling the batch is not worth breaking FIFO fairness. A block
        (expert/sample item) that would overflow is split: its first rows fill the batch, the rest
        stays at the front of the queue.
        """
        out: list = []
        rows = 0
        for items in self._lanes():
            if items:  # (an empty lane: nothing to call for)
                rows, full = self._take_lane(items, out, rows, eligible)
                if full:
                    break
        self.rows -= rows
        if not self.rows:
            self._active.discard(self.stage_id)
        return out

    def _take_lane(self, items: deque, out: list, rows: int, eligible) -> tuple[int, bool]:
        # take()'s loop over one lane: appends to `out`, returns the batch's rows and whether the cap stopped it.
        kept = []
        cap = self.cap
        full = False
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
                    full = True
                    break
                if out:
                    full = True
                    break  # (a segment larger than the cap alone still runs, so nothing can stick forever)
            out.append(items.popleft())
            rows += n
        # Put skipped items back in front, in their original order.
        items.extendleft(reversed(kept))
        return rows, full

    def has_eligible(self, eligible: Optional[Callable[[object], bool]] = None) -> bool:
        if eligible is None:
            return bool(self.rows)
        return any(eligible(item) for lane in self._lanes() for item in lane)

    def has_eligible_decode(self, eligible: Optional[Callable[[object], bool]] = None) -> bool:
        """Whether a batch taken now would hold a decode row (the decode lane; a sample queue's any row, as in
        `decode_enqueue`)."""
        lane = self._items if self._decode is None else self._decode
        if not lane:
            return False
        return eligible is None or any(eligible(item) for item in lane)


def is_decode(item) -> bool:
    """Whether a queue item goes in its queue's decode lane: attention decode rows (a block, a one-row segment), expert
    rows of an attention batch that held decode rows."""
    t = type(item)
    if t is AttnItem:
        return item.n == 1
    return t is AttnBlock or item.decode
