"""Device-side view of a PagedKVStore: fixed-address caches and page tables the decode graph reads.

The engine owns a `PagedKVStore` (runtime/core/kv_cache.py): page tables on the host, K/V storage
[pages, block, heads, dim] on the executor's device, the layout `dataflow_kernels.paged_attention` reads.
For CUDA graphs two things must not move or be rebuilt per batch:
- the K/V storage of every layer: preallocated whole (+1 trash page, id num_blocks, where the
  padded rows of a captured batch write their K/V), so the lazy doubling never reallocates;
- the page tables: a sequence's pages are all reserved at admission and never change, so each
  table is copied to a device row once (`on_reserve`, an observer hook of the store), and a
  decode batch passes only one row id per sequence. The graph gathers the rows it needs
  (`index_select`) and finds each token's write slot there itself.

Row writes are batched: `on_reserve` only notes the row, and `flush()` (the executor calls it before every
attention batch, in `CudaExecutor._view`) uploads every row noted since, with their keys, as one array and writes
them with one `index_copy_` each. Per admitted sequence two uploads of ~8 torch calls each had cost ~150-200 us of
a busy rank's host on the H200s (~5 admissions per decode step at 512 requests: 6-8% of the loop).

Row `rows` (the last) is the trash row: every entry is the trash page. Padded batch rows point
at it with position -1, i.e. context length 0: the kernel reads nothing and yields zeros.
A sequence longer than `width` pages or arriving when all rows are taken gets no row; batches
containing it take the eager path (`rows_of` gives None), which reads the host tables.
"""
from __future__ import annotations

from typing import Callable, Optional

import numpy as np
import torch


class DeviceBlockTables:
    def __init__(self, kv, width: int, rows: int, device: torch.device,
                 upload: Callable[[np.ndarray], tuple]) -> None:
        """`upload(host_array) -> (device tensor, event)` stages a host copy (pinned, non-blocking: HostStaging.upload)."""
        # Wrappers (lab/decode_only.py RandomPrefixKV) delegate to an inner store: the hooks must
        # sit on the store that actually reserves and releases.
        while hasattr(kv, "inner"):
            kv = kv.inner
        self.kv = kv
        self.width = width
        self.trash_page = kv.allocator.num_blocks
        self.trash_row = rows
        self._upload = upload
        self._unsent: dict[int, tuple[int, list[int]]] = {}  # row -> (sequence, its pages), for flush()
        self.table = torch.full((rows + 1, width), self.trash_page, dtype=torch.int32, device=device)
        self._row: dict[int, int] = {}
        self._free = list(range(rows - 1, -1, -1))  # pop() gives the lowest row first
        self.overflow = 0  # sequences that got no row (too long, or no row free)
        self.releases = 0  # rows given back so far: a row looked up before is still that sequence's while unchanged
        self._rows_memo: Optional[tuple] = None  # (segments, releases, rows, positions, fits): batch_rows()
        # Optional per-row int64 key of the row's sequence (`track_keys`): what a router inside the
        # attention graph hashes (CudaExecutor.use_keyed_router).
        self.keys: Optional[torch.Tensor] = None
        self._key_of: Optional[Callable[[int], int]] = None
        for seq_id, blocks in kv.tables().items():
            self.on_reserve(seq_id, blocks)
        kv.device_view = self

    def on_reserve(self, seq_id: int, blocks: list[int]) -> None:
        if len(blocks) > self.width or not self._free:
            self.overflow += 1
            return
        r = self._free.pop()
        self._row[seq_id] = r
        self._unsent[r] = (seq_id, blocks)  # (a row given back and taken again before a flush: its last owner's)

    def flush(self) -> None:
        """Write the rows noted since the last flush (pages, and keys when tracked) to the device: one upload, one
        index_copy_ per tensor, in stream order before anything queued later (the graphs that read them)."""
        if not self._unsent:
            return
        a = np.full((len(self._unsent), 2 + self.width), self.trash_page, dtype=np.int64)  # row, key, pages
        key_of = self._key_of
        for i, (r, (seq_id, blocks)) in enumerate(self._unsent.items()):
            a[i, 0] = r
            a[i, 1] = key_of(seq_id) if key_of is not None else 0
            a[i, 2:2 + len(blocks)] = blocks
        self._unsent.clear()
        dev, _ = self._upload(a)
        idx = dev[:, 0]
        self.table.index_copy_(0, idx, dev[:, 2:].to(torch.int32))
        if self.keys is not None:
            self.keys.index_copy_(0, idx, dev[:, 1])

    def track_keys(self, key_of: Callable[[int], int]) -> None:
        """Keep `keys[row] = key_of(sequence)` for every row from now on (the trash row's key is 0) in the device
        tensor `keys`, whose address never changes (graphs may bake it)."""
        if self.keys is None:
            self.keys = torch.zeros(self.table.shape[0], dtype=torch.int64, device=self.table.device)  # per table row
        self._key_of = key_of
        for seq_id, r in self._row.items():  # rows written before: again, with their keys, at the next flush
            self._unsent[r] = (seq_id, self.kv.table(seq_id))

    def on_release(self, seq_id: int) -> None:
        r = self._row.pop(seq_id, None)
        if r is not None:
            # Stale entries are harmless (a new owner overwrites the prefix it uses; context
            # lengths bound every read), so no device write on release.
            self._free.append(r)
            self.releases += 1

    def batch_rows(self, segments, positions, T: int) -> tuple[Optional[list], bool]:
        """(table row of every batch row, fits) of a batch of T rows made of segments (rid, first row, n) in row order:
        fits when every segment's sequence has a row and every position fits the tables' width. A prompt's chunk is
        rows of one sequence like a decode row's: each row's context is its sequence's positions up to its own, the
        K/V of the rows before it in this batch included (the paged kernels write the batch's K/V before attending).
        A decode wave passes the same segments and positions lists at every layer of a step (Engine._block_segments):
        they are looked up and checked once, valid while no sequence released its row."""
        memo = self._rows_memo
        if memo is not None and memo[0] is segments and memo[1] == self.releases:
            rows = memo[2]
            if memo[3] is positions:
                return rows, memo[4]
        elif T > 0 and segments:  # column-wise with C-level loops (zip/map), no per-row Python for one-row segments
            sids, starts, ns = zip(*segments)
            rows = self.rows_of(sids)
            if ns.count(1) != len(ns):  # a prompt's chunk: its sequence's row once per row
                rows = [r for r, n in zip(rows, ns) for _ in range(n)]
        else:
            return None, False
        fits = len(rows) == T and None not in rows and max(positions) < self.width * self.kv.block_size
        self._rows_memo = (segments, self.releases, rows, positions, fits)
        return rows, fits

    def rows_of(self, seq_ids) -> list:
        """The device table row of every id (None where a sequence has no row), one C-level map over the dict."""
        return list(map(self._row.get, seq_ids))
