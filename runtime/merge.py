"""Top-k merge on the home rank: hold the k partial expert outputs of each token until all arrived.

One entry per segment in flight at one MoE layer, keyed by (request, first position, layer): a
prefill chunk leaves attention as one segment and must re-enter the next layer's attention as one
segment (its rows attend to each other), so the whole segment waits until its n*k parts are in.
Parts are stored by (row, slot) whatever order they arrive in; `complete` hands them back stacked in
slot order j = 0..k-1, which is the order `moe_combine` sums them in, so the result is bit-identical
to the reference decoder no matter how the network reordered the messages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch

MergeKey = tuple[int, int, int]  # (rid, pos0, layer)


@dataclass(slots=True)
class MergeEntry:
    rid: int
    pos0: int
    layer: int
    positions: list[int]  # positions of the kept rows (pos0.. for a full segment)
    h_res: torch.Tensor  # [n, H] residual stream after attention
    shared: Optional[torch.Tensor]  # [n, H] shared-expert output, None when the model has none
    weights: torch.Tensor  # [n, k] routing weights, slot order
    parts: list[list[Optional[torch.Tensor]]]  # [n][k] expert output rows
    missing: int
    t_open: float


class MergeTable:
    def __init__(self, top_k: int) -> None:
        self.top_k = top_k
        self._open: dict[MergeKey, MergeEntry] = {}

    def __len__(self) -> int:
        return len(self._open)

    def open(self, rid: int, pos0: int, layer: int, positions: list[int], h_res: torch.Tensor,
             shared: Optional[torch.Tensor], weights: torch.Tensor, now: float) -> MergeEntry:
        key = (rid, pos0, layer)
        if key in self._open:
            raise ValueError(f"merge entry {key} opened twice")
        n = len(positions)
        entry = MergeEntry(rid, pos0, layer, positions, h_res, shared, weights,
                           [[None] * self.top_k for _ in range(n)], n * self.top_k, now)
        self._open[key] = entry
        return entry

    def add(self, rid: int, pos0: int, layer: int, row: int, slot: int, y: torch.Tensor) -> Optional[MergeEntry]:
        """Store one expert output row; returns the entry (removed from the table) once complete."""
        key = (rid, pos0, layer)
        entry = self._open.get(key)
        if entry is None:
            raise KeyError(f"expert output for unknown merge entry {key} (row {row}, slot {slot})")
        if entry.parts[row][slot] is not None:
            raise ValueError(f"duplicate expert output for {key} row {row} slot {slot}")
        entry.parts[row][slot] = y
        entry.missing -= 1
        if entry.missing:
            return None
        del self._open[key]
        return entry

    @staticmethod
    def stacked(entry: MergeEntry) -> torch.Tensor:
        """The expert rows as [n, k, H] in slot order, ready for `moe_combine`."""
        return torch.stack([torch.stack(row) for row in entry.parts])
