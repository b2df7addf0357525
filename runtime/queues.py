"""Mu-queues: one per stage of the chain on every rank, holding the items waiting for that stage.

Items are plain slotted dataclasses (this is the hot loop) carrying the metadata the paper's CPU-side
record carries (request id, position, home rank, LayerID, slot, routing weight) plus the tensor rows.
Depth is counted in *tokens*: attention and sample items count their rows, expert rows count 1/k
each (a token routed to k experts is one token of work for the layer, as the defragmenting
scheduler's Q(s) defines it).
"""
from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

import torch


@dataclass(slots=True)
class AttnItem:
    """A segment of one request entering attention of a layer: rows of consecutive positions.

    A prefill chunk is one segment; a decode token is a 1-row segment. At layer 0 the rows are
    `tokens` (embedded inside the batch); deeper layers carry the hidden rows `h` [n, H].
    """

    rid: int
    pos0: int
    n: int
    tokens: Optional[list[int]]
    h: Optional[torch.Tensor]
    t_enq: float


@dataclass(slots=True)
class ExpertItem:
    """One routed copy of one token: row `row` of segment (rid, pos0) sent to `expert` in slot `slot`."""

    rid: int
    pos0: int
    row: int
    home: int
    layer: int
    slot: int
    expert: int
    weight: float
    x: torch.Tensor  # [H]
    t_enq: float


@dataclass(slots=True)
class SampleItem:
    """The final hidden row of the last position of a request, waiting for logits + sampling."""

    rid: int
    pos: int
    h: torch.Tensor  # [H]
    t_enq: float


class MuQueue:
    """FIFO of items for one stage. `token_weight` is 1 for attn/sample rows and 1/k for expert rows."""

    __slots__ = ("stage_id", "kind", "layer", "cap", "token_weight", "_items", "_rows")

    def __init__(self, stage_id: int, kind: str, layer: int, cap: int, token_weight: float = 1.0) -> None:
        self.stage_id = stage_id
        self.kind = kind
        self.layer = layer
        self.cap = cap
        self.token_weight = token_weight
        self._items: deque = deque()
        self._rows = 0

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator:
        return iter(self._items)

    @property
    def rows(self) -> int:
        return self._rows

    @property
    def depth(self) -> float:
        """Queue depth in tokens (Q(s) of the scheduler)."""
        return self._rows * self.token_weight

    def oldest_enqueue(self) -> Optional[float]:
        # FIFO: the front item is the one that has waited longest.
        return self._items[0].t_enq if self._items else None

    def push(self, item) -> None:
        self._items.append(item)
        self._rows += item.n if isinstance(item, AttnItem) else 1

    def take(self, eligible: Optional[Callable[[object], bool]] = None) -> list:
        """Pop items in FIFO order up to `cap` rows, skipping ineligible ones (they keep their place).

        Stops at the first eligible item that would overflow the cap rather than searching for a
        smaller one further back: filling the batch is not worth breaking FIFO fairness.
        """
        out, kept, rows = [], [], 0
        items = self._items
        while items:
            item = items[0]
            n = item.n if isinstance(item, AttnItem) else 1
            if eligible is not None and not eligible(item):
                kept.append(items.popleft())
                continue
            if rows + n > self.cap and out:
                break  # (an item larger than the cap alone still runs, so nothing can stick forever)
            out.append(items.popleft())
            rows += n
        # Put skipped items back in front, in their original order.
        items.extendleft(reversed(kept))
        self._rows -= rows
        return out

    def has_eligible(self, eligible: Optional[Callable[[object], bool]] = None) -> bool:
        if not self._items:
            return False
        if eligible is None:
            return True
        return any(eligible(item) for item in self._items)
