"""Routed rows to their experts and the experts' outputs back home: the two expert dispatches.

Part of the Engine (runtime/core/engine.py), whose state it reads: the expert -> rank tables, the merge table, the
queues, the transport and the wave announcements (`_announced`, the scheduler's wave hold).

Host-routed (`_dispatch_host`): the routing comes to the host; the destination of every (row, slot) comes from a
per-layer expert -> rank table, one stable sort by destination (runtime/core/dispatch_plan.py), one index_select
into that order and a slice per destination. Wire metadata: routed rows {"t": "x", "layer", "home", "rows": merge
tags, "e": expert ids} (runtime/core/expert_wire.py forms), expert outputs {"t": "y", "layer", "rows"}.

Device-routed (`_dispatch_routed`, runtime/core/routed_rows.py): the whole batch's payload (rows, expert ids and
weights packed in one tensor) goes to every rank holding experts of the layer, {"t": "r", ...}; each returns one
row per token (the weighted sum of its own slots).

Either way the home opens the batch's merge group (runtime/core/merge.py) and an expert batch's outputs go back to
their homes grouped per home (`_complete_expert`), where they are merged and move on (`_merged`).
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional

import numpy as np
import torch

from runtime.core.dispatch_plan import plan_dispatch
from runtime.core.expert_wire import decode_tags, encode_ids, encode_tags
from runtime.core.merge import TAG_SHIFT, MergeGroup, MergeTable
from runtime.core.queues import ExpertItem, RoutedItem, is_decode
from runtime.executors.device_index import to_device

if TYPE_CHECKING:
    from runtime.core.batch_choice import Batch

# Message kinds on the wire (meta["t"]).
MSG_EXPERT_IN = "x"  # home -> expert owner: routed rows
MSG_EXPERT_OUT = "y"  # expert owner -> home: expert output rows
MSG_EXPERT_ROUTED = "r"  # home -> expert owner: a whole attention batch's payload (device-routed dispatch)
MSG_NONE = "n"  # home -> expert owner: none of the rows its hold_ahead announced for this layer come there


def _holds_decode(batch: Batch) -> bool:
    """Whether an attention batch holds decode rows (a block, a one-row segment): its expert rows then queue in the
    decode lane (runtime/core/queues.MuQueue)."""
    return any(map(is_decode, batch.items))


class ExpertDispatch:
    """The Engine's expert dispatch (module docstring)."""

    def _route(self, batch: Batch, layer: int, h_res: torch.Tensor, x: torch.Tensor) -> None:
        """An attention batch's routing at its execute, in the form its dispatch sends (kept on the batch)."""
        if self.device_routed:  # the routing stays where the graph made it (device tensors)
            # rows, ids and weights packed (by the attention graph where there is one: runtime/core/routed_rows.py)
            payload = self.executor.routed_payload(layer, x)
            batch.out.update(h_res=h_res, payload=payload, shared=self.executor.shared_expert(layer, x))
            self._exec_timer.lap("payload")
            return
        ids, weights = self.executor.route_arrays(layer, x)  # numpy arrays where the executor has them so, or tensors
        batch.out.update(h_res=h_res, x=x, ids=ids, weights=weights, shared=self.executor.shared_expert(layer, x))

    def _dispatch_host(self, batch: Batch, layer: int, open_group, rows_of) -> None:
        """Host-routed dispatch: each owner gets its routed rows, one message per destination per batch."""
        tm = self._dispatch_timer
        out = batch.out
        weights, ids = rows_of(out["weights"]), rows_of(out["ids"])
        if type(ids) is not np.ndarray:
            ids = ids.numpy() if ids.device.type == "cpu" else ids.cpu().numpy()
        # Dispatch: the destination of every (row, slot), flat index f = row * k + slot; rows of a
        # destination keep ascending f order (stable sort), one message per destination per batch,
        # destinations in rank order (deterministic). The merge addresses rows by their position in
        # this order (tags = positions), so each message's outputs come back as one contiguous range.
        # The order, its inverse and the merge's packed device inputs come from one compiled call.
        T, k = ids.shape
        replica = self._replica
        owner = self._expert_rank[layer] if replica is None else replica.owners(layer, self.clock.now())
        plan = plan_dispatch(ids, weights, owner, self.cfg.world_size)
        g = open_group(weights, plan=plan)
        if replica is not None:
            replica.sent(g.gid, self.clock.now())
        tm.lap("order+merge_open")
        x = rows_of(out["x"])
        tag0 = g.gid << TAG_SHIFT  # the tag of dispatch position p is tag0 + p
        # The routed rows in dispatch order, one gather for all destinations: each destination's rows are
        # then a contiguous slice (a view: nothing more to copy before the send or the local enqueue). One row whose
        # tensor is the executor's own (`fresh_outputs`: no buffer it writes again) goes as it is, or as a view of it
        # repeated (a decode wave of one request: the gather and the split were ~4 us of a ~20 us dispatch here).
        experts = plan.experts
        parts = [x if c == 1 else x.expand(c, -1) for c in plan.sizes] if T == 1 and self._fresh_outputs else \
            (x.repeat_interleave(k, dim=0) if plan.order is None else x.index_select(0, g.gather)).split_with_sizes(plan.sizes)
        # Wave announcement: this home's tokens still headed for attn(layer) soon (queued, or in merges of
        # the layer before), times this batch's rows per token to each owner: what that owner's expert
        # queue can still expect from here (the scheduler's wave hold uses it; meta key "more").
        ahead = self._wave_ahead(batch)
        # hold_ahead: the same tokens' rows at expert(layer + 1), estimated with this layer's share per owner
        announce_next = self.policy.hold_ahead and layer + 1 < self.cfg.num_layers and self.cfg.expert_rank[layer + 1]
        decode = _holds_decode(batch)
        tm.lap("gather")
        wire_e, size = encode_ids(experts, self._id_dtype), self._id_dtype.itemsize  # (every destination's, at once)
        off = 0  # (the destinations with rows only: a loop over every rank was O(world) per batch)
        for d, c, xd in zip(plan.dests, plan.sizes, parts):
            more = ahead * c / T
            nxt = float(c) if announce_next else 0.0
            if d == self.rank:
                self._enqueue_expert_rows(layer, self.rank, (tag0 + off, c), experts[off:off + c], xd, more, nxt, decode)
            else:
                meta = {"t": MSG_EXPERT_IN, "layer": layer, "home": self.rank, "rows": (tag0 + off, c),
                        "e": wire_e[off * size:(off + c) * size], "more": more}  # wire forms: runtime/core/expert_wire.py
                if nxt:
                    meta["next"] = nxt
                if decode:
                    meta["d"] = 1
                self.transport.send(d, meta, xd)
            off += c
        # hold_ahead's announcements are estimates: an owner told at layer - 1 to expect rows here that got none
        # hears so (else its wave hold waits for them until its bound, at every batch, until this home sends it rows
        # of this layer again: benchmarks/NOTES.md §38)
        for d in self._promised.pop(layer, ()):
            if not plan.counts[d]:  # (this rank itself hears it at once, as it takes its own rows)
                deliver = self.on_message if d == self.rank else self.transport.send
                deliver(d, {"t": MSG_NONE, "layer": layer, "home": self.rank}, None)
        if announce_next:
            self._promised.setdefault(layer + 1, set()).update(plan.dests)
        tm.lap("send+enqueue")

    def _dispatch_routed(self, batch: Batch, layer: int, open_group, rows_of,
                         sent: Optional[tuple[int, float]] = None) -> None:
        """Device-routed dispatch (runtime/core/routed_rows.py): the whole batch's payload (rows, expert ids and weights)
        to every rank holding experts of the layer; each returns one row per token (the weighted sum of its own
        slots), which the merge group, a holder group, lands at holder j's range j*T .. (j+1)*T - 1. `sent`: what
        _send_routed returned when the payload already went out (before the bookkeeping); None: send it now."""
        payload = rows_of(batch.out["payload"])
        owners = self._owners[layer]
        gid, more = sent if sent is not None else self._send_routed(batch, layer, payload)
        g = open_group(None, holders=len(owners))
        assert g.gid == gid, (g.gid, gid)
        tm = self._dispatch_timer
        tm.lap("routed:merge_open")
        T = payload.shape[0]
        if self.rank in owners:  # (opening the layer's group changed no count `more` was made of)
            self._enqueue_routed(layer, self.rank, payload, (gid << TAG_SHIFT) + owners.index(self.rank) * T, more,
                                 _holds_decode(batch))
        tm.lap("routed:enqueue")

    def _send_routed(self, batch: Batch, layer: int, payload: torch.Tensor) -> tuple[int, float]:
        """Send the payload to every other holder of `layer`, tagged for the merge group the next open() makes
        (holder j's rows at j*T ..); returns that group's id and the wave announcement sent with it (`more`)."""
        gid = self.merge.next_gid
        T = payload.shape[0]
        more = self._wave_ahead(batch) * self.cfg.top_k
        decode = _holds_decode(batch)
        for j, d in enumerate(self._owners[layer]):
            if d != self.rank:
                meta = {"t": MSG_EXPERT_ROUTED, "layer": layer, "home": self.rank,
                        "rows": ((gid << TAG_SHIFT) + j * T, T), "more": more}
                if decode:
                    meta["d"] = 1
                self.transport.send(d, meta, payload)
        return gid, more

    def _wave_ahead(self, batch: Batch) -> float:
        """This home's tokens still headed for the batch's attention stage soon (the wave announcement)."""
        return self.queues[batch.stage.id].depth + self._incoming(batch.stage.id)

    def _exec_expert(self, batch: Batch) -> None:
        items = batch.items
        if type(items[0]) is RoutedItem:  # device-routed: whole batches, selected on the device
            layer = batch.stage.layer
            owned = self.owned_experts(layer, items[0].payload.device)
            # This home's own item alone: its output goes straight into its merge group's buffer (the expert
            # graph's output copied there, where it went to a new tensor and then the merge copied it again)
            into = self.merge.rows_at(items[0].tag0, items[0].out_rows) \
                if len(items) == 1 and items[0].home == self.rank else None
            batch.out["y"] = self.executor.experts_routed(layer, [it.payload for it in items], owned, out=into)
            batch.out["landed"] = into is not None
            return
        # several row blocks: the executor concatenates them where the batch's input lives
        x, ids = (items[0].x, items[0].expert) if len(items) == 1 else \
            ([it.x for it in items], np.concatenate([it.expert for it in items]))
        batch.out["y"] = self.executor.experts(batch.stage.layer, x, torch.from_numpy(ids))

    def _complete_expert(self, batch: Batch) -> None:
        layer, y, items = batch.stage.layer, batch.out["y"], batch.items
        by_home: dict[int, list[tuple[int, int, object]]] = {}  # home -> [(first row, end row, item)]
        row = 0
        for it in items:
            by_home.setdefault(it.home, []).append((row, row + it.out_rows, it))
            row += it.out_rows
        # other homes' first (they wait for them)
        for dst in sorted(by_home, key=lambda d: (d == self.rank, d)) if len(by_home) > 1 else by_home:
            parts = by_home[dst]
            # The rows' merge tags in the wire form: usually one run, bookkept with slices (MergeTable.add), 3 ints
            # on the wire. A device-routed item's tags are a run by construction (no array made and scanned for it).
            if len(parts) == 1:
                a, b, it = parts[0]
                part = y if a == 0 and b == row else y[a:b]
                rows = (it.tag0, it.out_rows) if type(it) is RoutedItem else \
                    it.tag if type(it.tag) is tuple else encode_tags(it.tag)
            else:
                part = torch.cat([y[a:b] for a, b, _ in parts])
                rows = encode_tags(np.concatenate([decode_tags(it.tag) for _, _, it in parts]))
            if dst == self.rank:
                if self._replica is not None:
                    self._replica.returned(dst, rows, self.clock.now())
                self._merge_rows(rows, part, batch.out.get("landed", False))  # (landed: the batch's only part)
            else:
                self.transport.send(dst, {"t": MSG_EXPERT_OUT, "layer": layer, "rows": rows}, part)

    def _enqueue_expert_rows(self, layer: int, home: int, tags, experts, x: torch.Tensor,
                             more: float = 0.0, nxt: float = 0.0, decode: bool = False) -> None:
        """One queue item for the whole block of routed rows; `more`: rows `home` expects to send here
        for this layer soon (the rest of its wave), for the wave hold; `nxt`: rows the same tokens will
        bring to this rank's expert(layer + 1) (the policy's hold_ahead; replaced by `more` when that
        layer's dispatch from `home` arrives); `decode`: their attention batch held decode rows (the queue's
        decode lane; on the wire, meta key "d")."""
        self._announced[layer][home] = more
        if nxt:
            self._announced[layer + 1][home] = self._announced[layer + 1].get(home, 0.0) + nxt
        tags, experts = tags if type(tags) is tuple else np.asarray(tags, dtype=np.int64), np.asarray(experts, dtype=np.int64)
        self.queues[self.expert_stage[layer]].push(
            ExpertItem(home, layer, x, tags, experts, self.clock.now(), len(experts), decode))

    def _enqueue_routed(self, layer: int, home: int, payload: torch.Tensor, tag0: int, more: float = 0.0,
                        decode: bool = False) -> None:
        """One RoutedItem for a home's whole attention batch (device-routed dispatch; its packed payload as is)."""
        self._announced[layer][home] = more
        n = payload.shape[0] * self.cfg.top_k
        self.queues[self.expert_stage[layer]].push(RoutedItem(home, layer, payload, tag0, self.clock.now(), n,
                                                              decode))

    def owned_experts(self, layer: int, device: torch.device) -> torch.Tensor:
        """bool [E] on `device`: the experts of `layer` this rank holds (one tensor per (layer, device): the CUDA
        executor keys its device-routed graphs by it; CudaExecutor.prepare captures them from it)."""
        key = (layer, device)
        owned = self._owned.get(key)
        if owned is None:
            owned = self._owned[key] = torch.from_numpy(self._expert_rank[layer] == self.rank).to(device)
        return owned

    def _merge_rows(self, tags, y: torch.Tensor, landed: bool = False) -> None:
        for group, segs in self.merge.add(tags, y, landed):
            self._merged(group, segs)

    def _landing(self, src: int, meta: dict, shape: tuple, dtype: torch.dtype):
        """The transport's receive-in-place hook (phase 2 of the exchange, header already read): the
        merge-buffer slice an expert-output message can be received into, with the event a receive
        on another stream waits for, or None. Marks the message so `on_message` skips the copy.
        Runs on the engine thread, inside the transport's poll() or post_receives() (a group and its
        buffer exist from open() until all its parts were merged, this one included)."""
        if meta.get("t") != MSG_EXPERT_OUT:
            return None
        target = self.merge.landing(meta["rows"], shape, dtype)
        if target is not None:
            meta["landed"] = True
        return target

    def _merged(self, g: MergeGroup, segs: np.ndarray) -> None:
        """Segments of group `g` whose k parts are all in: combine in slot order (one call for all
        of them: the combine is row-wise elementwise fp32, so batching changes no bits), move on."""
        if len(segs) == len(g.rids):
            rows = None
            h_res, shared, w = g.h_res, g.shared, g.weights
        else:
            rows = g.rows_of(segs)
            idx = to_device(rows, g.h_res.device)
            h_res = g.h_res.index_select(0, idx)
            shared = None if g.shared is None else g.shared.index_select(0, idx)
            w = g.weights.index_select(0, idx)
        y, row_index = MergeTable.combine_inputs(g, rows)
        nxt = self.stages[self.expert_stage[g.layer]].next
        h_next = self.executor.combine(h_res, shared, y, w, row_index, feeds_attention=self.stages[nxt].kind == "attn")
        if rows is None and not g.multi:  # a whole decode wave: its lists as they are (see _block_segments); pos0 ==
            # first for one-row segments, except after the last layer, where first is the sampled position, which the
            # sample stage does not read
            self._forward(nxt, g.rids, g.pos0, None, h_next, False)  # (ns is read only when multi)
            return
        n = g.n[segs]
        segs = segs.tolist()
        self._forward(nxt, [g.rids[s] for s in segs], [int(g.first[s]) for s in segs], n.tolist(), h_next, n.max() > 1)
