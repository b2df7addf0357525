"""The CUDA executor's expert stage: one graph per (layer, bucket) for each dispatch kind, and the merge.

experts(layer, x, expert_ids) (host-routed): permute the rows into expert order (counting sort on the device),
gather, grouped FFN (kernels/grouped_ffn.py: its torch reference is models.moe's expert math with models.moe.glu, the
Triton version the same FFN as two grouped GEMMs), scatter back. The expert ids live in a static device buffer the
graph reads, so a new split of rows over experts never re-captures. Padded rows get the sentinel expert E: never
placed in an expert's range, never computed. Weights holding only some experts (a rank's shard, ModelWeights.held) are
indexed by row: the host translates the engine's global ids with one numpy table lookup per batch while filling the
ids buffer, and the layer's body sorts into as many bins as the layer holds experts (sentinel ids clamp to that count).
experts_routed(...) (device-routed): the same FFN over the slots a rank owns, selected on the device, then each
token's slots summed with their weights (runtime/core/routed_rows.py's payload in, one row per token out).
combine(...): `dataflow_kernels.topk_merge` (one launch; same fp32 order as models.moe.combine, bit-equal).
"""
from __future__ import annotations

from typing import Optional

import numpy as np
import torch
from torch import Tensor

from dataflow_kernels.grouped_ffn import grouped_ffn_torch, grouped_ffn_triton
from dataflow_kernels.permute import permute_to_experts_torch, permute_to_experts_triton
from dataflow_kernels.topk_merge import topk_merge
from runtime.core.routed_rows import pack_tail, payload_columns, unpack as unpack_routed
from runtime.executors.capture import bucket_for
from runtime.executors.cuda_buffers import timed


class ExpertsMixin:
    """CudaExecutor's expert and merge methods (runtime/executors/cuda_executor.py composes it)."""

    def _expert_bufs(self, b: int, static: bool) -> dict[str, Tensor]:
        def make() -> dict[str, Tensor]:  # (outside any capture)
            H, dt, dev = self.spec.hidden_size, self.dtype, self.device
            return {"x": torch.zeros((b, H), dtype=dt, device=dev), "y": torch.zeros((b, H), dtype=dt, device=dev),
                    "ids": torch.zeros(b, dtype=torch.int32, device=dev), "arange": torch.arange(b, device=dev)}
        return self._kept(("expert", b), static, make)

    def _expert_bucket(self, N: int) -> tuple[int, bool]:
        """(bucket, static) for an expert batch of N rows (slots, device-routed): the smallest captured bucket
        that fits, or an eager batch of exactly N rows above the largest."""
        b = bucket_for(N, self.buckets["expert"])
        if b is not None:
            return b, True
        self.stats.note("expert: batch above the largest bucket")
        return N, False

    def _run_expert(self, key: tuple, make_body, static: bool) -> None:
        """An expert body (either graph kind: key[0] "expert" or "expert_routed") over its bucket's static
        buffers: its graph replayed (captured at first use), or eagerly for an eager batch's own buffers."""
        if static:
            g = self.graphs.get(key, make_body, self.expert_graphs)
            g.run()
            self.stats.expert_graph += int(g.capture)
            self.stats.expert_eager += int(not g.capture)
        else:
            make_body()()
            self.stats.expert_eager += 1

    def _held_count(self, layer: int) -> int:
        """Experts whose weights layer `layer` holds here (rows of its stacked tensors)."""
        return self.w.layers[layer]["experts.gate"].shape[0]

    def _expert_body(self, layer: int, bufs: dict[str, Tensor]):
        x_in, ids_buf, y_out, ar = bufs["x"], bufs["ids"], bufs["y"], bufs["arange"]
        ffn = self._ffn_rows(layer)

        def body() -> None:
            ffn(x_in, ids_buf.to(torch.int64), ar, y_out, sentinels_anywhere=False)
        return body

    def _ffn_rows(self, layer: int):
        """The expert FFN of one layer over rows and their ids (capturable): f(x [b, H], ids int64 [b] in
        [0, num_experts], arange [b], y_out [b, H], sentinels_anywhere) writes row i's output to y_out[i]; ids
        num_experts (the padding sentinel) give rows that are not real. With sentinels_anywhere False they sit
        in the padded tail only (host-routed batches); the routed graph kind has them anywhere."""
        lw, ex = self.w.layers[layer], self.spec.experts
        E = self._held_count(layer)
        # The padding id is num_experts in every layer's buffers: a shard holding fewer experts clamps that
        # sentinel to its own count E.
        clamp = E < self.num_experts
        wg, wu, wd = lw["experts.gate"], lw["experts.up"], lw["experts.down"]
        bg, bu, bd = (lw["experts.gate_b"], lw["experts.up_b"], lw["experts.down_b"]) if ex.bias else (None,) * 3
        ffn = grouped_ffn_triton if self.ffn_impl == "triton" else grouped_ffn_torch
        # (order, offsets) of the ids in [0, E] (E: the padding sentinel), without a host sync either way
        permute = permute_to_experts_triton if self.permute_impl == "triton" else permute_to_experts_torch

        def run(x_in: Tensor, ids: Tensor, ar: Tensor, y_out: Tensor, sentinels_anywhere: bool) -> None:
            if clamp:
                ids = ids.clamp(max=E)
            order, offsets = permute(ids, E)
            # Rows of the sentinel expert (padding) are not real: clip every expert range to
            # the real rows and give the padded positions of `order` the padded rows
            # themselves (the Triton sort leaves them unwritten), so order is a permutation.
            n_real = (ids < E).sum()
            offsets = torch.minimum(offsets, n_real)
            # With sentinels anywhere, the positions past n_real take the sentinel rows in index order.
            fill = torch.argsort((ids >= E).to(torch.int32), stable=True) if sentinels_anywhere else ar
            order = torch.where(ar < n_real, order, fill)
            xs = x_in.index_select(0, order)
            ys = ffn(xs, offsets, wg, wu, wd, bg, bu, bd, ex.activation, ex.glu_alpha, ex.glu_limit)
            y_out.index_copy_(0, order, ys)
        return run

    @torch.no_grad()
    @timed("expert")
    def experts(self, layer: int, x, expert_ids: list[int]) -> Tensor:
        tm = self._expert_timer
        tm.start()
        # x: [N, H], or its row blocks (runtime/executors/torch_executor.row_blocks), concatenated below straight into
        # the static input (one copy, not a cat and then a copy).
        blocks = [self._to_dev(x)] if isinstance(x, Tensor) else [self._to_dev(b) for b in x]
        N = sum(b.shape[0] for b in blocks)
        if N == 0:
            return blocks[0].new_zeros((0, self.spec.hidden_size))
        b, static = self._expert_bucket(N)
        bufs = self._expert_bufs(b, static)
        # The engine hands a CPU int64 tensor (a numpy block): read it as numpy directly
        # (assigning a tensor to an ndarray goes through Tensor.__array__ in Python).
        ids = expert_ids.numpy() if isinstance(expert_ids, Tensor) and expert_ids.device.type == "cpu" else expert_ids
        rows_of = self._rows_of.get(layer)
        if rows_of is not None:  # a shard: global ids -> rows of the held experts
            gids = np.asarray(ids if not isinstance(ids, Tensor) else ids.cpu().numpy(), dtype=np.int64)
            ids = rows_of[gids]
            if (ids < 0).any():
                raise self.w.unheld_error(layer, gids[ids < 0].tolist())

        def fill(a: np.ndarray) -> None:
            a[:N] = ids
            a[N:] = self.num_experts  # padding
        tm.lap("ids_prep")
        self.staging.h2d_array(bufs["ids"], fill)
        tm.lap("ids_h2d")
        x_in, y_out = self._kept(("expert", b, N), static, lambda: (bufs["x"][:N], bufs["y"][:N]))
        if len(blocks) == 1:
            x_in.copy_(blocks[0])
        else:
            torch.cat(blocks, out=x_in)
        tm.lap("x_copy")
        self._run_expert(("expert", layer, b), lambda: self._expert_body(layer, bufs), static)
        tm.lap("replay")
        y = y_out.clone()
        tm.lap("y_clone")
        return y

    def _routed_select(self, layer: int, owned: Tensor) -> tuple[Tensor, Tensor]:
        """(row, mine) on the device, each indexed by a global expert id or the token padding id num_experts
        (E + 1 entries): row int32 = the held row of an expert this rank owns, else the padding id of the expert
        body; mine bool = owned here. Derived once per (layer, owned tensor): ranks in one process share an
        executor, each engine keeps one owned tensor per layer, and the entry holds it so that its id stays unique."""
        t = self._routed_tables.get((layer, id(owned)))
        if t is None or t[0] is not owned:
            E = self.num_experts
            lut = self._rows_of.get(layer)
            held = torch.arange(E, dtype=torch.int32) if lut is None else torch.from_numpy(lut).to(torch.int32)
            mine = torch.cat([owned.to("cpu", torch.bool), torch.zeros(1, dtype=torch.bool)])
            # not owned (or padding): the sentinel expert
            row = torch.where(mine, torch.cat([held, torch.zeros(1, dtype=torch.int32)]), E).to(torch.int32)
            t = self._routed_tables[(layer, id(owned))] = (owned, row.to(self.device), mine.to(self.device))
        return t[1:]

    @torch.no_grad()
    @timed("expert")
    def experts_routed(self, layer: int, payloads: list[Tensor], owned: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """The device-routed expert batch (TorchExecutor.experts_routed's contract) without a host sync. Its own
        graph kind ("expert_routed", bucketed in slots): the host copies the items' payloads (token rows, expert ids
        and weights: routed_rows.pack's layout) into the bucket's static input and replays; inside the graph each
        token row goes to its k slots, the ids map to held rows (slots of experts this rank does not own -> the
        padding id), the expert FFN runs, the slots it does not own are zeroed, and topk_merge sums each token's
        slots with their weights (from zero, slot order, fp32): one row per token out, copied into `out` when given
        (the merge group's buffer: runtime/core/merge.py MergeTable.rows_at), else into a tensor of its own."""
        tm = self._expert_timer
        tm.start()
        T = sum(p.shape[0] for p in payloads)
        b, static = self._expert_bucket(T * self.top_k)
        bufs = self._routed_bufs(b, static)
        payload_T, tail_pad, y_T = self._kept(("routed", b, T), static, lambda: (
            bufs["payload"][:T], bufs["payload"][T:, self.spec.hidden_size:], bufs["y"][:T]))
        if len(payloads) == 1:
            payload_T.copy_(payloads[0])
        else:
            torch.cat(payloads, out=payload_T)
        # Padding tokens: owned by nobody, weight 0. A static bucket's rows from _routed_padded[b] on still hold the
        # padding tail a batch before wrote (the graph only reads its input): rewritten only below a shorter batch.
        if tail_pad.shape[0] and (not static or self._routed_padded.get(b, T + 1) > T):
            tail_pad.copy_(self._padding_tail())
        if static:
            self._routed_padded[b] = T
        tm.lap("routed:payload_in")
        select = self._routed_select(layer, owned)
        self._run_expert(("expert_routed", layer, b, id(owned)), lambda: self._routed_body(layer, bufs, select),
                         static)
        tm.lap("replay")
        y = y_T.clone() if out is None else out.copy_(y_T)  # (the static buffer is reused by the next batch)
        tm.lap("y_clone")
        return y

    def _padding_tail(self) -> Tensor:
        """[1, c]: a padding token's payload tail (the padding expert id num_experts, weight 0), broadcast over rows."""
        if self._pad_tail is None:
            k = self.top_k
            ids = torch.full((1, k), self.num_experts, dtype=torch.int32, device=self.device)
            self._pad_tail = pack_tail(ids, torch.zeros((1, k), device=self.device), self.dtype)
        return self._pad_tail

    def _routed_bufs(self, b: int, static: bool) -> dict[str, Tensor]:
        """Static buffers of a routed expert bucket of b slots: the payloads of b // k tokens in, their b // k * k
        slot rows (inside), b // k partial sums out, and the fixed slot -> token row index."""
        def make() -> dict[str, Tensor]:  # (outside any capture)
            H, dt, dev, k = self.spec.hidden_size, self.dtype, self.device, self.top_k
            bt = b // k
            return {"payload": torch.zeros((bt, H + payload_columns(k, dt)), dtype=dt, device=dev),
                    "slots": torch.zeros((bt * k, H), dtype=dt, device=dev),
                    "zero": torch.zeros((bt, H), dtype=dt, device=dev),  # topk_merge's residual: sums start from 0
                    "y": torch.zeros((bt, H), dtype=dt, device=dev),
                    "slot_row": torch.arange(bt * k, device=dev) // k, "arange": torch.arange(bt * k, device=dev)}
        return self._kept(("expert_routed", b), static, make)

    def _routed_body(self, layer: int, bufs: dict[str, Tensor], select: tuple[Tensor, Tensor]):
        row, mine_of = select
        payload, slots, zero, y_out, slot_row, ar = (bufs[n] for n in ("payload", "slots", "zero", "y", "slot_row",
                                                                           "arange"))
        H, k = self.spec.hidden_size, self.top_k
        slot_of = ar.view(-1, k)  # [b / k, k]: token t's slot j is row t*k + j of `slots`
        ffn = self._ffn_rows(layer)

        def body() -> None:
            # views of the static input, made while capturing (or a small copy inside the graph where an odd hidden
            # size leaves the ids unaligned: routed_rows.unpack)
            xt, ids, wts = unpack_routed(payload, H)
            sel = ids.reshape(-1).to(torch.int64)
            mine = mine_of[sel]
            ffn(xt.index_select(0, slot_row), row[sel].to(torch.int64), ar, slots, sentinels_anywhere=True)
            slots.masked_fill_(~mine.unsqueeze(1), 0)
            y_out.copy_(topk_merge(zero, None, slots, slot_of, wts))
        return body

    def _row_index(self, T: int, k: int) -> Tensor:
        idx = self._index_cache.get((T, k))
        if idx is None:
            idx = torch.arange(T * k, dtype=torch.int64, device=self.device).view(T, k)
            if len(self._index_cache) < 4096:
                self._index_cache[(T, k)] = idx
        return idx

    @torch.no_grad()
    def combine(self, h_res: Tensor, shared: Optional[Tensor], y: Tensor, weights: Tensor,
                row_index: Optional[Tensor] = None, feeds_attention: bool = False) -> Tensor:
        """h_next = h_res + sum_j w_j y_j (+ shared) in one topk_merge launch (bit-equal to
        models.moe.combine: same fp32 operations in the same order). y [T, k, H], or rows [N, H]
        gathered through `row_index` [T, k] by the kernel itself (no gathered copy). `feeds_attention`: the rows
        go on to an attention stage; they are then written into the static input of the attention bucket they fit
        when no other output waits there, and that batch replays without copying them in (_attn_input)."""
        h_res, shared, y = self._to_dev(h_res), self._to_dev(shared), self._to_dev(y)
        w = self._to_dev(weights, torch.float32)
        out = self._claim_attn_input(h_res.shape[0]) if feeds_attention else None
        if row_index is not None:
            return topk_merge(h_res, shared, y, self._to_dev(row_index), w, out=out)
        T, k, H = y.shape
        return topk_merge(h_res, shared, y.reshape(T * k, H), self._row_index(T, k), w, out=out)
