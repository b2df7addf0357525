"""An attention batch: its inputs (embedding or the rows that arrived), the executor call, and which of its rows
move on to where.

Part of the Engine (runtime/core/engine.py), whose state it reads: the live requests (each row's K/V position is
recorded per layer while a chunked prompt is in flight, `Request.kv_next`), the queues and the timers. After the
last layer only the rows that are sampled move on; at a MoE layer the rows go to their experts through
runtime/core/expert_dispatch.py, at a dense layer straight to the next stage (`_forward`).

A decode wave (one AttnBlock of one-row segments) keeps its request and position lists through every layer of a
step: they move on as they are, and the segment list derived from them is made once per step (`_block_segments`).
"""
from __future__ import annotations

from functools import partial
from itertools import repeat
from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from runtime.core.queues import AttnBlock, AttnItem, SampleItem
from runtime.core.requests import Request
from runtime.executors.device_index import to_device

if TYPE_CHECKING:
    from runtime.core.batch_choice import Batch


class AttentionStage:
    """The Engine's attention batches (module docstring)."""

    def _layer0_ids(self, items: list):
        """A layer-0 batch's token ids for the embedding: a list of ints, or a device tensor when a block's ids stayed
        on the device (step-ahead)."""
        if len(items) == 1:
            return items[0].tokens
        if all(type(it.tokens) is list for it in items):
            return [t for it in items for t in it.tokens]
        dev = next(it.tokens.device for it in items if type(it.tokens) is not list)
        return torch.cat([it.tokens if type(it.tokens) is not list else to_device(np.asarray(it.tokens, dtype=np.int64), dev)
                          for it in items])

    def _exec_attn(self, batch: Batch) -> None:
        tm = self._exec_timer
        tm.start()
        layer = batch.stage.layer
        items: list = batch.items  # AttnItem segments and AttnBlocks
        if layer == 0:
            h = self.executor.embed(self._layer0_ids(items))
        else:
            h = self._gather_h(items)
        tm.lap("embed" if layer == 0 else "gather_h")
        if len(items) == 1 and type(items[0]) is AttnBlock:  # a decode wave's batch
            positions, segments = items[0].pos, self._block_segments(items[0])
            items = ()
        else:
            positions, segments = [], []
        row = 0
        for it in items:
            if type(it) is AttnBlock:
                positions.extend(it.pos)
                segments.extend(zip(it.rids, range(row, row + it.n), repeat(1)))
                row += it.n
                continue
            if it.n == 1:
                positions.append(it.pos0)
            else:
                positions.extend(range(it.pos0, it.pos0 + it.n))
            segments.append((it.rid, row, it.n))
            row += it.n
        tm.lap("segments")
        h_res, x = self.executor.attention(layer, h, positions, segments, self.kv)
        tm.lap("executor")
        if not self.cfg.expert_rank[layer]:
            batch.out["h_next"] = h_res + self.executor.dense_mlp(layer, x)
        else:
            self._route(batch, layer, h_res, x)

    def _block_segments(self, blk: AttnBlock) -> list:
        """The one-row segments (rid, row, 1) of a batch that is one block: the same list object at every layer of
        the wave (the device tables key their row lookup on it: DeviceBlockTables.batch_rows)."""
        memo = self._wave_segments
        if memo is not None and memo[0] is blk.rids and memo[1] is blk.pos:
            return memo[2]
        segments = list(zip(blk.rids, range(blk.n), repeat(1)))
        self._wave_segments = (blk.rids, blk.pos, segments)
        return segments

    @staticmethod
    def _gather_h(items: list) -> torch.Tensor:
        """The items' hidden rows, back to back: one slice per contiguous run of a source block."""
        runs = []  # [block, first row, end row]
        for it in items:
            if runs and runs[-1][0] is it.h and runs[-1][2] == it.hrow:
                runs[-1][2] += it.n
            else:
                runs.append([it.h, it.hrow, it.hrow + it.n])
        parts = [blk if a == 0 and b == blk.shape[0] else blk[a:b] for blk, a, b in runs]
        return parts[0] if len(parts) == 1 else torch.cat(parts)

    @staticmethod
    def _sampled(req: Request, last_pos: int) -> bool:
        """Whether a segment of `req` ending at position last_pos is sampled after the last layer: a decode row, or the
        prompt's last chunk (an earlier chunk is not). By position, not by len(req.output): with step-ahead a row can
        reach the last layer before its request's previous token was read."""
        return last_pos >= len(req.prompt) - 1

    def _complete_attn(self, batch: Batch) -> None:
        tm = self._dispatch_timer
        tm.start()
        layer = batch.stage.layer
        last = layer == self.cfg.num_layers - 1
        out = batch.out
        sent = None
        if not last and "payload" in out:
            # Device-routed: every row moves on, so the payload leaves first and the holders start on it while this
            # rank does the batch's bookkeeping (which is on the wave's critical path: the holders would idle
            # through it).
            sent = self._send_routed(batch, layer, out["payload"])
        reqs = self.requests
        rids, pos0s, first, ns = [], [], [], []
        keep: Optional[list[int]] = [] if last else None  # batch rows that move on (None: all)
        row = 0
        multi = False
        track = self._chunked > 0  # else no K/V order to record, and every block row is its request's sampled one
        items = batch.items
        if not last and not track and len(items) == 1 and type(items[0]) is AttnBlock:
            # A decode wave: its lists move on as they are (one-row segments: pos0 == first), and with them what
            # _block_segments derived from them
            it = items[0]
            rids, pos0s, first, row = it.rids, it.pos, it.pos, it.n
            items = ()
        for it in items:
            if type(it) is AttnBlock:  # one-row segments
                if track:
                    for r, p in zip(it.rids, it.pos):
                        reqs[r].kv_next[layer] = p + 1
                if last and track:  # a chunked prompt's one-row chunk may not be its sampled row
                    for i, (r, p) in enumerate(zip(it.rids, it.pos)):
                        if self._sampled(reqs[r], p):
                            keep.append(row + i)
                            rids.append(r)
                            pos0s.append(p)
                            first.append(p)
                            ns.append(1)
                else:
                    if last:
                        keep += range(row, row + it.n)
                    rids += it.rids
                    pos0s += it.pos
                    first += it.pos
                    ns += repeat(1, it.n)
                row += it.n
                continue
            req = reqs[it.rid]
            req.kv_next[layer] = it.pos0 + it.n
            if last:
                # After the last layer only the sampled position matters; the other prompt rows
                # were needed for their K/V only.
                sp = it.pos0 + it.n - 1
                if self._sampled(req, sp):
                    keep.append(row + it.n - 1)
                    rids.append(it.rid)
                    pos0s.append(it.pos0)
                    first.append(sp)
                    ns.append(1)
            else:
                rids.append(it.rid)
                pos0s.append(it.pos0)
                first.append(it.pos0)
                ns.append(it.n)
                multi |= it.n > 1
            row += it.n
        if not rids:
            return
        sel = None
        if keep is not None and len(keep) != row:
            sel = np.asarray(keep, dtype=np.int64)

        def rows_of(t):
            return t if sel is None else t[sel] if type(t) is np.ndarray else t.index_select(0, to_device(sel, t.device))

        nxt = batch.stage.next
        if "h_next" in out:  # a dense layer: no experts
            self._forward(nxt, rids, first, ns, rows_of(out["h_next"]), multi)
            return
        tm.lap("bookkeeping")
        # The batch's merge group, opened below with its dispatch order (host-routed) or its holders (device-routed).
        shared = rows_of(out["shared"]) if out["shared"] is not None else None
        n = np.asarray(ns, dtype=np.int64) if multi else None  # (None: one row each. A list -> array is ~1 us per 30 rows)
        open_group = partial(self.merge.open, layer, rids, pos0s, first, n, rows_of(out["h_res"]), shared)
        if "payload" in out:
            self._dispatch_routed(batch, layer, open_group, rows_of, sent)
        else:
            self._dispatch_host(batch, layer, open_group, rows_of)

    def _forward(self, sid: int, rids: list[int], first: list[int], ns: list[int], h: torch.Tensor,
                 multi: bool) -> None:
        """Queue segments that finished a layer for stage `sid` (next layer's attention, or sample):
        segment i has rows first[i].. (ns[i] of them), back to back in h. `multi`: some ns[i] > 1."""
        now = self.clock.now()
        q = self.queues[sid]
        if self.stages[sid].kind == "sample":
            # Only the last position of a request is ever sampled (rows were filtered before).
            if multi:
                h = h.index_select(0, to_device(np.cumsum(ns) - 1, h.device))
            q.push(SampleItem(rids, h, now, len(rids)))
        elif not multi:
            q.push(AttnBlock(rids, first, None, h, now, len(rids)))
        else:
            row = 0
            for rid, p, n in zip(rids, first, ns):
                q.push(AttnItem(rid, p, n, None, h, now, row))
                row += n
