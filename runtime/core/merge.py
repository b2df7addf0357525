"""Top-k merge on the home rank: hold the k partial expert outputs of each token until all arrived.

One `MergeGroup` per MoE attention batch in flight (its kept rows at one layer), holding a receive
buffer y [R*k, H], the residual, shared-expert output and routing weights of those rows, and per
segment the number of parts still missing. A segment is one request's rows of that batch: a prefill
chunk leaves attention as one segment and must re-enter the next layer's attention as one segment
(its rows attend to each other), so a segment completes when all its n*k parts are in,
independently of the other segments of the group.

Addressing by dispatch position. The home sends the (row, slot) pairs of a batch sorted by
destination rank: position p of that order holds flat index f = order[p] = row * k + slot, and the
rows for destination d are the positions off_d .. off_d + c_d - 1. Routed rows carry a *tag* to the
expert owner and back: tag = gid << TAG_SHIFT | p, and the receive buffer is indexed by p. So the
rows of one message land in one contiguous range of y: a slice copy instead of an index upload and
a scatter, or, through the transport's `recv_into` hook (the two-phase exchange knows the message's
tags before its tensor), no copy at all: the tensor is received straight into that range. The
combine then reads y through row_index[t, j] = position of (t, j) (the inverse of `order`; the
topk_merge kernel gathers through an index anyway), in slot order j = 0..k-1, the order
`moe_combine` sums them in, so the result is bit-identical to the reference decoder no matter how
the network reordered the messages.

Holder groups (`holders` > 0, the device-routed dispatch of runtime/core/routed_rows.py): each of the layer's
expert holders returns one row per token, the weighted sum of its own slots' outputs, so a token's "slots" are the
holders (k = holders, weights 1) and the positions are holder-major, p = j*R + row for holder j: each holder's
rows land in one contiguous range (in place, like any message). The combine adds the holders' partial sums in
holder order (1.0 * v is exact in fp32): the same sum as the host-routed combine's in another order of additions,
so not bit-identical to it (bit-identical run to run, and on the CPU and the GPU alike).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from runtime.executors.cuda_stream import current_stream
from runtime.executors.device_index import to_device, to_device_marked
from runtime.core.dispatch_plan import DispatchPlan, pack_weights, unpack_group_inputs
from runtime.core.expert_wire import decode_tags, encode_tags

TAG_SHIFT = 32
TAG_MASK = (1 << TAG_SHIFT) - 1


@dataclass(slots=True)
class MergeGroup:
    gid: int
    layer: int
    k: int
    rids: list[int]  # per segment
    pos0: list[int]  # per segment: pos0 of the attention item (the segment's key)
    first: list[int]  # per segment: position of its first kept row (a list or an int64 array, as the caller made it)
    start: np.ndarray  # int64 [S]: first row of the segment in the group
    n: np.ndarray  # int64 [S]: kept rows of the segment
    seg_of_row: np.ndarray  # int64 [R]
    h_res: torch.Tensor  # [R, H] residual stream after attention
    shared: Optional[torch.Tensor]  # [R, H] shared-expert output, None when the model has none
    weights: torch.Tensor  # [R, k] fp32 routing weights, slot order, on h_res's device (holder groups: ones)
    y: torch.Tensor  # [R*k, H] expert outputs by dispatch position p
    y_host: Optional[np.ndarray]  # y as numpy (same memory) where it is in host memory in a dtype numpy has, else None
    ready: object  # CUDA event recorded after y's allocation (a receive on another stream waits on it); None on CPU
    own_ready: object  # `ready` when the table made it (it goes back with y when the group leaves), else None
    order: Optional[np.ndarray]  # int64 [R*k]: f = row*k + slot at position p; None = identity
    inv: Optional[np.ndarray]  # int64 [R, k]: position of (row, slot); None = identity
    gather: Optional[torch.Tensor]  # order // k on the device: the row of each dispatch position (dispatch gather)
    row_index: Optional[torch.Tensor]  # inv on the device (the whole group's combine); None = identity
    seg_of_pos: np.ndarray  # int64 [R*k]: segment of the row at position p
    filled: np.ndarray  # bool [R*k], by position
    nfilled: int
    missing: np.ndarray  # int64 [S]: parts still missing per segment
    open_segments: int

    @property
    def rows(self) -> int:
        return len(self.seg_of_row)

    @property
    def multi(self) -> bool:
        """Some segment has more than one row (a prompt chunk)."""
        return len(self.seg_of_row) > len(self.rids)

    def rows_of(self, segs: np.ndarray) -> np.ndarray:
        """Group row indices of segments `segs` (ascending segment order, rows in order)."""
        n = self.n[segs]
        starts = self.start[segs]
        offs = np.cumsum(n) - n
        return np.repeat(starts - offs, n) + np.arange(int(n.sum()), dtype=np.int64)


class MergeTable:
    """`whole_groups`: hand a group's segments back only once every segment of it is complete (one
    combine per attention batch) instead of each segment as soon as its own parts are in. The engine
    turns it on under the wave hold, where a segment completed early would only wait at the next
    attention stage for the rest of its wave anyway."""

    def __init__(self, top_k: int, whole_groups: bool = False) -> None:
        self.top_k, self.whole_groups = top_k, whole_groups
        self._groups: dict[int, MergeGroup] = {}
        self._next_gid = self._open_segments = 0
        self._open_rows: dict[int, int] = {}  # layer -> rows of segments still waiting (wave hold)
        self._holder_layouts: dict[tuple, tuple] = {}  # (R, holders, device) -> holder groups' fixed inputs
        # y buffers (with the events that marked them ready) of groups that left the table, by (shape, dtype, device),
        # most recently used key last: a decode wave's groups have one shape at every layer of a step, so each open
        # reuses the buffer and event of the group before it instead of allocating (the caching allocator's Python
        # and C++ path) and creating an event (~100 us per open on the H200 host with both)
        self._spare: dict[tuple, list[tuple[torch.Tensor, object]]] = {}
        self._decode: dict[int, tuple[np.ndarray, np.ndarray]] = {}  # S -> (ones, 0 .. S-1) (_decode_arrays)

    def __len__(self) -> int:
        """Segments waiting for expert outputs."""
        return self._open_segments

    @property
    def next_gid(self) -> int:
        """The gid the next open() gives its group (a home may tag a dispatch before it opens the group: a message
        that comes back before the open finds no landing and is stored by add(), after it)."""
        return self._next_gid

    def open_rows(self, layer: int) -> int:
        """Rows of layer `layer` still waiting for expert outputs: tokens that enter the next stage
        as soon as their parts arrive (the scheduler's `incoming` of that stage)."""
        return self._open_rows.get(layer, 0)

    @property
    def _open(self) -> list[tuple[int, int, int]]:
        """(rid, pos0, layer) of every waiting segment (for stall reports)."""
        return [(g.rids[s], g.pos0[s], g.layer) for g in self._groups.values()
                for s in np.flatnonzero(g.missing > 0).tolist()]

    def open(self, layer: int, rids: list[int], pos0: list[int], first, n: Optional[np.ndarray],
             h_res: torch.Tensor, shared: Optional[torch.Tensor], weights, plan: Optional[DispatchPlan] = None,
             holders: int = 0) -> MergeGroup:
        """A group for the kept rows of one attention batch: segment s owns rows
        start[s] .. start[s]+n[s]-1 (segments back to back, in order; n None: one row each, a decode wave's group,
        whose per-segment arrays are then shared read-only ones; `first`: each segment's first kept position, a list or
        an int64 array). `plan`: the batch's dispatch plan
        (runtime/core/dispatch_plan.py: its order, f at position p, and the packed device inputs; None = identity
        order, weights packed here). `weights` [R, k]: numpy or a tensor. Tags: `group.gid << TAG_SHIFT | p`.
        `holders` > 0: the device-routed dispatch (a holder group, see the module doc): `weights` is ignored,
        holder j's row r is at position j*R + r."""
        k = holders or self.top_k
        S = len(rids)
        start = None
        if n is None:
            n, start = self._decode_arrays(S)
            seg_of_row, R = start, S
        else:
            R = int(n.sum())
        if R * k > TAG_MASK:
            raise ValueError(f"merge group of {R} rows x {k} slots does not fit a tag")
        order = inv = row_of_pos = None
        if plan is not None:
            order, inv, row_of_pos = plan.order, plan.inv, plan.row_of_pos
        elif holders:
            order, inv, row_of_pos, row_index, weights = self._holder_layout(R, k, h_res.device)
        if R == S:  # decode: every segment one row (fewer numpy calls)
            if start is None:
                start = seg_of_row = np.arange(S, dtype=np.int64)
            seg_of_pos = row_of_pos if order is not None else np.repeat(seg_of_row, k)
        else:
            start = np.cumsum(n) - n
            seg_of_row = np.repeat(np.arange(S, dtype=np.int64), n)
            seg_of_pos = np.repeat(seg_of_row, k)
            if order is not None:
                seg_of_pos = seg_of_pos[order]
        y, own_ready = self._take_y((R * k,) + tuple(h_res.shape[1:]), h_res.dtype, h_res.device)
        # One upload for what the device needs of this group: the dispatch gather (order // k), the combine's
        # row_index (inv) and the routing weights, packed as int64 (the fp32 weights two per element). Its
        # event is recorded after y's allocation, so it is also y's `ready` (three copies and two events
        # per attention batch became one of each). A holder group's are fixed (above).
        gather = ready = None
        on_host = not holders and (type(weights) is np.ndarray or weights.device.type == "cpu")  # numpy: route_arrays
        if h_res.is_cuda and on_host:  # the routing came to the host
            packed = plan.packed if plan is not None else pack_weights(weights)
            dev, ready = to_device_marked(packed, h_res.device)
            gather, row_index, weights = unpack_group_inputs(dev, R, k, order is not None)
        elif not holders:  # weights already where the rows are (a host-side executor: these "uploads" are views)
            if type(weights) is np.ndarray:
                weights = torch.from_numpy(weights)
            row_index = None
            if order is not None:
                gather, row_index = to_device(row_of_pos, h_res.device), to_device(inv, h_res.device)
        if ready is None and y.is_cuda:  # what a receive into y on another stream waits for
            ready = own_ready = own_ready or torch.cuda.Event()
            # (re-recording a reused event is safe: every receive that waited on it belonged to a group that is
            # complete, so each already enqueued its wait on the record it needed)
            ready.record(current_stream(y.device))
        else:
            own_ready = None
        g = MergeGroup(self._next_gid, layer, k, rids, pos0, first, start, n, seg_of_row, h_res, shared, weights, y,
                       y.numpy() if y.is_cpu and y.dtype in _NUMPY_DTYPES else None, ready, own_ready, order, inv,
                       gather, row_index, seg_of_pos, np.zeros(R * k, dtype=bool), 0, n * k, S)
        self._groups[g.gid] = g
        self._next_gid += 1
        self._open_segments += S
        self._open_rows[layer] = self._open_rows.get(layer, 0) + R
        return g

    def _decode_arrays(self, S: int) -> tuple[np.ndarray, np.ndarray]:
        """(ones, 0 .. S-1) as int64: `n` and `start` (= `seg_of_row`) of a group of S one-row segments, which reads
        them and never writes them (read-only arrays: a write raises); one pair per size, kept while sizes stay few."""
        got = self._decode.get(S)
        if got is None:
            got = (np.ones(S, dtype=np.int64), np.arange(S, dtype=np.int64))
            for a in got:
                a.flags.writeable = False
            if len(self._decode) < 64:
                self._decode[S] = got
        return got

    def _take_y(self, shape: tuple, dtype: torch.dtype, device) -> tuple[torch.Tensor, object]:
        """A group's y buffer: a spare one of that shape with its event, else a new one (and no event)."""
        key = (shape, dtype, device)
        if spare := self._spare.pop(key, None):
            self._spare[key] = spare  # (re-inserted: the most recently used key is last)
            return spare.pop()
        return torch.empty(shape, dtype=dtype, device=device), None

    def _give_back(self, g: MergeGroup) -> None:
        """Keep a group's y once it left the table, for a later open of the same shape. Safe without a host wait:
        the only later reads of y (the group's combine, enqueued right after the merge that completed it) are on
        the stream the next open() records its `ready` on, and every write into a reused y (a local part's copy on
        that stream, or a receive on another stream that first waits on `ready`) comes after that record."""
        key = (tuple(g.y.shape), g.y.dtype, g.y.device)
        spare = self._spare.setdefault(key, [])
        if len(spare) < _SPARE_PER_SHAPE:
            spare.append((g.y, g.own_ready))
        while len(self._spare) > _SPARE_SHAPES:  # the wave's size moved on: drop the least recently used shape
            del self._spare[next(iter(self._spare))]

    def _holder_layout(self, R: int, holders: int, device) -> tuple:
        """A holder group's fixed inputs for R rows (made once per (R, holders, device)): order (f = row*holders + j
        at position p = j*R + row), inv [R, holders], the row of each position, and on the device the combine's
        row_index (inv) and weights (ones)."""
        key = (R, holders, device)
        got = self._holder_layouts.get(key)
        if got is None:
            p = np.arange(R * holders, dtype=np.int64)
            row_of_pos = p % R
            order = row_of_pos * holders + p // R
            inv = np.arange(R * holders, dtype=np.int64).reshape(holders, R).T.copy()
            # (through the pinned ring: `from_numpy(inv).to(device)` copied from pageable memory and synchronized the
            # stream, draining the GPU's queue once per decode step, whenever a wave's size was new)
            got = (order, inv, row_of_pos, to_device(inv, device),
                   torch.ones((R, holders), dtype=torch.float32, device=device))
            if len(self._holder_layouts) < 4096:
                self._holder_layouts[key] = got
        return got

    def landing(self, tags, shape: tuple, dtype: torch.dtype) -> Optional[tuple[torch.Tensor, object]]:
        """Where an arriving message of expert rows `tags` can be received in place: (the slice of its
        group's buffer, the event a receive on another stream must wait for), or None (receive it
        anywhere; `add` copies). In place needs one contiguous run of positions of one group and the
        buffer's row shape and dtype; `add(..., landed=True)` then only does the bookkeeping. `tags`: an
        array or the wire's run form (first, count) (runtime/core/expert_wire.py)."""
        run = tags if type(tags) is tuple else encode_tags(tags)
        if type(run) is not tuple:  # not one run of positions
            return None
        t0, n = run
        if n == 0 or shape[0] != n:
            return None
        g = self._groups.get(t0 >> TAG_SHIFT)
        if g is None or tuple(shape[1:]) != tuple(g.y.shape[1:]) or dtype != g.y.dtype:
            return None
        rows = self.rows_at(t0, n)
        return None if rows is None else (rows, g.ready)

    def rows_at(self, first: int, n: int) -> Optional[torch.Tensor]:
        """The buffer rows of tags first .. first + n - 1 (one group's positions): where an expert batch that runs on
        the group's own rank, on the stream the group was opened on, can write its output (`add(..., landed=True)`
        then only does the bookkeeping). None when the group is gone or the run leaves it."""
        g = self._groups.get(first >> TAG_SHIFT)
        p0 = first & TAG_MASK
        if g is None or n <= 0 or p0 + n > len(g.filled):
            return None
        return g.y[p0:p0 + n]

    def add(self, tags: np.ndarray, y: torch.Tensor, landed: bool = False) -> list[tuple[MergeGroup, np.ndarray]]:
        """Store expert output rows y[i] at tags[i] (`landed`: they were received in place, see
        `landing`: only the bookkeeping is left). Returns (group, completed segments ascending) for
        every group that this message completed segments of, in ascending group order; a group
        whose segments are all complete leaves the table. `tags`: an array, or the wire's run form
        (first, count) (runtime/core/expert_wire.py), which is bookkept with slices instead of index arrays."""
        if type(tags) is tuple:
            if (done := self._add_run(tags[0], tags[1], y, landed)) is not None:
                return done
            tags = decode_tags(tags)  # an error case: named below
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
            p = (tags if idx is None else tags[idx]) & TAG_MASK
            if g is None:
                raise KeyError(f"expert output for unknown merge group {gid} (positions {p[:4].tolist()}...)")
            if len(p) and int(p.max()) >= len(g.filled):
                raise KeyError(f"expert output position {int(p.max())} beyond merge group {gid} of {g.rows} rows")
            seen = g.filled[p]
            g.filled[p] = True
            nfilled = int(np.count_nonzero(g.filled))
            if seen.any() or nfilled - g.nfilled != len(p):
                if seen.any():
                    dup = int(p[seen][0])
                else:  # the same (row, slot) twice within this message
                    vals, counts = np.unique(p, return_counts=True)
                    dup = int(vals[counts > 1][0])
                f = dup if g.order is None else int(g.order[dup])
                r, s = f // g.k, f % g.k
                seg = int(g.seg_of_row[r])
                raise ValueError(f"duplicate expert output for {(g.rids[seg], g.pos0[seg], g.layer)} "
                                 f"row {r - int(g.start[seg])} slot {s}")
            g.nfilled = nfilled
            if not landed:
                _store(g.y, p, y, idx)
            done = self._completed(g, p)
            if len(done):
                out.append((g, done))
        return out

    def _add_run(self, first: int, n: int, y: torch.Tensor, landed: bool) -> Optional[list]:
        """add() of positions p0 .. p0 + n - 1 of one group (the run form); None when the message is not
        simply that (unknown group, out of range, a duplicate): the general path then names the error."""
        if n == 0:
            return []
        gid, p0 = first >> TAG_SHIFT, first & TAG_MASK
        g = self._groups.get(gid)
        if g is None or p0 + n > len(g.filled):
            return None
        f = g.filled
        if f[p0] if n == 1 else f[p0:p0 + n].any():  # (a one-row part: a scalar read and write; a slice, any() and
            return None                             # a slice write cost ~2 us)
        f[p0 if n == 1 else slice(p0, p0 + n)] = True
        g.nfilled += n
        if not landed:  # (through numpy where it can: ~0.9 us a part, torch's slice and copy_ ~4 us)
            if g.y_host is not None and y.dtype is g.y.dtype and y.is_cpu and not y.requires_grad:
                g.y_host[p0:p0 + n] = y.numpy()
            else:
                g.y[p0:p0 + n].copy_(y)
        done = self._completed(g, slice(p0, p0 + n))
        return [(g, done)] if len(done) else []

    def _completed(self, g: MergeGroup, p) -> np.ndarray:
        """Account for positions `p` (an index array or a slice) just filled in group g: the segments this
        completed (ascending); a group with no open segment left leaves the table."""
        if self.whole_groups:  # complete only with the group's last part: all segments at once
            if g.nfilled != len(g.filled):
                return _NONE
            g.missing[:] = 0
            done, rows = self._decode_arrays(len(g.rids))[1], g.rows  # every segment (0 .. S-1, shared, read-only)
        elif len(g.missing) == 1:  # one segment (a one-row decode batch, one prompt chunk): no per-position count
            m = g.missing[0] = int(g.missing[0]) - (p.stop - p.start if type(p) is slice else len(p))
            if m:
                return _NONE
            done, rows = self._decode_arrays(1)[1], int(g.n[0])
        else:
            dec = np.bincount(g.seg_of_pos[p], minlength=len(g.missing))
            g.missing -= dec
            done = np.flatnonzero((g.missing == 0) & (dec > 0))
            if not len(done):
                return done
            rows = int(g.n[done].sum())
        g.open_segments -= len(done)
        self._open_segments -= len(done)
        self._open_rows[g.layer] -= rows
        if g.open_segments == 0:
            del self._groups[g.gid]
            self._give_back(g)
        return done

    @staticmethod
    def combine_inputs(g: MergeGroup, rows: Optional[np.ndarray] = None) -> tuple[torch.Tensor, Optional[torch.Tensor]]:
        """(expert rows, row_index) for the executor's combine of group rows `rows` (all when None):
        y[row_index[t, j]] is slot j of row t. Identity order: y as [R, k, H] and no index."""
        if g.inv is None:
            y = g.y.view((g.rows, g.k) + tuple(g.y.shape[1:]))
            return (y, None) if rows is None else (y.index_select(0, to_device(rows, y.device)), None)
        return g.y, g.row_index if rows is None else to_device(g.inv[rows], g.y.device)


_NONE = np.zeros(0, dtype=np.int64)
_NUMPY_DTYPES = (torch.float16, torch.float32, torch.float64)  # (numpy has no bfloat16 or fp8)
_SPARE_SHAPES = 4  # y shapes kept (a home's waves: the decode wave's, a capped wave's remainder, prompts joining)
_SPARE_PER_SHAPE = 4  # buffers per shape (a home's groups in flight at one time: one or two per wave)


def _runs(p: np.ndarray) -> np.ndarray:
    """Starts of the maximal runs of consecutive values in p (p[i+1] == p[i] + 1 inside a run)."""
    return np.concatenate(([0], np.flatnonzero(np.diff(p) != 1) + 1))


def _store(buf: torch.Tensor, p: np.ndarray, y: torch.Tensor, idx: Optional[np.ndarray]) -> None:
    """buf[p[i]] = y[idx[i]] (idx None: y[i]). A message's rows of one group are a few runs of
    consecutive positions (one per queue item the owner batched), usually read from consecutive
    message rows too: those are slice copies; anything else one index upload and scatter."""
    starts = _runs(p)
    n = len(p)
    if len(starts) <= 4:
        ends = list(starts[1:]) + [n]
        for a, b in zip(starts.tolist(), ends):
            src = int(idx[a]) if idx is not None else a
            if idx is not None and int(idx[b - 1]) - src != b - 1 - a:
                break  # this run's message rows are not consecutive: scatter the whole part
            buf[int(p[a]):int(p[a]) + b - a].copy_(y[src:src + b - a])
        else:
            return
    ys = y if idx is None else y.index_select(0, to_device(idx, y.device))
    buf.index_copy_(0, to_device(p, buf.device), ys.to(buf.device, buf.dtype))
