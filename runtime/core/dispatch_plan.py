"""The dispatch plan of one MoE attention batch: where each of its (row, slot) pairs goes, in one compiled call.

After an attention batch the home rank knows each row's top-k experts (`ids` [R, k]) and weights. The dispatch
needs, derived from them and the layer's expert -> rank table (`owner`):
- `counts[d]`: pairs bound for rank d (one message per destination, destinations in rank order); `dests` and `sizes`:
  the ranks with pairs, ascending, and their counts, as lists (the dispatch loops over them, not over every rank);
- `order[p]`: the flat index f = row * k + slot at dispatch position p, pairs of one destination contiguous and
  in ascending f (a stable sort by destination: runtime/core/merge.py addresses expert outputs by p);
- `inv[row, slot]`: the position p of each pair (the combine's row_index), the inverse of `order`;
- `experts[p]`: the expert id of the pair at position p (the owner's expert queue);
- `packed`: what the merge group's device side needs, one int64 host array uploaded in one copy:
  [order // k (the dispatch gather), inv, the fp32 weights two per element] (without an order: `pack_weights`).

The numpy version (`plan_reference`, now in tests/test_dispatch_plan.py as the reference it is compared with) made ~20 numpy calls
per batch (a bincount, a stable argsort, a scatter for the inverse, a division, the packing); `plan_dispatch`
does one counting sort in numba: one call, the identical result (tests/test_dispatch_plan.py). On the H200 host
that saved ~30 us per attention batch, not the 100-150 us
predicted: the step's remaining cost is its ~12 torch calls, not numpy.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Optional

import numba
import numpy as np
import torch


@dataclass(slots=True)
class DispatchPlan:
    counts: np.ndarray  # int64 [world]
    order: Optional[np.ndarray]  # int64 [R*k]; None: identity (every pair to one destination)
    inv: Optional[np.ndarray]  # int64 [R, k]; None with order
    experts: np.ndarray  # int64 [R*k]: expert id at each dispatch position
    packed: np.ndarray  # int64: [order // k, inv,] weights as fp32 pairs (without order: the weights only)
    dests: list = ()  # ranks with pairs, ascending
    sizes: list = ()  # pairs bound for each of dests

    @property
    def row_of_pos(self) -> Optional[np.ndarray]:
        """order // k: the batch row at each dispatch position (a view of `packed`)."""
        return None if self.order is None else self.packed[:len(self.order)]


@numba.njit(cache=True)
def _plan(ids, weights, owner, world):
    """Counting sort of the pairs by owner rank (stable: ascending f within a rank). Returns (counts, order,
    inv, experts, packed, dests, bad): bad >= 0 is the flat index of an expert id outside the owner table (nothing
    else is then valid)."""
    R, k = ids.shape
    n = R * k
    nw = (n + 1) // 2
    E = owner.shape[0]
    counts = np.zeros(world, np.int64)
    for i in range(R):
        for j in range(k):
            e = ids[i, j]
            if e < 0 or e >= E or owner[e] < 0 or owner[e] >= world:
                return counts, np.empty(0, np.int64), np.empty((0, k), np.int64), np.empty(0, np.int64), \
                    np.empty(0, np.int64), np.empty(0, np.int64), i * k + j
            counts[owner[e]] += 1
    nxt = np.empty(world, np.int64)
    acc = 0
    for d in range(world):
        nxt[d] = acc
        acc += counts[d]
    order = np.empty(n, np.int64)
    inv = np.empty((R, k), np.int64)
    experts = np.empty(n, np.int64)
    packed = np.empty(2 * n + nw, np.int64)
    for i in range(R):
        for j in range(k):
            e = ids[i, j]
            d = owner[e]
            p = nxt[d]
            nxt[d] = p + 1
            order[p] = i * k + j
            inv[i, j] = p
            experts[p] = e
            packed[p] = i
            packed[n + i * k + j] = p
    w = packed[2 * n:].view(np.float32)
    if n % 2:
        w[n] = 0.0
    for i in range(R):
        for j in range(k):
            w[i * k + j] = weights[i, j]
    return counts, order, inv, experts, packed, np.flatnonzero(counts), -1


def _weights32(weights) -> np.ndarray:
    if type(weights) is not np.ndarray:  # a CPU tensor (the torch executors' route())
        weights = (weights if weights.dtype == torch.float32 else weights.to(torch.float32)).numpy()
    return weights if weights.dtype == np.float32 else weights.astype(np.float32)


def plan_dispatch(ids: np.ndarray, weights, owner: np.ndarray, world: int) -> DispatchPlan:
    """The plan of a batch whose pairs go to `owner[ids]` (ids [R, k] int, weights [R, k], owner [E] int64)."""
    counts, order, inv, experts, packed, dests, bad = _plan(ids, _weights32(weights), owner, world)
    if bad >= 0:
        k = ids.shape[1]
        e = int(ids[bad // k, bad % k])
        raise ValueError(f"routing row {bad // k} slot {bad % k}: expert id {e} has no owner rank "
                         f"(valid ids 0..{len(owner) - 1}, owners 0..{world - 1})")
    sizes = counts[dests].tolist()
    if len(sizes) > 1:
        return DispatchPlan(counts, order, inv, experts, packed, dests.tolist(), sizes)
    return DispatchPlan(counts, None, None, experts, packed[2 * len(order):], dests.tolist(), sizes)


def pack_weights(weights) -> np.ndarray:
    """The fp32 weights [R, k] (a numpy array or CPU tensor) two per int64 element (an odd count's last half
    zero): a merge group's device inputs without a dispatch order (`packed`'s layout then), uploaded in one copy."""
    R, k = weights.shape
    host = np.empty((R * k + 1) // 2, dtype=np.int64)
    w = host.view(np.float32)
    w[R * k:] = 0.0
    w[:R * k] = _weights32(weights).reshape(-1)
    return host


def unpack_group_inputs(packed: torch.Tensor, R: int, k: int, has_order: bool):
    """(gather [R*k] int64, row_index [R, k] int64, weights [R, k] fp32) views of a plan's `packed` array on the
    device (gather and row_index None without an order); one as_strided per view (torch calls are what costs on
    the H200 host, not bytes)."""
    nw = (R * k + 1) // 2
    base = packed.storage_offset()  # as_strided offsets count from the storage's start
    off = base + len(packed) - nw  # int64 elements before the weights
    weights = packed.view(torch.float32).as_strided((R, k), (k, 1), 2 * off)
    if not has_order:
        return None, None, weights
    return packed.as_strided((R * k,), (1,), base), packed.as_strided((R, k), (k, 1), base + R * k), weights


@functools.cache  # once per process
def warm_up() -> None:
    """Load (or compile) the kernel for the engine's argument types now, not inside the first timed batch."""
    plan_dispatch(np.zeros((2, 2), dtype=np.int64), np.ones((2, 2), dtype=np.float32),
                  np.array([0, 1], dtype=np.int64), 2)
