"""CUDA executor: the TorchExecutor interface, run through per-bucket CUDA graphs and Triton kernels.

Same methods, same results up to floating point rounding, as runtime/executors/torch_executor.py; the engine does
not know which one it has. What differs is how the work reaches the GPU:

attention(layer, h, positions, segments, kv)
  Decode batches (every segment one row, every sequence with a device table row) run the whole
  layer as ONE graph replay per (layer, bucket, KV store): input norm, q/k/v + RoPE, KV write
  into the paged cache through device page tables, `kernels.paged_attention` (Triton
  flash-decoding), output projection, residual, post-attention norm, router, shared expert. The
  batch is padded to the plan's bucket: padded rows have position -1 (context length 0, so the
  kernel reads nothing), write their K/V into a trash page, and their outputs are never copied out.
  The host per batch: fill one pinned int32 [2, bucket] array (positions, table rows), one H2D copy,
  one D2D copy of h into the static input, one replay, one D2D copy of the outputs out of the
  static buffers, one D2H copy of the routing ids + weights into pinned memory + an event.
  Prefill / mixed batches (rows attend to each other) take the eager torch path: the very stage
  function the TorchExecutor runs, over the same paged storage.
route(layer, x) / shared_expert(layer, x)
  Return what the attention graph already computed for that x. route() is the one host
  synchronization of the hot path: the engine must know the experts to dispatch (it waits on the
  event of the D2H copy; ids/weights come back as CPU tensors, which is what the engine's dispatch
  loop indexes per row without further device round trips).
experts(layer, x, expert_ids)
  One graph per (layer, bucket): permute the rows into expert order (counting sort on the device),
  gather, grouped FFN (Triton, or torch._grouped_mm), scatter back. The expert ids live in a static
  device buffer the graph reads, so a new split of rows over experts never re-captures. Padded
  rows get the sentinel expert E: never placed in an expert's range, never computed (for
  torch._grouped_mm, whose bias gather cannot take the sentinel, they repeat the first row's
  expert instead: computed, discarded). Weights holding only some experts (a rank's shard,
  ModelWeights.held) are indexed by row: the host translates the engine's global ids with one
  numpy table lookup per batch while filling the ids buffer, and the layer's body sorts into as
  many bins as the layer holds experts (sentinel ids clamp to that count).
combine(...)  `kernels.topk_merge` (one launch; same fp32 order as models.moe.combine, bit-equal).
logits / sample: one graph per sample bucket (the plan's "sample" buckets): final norm, LM head and the greedy
  argmax into a static ids buffer, copied to the host once (D2H into a pinned slot). The logits themselves stay
  inside the graph's pool; a caller that reads them (a sampling row, a test) gets them recomputed eagerly from the
  same rows. Above the largest bucket: eagerly.

CPU twin: on a CPU device (or with graphs=False) the very same bucket / padding / body code runs,
without capture, with the torch reference kernels, so CPU tests cover the padding semantics.
"""
from __future__ import annotations

import atexit
import functools
import os
import sys
import time
import weakref
from dataclasses import dataclass, field
from typing import Optional

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor

from graph_ir.spec import ModelSpec
from kernels.grouped_ffn import grouped_ffn_grouped_mm, grouped_ffn_torch, grouped_ffn_triton
from kernels.paged_attention import (block_rows_for, clear_block_rows, paged_decode_attention_torch,
                                     paged_decode_attention_triton, paged_row_block_attention_triton, row_blocks)
from kernels.permute import permute_to_experts_triton
from kernels.rms_norm import rms_norm_fused
from kernels.rope_kv_write import kv_write_torch, rope_kv_write, rope_kv_write_torch, rope_table
from kernels.topk_merge import topk_merge
from models import layers
from models.attention import gqa_project, gqa_qkv, mla_qkv, norm_in_fp32, rms_norm, softmax_scale
from models.moe import route_tokens, shared_expert_out
from models.rope import rope_parameters, rotary_dim
from models.sampling import SamplingParams, sample, sample_tokens
from models.weights import ModelWeights, stack_qkv
from runtime.executors.capture import GraphCache, StaticBuffers, bucket_for
from runtime.executors.cuda_stream import current_stream
from runtime.executors.device_index import to_device
from runtime.executors.host_staging import HostStaging, PendingHost  # noqa: F401 (PendingHost: part of this module's API)
from runtime.executors.kv_cache_paged_gpu import DeviceBlockTables
from runtime.core.routed_rows import (device_routed_from_env, pack as pack_routed, pack_tail, payload_columns,
                                 unpack as unpack_routed)
from runtime.observability.step_timer import StepTimer

_GREEDY = SamplingParams()
# Published StreamEP buckets, used when no plan is given (lowering/plan.py has the same lists).
_DEFAULT_BUCKETS = {"attn": [1, 8, 40, 72, 104, 128, 192, 256], "expert": [128, 256, 512, 1024],
                    "sample": [1, 8, 40, 72, 104, 128, 192, 256]}

ATTN_IMPLS = ("triton", "torch")
FFN_IMPLS = ("triton", "grouped_mm", "torch")
PERMUTE_IMPLS = ("triton", "torch")


# ---------------------------------------------------------------------------------------------
# logits handed to sample()


class DeviceLogits:
    """logits [T, V] plus the batched greedy argmax, copied to the host once. `argmax`: the ids already computed on
    the device, or a function that computes them (the sample graph's replay: its ids are its static buffer), called
    only when the ids are first wanted, so a batch that samples from the eager logits never replays the graph (its LM
    head would run twice); the logits are computed only if read, by `eager()` (the same rows through the same ops).
    `n`: the rows, when neither the logits nor the ids are given yet."""

    def __init__(self, logits: Optional[Tensor], staging: HostStaging, argmax=None, eager=None,
                 n: Optional[int] = None) -> None:
        self._tensor, self._eager, self._staging = logits, eager, staging
        self._make_ids = argmax if callable(argmax) else None
        self._ids: Optional[Tensor] = None if callable(argmax) else argmax
        self._n = logits.shape[0] if logits is not None else (n if n is not None else argmax.shape[0])
        self._copy = None  # the ids' copy to the host (HostStaging.d2h), made with the ids
        self._host: Optional[list[int]] = None

    @property
    def _argmax(self):
        """The ids' copy to the host, the ids made first if they are not yet."""
        if self._copy is None:
            if self._ids is None:
                # the ids: the logits' argmax, or the function's (a sample graph's static buffer)
                self._ids = self._make_ids() if self._make_ids is not None else torch.argmax(self._tensor, dim=-1)
            self._copy = self._staging.d2h(self._ids)
        return self._copy

    @property
    def tensor(self) -> Tensor:
        if self._tensor is None:
            self._tensor = self._eager()
        return self._tensor

    def __len__(self) -> int:
        return self._n

    @property
    def shape(self):
        return self.tensor.shape

    def greedy(self, i: int) -> int:
        if self._host is None:
            self._host = self._argmax.wait().tolist()
            self._argmax.release()
        return self._host[i]

    # the engine's asynchronous sampling (CudaExecutor.sample_batch_start): the greedy ids, read once copied
    def ready(self) -> bool:
        return self._host is not None or self._argmax.ready()

    def wait(self) -> None:
        """Block until ready() (the engine's driver, when it has nothing else to run)."""
        if self._host is None:
            self._argmax.wait()

    def tokens(self) -> list[int]:
        if len(self):
            self.greedy(0)  # reads the copy once (and releases its slot)
        return list(self._host or [])

    def device_ids(self, rows: Optional[list[int]] = None) -> Tensor:
        """The token ids of rows `rows` (all when None: the argmax, or the ids sample_tokens drew) as a device tensor
        of their own, queued right behind them (the engine's step-ahead: the next step embeds them before the host has
        read them; a copy, since the sample graph's buffer is rewritten by its next replay)."""
        self._argmax  # the ids exist (and are on their way to the host)
        if rows is None:
            return self._ids.clone()
        return self._ids.index_select(0, to_device(np.asarray(rows, dtype=np.int64), self._ids.device))

    def __getitem__(self, i: int) -> "LogitsRow":
        return LogitsRow(self, i)


@dataclass
class LogitsRow:
    parent: DeviceLogits
    index: int

    @property
    def tensor(self) -> Tensor:
        return self.parent.tensor[self.index]


# ---------------------------------------------------------------------------------------------


@dataclass
class _Pending:
    """What the last attention call computed beyond (h_res, x): served to route / shared_expert, or handed
    to the engine as a whole by route_start (asynchronous dispatch: ready() / result())."""

    x: Tensor
    route: Optional[PendingHost]
    shared: Optional[Tensor]
    k: int
    # kept on the device (DATAFLOW_DISPATCH=device): the payload [T, H + c], rows, int32 ids and fp32 weights in
    # routed_rows.pack's layout
    on_device: Optional[Tensor] = None

    def ready(self) -> bool:
        """The routing has reached the host (never blocks)."""
        return self.route.ready()

    def wait(self) -> None:
        """Block until ready() (the engine's driver, when it has nothing else to run)."""
        self.route.wait()

    def result(self) -> tuple[np.ndarray, np.ndarray]:
        """(ids [T,k] int64, weights [T,k] float32) as numpy arrays (what the engine dispatches with), copied
        out of the pinned ring slot (it is reused a few batches later) and the slot released."""
        return self.read(self.route.wait())

    def read(self, v: Tensor) -> tuple[np.ndarray, np.ndarray]:
        # numpy, not torch: one torch call (the view) instead of four slices and copies, and none later for
        # the engine's .numpy() and the merge's weight packing (torch calls are what costs on the H200 host)
        # (ids [T, k] int64, weights [T, k] fp32) of the routing as the attention graph writes it ([T, 2k] fp32: ids
        # as values, then weights), copied (the array is a pinned slot the ring reuses)
        a, k = v.numpy(), self.k
        out = a[:, :k].astype(np.int64), a[:, k:].copy()
        self.route.release()
        return out


@dataclass
class ExecStats:
    attn_graph: int = 0
    attn_paged_eager: int = 0  # through the paged kernels without a graph (over the largest bucket, or graphs off)
    attn_paged_prompt: int = 0  # batches holding a prompt's chunk that went through the paged kernels
    attn_eager: int = 0  # by models.attention (a sequence without a table row; prompts='split' / 'eager')
    attn_claims_used: int = 0  # decode batches whose input a combine had written in place (no input copy)
    attn_claims_moved: int = 0  # another output's rows moved out of a bucket's input first (_attn_input)
    attn_outputs_moved: int = 0  # a bucket's last outputs still held when it replayed again: moved out first
    expert_graph: int = 0
    expert_eager: int = 0
    route_wait_s: float = 0.0  # route_arrays()'s waits for the routing copy (also counted in staging.wait_s)
    eager_reasons: dict = field(default_factory=dict)

    def note(self, why: str) -> None:
        self.eager_reasons[why] = self.eager_reasons.get(why, 0) + 1


def _same(a: list, b: list) -> bool:
    """Equal lists, by identity first: a decode wave hands every layer the same position and table-row lists, where
    comparing 256-512 items costs a few us per batch."""
    return a is b or a == b


_CLAIM_BACKOFF = 64  # claims a bucket skips after one of its claims had to be moved out (CudaExecutor._claim_skip)


PROMPT_PATHS = ("paged", "eager")  # CudaExecutor(prompts=...)
# A layer whose window is shorter than this runs batches with prompt chunks row by row (the decode kernel): each row
# re-reads at most the window's keys, and a block's tile then costs more than the reads it saves (run 152, GPT-OSS's
# 128-key window: a 128-row chunk 0.20 ms per layer by blocks against 0.17 row by row). Measured at 128 and without a
# window only; 1024 is where the rows' re-reading is eight times the window-128 case's.
ROW_BLOCK_MIN_WINDOW = 1024


def _env(name: str, default: str, valid: tuple) -> str:
    v = os.environ.get(name, "").strip().lower() or default
    if v not in valid:
        raise ValueError(f"{name}={v!r}: expected one of {', '.join(valid)}")
    return v


class CudaExecutor:
    # Every attention batch whose sequences have device page-table rows runs through the bucketed path (`_attn_paged`:
    # the paged kernels, a CUDA graph on CUDA), prompt chunks and decode rows alike; the rest by models.attention.

    def __init__(self, spec: ModelSpec, weights: ModelWeights, plan=None, device=None, *,
                 graphs: Optional[bool] = None, attn_impl: Optional[str] = None, ffn_impl: Optional[str] = None,
                 permute_impl: Optional[str] = None, max_context: Optional[int] = None,
                 table_rows: int = 4096, buckets: Optional[dict] = None,
                 route_on_device: Optional[bool] = None, prompts: str = "paged") -> None:
        """`plan`: its capture buckets are used (else the published ones); `device`: default the
        weights' device. Implementation choices default to the fast ones on CUDA and the torch
        references on CPU; env DATAFLOW_ATTN_IMPL / DATAFLOW_FFN_IMPL / DATAFLOW_PERMUTE_IMPL or
        the arguments override. `max_context`: tokens a sequence may have for the graph path
        (device page-table width); longer ones run eagerly. `route_on_device`: keep each attention batch's
        routing on the device for the device-routed dispatch (default: the plan's dispatch, or by device without
        one; DATAFLOW_DISPATCH overrides: runtime/core/routed_rows.py; the barrier baselines, which read the routing on
        the host, pass False). `prompts`: how a batch holding a prompt's chunk runs (A/B runs; PROMPT_PATHS): "paged"
        (the default) like a decode batch, through the paged kernels (a CUDA graph up to the largest bucket); "eager"
        by models.attention (before session 18; session 17 ran a mixed batch's decode rows through the paged kernels
        and the chunk by models.attention: gone, "paged" was 2-37x faster per layer, runs 149-150)."""
        self.spec = spec
        self.device = torch.device(device) if device is not None else weights.embed.device
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.w = weights if weights.embed.device == self.device else weights.to(self.device)
        self.dtype = self.w.embed.dtype
        on_cuda = self.device.type == "cuda"
        self.attn_impl = attn_impl or _env("DATAFLOW_ATTN_IMPL", "triton" if on_cuda else "torch", ATTN_IMPLS)
        self.ffn_impl = ffn_impl or _env("DATAFLOW_FFN_IMPL", "triton" if on_cuda else "torch", FFN_IMPLS)
        self.permute_impl = permute_impl or _env("DATAFLOW_PERMUTE_IMPL", "triton" if on_cuda else "torch",
                                                 PERMUTE_IMPLS)
        for name, v, valid in (("attn_impl", self.attn_impl, ATTN_IMPLS), ("ffn_impl", self.ffn_impl, FFN_IMPLS),
                               ("permute_impl", self.permute_impl, PERMUTE_IMPLS)):
            if v not in valid:
                raise ValueError(f"{name}={v!r}: expected one of {valid}")
        if self.ffn_impl == "grouped_mm":
            from kernels.grouped_ffn import grouped_mm_supported
            probe = torch.empty(1, spec.hidden_size, dtype=weights.embed.dtype, device=self.device)
            wg = next((weights.layers[l]["experts.gate"] for l in spec.moe_layers), None)
            if wg is None or not grouped_mm_supported(probe, wg):
                raise ValueError("ffn_impl=grouped_mm: torch._grouped_mm does not support these shapes/dtype/device")
        src = buckets or (plan.capture.buckets if plan is not None else _DEFAULT_BUCKETS)
        self.buckets = {k: sorted(v) for k, v in src.items()}
        graphs = on_cuda if graphs is None else (graphs and on_cuda)
        # The torch references synchronize with the host (offsets / lengths .tolist()): not capturable.
        self.attn_graphs = graphs and self.attn_impl != "torch"
        self.expert_graphs = graphs and self.ffn_impl != "torch"
        self.graphs = GraphCache(self.device, graphs)
        self.staging = HostStaging(self.device)
        # keep each batch's routing on the device (no copy to the host); the engine follows this choice. Default:
        # the plan's dispatch (by device for a plan that does not record one, or no plan)
        if route_on_device is None:
            planned = plan.cluster.dispatch if plan is not None else None
            route_on_device = device_routed_from_env(planned == "device" if planned is not None else on_cuda)
        self.route_on_device = route_on_device
        # Rows per block of the row-block attention for batches with prompt chunks (0: the decode kernel for them too,
        # as with the torch reference, whose result is the same; A/B runs set it to 0 after construction, or
        # DATAFLOW_ROW_BLOCKS=0). On by default since run 153 (NOTES §36 item 1)
        a_ = spec.attention
        on = self.attn_impl == "triton" and os.environ.get("DATAFLOW_ROW_BLOCKS", "1") == "1"
        self.block_rows = block_rows_for(a_.num_heads, a_.num_kv_heads) if on else 0
        if prompts not in PROMPT_PATHS:
            raise ValueError(f"prompts={prompts!r}: expected one of {PROMPT_PATHS}")
        self.prompts = prompts
        self._routed_tables: dict[tuple, tuple] = {}  # (layer, id(owned)) -> (owned, _routed_select's tables)
        self._pad_tail: Optional[Tensor] = None  # _padding_tail()
        self._meta_last: dict[int, tuple] = {}  # attention bucket -> (trash row, positions, rows) its meta buffer holds
        self.stats = ExecStats()
        self.last_prepare: Optional[dict] = None  # where the last prepare() spent its time (prepare's doc)
        a = spec.attention
        self._mla = a.kind == "mla"
        self._qkv = mla_qkv if self._mla else gqa_qkv
        if not self._mla:  # q, k and v in one GEMM (run 91: three GEMMs, 30 us at B=256; k's and v's latency-bound)
            self.w = stack_qkv(self.w)
        rdim = a.qk_rope_head_dim if self._mla else rotary_dim(a.rope, a.head_dim)
        inv_freq, self._rope_scaling = rope_parameters(a.rope, rdim)
        self._inv_freq = inv_freq.to(self.device)
        # GQA's rotate-half RoPE and the KV write run as one kernel in the attention body (kernels/rope_kv_write.py)
        # from a cos/sin table per position; MLA (interleaved pairs, latent K) keeps the torch ops
        self._rope_kv_fused = not self._mla and not a.rope.interleaved
        self._rope_tables: dict[int, tuple[Tensor, Tensor]] = {}  # positions -> (cos, sin) tables (_rope_table)
        if self._mla:
            self._k_row, self._v_row = (a.num_heads, a.qk_head_dim), (a.num_heads, a.v_head_dim)
        else:
            self._k_row, self._v_row = (a.num_kv_heads, a.head_dim), (a.num_kv_heads, a.head_dim)
        self._scale = softmax_scale(a)
        self._fp32w = norm_in_fp32(spec)
        self.max_context = max_context or min(spec.max_position, 8192)
        self.table_rows = table_rows
        self._views: dict[int, DeviceBlockTables] = {}  # kv serial -> device tables
        self._serial = 0
        self._pending: Optional[_Pending] = None
        # A router keyed by (request, position, layer) that runs inside the attention graph instead of
        # the model's (use_keyed_router); None: the model's router.
        self.keyed_router = None
        self._row_views: dict = {}  # (kind, bucket, rows) -> views of that bucket's static buffers (_first_rows)
        # attention bucket -> the combine output written straight into that bucket's static input (a weak reference
        # to it): the next attention batch of the bucket skips its input copy when that output is its input
        # (combine(feeds_attention=True), _attn_input)
        self._claims: dict[int, weakref.ref] = {}
        # attention bucket -> claims still to skip: after a claim had to be moved out (another wave's batch of the
        # bucket came first: in-process ranks sharing this executor take turns), writing in place costs a copy more
        # than it saves, so the bucket's combines stop claiming for a while
        self._claim_skip: dict[int, int] = {}
        # routed expert bucket -> the first token row from which on its static payload holds padding tails
        # (_experts_routed: a batch of T tokens leaves rows T.. as they were, so a batch of at least T skips padding)
        self._routed_padded: dict[int, int] = {}
        # attention bucket -> weak references to its last batch's outputs, handed out as views of the static output
        # buffer (no clone): they are read in place until the bucket replays again, which first moves out any still
        # held (_release_outputs); and -> batches still to clone after such a move (the same back-off as the claims)
        self._out_claims: dict[int, list] = {}
        self._out_skip: dict[int, int] = {}
        self._embed_ids: Optional[Tensor] = None  # device int64: the ids of a layer-0 batch (_embed_ids_rows)
        # DATAFLOW_PROFILE_EXEC=1: wall time per step of the attention / expert calls, printed at exit
        profile = os.environ.get("DATAFLOW_PROFILE_EXEC") == "1"
        self._attn_timer = StepTimer("executor attention", profile)
        self._expert_timer = StepTimer("executor experts", profile)
        self._embed_timer = StepTimer("executor embed", profile)  # (layer 0: 190-300 us per batch in run 121)
        if profile:
            atexit.register(lambda: print(f"{self._attn_timer.report()}\n{self._expert_timer.report()}\n"
                                          f"{self._embed_timer.report()}", file=sys.stderr))
        # When a list: (kind, start event, end event) per attention / expert call, recorded around
        # the call's device work (benchmarks/gpu_bench.py derives GPU time per batch from it).
        self.profile: Optional[list] = None
        self._timing_events: list = []  # made before a timed run (reserve_timing_events), used by _mark
        self._index_cache: dict[tuple[int, int], Tensor] = {}
        self._bufs_cache: dict[tuple[str, int], StaticBuffers] = {}  # (kind, bucket) -> its static buffers
        ex = spec.experts
        self.num_experts = ex.num_experts
        self.top_k = ex.top_k
        for l in spec.moe_layers:
            for n in ("experts.gate", "experts.up", "experts.down"):
                if not self.w.layers[l][n].is_contiguous():
                    self.w.layers[l][n] = self.w.layers[l][n].contiguous()
        # Per MoE layer: global id -> row of the held experts (-1: not held), as numpy for the
        # host-side fill; None where the layer holds every expert (ids are rows already).
        self._rows_of: dict[int, Optional[np.ndarray]] = {}
        for l in spec.moe_layers:
            lut = self.w.expert_lookup(l)
            self._rows_of[l] = None if lut is None else lut.numpy()

    # ------------------------------------------------------------------ KV store attachment
    def kv_rows(self) -> tuple[tuple, tuple, torch.dtype]:
        """(K row shape, V row shape, dtype) of one cached token per layer, as `_view` preallocates
        them (runtime/executors/kv_fit.py sizes the pool from it before any engine exists)."""
        return self._k_row, self._v_row, self.dtype

    def _view(self, kv) -> DeviceBlockTables:
        serial = getattr(kv, "_cuda_exec_serial", None)
        dv = self._views.get(serial) if serial is not None else None
        if dv is None:
            for layer in range(self.spec.num_layers):
                kv.preallocate(layer, self._k_row, self._v_row, self.dtype, self.device)
            width = -(-self.max_context // kv.block_size)
            self._serial += 1
            kv._cuda_exec_serial = self._serial
            dv = DeviceBlockTables(kv, width, self.table_rows, self.device, self.staging.upload)
            if self.keyed_router is not None:
                dv.track_keys(self.keyed_router.request_base)
            self._views[self._serial] = dv
        dv.flush()  # rows of sequences admitted since the last batch: before anything that reads the tables
        return dv

    def detach(self, kv) -> None:
        """Forget a KV store (its graphs bake its addresses): call when a run's engines are dropped."""
        serial = getattr(kv, "_cuda_exec_serial", None)
        if serial is None:
            return
        dv = self._views.pop(serial, None)
        if dv is not None:
            kv.device_view = None
        self.graphs.drop(lambda k: k[0] == "attn" and k[3] == serial)
        kv._cuda_exec_serial = None

    def use_keyed_router(self, router) -> None:
        """Route MoE layers with `router` inside the attention graph instead of the model's router.
        `router.request_base(seq_id) -> int` is hashed once per sequence into its device table row's
        key; `router.route_torch(layer, base0 [T], pos [T]) -> (ids, weights)` runs capturable torch ops
        (lab/zipf_torch.py). Same answers as wrapping this executor in
        KeyedRoutingExecutor, without the host work per batch (the bench's synthetic routing)."""
        self.keyed_router = router
        for dv in self._views.values():
            dv.track_keys(router.request_base)
        self.graphs.drop(lambda k: k[0] == "attn")  # captured with the previous router
        self._pending = None

    # ------------------------------------------------------------------ small pieces
    def _rope(self, pos: Tensor) -> tuple[Tensor, Tensor]:
        # Same ops as models.rope.cos_sin, with inv_freq already on the device (no H2D in a graph).
        freqs = pos.to(torch.float32)[:, None] * self._inv_freq[None, :]
        return freqs.cos() * self._rope_scaling, freqs.sin() * self._rope_scaling

    def _rope_table(self, positions: int) -> tuple[Tensor, Tensor]:
        """cos, sin [positions, r/2] on the device (kernels.rope_kv_write.rope_table), made once per length."""
        t = self._rope_tables.get(positions)
        if t is None:
            t = self._rope_tables[positions] = rope_table(self._inv_freq, self._rope_scaling, positions)
        return t

    def _positions(self, positions: list[int]) -> Tensor:
        out = torch.empty(len(positions), dtype=torch.int64, device=self.device)
        self.staging.h2d(out, torch.tensor(positions, dtype=torch.int64))
        return out

    def _to_dev(self, t: Optional[Tensor], dtype=None) -> Optional[Tensor]:
        if t is None:
            return None
        if t.device == self.device:
            return t if dtype is None else t.to(dtype)
        out = torch.empty(t.shape, dtype=dtype or t.dtype, device=self.device)
        self.staging.h2d(out, t.to(out.dtype))
        return out

    # ------------------------------------------------------------------ interface
    @torch.no_grad()
    def embed(self, token_ids) -> Tensor:
        """The rows of `token_ids` (layers.embed's values), gathered by one index_select from ids uploaded through the
        staging ring into a device buffer kept for them. `token_ids`: a list of ints, or int64 ids on the device
        already (the engine's step-ahead: a sample batch's greedy ids that the host has not read yet)."""
        tm = self._embed_timer
        tm.start()
        T = len(token_ids)
        if not T:
            return self.w.embed[:0]
        # The ids into a device buffer kept for them (an upload to a new tensor allocated one: 32-69 us, run 123's
        # trace), the rows straight into the attention bucket's static input they go to (the combine's claim, which
        # the layer-0 batch reads without a copy).
        if isinstance(token_ids, Tensor):
            ids = token_ids
        else:
            ids = self._embed_ids_rows(T)
            self.staging.h2d_array(ids, lambda a: a.__setitem__(slice(None), token_ids))
        tm.lap("upload")
        out = self._claim_attn_input(T)
        h = torch.index_select(self.w.embed, 0, ids) if out is None else torch.index_select(self.w.embed, 0, ids, out=out)
        tm.lap("index_select")
        return h

    def _embed_ids_rows(self, T: int) -> Tensor:
        """The first T entries of the device buffer for embedding ids (int64, grown to the largest batch seen), a view
        kept per T. One buffer serves every batch: each upload into it is queued after the previous batch's gather."""
        if self._embed_ids is None or self._embed_ids.numel() < T:
            self._embed_ids = torch.empty(max(T, 256), dtype=torch.int64, device=self.device)
        buf = self._embed_ids
        return self._first_rows(("embed_ids", buf.numel(), T), True, lambda: (buf[:T],))[0]

    def _row_blocked(self, layer: int) -> bool:
        """Whether `layer` runs a batch with prompt chunks by row blocks (see ROW_BLOCK_MIN_WINDOW)."""
        window = self.spec.attention.window(layer)
        return self.block_rows > 0 and (window is None or window >= ROW_BLOCK_MIN_WINDOW)

    def _mark(self) -> Optional[torch.cuda.Event]:
        if self.profile is None or self.device.type != "cuda":
            return None
        pool = self._timing_events
        ev = pool.pop() if pool else torch.cuda.Event(enable_timing=True)
        ev.record(current_stream(self.device))  # (Event.record() would build a Stream object: ~7 us)
        return ev

    def reserve_timing_events(self, n: int) -> None:
        """Make `n` timing events for _mark now, outside the timed run: an Event object and its CUDA event
        (created at its first record) cost two more calls inside every timed executor call otherwise."""
        if self.device.type != "cuda":
            return
        stream = current_stream(self.device)
        for _ in range(n - len(self._timing_events)):
            ev = torch.cuda.Event(enable_timing=True)
            ev.record(stream)
            self._timing_events.append(ev)

    def _marked(self, kind: str, start) -> None:
        if start is not None:
            self.profile.append((kind, start, self._mark()))

    @torch.no_grad()
    def prepare(self, kv, layers_: Optional[list[int]] = None, owned=None, *, host_experts: bool = True) -> int:
        """Capture every (layer, bucket) graph for this KV store now (attention) and for the
        executor (experts), so a timed run never captures. The warm-up pass of each capture runs
        on padding only (positions -1, trash page; sentinel experts). `owned`: the engine's
        owned_experts(layer, device), with which the device-routed expert graphs (keyed by that
        tensor) are captured too when this executor keeps the routing on the device. `host_experts`
        False: not the host-routed expert graphs (`experts()`), which a device-routed engine never runs
        (the rank processes pass it; a caller that runs both kinds on one executor, like gpu_bench's
        barrier baselines, keeps the default). Returns graphs captured. `last_prepare` says where the time
        went: kv_alloc_s (this KV store's device pool and tables), and per graph kind the graphs, seconds
        and the slowest one (the first of a kind compiles its Triton kernels)."""
        self.last_prepare = None
        if not self.graphs.capture:  # (the CPU: nothing is captured)
            return 0
        t0 = time.perf_counter()
        for b in list(self._out_claims):  # capturing replays the bodies over the static outputs
            self._release_outputs(b)
        dv = self._view(kv)
        torch.cuda.synchronize(self.device)  # (the pool's zero fill: its time is the allocation's)
        kinds: dict[str, list] = {}  # kind -> [graphs, seconds, slowest]
        stats = self.last_prepare = {"kv_alloc_s": time.perf_counter() - t0, "kinds": kinds}
        before = self.graphs.captures

        def capture(key: tuple, make_body) -> None:  # the graph under `key` (kind, layer, bucket, ...), captured now
            g = self.graphs.get(key, make_body, True)
            if g.graph is None:
                t = time.perf_counter()
                g._capture()
                dt = time.perf_counter() - t
                k = kinds.setdefault(key[0] + ("_blocks" if key[-1] == "blocks" else ""), [0, 0.0, 0.0])
                k[0], k[1], k[2] = k[0] + 1, k[1] + dt, max(k[2], dt)

        lays = list(range(self.spec.num_layers)) if layers_ is None else layers_
        for b in self.buckets["attn"]:
            bufs = self._attn_bufs(b, True)

            def fill(a: np.ndarray) -> None:
                a[0, :] = -1
                a[1, :] = dv.trash_row
                a[2:, :] = 0  # no row blocks
            self.staging.h2d_array(bufs._t["meta"], fill)
            self._meta_last.pop(b, None)
            for layer in lays:
                if self.attn_graphs:
                    key = ("attn", layer, b, kv._cuda_exec_serial)
                    capture(key, lambda: self._attn_body(layer, bufs, dv, kv))
                    if self._row_blocked(layer):  # and the graph of batches with prompt chunks
                        capture(key + ("blocks",), lambda: self._attn_body(layer, bufs, dv, kv, True))
        for b in self.buckets["expert"] if host_experts else ():
            bufs = self._expert_bufs(b, True)
            pad = self.num_experts if self.ffn_impl != "grouped_mm" else 0
            self.staging.h2d_array(bufs._t["ids"], lambda a: a.fill(pad))
            for layer in lays:
                # A layer of which this shard holds no expert never gets a row: nothing to capture.
                if self.expert_graphs and self.spec.is_moe_layer(layer) and self._held_count(layer):
                    capture(("expert", layer, b), lambda: self._expert_body(layer, bufs))
        if self.route_on_device and owned is not None and self.expert_graphs:
            for b in self.buckets["expert"]:
                bufs = self._routed_bufs(b, True)
                bufs._t["payload"][:, self.spec.hidden_size:].copy_(self._padding_tail())  # padding tokens only
                self._routed_padded[b] = 0
                for layer in lays:
                    mine = owned(layer, self.device) if self.spec.is_moe_layer(layer) else None
                    if mine is None or not bool(mine.any()):
                        continue
                    select = self._routed_select(layer, mine)
                    capture(("expert_routed", layer, b, id(mine)), lambda: self._routed_body(layer, bufs, select))
        for b in self.buckets.get("sample", ()):  # a fresh buffer's padding rows are zeros: a finite argmax, unread
            bufs = self._sample_bufs(b)
            capture(("sample", -1, b), lambda: self._sample_body(bufs))
        torch.cuda.synchronize(self.device)
        stats["capture_s"] = time.perf_counter() - t0 - stats["kv_alloc_s"]
        if os.environ.get("DATAFLOW_VERBOSE") == "1":
            print(f"{self.device}: KV pool {stats['kv_alloc_s']:.3f} s; captured {self.graphs.captures - before} "
                  f"graphs in {stats['capture_s']:.3f} s: " + ", ".join(
                      f"{k} {n} ({s:.3f} s, slowest {m:.3f} s)" for k, (n, s, m) in kinds.items()),
                  file=sys.stderr, flush=True)
        return self.graphs.captures - before

    @torch.no_grad()
    def attention(self, layer: int, h: Tensor, positions: list[int], segments: list[tuple[int, int, int]],
                  kv) -> tuple[Tensor, Tensor]:
        start = self._mark()
        try:
            return self._attention(layer, h, positions, segments, kv)
        finally:
            self._marked("attn", start)

    def _attention(self, layer, h, positions, segments, kv):
        tm = self._attn_timer
        tm.start()
        self._pending = None
        tm.lap("drop_pending")
        h = self._to_dev(h)
        T = h.shape[0]
        dv = self._view(kv)
        tm.lap("view")
        rows, fits = dv.batch_rows(segments, positions, T)  # every row's table row, and whether all have one
        if fits and (self.prompts == "paged" or len(rows) == len(segments)):
            b = bucket_for(T, self.buckets["attn"])
            if b is None:
                self.stats.note("attn: batch above the largest bucket")
            blocks = None
            if len(rows) != len(segments):
                self.stats.attn_paged_prompt += 1
                if self._row_blocked(layer):
                    blocks = row_blocks(segments, self.block_rows)
            return self._attn_paged(layer, h, positions, rows, dv, kv, b, blocks)
        b = bucket_for(T, self.buckets["attn"])
        held = self._claims.get(b)
        if held is not None and held() is h:  # read where it is: the claim is spent (kept, a later batch would move it)
            del self._claims[b]
        if not fits:
            self.stats.note("attn: a sequence without a device table row, or a position past the tables' width")
        self.stats.attn_eager += 1
        return self._attn_eager(layer, h, positions, segments, kv)

    def _attn_eager(self, layer, h, positions, segments, kv):
        pos = self._positions(positions)
        h_res, x = layers.attention_stage(self.spec, self.w, layer, h, pos, segments, kv, positions)
        if self.spec.is_moe_layer(layer):
            lw = self.w.layers[layer]
            if self.keyed_router is None:
                ids, wts = route_tokens(self.spec, lw, x)
            else:
                base = [0] * h.shape[0]
                for seq, start, n in segments:
                    base[start:start + n] = [self.keyed_router.request_base(seq)] * n
                base0 = self._to_dev(torch.tensor(base, dtype=torch.int64))
                ids, wts = self.keyed_router.route_torch(layer, base0, pos)
            shared = shared_expert_out(self.spec, lw, x)
            if self.route_on_device:
                self._set_pending(x, shared, None, pack_routed(x, ids, wts), own=True)
            else:
                self._set_pending(x, shared, torch.cat([ids.to(torch.float32), wts], dim=1), None, own=True)
        return h_res, x

    def _set_pending(self, x: Tensor, shared: Optional[Tensor], route: Optional[Tensor], payload: Optional[Tensor],
                     own: bool) -> None:
        """What an attention call leaves beyond (h_res, x): the routing on its way to the host (`route`, [T, 2k] fp32:
        ids as values, then weights), or kept on the device (`payload`). `own`: the payload is the batch's own tensor,
        not a view of a static buffer (which the next batch of the bucket rewrites: cloned here)."""
        if payload is not None:
            self._pending = _Pending(x, None, shared, self.top_k, payload if own else payload.clone())
        else:
            self._pending = _Pending(x, self.staging.d2h(route), shared, self.top_k)

    def _first_rows(self, key: tuple, static: bool, make) -> tuple:
        """The views `make()` returns of a batch's first rows of its bucket's static buffers, made once per
        (kind, bucket, rows) when static (a slice is a torch call, ~10-25 us on the H200 host; the static buffers
        never change once made); made each time for an eager batch's own buffers."""
        if not static:
            return make()
        views = self._row_views.get(key)
        if views is None:
            views = self._row_views[key] = make()
        return views

    def _attn_bufs(self, b: int, static: bool) -> StaticBuffers:
        if static:  # the static buffers of a bucket never change once made: one dict hit per batch
            bufs = self._bufs_cache.get(("attn", b))
            if bufs is not None:
                return bufs
        bufs = self.graphs.buffers("attn", b) if static else StaticBuffers()
        H, dev = self.spec.hidden_size, self.device
        nout = 3 if self.spec.experts.shared_intermediate_size else 2
        bufs.get("h", (b, H), self.dtype, dev)
        # positions, table rows; and for a batch with prompt chunks its row blocks' first rows and row counts and the
        # decode kernel's context of its other rows (kernels.paged_attention.paged_row_block_attention_triton)
        bufs.get("meta", (5, b), torch.int32, dev)
        bufs.get("out", (nout, b, H), self.dtype, dev)
        bufs.get("route", (b, 2 * self.top_k), torch.float32, dev)
        if self.spec.moe_layers:  # the device-routed payload: x's rows, ids and weights (runtime/core/routed_rows.py)
            bufs.get("payload", (b, H + payload_columns(self.top_k, self.dtype)), self.dtype, dev)
        if static:
            self._bufs_cache[("attn", b)] = bufs
        return bufs

    def _attn_body(self, layer: int, bufs: StaticBuffers, dv: DeviceBlockTables, kv, blocked: bool = False):
        """The attention stage of a bucket's rows. `blocked`: the attention by row blocks (meta rows 2-3; a batch with
        prompt chunks on the Triton kernels: kernels.paged_attention.paged_row_block_attention_triton), the same
        result as the decode kernel's with each K/V tile read once per block of a chunk's rows."""
        spec, lw, a = self.spec, self.w.layers[layer], self.spec.attention
        h_in, meta, out, route_out = bufs._t["h"], bufs._t["meta"], bufs._t["out"], bufs._t["route"]
        payload = bufs._t.get("payload")
        H = spec.hidden_size
        kc, vc = kv.storage(layer)
        table, bs = dv.table, kv.block_size
        window, sinks = a.window(layer), lw.get("sinks")
        moe = spec.is_moe_layer(layer)
        eps, fp32w, k = spec.rms_norm_eps, self._fp32w, self.top_k
        attn_fn = paged_decode_attention_triton if self.attn_impl == "triton" else paged_decode_attention_torch
        if blocked:
            attn_fn = functools.partial(paged_row_block_attention_triton, first=meta[2], count=meta[3],
                                        solo_lens=meta[4], rows_per_block=self.block_rows)
        # one launch per norm, and RoPE + the KV write in one, where the attention kernels are Triton's
        # (kernels/rms_norm.py, kernels/rope_kv_write.py); else the torch references
        fused = self.attn_impl == "triton"
        norm = rms_norm_fused if fused else rms_norm
        rope_kv = rope_kv_write if fused else rope_kv_write_torch
        cos_t, sin_t = self._rope_table(table.shape[1] * bs) if self._rope_kv_fused else (None, None)
        b = h_in.shape[0]
        router, keys = self.keyed_router, dv.keys

        def body() -> None:
            xn = norm(h_in, lw["attn_norm"], eps, fp32w)
            bt = table.index_select(0, meta[1])  # [b, width] int32: this batch's page tables
            if cos_t is not None:  # padded rows (position -1) rotate at 0 and write the trash page (discarded)
                q, kk, vv = gqa_project(spec, lw, xn)
                q, ctx = rope_kv(q, kk, vv, meta[0], meta[1], table, bs, cos_t, sin_t, kc, vc)
            else:
                posc = meta[0].to(torch.int64).clamp(min=0)
                q, kk, vv = self._qkv(spec, lw, xn, posc, rope_cs=self._rope(posc))
                kv_write_torch(kk, vv, posc, meta[1], table, bs, kc, vc)
                ctx = (meta[0].to(torch.int64) + 1).to(torch.int32)
            o = attn_fn(q, kc, vc, bt, ctx, self._scale, sinks, window)
            h_res = torch.add(h_in, F.linear(o.reshape(b, -1), lw["o.w"], lw.get("o.b")), out=out[0])
            x = norm(h_res, lw["mlp_norm"], eps, fp32w)
            out[1].copy_(x)
            if moe:
                if router is None:
                    ids, wts = route_tokens(spec, lw, x)
                else:  # keyed by (request, position, layer): the row's request base from its table row
                    ids, wts = router.route_torch(layer, keys.index_select(0, meta[1]), meta[0].to(torch.int64))
                route_out[:, :k].copy_(ids)
                route_out[:, k:].copy_(wts)
                # both dispatches' forms (the barriers switch route_on_device between runs): ~1.5 MB more
                # written per 256-row batch in bf16, under a microsecond of HBM time
                payload[:, :H].copy_(x)
                payload[:, H:].copy_(pack_tail(ids, wts, payload.dtype))
                if out.shape[0] > 2:
                    out[2].copy_(shared_expert_out(spec, lw, x))
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
        if last is None or last[0] != trash or not _same(last[1], positions) or not _same(last[2], rows) or blocks:
            self.staging.h2d_array(bufs._t["meta"], fill)
            if static:
                self._meta_last[b] = (trash, positions, rows) if blocks is None else None
        tm.lap("meta_h2d")
        h_in, out_T, route_T, payload_T = self._first_rows(("attn", b, T), static, lambda: (
            bufs._t["h"][:T], bufs._t["out"][:, :T], bufs._t["route"][:T],
            bufs._t["payload"][:T] if "payload" in bufs._t else None))
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
            self._set_pending(x, shared, None if self.route_on_device else route_T,
                              payload_T if self.route_on_device else None, own=not static)
        tm.lap("route_d2h")
        return h_res, x

    @torch.no_grad()
    def dense_mlp(self, layer: int, x: Tensor) -> Tensor:
        return layers.dense_mlp(self.spec, self.w, layer, self._to_dev(x))

    @torch.no_grad()
    def route(self, layer: int, x: Tensor) -> tuple[Tensor, Tensor]:
        """(ids [T,k] int64, weights [T,k] fp32) as CPU tensors (the executor interface)."""
        ids, wts = self.route_arrays(layer, x)
        return torch.from_numpy(ids), torch.from_numpy(wts)

    def route_arrays(self, layer: int, x: Tensor) -> tuple[np.ndarray, np.ndarray]:
        """route() as numpy arrays, the form the streaming engine dispatches with (fewer torch calls)."""
        p = self._pending
        if p is not None and p.x is x and p.route is not None:
            t = time.perf_counter()
            v = p.route.wait()
            self.stats.route_wait_s += time.perf_counter() - t
            return p.read(v)
        if p is not None and p.x is x and p.on_device is not None:  # kept on the device (DATAFLOW_DISPATCH=device):
            _, ids, wts = unpack_routed(p.on_device, self.spec.hidden_size)  # a host caller (the barriers) waits for
            return ids.cpu().numpy().astype(np.int64), wts.cpu().numpy()  # a copy of the payload's routing
        self.stats.note("route: not the last attention's x (eager route + sync)")
        with torch.no_grad():  # (only here: entering no_grad is two more torch calls on the hot path above)
            ids, wts = layers.route(self.spec, self.w, layer, self._to_dev(x))
        return ids.cpu().numpy(), wts.cpu().to(torch.float32).numpy()

    def routed_payload(self, layer: int, x: Tensor) -> Tensor:
        """The device-routed dispatch's form of the batch (runtime/core/routed_rows.py), left on the device: the payload
        [T, H + c] (x's rows, the int32 expert ids and the fp32 weights) as the attention graph packed it, no host
        copy and no wait."""
        p = self._pending
        if p is not None and p.x is x and p.on_device is not None:
            return p.on_device
        self.stats.note("routed_payload: not the last attention's x (eager route)")
        with torch.no_grad():
            x = self._to_dev(x)
            return pack_routed(x, *layers.route(self.spec, self.w, layer, x))

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
            # not owned (or padding): the sentinel expert, or (grouped_mm, which has none) a held row, masked after
            pad = E if self.ffn_impl != "grouped_mm" else 0
            row = torch.where(mine, torch.cat([held, torch.zeros(1, dtype=torch.int32)]), pad).to(torch.int32)
            t = self._routed_tables[(layer, id(owned))] = (owned, row.to(self.device), mine.to(self.device))
        return t[1:]

    @torch.no_grad()
    def experts_routed(self, layer: int, payloads: list[Tensor], owned: Tensor, out: Optional[Tensor] = None) -> Tensor:
        """The device-routed expert batch (TorchExecutor.experts_routed's contract) without a host sync. Its own
        graph kind ("expert_routed", bucketed in slots): the host copies the items' payloads (token rows, expert ids
        and weights: routed_rows.pack's layout) into the bucket's static input and replays; inside the graph each
        token row goes to its k slots, the ids map to held rows (slots of experts this rank does not own -> the
        padding id), the expert FFN runs, the slots it does not own are zeroed, and topk_merge sums each token's
        slots with their weights (from zero, slot order, fp32): one row per token out, copied into `out` when given
        (the merge group's buffer: runtime/merge.MergeTable.rows_at), else into a tensor of its own."""
        start = self._mark()
        try:
            return self._experts_routed(layer, payloads, owned, out)
        finally:
            self._marked("expert", start)

    def _experts_routed(self, layer, payloads, owned, out):
        tm = self._expert_timer
        tm.start()
        k = self.top_k
        T = sum(p.shape[0] for p in payloads)
        b, static = self._expert_bucket(T * k)
        bufs = self._routed_bufs(b, static)
        H = self.spec.hidden_size
        payload_T, tail_pad, y_T = self._first_rows(("routed", b, T), static, lambda: (
            bufs._t["payload"][:T], bufs._t["payload"][T:, H:], bufs._t["y"][:T]))
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

    def _routed_bufs(self, b: int, static: bool) -> StaticBuffers:
        """Static buffers of a routed expert bucket of b slots: the payloads of b // k tokens in, their b // k * k
        slot rows (inside), b // k partial sums out, and the fixed slot -> token row index."""
        key = ("expert_routed", b)
        if static and key in self._bufs_cache:
            return self._bufs_cache[key]
        bufs = self.graphs.buffers(*key) if static else StaticBuffers()
        H, dev, k = self.spec.hidden_size, self.device, self.top_k
        bt = b // k
        bufs.get("payload", (bt, H + payload_columns(k, self.dtype)), self.dtype, dev)
        bufs.get("slots", (bt * k, H), self.dtype, dev)
        bufs.get("zero", (bt, H), self.dtype, dev)  # topk_merge's residual: the partial sums start from zero
        bufs.get("y", (bt, H), self.dtype, dev)
        if "slot_row" not in bufs._t:  # filled once, outside any capture
            bufs.get("slot_row", (bt * k,), torch.int64, dev).copy_(
                torch.div(torch.arange(bt * k, device=dev), k, rounding_mode="floor"))
            bufs.get("arange", (bt * k,), torch.int64, dev).copy_(torch.arange(bt * k, device=dev))
        if static:
            self._bufs_cache[key] = bufs
        return bufs

    def _routed_body(self, layer: int, bufs: StaticBuffers, select: tuple[Tensor, Tensor]):
        row, mine_of = select
        payload, slots, zero, y_out, slot_row, ar = (bufs._t[n] for n in ("payload", "slots", "zero", "y", "slot_row",
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

    def route_start(self, layer: int, x: Tensor) -> Optional[_Pending]:
        """The engine's asynchronous dispatch: the routing of the attention call that returned `x`, still on
        its way to the host, as a handle with ready() / result() and `shared` (the shared-expert output);
        None when there is none (the engine then calls route()). Its pinned slot is held until read."""
        p = self._pending
        if p is None or p.x is not x or p.route is None:
            return None
        self._pending = None
        p.route.hold()
        return p

    @torch.no_grad()
    def shared_expert(self, layer: int, x: Tensor) -> Optional[Tensor]:
        p = self._pending
        if p is not None and p.x is x:
            return p.shared
        return layers.shared_expert(self.spec, self.w, layer, self._to_dev(x))

    # ------------------------------------------------------------------ experts
    def _expert_bufs(self, b: int, static: bool) -> StaticBuffers:
        if static:
            bufs = self._bufs_cache.get(("expert", b))
            if bufs is not None:
                return bufs
        bufs = self.graphs.buffers("expert", b) if static else StaticBuffers()
        H, dev = self.spec.hidden_size, self.device
        bufs.get("x", (b, H), self.dtype, dev)
        bufs.get("ids", (b,), torch.int32, dev)
        bufs.get("y", (b, H), self.dtype, dev)
        if "arange" not in bufs._t:  # filled once, outside any capture
            bufs.get("arange", (b,), torch.int64, dev).copy_(torch.arange(b, device=dev))
        if static:
            self._bufs_cache[("expert", b)] = bufs
        return bufs

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

    def _permute(self, ids: Tensor, E: Optional[int] = None) -> tuple[Tensor, Tensor]:
        """(order, offsets) of ids [b] int64 in [0, E] (E: padding sentinel; default num_experts,
        a shard's layer passes its held count). Capturable both ways."""
        E = self.num_experts if E is None else E
        if self.permute_impl == "triton":
            return permute_to_experts_triton(ids[:, None], E)
        # Torch, no host sync: stable argsort puts sentinel rows last; counts by scatter_add into
        # E+1 bins (bincount would read the max on the host).
        order = torch.argsort(ids, stable=True)
        counts = torch.zeros(E + 1, dtype=torch.int64, device=ids.device).scatter_add_(0, ids, torch.ones_like(ids))
        offsets = torch.zeros(E + 1, dtype=torch.int64, device=ids.device)
        offsets[1:] = torch.cumsum(counts[:E], dim=0)
        return order, offsets

    def _expert_body(self, layer: int, bufs: StaticBuffers):
        x_in, ids_buf, y_out, ar = bufs._t["x"], bufs._t["ids"], bufs._t["y"], bufs._t["arange"]
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
        ffn = {"triton": grouped_ffn_triton, "grouped_mm": grouped_ffn_grouped_mm, "torch": grouped_ffn_torch}[self.ffn_impl]
        sentinel = self.ffn_impl != "grouped_mm"

        def run(x_in: Tensor, ids: Tensor, ar: Tensor, y_out: Tensor, sentinels_anywhere: bool) -> None:
            if clamp:
                ids = ids.clamp(max=E)
            order, offsets = self._permute(ids, E)
            if sentinel:
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
    def experts(self, layer: int, x: Tensor, expert_ids: list[int]) -> Tensor:
        start = self._mark()
        try:
            return self._experts(layer, x, expert_ids)
        finally:
            self._marked("expert", start)

    def _experts(self, layer: int, x, expert_ids: list[int]) -> Tensor:
        tm = self._expert_timer
        tm.start()
        # x: [N, H], or its row blocks (runtime/executor.row_blocks), concatenated below straight into
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
        pad = self.num_experts if self.ffn_impl != "grouped_mm" else int(ids[0])

        def fill(a: np.ndarray) -> None:
            a[:N] = ids
            a[N:] = pad
        tm.lap("ids_prep")
        self.staging.h2d_array(bufs._t["ids"], fill)
        tm.lap("ids_h2d")
        x_in, y_out = self._first_rows(("expert", b, N), static, lambda: (bufs._t["x"][:N], bufs._t["y"][:N]))
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

    # ------------------------------------------------------------------ merge, head, sampling
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

    def _claim_attn_input(self, T: int) -> Optional[Tensor]:
        """Rows 0..T-1 of the static input of the attention bucket T fits, as a new view that is the claim (never a
        cached view: an eviction repoints the claim's storage), or None when another live output holds the bucket."""
        b = bucket_for(T, self.buckets["attn"]) if T else None
        if b is None:
            return None
        held = self._claims.get(b)
        if held is not None and held() is not None:
            return None
        skip = self._claim_skip.get(b)
        if skip:
            self._claim_skip[b] = skip - 1
            return None
        view = self._attn_bufs(b, True)._t["h"][:T]
        self._claims[b] = weakref.ref(view)
        return view

    def _release_outputs(self, b: int) -> None:
        """Before attention bucket b replays: its last batch's outputs (views of the static output buffer) that are
        still held (a merge group not combined yet: another wave, an in-process rank sharing this executor) move to
        tensors of their own (Tensor.set_ repoints them where they are held), and the bucket clones its outputs for
        its next _CLAIM_BACKOFF batches. In one wave's steady decode they are gone by then: the group's combine read
        h_res before the wave's next attention batch was made, and x lived in the batch that is done."""
        held = self._out_claims.pop(b, None)
        if held is None:
            return
        live = [t for t in (r() for r in held) if t is not None]
        if not live:
            return
        for t in live:
            t.set_(t.clone())
        self.stats.attn_outputs_moved += 1
        self._out_skip[b] = _CLAIM_BACKOFF

    def _attn_input(self, b: int, h: Tensor) -> Optional[Tensor]:
        """What an attention batch of bucket b must copy into the bucket's static input: None when `h` is already
        there (the combine that made it claimed the bucket), else h. A live claim of another output is evicted
        first: its rows move to a tensor of their own (Tensor.set_ repoints the claim, so every queue item holding it
        reads them there), and an `h` sliced from that claim is re-sliced from the moved rows (a copy between
        overlapping rows of one buffer is not allowed)."""
        held = self._claims.pop(b, None)
        owner = held() if held is not None else None
        if owner is None:
            return h
        if owner is h:
            return None
        moved = owner.clone()
        if h.untyped_storage().data_ptr() == owner.untyped_storage().data_ptr():  # h is rows of the claim
            first = (h.storage_offset() - owner.storage_offset()) // owner.stride(0)
            h = moved[first:first + h.shape[0]]
        owner.set_(moved)
        self.stats.attn_claims_moved += 1
        self._claim_skip[b] = _CLAIM_BACKOFF
        return h

    @torch.no_grad()
    def logits(self, h: Tensor) -> DeviceLogits:
        """The batch's logits and their greedy argmax (copied to the host once). For a batch that fits a sample bucket
        the argmax is that bucket's graph (norm, LM head, argmax: 16 torch calls on the host became ~7, and a sample
        batch 857-900 -> 129-143 us of host on the H200 host; NOTES §28), replayed when the ids are first wanted; the
        logits are computed eagerly only if read (a batch that samples: then the graph never runs)."""
        h = self._to_dev(h)
        T = h.shape[0]
        head = lambda: layers.final_logits(self.spec, self.w, h)  # noqa: E731 (the eager logits)
        b = bucket_for(T, self.buckets.get("sample", ()))
        if b is None or T == 0:
            return DeviceLogits(head(), self.staging)
        bufs = self._sample_bufs(b)

        def replay() -> Tensor:
            h_in, ids = self._first_rows(("sample", b, T), True, lambda: (bufs._t["h"][:T], bufs._t["ids"][:T]))
            h_in.copy_(h)
            self.graphs.get(("sample", -1, b), lambda: self._sample_body(bufs)).run()
            return ids
        return DeviceLogits(None, self.staging, argmax=replay, eager=head, n=T)

    def _sample_bufs(self, b: int) -> StaticBuffers:
        bufs = self._bufs_cache.get(("sample", b))
        if bufs is None:
            bufs = self._bufs_cache[("sample", b)] = self.graphs.buffers("sample", b)
            bufs.get("h", (b, self.spec.hidden_size), self.dtype, self.device)
            bufs.get("ids", (b,), torch.int64, self.device)
        return bufs

    def _sample_body(self, bufs: StaticBuffers):
        h_in, ids = bufs._t["h"], bufs._t["ids"]
        spec, w = self.spec, self.w

        def body() -> None:
            ids.copy_(torch.argmax(layers.final_logits(spec, w, h_in), dim=-1))
        return body

    def sample(self, logits, params: Optional[SamplingParams], step: int) -> int:
        params = params or _GREEDY
        if isinstance(logits, LogitsRow):
            if params.greedy:
                return logits.parent.greedy(logits.index)
            logits = logits.tensor
        return sample(logits, params, step)

    def sample_batch_start(self, logits: DeviceLogits, params: list[Optional[SamplingParams]],
                           steps: list[int]) -> Optional[DeviceLogits]:
        """The engine's asynchronous sampling: the batch's token ids on their way to a pinned slot (held until read:
        the ring must not reuse it meanwhile), with ready() / tokens() / device_ids(). An all-greedy batch's are the
        logits' argmax (the sample graph's); a batch with rows that sample draws all its rows on the device
        (models.sampling.sample_tokens over the eagerly computed logits) and hands out their ids the same way.
        None for an empty batch."""
        if not params:
            return None
        if all(p is None or p.greedy for p in params):
            pending = logits
        else:
            pending = DeviceLogits(None, self.staging, argmax=sample_tokens(logits.tensor, params, steps))
        pending._argmax.hold()
        return pending

    def sample_batch(self, logits: DeviceLogits, params: list[Optional[SamplingParams]], steps: list[int]) -> list[int]:
        """sample() of every row, in one device call; an all-greedy batch reads the argmax DeviceLogits copied once."""
        if all(p is None or p.greedy for p in params):
            return [logits.greedy(i) for i in range(len(params))] if params else []
        return sample_tokens(logits.tensor, params, steps).tolist()
