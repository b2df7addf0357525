"""Top-k merge on the home rank: hold the k partial expert outputs of each token until all arrived.

One `MergeGroup` per MoE attention batch in flight (its kept rows at one layer), holding a receive
buffer y [R*k, H] addressed by flat index f = row * k + slot, the residual, shared-expert output
and routing weights of those rows, and per segment the number of parts still missing. A segment is
one request's rows of that batch: a prefill chunk leaves attention as one segment and must re-enter
the next layer's attention as one segment (its rows attend to each other), so a segment completes
when all its n*k parts are in, independently of the other segments of the group.

Routed rows carry a *tag* to the expert owner and back: tag = gid << TAG_SHIFT | f. Arriving expert
output rows are scattered into the buffer by tag (one index_copy per message and group), whatever
order they arrive in; a completed segment is handed back as [n, k, H] in slot order j = 0..k-1, the
order `moe_combine` sums them in, so the result is bit-identical to the reference decoder no matter
how the network reordered the messages.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from runtime.device_index import to_device

TAG_SHIFT = 32
TAG_MASK = (1 << TAG_SHIFT) - 1


@dataclass(slots=True)
class MergeGroup:
    gid: int
    layer: int
    k: int
    rids: list[int]  # per segment
    pos0: list[int]  # per segment: pos0 of the attention item (the segment's key)
    first: np.ndarray  # int64 [S]: position of the segment's first kept row
    start: np.ndarray  # int64 [S]: first row of the segment in the group
    n: np.ndarray  # int64 [S]: kept rows of the segment
    seg_of_row: np.ndarray  # int64 [R]
    h_res: torch.Tensor  # [R, H] residual stream after attention
    shared: Optional[torch.Tensor]  # [R, H] shared-expert output, None when the model has none
    weights: torch.Tensor  # [R, k] routing weights, slot order
    y: Optional[torch.Tensor]  # [R*k, H] expert outputs by f = row*k + slot (allocated at first arrival)
    filled: np.ndarray  # bool [R*k]
    nfilled: int
    missing: np.ndarray  # int64 [S]: parts still missing per segment
    open_segments: int
    t_open: float

    @property
    def rows(self) -> int:
        return len(self.seg_of_row)

    def rows_of(self, segs: np.ndarray) -> np.ndarray:
        """Group row indices of segments `segs` (ascending segment order, rows in order)."""
        n = self.n[segs]
        starts = self.start[segs]
        offs = np.cumsum(n) - n
        return np.repeat(starts - offs, n) + np.arange(int(n.sum()), dtype=np.int64)


class MergeTable:
    def __init__(self, top_k: int) -> None:
        self.top_k = top_k
        self._groups: dict[int, MergeGroup] = {}
        self._next_gid = 0
        self._open_segments = 0
        self._open_rows: dict[int, int] = {}  # layer -> rows of segments still waiting (wave hold)

    def __len__(self) -> int:
        """Segments waiting for expert outputs."""
        return self._open_segments

    def open_rows(self, layer: int) -> int:
        """Rows of layer `layer` still waiting for expert outputs: tokens that enter the next stage
        as soon as their parts arrive (the scheduler's `incoming` of that stage)."""
        return self._open_rows.get(layer, 0)

    @property
    def _open(self) -> list[tuple[int, int, int]]:
        """(rid, pos0, layer) of every waiting segment (for stall reports)."""
        return [(g.rids[s], g.pos0[s], g.layer) for g in self._groups.values()
                for s in np.flatnonzero(g.missing > 0).tolist()]

    def open(self, layer: int, rids: list[int], pos0: list[int], first: np.ndarray, n: np.ndarray,
             h_res: torch.Tensor, shared: Optional[torch.Tensor], weights: torch.Tensor, now: float) -> MergeGroup:
        """A group for the kept rows of one attention batch: segment s owns rows
        start[s] .. start[s]+n[s]-1 (segments back to back, in order). Tags: `group.gid << TAG_SHIFT | f`."""
        k = self.top_k
        S = len(rids)
        R = int(n.sum())
        if R * k > TAG_MASK:
            raise ValueError(f"merge group of {R} rows x {k} slots does not fit a tag")
        start = np.cumsum(n) - n
        g = MergeGroup(self._next_gid, layer, k, rids, pos0, first, start, n,
                       np.repeat(np.arange(S, dtype=np.int64), n), h_res, shared, weights, None,
                       np.zeros(R * k, dtype=bool), 0, n * k, S, now)
        self._groups[g.gid] = g
        self._next_gid += 1
        self._open_segments += S
        self._open_rows[layer] = self._open_rows.get(layer, 0) + R
        return g

    def add(self, tags: np.ndarray, y: torch.Tensor) -> list[tuple[MergeGroup, np.ndarray]]:
        """Store expert output rows y[i] at tags[i]. Returns (group, completed segments ascending)
        for every group that this message completed segments of, in ascending group order;
        a group whose segments are all complete leaves the table."""
        tags = np.asarray(tags, dtype=np.int64)
        if len(tags) == 0:
            return []
        gids = tags >> TAG_SHIFT
        g0 = int(gids[0])
        if g0 == int(gids[-1]) and (gids == g0).all():
            parts = [(g0, None)]
        else:
            order = np.argsort(gids, kind="stable")
            uniq, first = np.unique(gids[order], return_index=True)
            bounds = list(first[1:]) + [len(order)]
            parts = [(int(u), order[a:b]) for u, a, b in zip(uniq, first, bounds)]
        out = []
        for gid, idx in parts:
            g = self._groups.get(gid)
            f = (tags if idx is None else tags[idx]) & TAG_MASK
            if g is None:
                raise KeyError(f"expert output for unknown merge group {gid} (rows {f[:4].tolist()}...)")
            k = g.k
            if len(f) and int(f.max()) >= len(g.filled):
                raise KeyError(f"expert output row {int(f.max()) // k} beyond merge group {gid} of {g.rows} rows")
            seen = g.filled[f]
            g.filled[f] = True
            nfilled = int(np.count_nonzero(g.filled))
            if seen.any() or nfilled - g.nfilled != len(f):
                if seen.any():
                    dup = int(f[seen][0])
                else:  # the same (row, slot) twice within this message
                    vals, counts = np.unique(f, return_counts=True)
                    dup = int(vals[counts > 1][0])
                r, s = dup // k, dup % k
                seg = int(g.seg_of_row[r])
                raise ValueError(f"duplicate expert output for {(g.rids[seg], g.pos0[seg], g.layer)} "
                                 f"row {r - int(g.start[seg])} slot {s}")
            g.nfilled = nfilled
            ys = y if idx is None else y.index_select(0, to_device(idx, y.device))
            if g.y is None:
                g.y = torch.empty((g.rows * k,) + tuple(y.shape[1:]), dtype=y.dtype, device=g.h_res.device)
            g.y.index_copy_(0, to_device(f, g.y.device), ys.to(g.y.device, g.y.dtype))
            dec = np.bincount(g.seg_of_row[f // k], minlength=len(g.missing))
            g.missing -= dec
            done = np.flatnonzero((g.missing == 0) & (dec > 0))
            if len(done):
                g.open_segments -= len(done)
                self._open_segments -= len(done)
                self._open_rows[g.layer] -= int(g.n[done].sum())
                if g.open_segments == 0:
                    del self._groups[gid]
                out.append((g, done))
        return out

    @staticmethod
    def stacked(g: MergeGroup, rows: Optional[np.ndarray] = None) -> torch.Tensor:
        """Expert rows of group rows `rows` (all when None) as [n, k, H] in slot order, for `moe_combine`."""
        y = g.y.view((g.rows, g.k) + tuple(g.y.shape[1:]))
        return y if rows is None else y.index_select(0, to_device(rows, y.device))
