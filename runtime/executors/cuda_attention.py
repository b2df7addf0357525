"""The CUDA executor's attention stage: a decode or mixed batch as one graph replay per (layer, bucket, KV store).

Every batch whose sequences have device page-table rows (runtime/executors/kv_cache_paged_gpu.py) runs padded to the
plan's bucket through the paged kernels: the stage function itself (models.layers.attention_stage) with the attend
step in its paged form (`PagedStep`: K/V written into the paged cache through the device page tables, GQA's RoPE fused
with that write, `dataflow_kernels.paged_attention` over the cache) and the RMSNorm kernel, followed by the router and the
shared expert (models.layers.route / shared_expert): on CUDA one CUDA graph. MLA layers attend over the latent cache
(`PagedStep.attend_latent`, kernels/mla_attention.py: the Triton decode kernel where its tiles fit, else capturable torch
ops; every row, prompt chunks' too, in the absorbed form). Padded rows have position -1 (context
length 0, so the kernel reads nothing), write their K/V into a trash page, and their outputs are never read.
The host per batch: one pinned int32 [5, bucket] upload (positions, table rows, row blocks), the input copy (often
none: the combine wrote it in place, cuda_buffers.py), one replay, the routing's D2H copy into a pinned slot.
The rest (a sequence without a table row; prompts="eager") runs the stage function over the host tables.
"""
from __future__ import annotations

import functools
import weakref
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from dataflow_kernels.paged_attention import (clear_block_rows, paged_decode_attention_torch, paged_decode_attention_triton,
                                     paged_row_block_attention_triton, row_blocks)
from dataflow_kernels.mla_attention import paged_mla_attention
from dataflow_kernels.rms_norm import rms_norm_fused
from dataflow_kernels.rope_kv_write import cache_write, rope_kv_write, rope_kv_write_torch, rope_table
from models import layers
from models.attention import latent_cache, rms_norm
from models.rope import rotation
from runtime.core.routed_rows import pack as pack_routed, pack_tail, payload_columns
from runtime.executors.capture import bucket_for
from runtime.executors.cuda_buffers import Pending, same_list, timed
from runtime.executors.kv_cache_paged_gpu import DeviceBlockTables

PROMPT_PATHS = ("paged", "eager")  # CudaExecutor(prompts=...)
# A layer whose window is shorter than this runs batches with prompt chunks row by row (the decode kernel): each row
# re-reads at most the window's keys, and a block's tile then costs more than the reads it saves (GPT-OSS's 128-key
# window: a 128-row chunk 0.20 ms per layer by blocks against 0.17 row by row). Measured at 128 and without a window
# only; 1024 is where the rows' re-reading is eight times the window-128 case's.
ROW_BLOCK_MIN_WINDOW = 1024


class PagedStep:
    """models.attention.PagedAttend over one bucket's static buffers: `meta` rows 0-1 hold each row's position (-1:
    padding) and device table row. Made once per graph body; its methods run inside the body (capturable)."""

    def __init__(self, meta: Tensor, table: Tensor, block_size: int, kc: Tensor, vc: Tensor, attend_kernel,
                 rope_kv, cos_tab: Optional[Tensor], sin_tab: Optional[Tensor], rope, latent_impl: str = "torch") -> None:
        """`latent_impl`: dataflow_kernels.mla_attention.paged_mla_attention's impl for MLA layers (kc is then the latent
        cache)."""
        self.meta, self.table, self.bs, self.kc, self.vc = meta, table, block_size, kc, vc
        self.kernel, self.rope_kv, self.cos_tab, self.sin_tab, self.rope = attend_kernel, rope_kv, cos_tab, sin_tab, rope
        self.latent_impl = latent_impl
        self.fuses_rope = cos_tab is not None
        self._posc: Optional[Tensor] = None

    def cos_sin(self) -> tuple[Tensor, Tensor]:
        # padded rows (position -1) rotate at 0 and write the trash page (discarded)
        self._posc = self.meta[0].to(torch.int64).clamp(min=0)
        return self.rope(self._posc)

    def attend(self, q: Tensor, k: Tensor, v: Tensor, scale: float, window: Optional[int],
               sinks: Optional[Tensor]) -> Tensor:
        meta, table, bs, kc, vc = self.meta, self.table, self.bs, self.kc, self.vc
        bt = table.index_select(0, meta[1])  # [b, width] int32: this batch's page tables
        if self.fuses_rope:
            q, ctx = self.rope_kv(q, k, v, meta[0], meta[1], table, bs, self.cos_tab, self.sin_tab, kc, vc)
        else:
            cache_write(self._posc, meta[1], table, bs, (k, kc), (v, vc))
            ctx = (meta[0].to(torch.int64) + 1).to(torch.int32)
        return self.kernel(q, kc, vc, bt, ctx, scale, sinks, window)

    def attend_latent(self, q: Tensor, c: Tensor, kv_lora_rank: int, scale: float, window: Optional[int],
                      sinks: Optional[Tensor]) -> Tensor:
        meta, table, bs = self.meta, self.table, self.bs
        bt = table.index_select(0, meta[1])
        cache_write(self._posc, meta[1], table, bs, (c, self.kc))
        ctx = (meta[0].to(torch.int64) + 1).to(torch.int32)
        return paged_mla_attention(q, self.kc, kv_lora_rank, bt, ctx, scale, sinks, window, impl=self.latent_impl)


class AttentionMixin:
    """CudaExecutor's attention methods (runtime/executors/cuda_executor.py composes it)."""

    @torch.no_grad()
    @timed("attn")
    def attention(self, layer: int, h: Tensor, positions: list[int], segments: list[tuple[int, int, int]],
                  kv) -> tuple[Tensor, Tensor]:
        tm = self._attn_timer
        tm.start()
        self._pending = None
        tm.lap("drop_pending")
        h = self._to_dev(h)
        T = h.shape[0]
        if self._mla and not latent_cache(kv):
            raise ValueError("the CUDA executor keeps MLA layers' KV cache latent: a store with mla_latent=False "
                             "(decompressed per head) is for the torch executor and the reference only")
        dv = self._view(kv)
        tm.lap("view")
        rows, fits = dv.batch_rows(segments, positions, T)  # every row's table row, and whether all have one
        b = bucket_for(T, self.buckets["attn"])
        if fits and (self.prompts == "paged" or len(rows) == len(segments)):
            if b is None:
                self.stats.note("attn: batch above the largest bucket")
            blocks = None
            if len(rows) != len(segments):
                self.stats.attn_paged_prompt += 1
                if self._row_blocked(layer):
                    blocks = row_blocks(segments, self.block_rows)
            return self._attn_paged(layer, h, positions, rows, dv, kv, b, blocks)
        held = self._claims.get(b)
        if held is not None and held() is h:  # read where it is: the claim is spent (kept, a later batch would move it)
            del self._claims[b]
        if not fits:
            self.stats.note("attn: a sequence without a device table row, or a position past the tables' width")
        self.stats.attn_eager += 1
        return self._attn_eager(layer, h, positions, segments, kv)

    def _attn_eager(self, layer, h, positions, segments, kv):
        pos = self.staging.upload(np.array(positions, dtype=np.int64))[0]
        h_res, x = layers.attention_stage(self.spec, self.w, layer, h, pos, segments, kv, positions)
        if self.spec.is_moe_layer(layer):
            if self.keyed_router is None:
                ids, wts = layers.route(self.spec, self.w, layer, x)
            else:
                base = [0] * h.shape[0]
                for seq, start, n in segments:
                    base[start:start + n] = [self.keyed_router.request_base(seq)] * n
                base0 = self._to_dev(torch.tensor(base, dtype=torch.int64))
                ids, wts = self.keyed_router.route_torch(layer, base0, pos)
            shared = layers.shared_expert(self.spec, self.w, layer, x)
            routing = pack_routed(x, ids, wts) if self.route_on_device else torch.cat([ids.to(torch.float32), wts], 1)
            self._set_pending(x, shared, routing, own=True)
        return h_res, x

    def _set_pending(self, x: Tensor, shared: Optional[Tensor], routing: Tensor, own: bool) -> None:
        """What an attention call leaves beyond (h_res, x): the routing kept on the device with route_on_device (the
        payload, runtime/core/routed_rows.py), else on its way to the host ([T, 2k] fp32: ids as values, then
        weights). `own`: the payload is the batch's own tensor, not a view of a static buffer (which the next batch of
        the bucket rewrites: cloned here)."""
        if self.route_on_device:
            self._pending = Pending(x, None, shared, routing if own else routing.clone())
        else:
            self._pending = Pending(x, self.staging.d2h(routing), shared)

    def _row_blocked(self, layer: int) -> bool:
        """Whether `layer` runs a batch with prompt chunks by row blocks (see ROW_BLOCK_MIN_WINDOW)."""
        # (MLA's latent rows are one kv head for all query heads: a block's tile, rows x heads, would not fit)
        window = self.spec.attention.window(layer)
        return self.block_rows > 0 and not self._mla and (window is None or window >= ROW_BLOCK_MIN_WINDOW)

    def _rope_table(self, positions: int) -> tuple[Tensor, Tensor]:
        """cos, sin [positions, r/2] on the device (dataflow_kernels.rope_kv_write.rope_table), made once per length."""
        return self._kept(("rope", positions), True, lambda: rope_table(self._inv_freq, self._rope_scaling, positions))

    def _attn_bufs(self, b: int, static: bool) -> dict[str, Tensor]:
        def make() -> dict[str, Tensor]:
            H, dt, dev = self.spec.hidden_size, self.dtype, self.device
            nout = 3 if self.spec.experts.shared_intermediate_size else 2
            bufs = {"h": torch.zeros((b, H), dtype=dt, device=dev),
                    # positions, table rows; and for a batch with prompt chunks its row blocks' first rows and row
                    # counts and the decode kernel's context of its other rows
                    # (dataflow_kernels.paged_attention.paged_row_block_attention_triton)
                    "meta": torch.zeros((5, b), dtype=torch.int32, device=dev),
                    "out": torch.zeros((nout, b, H), dtype=dt, device=dev),
                    "route": torch.zeros((b, 2 * self.top_k), dtype=torch.float32, device=dev)}
            if self.spec.moe_layers:  # the device-routed payload: x's rows, ids, weights (runtime/core/routed_rows.py)
                bufs["payload"] = torch.zeros((b, H + payload_columns(self.top_k, dt)), dtype=dt, device=dev)
            return bufs
        return self._kept(("attn", b), static, make)

    def _attn_body(self, layer: int, bufs: dict[str, Tensor], dv: DeviceBlockTables, kv, blocked: bool = False):
        """The attention stage of a bucket's rows: the stage function with its paged attend step (`PagedStep`), then
        the router and the shared expert. `blocked`: the attention by row blocks (meta rows 2-4; a batch with prompt
        chunks on the Triton kernels: dataflow_kernels.paged_attention.paged_row_block_attention_triton), the same result as
        the decode kernel's with each K/V tile read once per block of a chunk's rows."""
        spec, w = self.spec, self.w
        h_in, meta, out, route_out = bufs["h"], bufs["meta"], bufs["out"], bufs["route"]
        payload = bufs.get("payload")
        H = spec.hidden_size
        kc, vc = kv.storage(layer)
        table, bs = dv.table, kv.block_size
        moe, k = spec.is_moe_layer(layer), self.top_k
        triton = self.attn_impl == "triton"
        kernel = paged_decode_attention_triton if triton else paged_decode_attention_torch
        if blocked:
            kernel = functools.partial(paged_row_block_attention_triton, first=meta[2], count=meta[3],
                                       solo_lens=meta[4], rows_per_block=self.block_rows)
        # one launch per norm, and RoPE + the KV write in one, where the attention kernels are Triton's
        # (kernels/rms_norm.py, kernels/rope_kv_write.py); else the torch references
        norm = rms_norm_fused if triton else rms_norm
        cos_t, sin_t = self._rope_table(table.shape[1] * bs) if self._rope_kv_fused else (None, None)
        step = PagedStep(meta, table, bs, kc, vc, kernel, rope_kv_write if triton else rope_kv_write_torch,
                         # models.rope.cos_sin of the positions, inv_freq already on the device (no H2D copy in a graph)
                         cos_t, sin_t, functools.partial(rotation, self._inv_freq, self._rope_scaling), self.attn_impl)
        router, keys = self.keyed_router, dv.keys

        def body() -> None:
            _, x = layers.attention_stage(spec, w, layer, h_in, None, (), None, paged=step, norm=norm, out=out[0])
            out[1].copy_(x)
            if moe:
                if router is None:
                    ids, wts = layers.route(spec, w, layer, x)
                else:  # keyed by (request, position, layer): the row's request base from its table row
                    ids, wts = router.route_torch(layer, keys.index_select(0, meta[1]), meta[0].to(torch.int64))
                route_out[:, :k].copy_(ids)
                route_out[:, k:].copy_(wts)
                # both dispatches' forms (the barriers switch route_on_device between runs): ~1.5 MB more
                # written per 256-row batch in bf16, under a microsecond of HBM time
                payload[:, :H].copy_(x)
                payload[:, H:].copy_(pack_tail(ids, wts, payload.dtype))
                if out.shape[0] > 2:
                    out[2].copy_(layers.shared_expert(spec, w, layer, x))
        return body

    def _attn_paged(self, layer, h, positions, rows, dv, kv, b, blocks=None):
        """`blocks`: (first rows, row counts) of a batch with prompt chunks for the row-block attention (None: the
        decode kernel)."""
        T = h.shape[0]
        static = b is not None
        b = b if static else T
        bufs = self._attn_bufs(b, static)
        trash = dv.trash_row

        def fill(a: np.ndarray) -> None:
            a[0, :T] = positions
            a[0, T:] = -1
            a[1, :T] = rows
            a[1, T:] = trash
            if blocks is not None:  # the chunks' row blocks, the rest unused; the other rows' context (padding: 0)
                first, count = blocks
                a[2, :len(first)] = first
                a[3, :len(first)] = count
                a[3, len(first):] = 0
                a[4, :T] = a[0, :T] + 1
                a[4, T:] = 0
                clear_block_rows(a[4], first, count)
        tm = self._attn_timer
        # The bucket's meta buffer may hold these rows already: a decode wave's next layer is usually the same
        # batch (same requests, positions and table rows), and the buffer keeps what the last upload wrote (each
        # replay reads it in stream order). Comparing two lists is a few us; the upload ~50-80 us on the H200 host.
        last = self._meta_last.get(b) if static else None
        if last is None or last[0] != trash or not same_list(last[1], positions) or not same_list(last[2], rows) or blocks:
            self.staging.h2d_array(bufs["meta"], fill)
            if static:
                self._meta_last[b] = (trash, positions, rows) if blocks is None else None
        tm.lap("meta_h2d")
        h_in, out_T, route_T, payload_T = self._kept(("attn", b, T), static, lambda: (
            bufs["h"][:T], bufs["out"][:, :T], bufs["route"][:T],
            bufs["payload"][:T] if "payload" in bufs else None))
        h = self._attn_input(b, h) if static else h
        if h is not None:
            h_in.copy_(h)
        else:
            self.stats.attn_claims_used += 1
        tm.lap("h_copy")
        if static:
            self._release_outputs(b)
            key = ("attn", layer, b, kv._cuda_exec_serial) + (("blocks",) if blocks is not None else ())
            g = self.graphs.get(key, lambda: self._attn_body(layer, bufs, dv, kv, blocks is not None), self.attn_graphs)
            g.run()
            self.stats.attn_graph += int(g.capture)
            self.stats.attn_paged_eager += int(not g.capture)
        else:
            self._attn_body(layer, bufs, dv, kv, blocks is not None)()
            self.stats.attn_paged_eager += 1
        tm.lap("replay")
        skip = self._out_skip.get(b, 0) if static else 0
        if skip:  # backing off: one copy, the static buffers are reused by the next batch
            self._out_skip[b] = skip - 1
            out = out_T.clone().unbind(0)
        else:  # views of the outputs where the graph wrote them (an eager batch's buffers are its own anyway)
            out = out_T.unbind(0)
            if static:
                self._out_claims[b] = [weakref.ref(t) for t in out]
        h_res, x = out[0], out[1]
        tm.lap("out_clone")
        if self.spec.is_moe_layer(layer):
            shared = out[2] if len(out) > 2 else None
            # (a payload from the static buffer is cloned: the next batch of the bucket rewrites it)
            self._set_pending(x, shared, payload_T if self.route_on_device else route_T, own=not static)
        tm.lap("route_d2h")
        return h_res, x
