"""Paged KV cache of the home rank: a block allocator plus a KV store over fixed-size pages.

`BlockAllocator` hands out page ids, lowest first (a heap), so a run is deterministic and the pages
in use stay packed at the low end of the pool; `PagedKVStore` keeps each request's page table and
implements the `write`/`read` protocol that `models.attention` uses for its contiguous store, so the
same stage functions run on both. It also offers a batched decode API (`write_rows` / `gather`: one
row per sequence, one index op for the whole batch) that `models.attention` uses when every segment
of a batch is one decode row: on the CPU the per-sequence Python of `write`/`read` was the largest
host cost of the runtime.

Admission reserves every page a request can ever need (prompt + max new tokens - 1 positions) up
front. That is conservative, but it means a running request can never hit a full cache: when the
pool is short, new requests wait in the admission queue instead of anything crashing.

Storage is allocated lazily per layer on the first write (shape and dtype come from that write,
so GQA and MLA caches need no special casing here) and grows by doubling up to `num_blocks`, so a
plan sized for a 140 GB GPU does not allocate its whole pool on a laptop. MLA layers write into this
store their latent form (`mla_latent`, models.attention): K is the row [1, kv_lora_rank + rope] and V
has width 0, so the V storage takes no memory and every method below works unchanged.
"""
from __future__ import annotations

import heapq
import math
from typing import Optional

import torch

from runtime.executors.device_index import to_device


class BlockAllocator:
    def __init__(self, num_blocks: int, block_size: int) -> None:
        if num_blocks <= 0 or block_size <= 0:
            raise ValueError(f"need positive num_blocks and block_size, got {num_blocks}, {block_size}")
        self.num_blocks = num_blocks
        self.block_size = block_size
        # Freed pages in a heap, plus a high-water mark below which every page has been handed out
        # once: O(pages in use) memory even for a plan with a million pages.
        self._freed: list[int] = []
        self._fresh = 0
        self._used: set[int] = set()

    @property
    def free_blocks(self) -> int:
        return self.num_blocks - len(self._used)

    @property
    def used_blocks(self) -> int:
        return len(self._used)

    def blocks_for(self, tokens: int) -> int:
        return math.ceil(max(tokens, 0) / self.block_size)

    def allocate(self, n: int) -> Optional[list[int]]:
        """`n` page ids, or None (and no change) when fewer are free."""
        if n > self.free_blocks:
            return None
        out = []
        for _ in range(n):
            # Freed pages are all below the high-water mark, so the heap first = lowest id first.
            if self._freed:
                out.append(heapq.heappop(self._freed))
            else:
                out.append(self._fresh)
                self._fresh += 1
        self._used.update(out)
        return out

    def free(self, blocks: list[int]) -> None:
        for b in blocks:
            if b not in self._used:
                raise ValueError(f"block {b} freed twice or never allocated")
            self._used.remove(b)
            heapq.heappush(self._freed, b)


class PagedKVStore:
    """KV pages of all layers of one rank; `seq_id` is the request id."""

    def __init__(self, num_layers: int, allocator: BlockAllocator, mla_latent: bool = True) -> None:
        """`mla_latent`: MLA layers cache the latent (the runtime's form); False keeps them decompressed per head, as
        the reference decoder does (a comparison in tests and benchmarks)."""
        self.allocator = allocator
        self.mla_latent = mla_latent
        self.block_size = allocator.block_size
        self._tables: dict[int, list[int]] = {}
        # The same tables as int64 tensors (made at a sequence's first host-side read or write: the CUDA decode path
        # never needs them), so slot arithmetic of a segment is tensor ops instead of Python per position.
        self._table_t: dict[int, torch.Tensor] = {}
        self._capacity: dict[int, int] = {}  # seq_id -> tokens it may hold
        self._k: list[Optional[torch.Tensor]] = [None] * num_layers  # [blocks_allocated, block, ...]
        self._v: list[Optional[torch.Tensor]] = [None] * num_layers
        # Optional observer of page-table changes (runtime/kv_cache_paged_gpu.DeviceBlockTables keeps
        # a device copy of every table, written once at reservation, so decode batches pass row ids
        # instead of tables). None on the CPU path: no cost.
        self.device_view = None

    # -- page tables -------------------------------------------------------------------------
    def reserve(self, seq_id: int, tokens: int) -> bool:
        """Reserve pages for `tokens` positions of a new sequence. False (no change) when full."""
        if seq_id in self._tables:
            raise ValueError(f"sequence {seq_id} already has pages")
        blocks = self.allocator.allocate(self.allocator.blocks_for(tokens))
        if blocks is None:
            return False
        self._tables[seq_id] = blocks
        self._capacity[seq_id] = len(blocks) * self.block_size
        if self.device_view is not None:
            self.device_view.on_reserve(seq_id, blocks)
        return True

    def release(self, seq_id: int) -> None:
        if self.device_view is not None:
            self.device_view.on_release(seq_id)
        self.allocator.free(self._tables.pop(seq_id))
        self._table_t.pop(seq_id, None)
        del self._capacity[seq_id]

    def _table_tensor(self, seq_id: int) -> torch.Tensor:
        t = self._table_t.get(seq_id)
        if t is None:
            t = self._table_t[seq_id] = torch.tensor(self._tables[seq_id], dtype=torch.int64)
        return t

    def table(self, seq_id: int) -> list[int]:
        """The page ids of a sequence (fixed from reservation to release)."""
        return self._tables[seq_id]

    def tables(self) -> dict[int, list[int]]:
        return dict(self._tables)

    def preallocate(self, layer: int, k_row: tuple, v_row: tuple, dtype: torch.dtype, device,
                    extra_blocks: int = 1) -> tuple[torch.Tensor, torch.Tensor]:
        """Allocate layer `layer`'s whole pool now: [num_blocks + extra_blocks, block, *row].

        A CUDA graph bakes in the cache's address, so the lazily doubling storage must not move
        once graphs exist. The `extra_blocks` pages past num_blocks are never handed out; the CUDA
        executor points padded batch rows' KV writes there (page id num_blocks). Data already
        written is kept. Returns (k, v) storage.
        """
        n = self.allocator.num_blocks + extra_blocks
        for which, row in ((self._k, k_row), (self._v, v_row)):
            t = which[layer]
            if t is not None and t.shape[0] >= n and t.device == torch.device(device) and t.dtype == dtype:
                continue
            new = torch.zeros((n, self.block_size) + tuple(row), dtype=dtype, device=device)
            if t is not None:
                new[: t.shape[0]] = t.to(device=device, dtype=dtype)
            which[layer] = new
        return self._k[layer], self._v[layer]

    def storage(self, layer: int) -> tuple[Optional[torch.Tensor], Optional[torch.Tensor]]:
        return self._k[layer], self._v[layer]

    def has(self, seq_id: int) -> bool:
        return seq_id in self._tables

    @property
    def sequences(self) -> int:
        return len(self._tables)

    # -- the KVStore protocol of models.attention --------------------------------------------
    def _storage(self, which: list, layer: int, like: torch.Tensor, upto_block: int) -> torch.Tensor:
        t = which[layer]
        if t is None or t.shape[0] <= upto_block:
            size = max(1, t.shape[0] if t is not None else 1)
            while size <= upto_block:
                size *= 2
            size = min(size, self.allocator.num_blocks)
            grown = torch.zeros((size, self.block_size) + tuple(like.shape[1:]), dtype=like.dtype, device=like.device)
            if t is not None:
                grown[: t.shape[0]] = t
            which[layer] = t = grown
        return t

    def _slots(self, seq_id: int, positions) -> tuple[torch.Tensor, torch.Tensor]:
        """(page id, offset in page) of each position, int64 CPU tensors; IndexError outside the
        sequence's reserved capacity."""
        table = self._table_tensor(seq_id)
        pos = torch.as_tensor(positions).to(device="cpu", dtype=torch.int64)
        if pos.numel():
            lo, hi = (int(x) for x in torch.aminmax(pos))
            cap = self._capacity[seq_id]
            if lo < 0 or hi >= cap:
                raise IndexError(f"sequence {seq_id}: positions {lo}..{hi} outside its {cap} reserved slots")
        return table[pos // self.block_size], pos % self.block_size

    def write(self, layer: int, seq_id: int, positions, k: torch.Tensor, v: torch.Tensor) -> None:
        blocks, offs = self._slots(seq_id, positions)
        if blocks.numel():
            self._put(layer, blocks, offs, int(blocks.max()), k, v)

    def _put(self, layer: int, blocks: torch.Tensor, offs: torch.Tensor, top: int, k: torch.Tensor,
             v: torch.Tensor) -> None:
        """Rows of k / v to their (page, offset) pairs (CPU int64 tensors; `top`: the highest page), the layer's
        storage grown to hold them first."""
        kk = self._storage(self._k, layer, k, top)
        vv = self._storage(self._v, layer, v, top)
        blocks, offs = _upload(blocks, offs, kk.device)
        kk[blocks, offs] = k.to(kk.dtype)
        vv[blocks, offs] = v.to(vv.dtype)

    def read(self, layer: int, seq_id: int, length: int) -> tuple[torch.Tensor, torch.Tensor]:
        blocks, offs = self._slots(seq_id, torch.arange(length))
        kk, vv = self._k[layer], self._v[layer]
        if kk is None:
            raise KeyError(f"layer {layer}: nothing written yet, cannot read {length} positions of {seq_id}")
        blocks, offs = _upload(blocks, offs, kk.device)
        return kk[blocks, offs], vv[blocks, offs]

    # -- batched decode API (models.attention uses it when a batch is all one-row segments) ----
    def write_rows(self, layer: int, seq_ids, positions, k: torch.Tensor, v: torch.Tensor) -> None:
        """Row i of k [B, nkv, dk] / v [B, nkv, dv] goes to position positions[i] of seq_ids[i]:
        one index_put per tensor for the batch. Python per row is O(1) (one page-table lookup),
        never per position of the context."""
        pos = torch.as_tensor(positions).tolist() if isinstance(positions, torch.Tensor) else list(positions)
        if not pos:
            return
        bs, tables, caps = self.block_size, self._tables, self._capacity
        blocks = []
        for s, p in zip(seq_ids, pos):
            if not 0 <= p < caps[s]:
                raise IndexError(f"sequence {s}: positions {p}..{p} outside its {caps[s]} reserved slots")
            blocks.append(tables[s][p // bs])
        self._put(layer, torch.tensor(blocks, dtype=torch.int64), torch.tensor(pos, dtype=torch.int64) % bs,
                  max(blocks), k, v)

    def gather(self, layer: int, seq_ids, lengths) -> tuple[torch.Tensor, torch.Tensor]:
        """K [B, Lmax, nkv, dk], V [B, Lmax, nkv, dv]: positions 0..lengths[i]-1 of seq_ids[i],
        padded to Lmax = max(lengths). Padding holds arbitrary cached values (of page 0 or of the
        sequence's own pages): the caller masks key positions >= lengths[i]."""
        lens = list(lengths)
        caps = self._capacity
        for s, n in zip(seq_ids, lens):
            if not 0 <= n <= caps[s]:
                raise IndexError(f"sequence {s}: positions 0..{n - 1} outside its {caps[s]} reserved slots")
        kk, vv = self._k[layer], self._v[layer]
        if kk is None:
            raise KeyError(f"layer {layer}: nothing written yet, cannot read sequences {list(seq_ids)[:4]}...")
        bs = self.block_size
        lmax = max(lens)
        pages = -(-lmax // bs)
        # [B, pages] page table of the batch. Columns past a sequence's own length point at page 0:
        # its later reserved pages may lie beyond the lazily grown storage.
        tbl = torch.nn.utils.rnn.pad_sequence([self._table_tensor(s) for s in seq_ids], batch_first=True)[:, :pages]
        need = torch.tensor([-(-n // bs) for n in lens], dtype=torch.int64)
        tbl = to_device(tbl.masked_fill(torch.arange(pages)[None, :] >= need[:, None], 0), kk.device)
        B = tbl.shape[0]
        k = kk[tbl].view(B, pages * bs, *kk.shape[2:])[:, :lmax]
        v = vv[tbl].view(B, pages * bs, *vv.shape[2:])[:, :lmax]
        return k, v


def _upload(blocks: torch.Tensor, offs: torch.Tensor, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """A store's (page, offset) index pair, CPU int64 tensors of one length, on `device` in one copy through the pinned
    ring (runtime/device_index.to_device). `.to(device)` of a pageable CPU tensor waits for the stream: on CUDA every
    eager batch's K/V write and read (each prompt chunk, each layer) drained the device that way."""
    both = to_device(torch.stack([blocks, offs]), device)
    return both[0], both[1]

