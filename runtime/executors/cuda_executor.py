"""CUDA executor: the Executor contract (runtime/executors/base.py) run through per-bucket CUDA graphs and Triton kernels.

Same methods, same results up to floating point rounding, as runtime/executors/torch_executor.py; the engine does
not know which one it has. The math is the same too: every stage is the stage function of models/layers.py (or a
kernel registered as the implementation of one step of it, whose torch reference is the model's own code), so a model
feature lives in models/ once. What differs is how the work reaches the GPU; each part has its file:

cuda_attention.py  attention(): a decode or mixed batch as one graph replay per (layer, bucket, KV store), the
                   stage function with its attend step over the paged cache, the router and the shared expert inside
cuda_experts.py    experts() / experts_routed() / combine(): one graph per (layer, bucket), grouped FFN kernels
cuda_sampling.py   logits() / sample*(): one graph per sample bucket (final norm, LM head, greedy argmax)
cuda_buffers.py    the static buffers' claims (rows written or read in place) and the executor's counters
here               construction (kernels from the `kernels` option), KV store attachment, embed, the routing
                   hand-over (route / route_arrays / routed_payload read what the attention graph made), prepare()

route(layer, x) / shared_expert(layer, x) return what the attention graph already computed for that x. Reading the
routing on the host is the one host synchronization of the host-routed hot path (it waits on the event of the D2H
copy); the device-routed dispatch keeps it on the device (routed_payload).

CPU twin: on a CPU device (or with graphs=False) the very same bucket / padding / body code runs, without capture,
with the torch reference kernels, so CPU tests cover the padding semantics and the math (tests/test_feature_matrix.py).
"""
from __future__ import annotations

import atexit
import sys
import time
import weakref
from typing import Optional

import numpy as np
import torch
from torch import Tensor

from graph_ir.spec import ModelSpec
from dataflow_kernels.paged_attention import block_rows_for
from lowering.plan import PUBLISHED_ATTN_BUCKETS, PUBLISHED_EXPERT_BUCKETS
from models import layers
from models.rope import rope_parameters, rotary_dim
from models.weights import ModelWeights, stack_qkv
from runtime import settings
from runtime.core.routed_rows import pack as pack_routed, unpack as unpack_routed, use_device_routing
from runtime.executors.base import ExecutorBase
from runtime.executors.capture import GraphCache
from runtime.executors.cuda_attention import PROMPT_PATHS, AttentionMixin
from runtime.executors.cuda_buffers import ExecStats, Pending, StaticInputs
from runtime.executors.cuda_experts import ExpertsMixin
from runtime.executors.cuda_sampling import SamplingMixin
from runtime.executors.cuda_stream import current_stream
from runtime.executors.host_staging import HostStaging
from runtime.executors.kv_cache_paged_gpu import DeviceBlockTables
from runtime.observability.step_timer import StepTimer

# Published StreamEP buckets, used when no plan is given.
_DEFAULT_BUCKETS = {"attn": PUBLISHED_ATTN_BUCKETS, "expert": PUBLISHED_EXPERT_BUCKETS,
                    "sample": PUBLISHED_ATTN_BUCKETS}

KERNELS = ("triton", "torch")  # CudaExecutor(attn_impl=, ffn_impl=)


def _kernel(given: Optional[str], on_cuda: bool, name: str) -> str:
    """One of the executor's kernel choices: the argument (tests), else the `kernels` option; auto is Triton on CUDA
    and the torch references elsewhere."""
    choice = given or settings.current().kernels
    if choice == "auto":
        choice = "triton" if on_cuda else "torch"
    if choice not in KERNELS:
        raise ValueError(f"{name}={choice!r}: expected one of {', '.join(KERNELS)}")
    return choice


class CudaExecutor(AttentionMixin, ExpertsMixin, SamplingMixin, StaticInputs, ExecutorBase):
    # Every attention batch whose sequences have device page-table rows runs through the bucketed path (`_attn_paged`:
    # the paged kernels, a CUDA graph on CUDA), prompt chunks and decode rows alike; the rest by models.attention.
    supports_device_routing = True

    def __init__(self, spec: ModelSpec, weights: ModelWeights, plan=None, device=None, *,
                 graphs: Optional[bool] = None, attn_impl: Optional[str] = None, ffn_impl: Optional[str] = None,
                 max_context: Optional[int] = None, table_rows: int = 4096, buckets: Optional[dict] = None,
                 route_on_device: Optional[bool] = None, prompts: str = "paged") -> None:
        """`plan`: its capture buckets are used (else the published ones); `device`: default the
        weights' device. Kernels (`attn_impl`, `ffn_impl`: KERNELS; the expert permute's is the option's) follow the
        `kernels` option (runtime/settings.py: Triton on CUDA and the torch references elsewhere by default); an
        argument overrides it (tests). `max_context`: tokens a sequence may have for the graph path
        (device page-table width); longer ones run eagerly. `route_on_device`: keep each attention batch's
        routing on the device for the device-routed dispatch (default: the plan's dispatch, or by device without
        one; the `dispatch` option overrides: runtime/core/routed_rows.py; the barrier baselines, which read the
        routing on the host, pass False). `prompts`: how a batch holding a prompt's chunk runs (PROMPT_PATHS): "paged"
        (the default) like a decode batch, through the paged kernels (a CUDA graph up to the largest bucket); "eager"
        by the stage function over the host tables (kept as the reference the paged path is compared with: the
        paged path was 2-37x faster per layer)."""
        self.spec = spec
        self.device = torch.device(device) if device is not None else weights.embed.device
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.w = weights if weights.embed.device == self.device else weights.to(self.device)
        self.dtype = self.w.embed.dtype
        on_cuda = self.device.type == "cuda"
        self.attn_impl = _kernel(attn_impl, on_cuda, "attn_impl")
        self.ffn_impl = _kernel(ffn_impl, on_cuda, "ffn_impl")
        self.permute_impl = _kernel(None, on_cuda, "permute_impl")
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
            route_on_device = use_device_routing(planned == "device" if planned is not None else on_cuda)
        self.route_on_device = route_on_device
        # Rows per block of the row-block attention for batches with prompt chunks: each K/V tile is read once per
        # block of a chunk's rows instead of once per row (1.38x tokens/s with long prompts arriving during decode).
        # 0 (the torch reference, whose result is the same; a benchmark may set it after construction): row by row.
        a = spec.attention
        self.block_rows = block_rows_for(a.num_heads, a.num_kv_heads) if self.attn_impl == "triton" else 0
        if prompts not in PROMPT_PATHS:
            raise ValueError(f"prompts={prompts!r}: expected one of {PROMPT_PATHS}")
        self.prompts = prompts
        self._routed_tables: dict[tuple, tuple] = {}  # (layer, id(owned)) -> (owned, _routed_select's tables)
        self._pad_tail: Optional[Tensor] = None  # _padding_tail()
        self._meta_last: dict[int, tuple] = {}  # attention bucket -> (trash row, positions, rows) its meta buffer holds
        self.stats = ExecStats()
        self._mla = a.kind == "mla"
        if not self._mla:  # q, k and v in one GEMM (three GEMMs took 30 us at B=256, k's and v's latency-bound)
            self.w = stack_qkv(self.w)
        rdim = a.qk_rope_head_dim if self._mla else rotary_dim(a.rope, a.head_dim)
        inv_freq, self._rope_scaling = rope_parameters(a.rope, rdim)
        self._inv_freq = inv_freq.to(self.device)
        # GQA's rotate-half RoPE and the KV write run as one kernel in the attention body (kernels/rope_kv_write.py)
        # from a cos/sin table per position; MLA (interleaved pairs, latent K) and a q/k norm applied after RoPE
        # (Hunyuan) keep the torch ops
        self._rope_kv_fused = not self._mla and not a.rope.interleaved and not a.qk_norm_after_rope
        if self._mla:
            # the latent cache (models.attention): K = [latent, roped key] of one kv head shared by all heads, no V
            self._k_row, self._v_row = (1, a.kv_lora_rank + a.qk_rope_head_dim), (1, 0)
        else:
            self._k_row, self._v_row = (a.num_kv_heads, a.head_dim), (a.num_kv_heads, a.head_dim)
        self.max_context = max_context or min(spec.max_position, 8192)
        self.table_rows = table_rows
        self._views: dict[int, DeviceBlockTables] = {}  # kv serial -> device tables
        self._serial = 0
        self._pending: Optional[Pending] = None
        # A router keyed by (request, position, layer) that runs inside the attention graph instead of
        # the model's (use_keyed_router); None: the model's router.
        self.keyed_router = None
        # (kind, bucket) -> that bucket's static buffers; (kind, bucket, rows) -> views of its first rows (_kept)
        self._kept_views: dict[tuple, object] = {}
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
        # the profile_steps option: wall time per step of the attention / expert calls, printed at exit
        profile = settings.current().profile_steps
        self._attn_timer = StepTimer("executor attention", profile)
        self._expert_timer = StepTimer("executor experts", profile)
        self._embed_timer = StepTimer("executor embed", profile)  # (layer 0 costs 190-300 us per batch on a GPU host)
        if profile:
            atexit.register(lambda: print(f"{self._attn_timer.report()}\n{self._expert_timer.report()}\n"
                                          f"{self._embed_timer.report()}", file=sys.stderr))
        # When a list: (kind, start event, end event) per attention / expert call, recorded around
        # the call's device work (benchmarks/gpu_bench.py derives GPU time per batch from it).
        self.profile: Optional[list] = None
        self._timing_events: list = []  # made before a timed run (reserve_timing_events), used by _mark
        self._index_cache: dict[tuple[int, int], Tensor] = {}
        self.num_experts, self.top_k = spec.experts.num_experts, spec.experts.top_k
        # Per MoE layer: global id -> row of the held experts (-1: not held), as numpy for the
        # host-side fill; None where the layer holds every expert (ids are rows already).
        self._rows_of: dict[int, Optional[np.ndarray]] = {}
        for l in spec.moe_layers:
            for n in ("experts.gate", "experts.up", "experts.down"):  # (the grouped FFN kernel reads them in place)
                if not self.w.layers[l][n].is_contiguous():
                    self.w.layers[l][n] = self.w.layers[l][n].contiguous()
            lut = self.w.expert_lookup(l)
            self._rows_of[l] = None if lut is None else lut.numpy()

    # ------------------------------------------------------------------ KV store attachment
    def kv_rows(self) -> tuple[tuple, tuple, torch.dtype]:
        """(K row shape, V row shape, dtype) of one cached token per layer, as `_view` preallocates
        them (runtime/executors/kv_fit.py sizes the pool from it before any engine exists)."""
        return self._k_row, self._v_row, self.dtype

    def _view(self, kv) -> DeviceBlockTables:
        dv = self._views.get(getattr(kv, "_cuda_exec_serial", None))  # (None: a store not seen yet)
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
        self._views.pop(serial, None)
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
        """The rows of `token_ids` (layers.embed, the stage function), from ids uploaded through the staging ring into
        a device buffer kept for them. `token_ids`: a list of ints, or int64 ids on the device
        already (the engine's step-ahead: a sample batch's greedy ids that the host has not read yet)."""
        tm = self._embed_timer
        tm.start()
        T = len(token_ids)
        if not T:
            return self.w.embed[:0]
        # The ids into a device buffer kept for them (an upload to a new tensor allocated one: 32-69 us), the rows
        # straight into the attention bucket's static input they go to (the combine's claim, which the layer-0 batch
        # reads without a copy).
        if isinstance(token_ids, Tensor):
            ids = token_ids
        else:
            ids = self._embed_ids_rows(T)
            self.staging.h2d_array(ids, lambda a: a.__setitem__(slice(None), token_ids))
        tm.lap("upload")
        out = self._claim_attn_input(T)
        h = layers.embed(self.w, ids, out=out)
        tm.lap("index_select")
        return h

    def _embed_ids_rows(self, T: int) -> Tensor:
        """The first T entries of the device buffer for embedding ids (int64, grown to the largest batch seen), a view
        kept per T. One buffer serves every batch: each upload into it is queued after the previous batch's gather."""
        if self._embed_ids is None or self._embed_ids.numel() < T:
            self._embed_ids = torch.empty(max(T, 256), dtype=torch.int64, device=self.device)
        return self._kept(("embed_ids", self._embed_ids.numel(), T), True, lambda: (self._embed_ids[:T],))[0]

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

    @torch.no_grad()
    def prepare(self, kv, owned=None, *, host_experts: bool = True) -> int:
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

        for b in self.buckets["attn"]:
            bufs = self._attn_bufs(b, True)

            def fill(a: np.ndarray) -> None:
                a[0, :] = -1
                a[1, :] = dv.trash_row
                a[2:, :] = 0  # no row blocks
            self.staging.h2d_array(bufs["meta"], fill)
            self._meta_last.pop(b, None)
            for layer in range(self.spec.num_layers):
                if self.attn_graphs:
                    key = ("attn", layer, b, kv._cuda_exec_serial)
                    capture(key, lambda: self._attn_body(layer, bufs, dv, kv))
                    if self._row_blocked(layer):  # and the graph of batches with prompt chunks
                        capture(key + ("blocks",), lambda: self._attn_body(layer, bufs, dv, kv, True))
        for b in self.buckets["expert"] if host_experts else ():
            bufs = self._expert_bufs(b, True)
            self.staging.h2d_array(bufs["ids"], lambda a: a.fill(self.num_experts))
            for layer in range(self.spec.num_layers):
                # A layer of which this shard holds no expert never gets a row: nothing to capture.
                if self.expert_graphs and self.spec.is_moe_layer(layer) and self._held_count(layer):
                    capture(("expert", layer, b), lambda: self._expert_body(layer, bufs))
        if self.route_on_device and owned is not None and self.expert_graphs:
            for b in self.buckets["expert"]:
                bufs = self._routed_bufs(b, True)
                bufs["payload"][:, self.spec.hidden_size:].copy_(self._padding_tail())  # padding tokens only
                self._routed_padded[b] = 0
                for layer in range(self.spec.num_layers):
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
        if settings.current().verbose:
            print(f"{self.device}: KV pool {stats['kv_alloc_s']:.3f} s; captured {self.graphs.captures - before} "
                  f"graphs in {stats['capture_s']:.3f} s: " + ", ".join(
                      f"{k} {n} ({s:.3f} s, slowest {m:.3f} s)" for k, (n, s, m) in kinds.items()),
                  file=sys.stderr, flush=True)
        return self.graphs.captures - before

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
            return p.read(p.route.wait())  # (a wait is counted in staging.wait_s)
        if p is not None and p.x is x and p.on_device is not None:  # kept on the device (dispatch=device):
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

    @torch.no_grad()
    def shared_expert(self, layer: int, x: Tensor) -> Optional[Tensor]:
        p = self._pending
        if p is not None and p.x is x:
            return p.shared
        return layers.shared_expert(self.spec, self.w, layer, self._to_dev(x))
