"""ModelWeights: every tensor of a model under its canonical name (see ARCHITECTURE.md).

The math in models/ reads only these names, so a checkpoint importer's whole job is to map a
family's tensor names and layouts onto them. `expected_shapes` (per layer graph_ir.spec.layer_shapes, which
lowering's memory plan counts too) is the single source of truth for which tensors a spec needs and their shapes:
random init builds from it and checkpoint loading validates against it, so the two can never disagree.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import torch
from torch import Tensor

from graph_ir.errors import UserError
from graph_ir.spec import ModelSpec, layer_shapes

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Tensors that HF keeps in fp32 whatever the model dtype (GLM/DeepSeek-V3 keep the selection bias
# as an fp32 buffer); rounding them to bf16 would change which experts win close races.
_FP32_ALWAYS = frozenset({"router.correction_bias"})


# Routed-expert tensors: stacked along dim 0 by expert, the only tensors a rank may hold a subset of.
EXPERT_TENSORS = ("experts.gate", "experts.up", "experts.down", "experts.gate_b", "experts.up_b", "experts.down_b")

# `experts=` argument of the builders: per layer the global expert ids to hold, or None for all of
# them (a None argument: all experts of every layer). Entries of dense layers are ignored.
ExpertSubset = Optional[Sequence[Optional[Sequence[int]]]]


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


def held_per_layer(spec: ModelSpec, experts: ExpertSubset) -> list[Optional[list[int]]]:
    """Normalize an `experts=` argument: per layer the sorted global ids held, None = all (and for
    dense layers). Sorted so row i of a stacked tensor is the i-th smallest held id on every path."""
    if experts is None:
        return [None] * spec.num_layers
    if len(experts) != spec.num_layers:
        raise ValueError(f"experts: {len(experts)} layer entries, the spec has {spec.num_layers} layers")
    E = spec.experts.num_experts
    out: list[Optional[list[int]]] = []
    for l, ids in enumerate(experts):
        if ids is None or not spec.is_moe_layer(l):
            out.append(None)
            continue
        ids = sorted(set(int(e) for e in ids))
        if ids and not (0 <= ids[0] and ids[-1] < E):
            raise ValueError(f"experts: layer {l} lists expert ids outside 0..{E - 1}: {ids}")
        out.append(None if len(ids) == E else ids)
    return out


@dataclass
class ModelWeights:
    embed: Tensor  # [V, H]
    final_norm: Tensor  # [H]
    lm_head: Optional[Tensor]  # [V, H]; None when tied to `embed`
    layers: list[dict[str, Tensor]] = field(default_factory=list)
    # Per layer, the global expert ids the stacked `experts.*` tensors hold, row i = held[i]; None
    # (the field, or a layer's entry) = every expert, row e = expert e. A rank of a multi-process
    # run holds only the experts the plan places on it (held_per_layer normalizes the lists).
    held: Optional[list[Optional[list[int]]]] = None
    # global id -> row lookup tables per (layer, device), built on first use (see local_rows).
    _lut: dict = field(default_factory=dict, init=False, repr=False, compare=False)

    def held_experts(self, layer: int) -> Optional[list[int]]:
        """The global expert ids layer `layer` holds (sorted), or None when it holds all of them."""
        return None if self.held is None else self.held[layer]

    def expert_lookup(self, layer: int, device: torch.device | str = "cpu") -> Optional[Tensor]:
        """int64 [num_experts]: row of each global expert id in the layer's stacked tensors, -1 where
        not held; None when the layer holds every expert (ids are rows: nothing to translate)."""
        held = self.held_experts(layer)
        if held is None:
            return None
        key = (layer, str(device))
        lut = self._lut.get(key)
        if lut is None:
            E = len(self.layers[layer]["router.w"])  # the router scores every expert, held or not
            cpu = torch.full((E,), -1, dtype=torch.int64)
            cpu[torch.tensor(held, dtype=torch.int64)] = torch.arange(len(held), dtype=torch.int64)
            lut = self._lut[key] = cpu.to(device)
        return lut

    def unheld_error(self, layer: int, expert_ids) -> LookupError:
        """The error for a row routed to an expert these weights do not hold (a placement bug)."""
        ids = sorted(set(int(e) for e in expert_ids))
        return LookupError(f"layer {layer}: expert(s) {ids} not held here; these weights hold experts "
                           f"{self.held_experts(layer)} of layer {layer} (the plan's placement for this rank)")

    def local_rows(self, layer: int, expert_ids: Tensor) -> Tensor:
        """Global expert ids -> rows of the layer's stacked expert tensors (identity when it holds all).
        One table lookup per batch; an id not held raises `unheld_error` instead of indexing garbage."""
        lut = self.expert_lookup(layer, expert_ids.device)
        if lut is None:
            return expert_ids
        rows = lut[expert_ids]
        if rows.numel() and bool((rows < 0).any()):
            raise self.unheld_error(layer, expert_ids[rows < 0].tolist())
        return rows

    @classmethod
    def from_names(cls, tensors: dict[str, Tensor], num_layers: int,
                   held: Optional[list[Optional[list[int]]]] = None) -> "ModelWeights":
        """The weights of a flat map of canonical names (`expected_shapes`' keys: `layers.{i}.{name}` per layer)."""
        layers: list[dict[str, Tensor]] = [{} for _ in range(num_layers)]
        for name, t in tensors.items():
            if name.startswith("layers."):
                _, idx, short = name.split(".", 2)
                layers[int(idx)][short] = t
        return cls(embed=tensors["embed"], final_norm=tensors["final_norm"], lm_head=tensors.get("lm_head"),
                   layers=layers, held=held)

    def named(self) -> dict[str, Tensor]:
        """The flat map of canonical names (`from_names`' inverse)."""
        out = {"embed": self.embed, "final_norm": self.final_norm}
        if self.lm_head is not None:
            out["lm_head"] = self.lm_head
        out.update((f"layers.{l}.{name}", t) for l, layer in enumerate(self.layers) for name, t in layer.items())
        return out

    @property
    def head(self) -> Tensor:
        """The LM head matrix, resolving tied embeddings."""
        return self.embed if self.lm_head is None else self.lm_head

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "ModelWeights":
        """Copy to `device` / `dtype`. Tensors in _FP32_ALWAYS keep fp32 when `dtype` is given."""

        def conv(name: str, t: Tensor) -> Tensor:
            keep = dtype is not None and name.split(".", 2)[-1] in _FP32_ALWAYS  # (a layer's short name)
            return t.to(device=device, dtype=torch.float32 if keep else dtype)

        named = {name: conv(name, t) for name, t in self.named().items()}
        return ModelWeights.from_names(named, len(self.layers), held=self.held)

    def num_bytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.named().values())


def stack_qkv(w: ModelWeights) -> ModelWeights:
    """The same weights with q/k/v stacked for one projection GEMM (models.attention.gqa_project reads "qkv.w").

    Per layer holding q.w, k.w and v.w (and all three biases or none): one stacked tensor, "qkv.w" / "qkv.b", in the
    returned weights' own layer dicts. q.w, k.w, v.w (and biases) become row views of it, in `w`'s dicts too: the
    same values, so any other user of `w` computes exactly as before, and the originals are freed (no second copy
    on the device). Layers without that form (MLA's q_a/kv_a) are shared as they are."""
    layers = []
    for lw in w.layers:
        names = [n for n in ("q", "k", "v") if f"{n}.w" in lw]
        biased = [n for n in names if f"{n}.b" in lw]
        if len(names) < 3 or len(biased) not in (0, 3):
            layers.append(lw)
            continue
        own = dict(lw)
        for kind in ("w",) + (("b",) if biased else ()):
            parts = [lw[f"{n}.{kind}"] for n in names]
            stacked = own[f"qkv.{kind}"] = torch.cat(parts)
            for n, view in zip(names, stacked.split([p.shape[0] for p in parts])):
                lw[f"{n}.{kind}"] = own[f"{n}.{kind}"] = view
        layers.append(own)
    return replace(w, layers=layers)


def expected_shapes(spec: ModelSpec, experts: ExpertSubset = None) -> dict[str, tuple[int, ...]]:
    """Flat map of every tensor the spec needs: `embed`, `final_norm`, `lm_head` (untied only) and
    `layers.{i}.{name}`. Used by `random_weights` and by checkpoint validation. With `experts`
    (see held_per_layer) the stacked expert tensors have one row per held expert."""
    V, H = spec.vocab_size, spec.hidden_size
    out: dict[str, tuple[int, ...]] = {"embed": (V, H), "final_norm": (H,)}
    if not spec.tie_embeddings:
        out["lm_head"] = (V, H)
    held = held_per_layer(spec, experts)
    for l in range(spec.num_layers):
        for name, shape in layer_shapes(spec, l).items():
            if held[l] is not None and name in EXPERT_TENSORS:
                shape = (len(held[l]),) + shape[1:]
            out[f"layers.{l}.{name}"] = shape
    return out


def validate_weights(spec: ModelSpec, w: ModelWeights, source: str = "weights") -> None:
    """Raise UserError naming the first missing, extra or mis-shaped tensor."""
    if len(w.layers) != spec.num_layers:
        raise UserError(f"{source}: {len(w.layers)} layers, the spec has {spec.num_layers}")
    got = w.named()
    want = expected_shapes(spec, w.held)
    for name, shape in want.items():
        if name not in got:
            raise UserError(f"{source}: missing tensor '{name}' (expected shape {list(shape)})")
        if tuple(got[name].shape) != shape:
            raise UserError(f"{source}: tensor '{name}' has shape {list(got[name].shape)}, expected {list(shape)}")
    extra = sorted(set(got) - set(want))
    if extra:
        raise UserError(f"{source}: unexpected tensor '{extra[0]}' for this spec"
                        + (f" (and {len(extra) - 1} more)" if len(extra) > 1 else ""))


_NORMS = frozenset({"attn_norm", "mlp_norm", "final_norm", "q_norm", "k_norm", "q_a_norm", "kv_a_norm"})


# ------------------------------------------------------------------------------------------------ random init
# Counter-based draws: every value is a pure function of (seed, tensor name or (layer, tensor, expert), element
# index), computed with exact 32-bit integer arithmetic and then one float32 multiply, so a CPU build and a CUDA
# build are bit-identical and a device builds its weights in place (no host draw, no copy). A GPT-OSS-20B rank drew
# ~21e9 values with torch's CPU generator (mt19937 + Box-Muller, one thread) and copied them over: most of the
# ~125 s before serving (issue 31). Until then the draws were torch.randn; every value changed with this recipe.
_MIX1, _MIX2 = 0x21F0AAAD, 0x735A2D97  # odd multipliers below 2^31: x * m < 2^63 for x < 2^32 (the int64 path)
_U32 = 0xFFFFFFFF
_T_OFFSET = 131069  # T = 2 * (four 15-bit fields + one bit) - 131069: odd (never 0), symmetric about 0
# sqrt(3) / 65536 rounded to float32 (this double is that float32 exactly): the draw's one rounding is T * _UNIT
_UNIT = 2.6428997443872504e-05
_MAX_DRAW = 1 << 31  # element indices per stream (2 j + 1 must fit 32 bits)
_CHUNK = {"cpu": 1 << 16, "device": 1 << 24}  # elements per step: cache-sized on the host, large on a device


def _stream_keys(seed: int, *parts) -> tuple[int, int]:
    """The two 31-bit keys of one stream (a tensor, or one expert's slice of a stacked tensor). A hash, not
    Python's hash() (salted per process): every rank, process and machine derives the same keys."""
    d = hashlib.blake2b("/".join(str(p) for p in (seed, *parts)).encode(), digest_size=8).digest()
    k = int.from_bytes(d, "little")
    return k & 0x7FFFFFFF, (k >> 32) & 0x7FFFFFFF


def _mix_np(x) -> None:
    """In place on a uint32 array (numpy wraps unsigned arithmetic modulo 2^32)."""
    x ^= x >> 16
    x *= _MIX1
    x ^= x >> 15
    x *= _MIX2
    x ^= x >> 15


def _draw_numpy(start: int, n: int, k1: int, k2: int) -> Tensor:
    """int32 [n]: the odd integers T of elements start..start+n-1 of the stream (k1, k2), on the host."""
    import numpy as np
    j2 = np.arange(start, start + n, dtype=np.uint32)
    j2 <<= 1
    a = j2 ^ np.uint32(k1)
    b = (j2 | np.uint32(1)) ^ np.uint32(k1)
    for x in (a, b):
        _mix_np(x)
        x ^= np.uint32(k2)
        _mix_np(x)
    s = (a & 0x7FFF) + ((a >> 16) & 0x7FFF) + (b & 0x7FFF) + ((b >> 16) & 0x7FFF) + ((a >> 15) & 1)
    t = s.astype(np.int32)
    t *= 2
    t -= _T_OFFSET
    return torch.from_numpy(t)


def _mix_torch(x: Tensor) -> Tensor:
    x = x ^ (x >> 16)
    x = (x * _MIX1) & _U32
    x = x ^ (x >> 15)
    x = (x * _MIX2) & _U32
    return x ^ (x >> 15)


def _draw_torch(start: int, n: int, k1: int, k2: int, device: torch.device) -> Tensor:
    """_draw_numpy's values with torch int64 ops on any device (products stay below 2^63: no overflow)."""
    j2 = torch.arange(start, start + n, dtype=torch.int64, device=device) * 2
    a = _mix_torch(_mix_torch(j2 ^ k1) ^ k2)
    b = _mix_torch(_mix_torch((j2 + 1) ^ k1) ^ k2)
    s = (a & 0x7FFF) + ((a >> 16) & 0x7FFF) + (b & 0x7FFF) + ((b >> 16) & 0x7FFF) + ((a >> 15) & 1)
    return (s * 2 - _T_OFFSET).to(torch.int32)


def _mix_tl(x):
    x ^= x >> 16
    x *= 0x21F0AAAD
    x ^= x >> 15
    x *= 0x735A2D97
    x ^= x >> 15
    return x


def _draw_kernel(out_ptr, start, n, k1, k2, BLOCK: tl.constexpr):  # noqa: F821 (tl: bound by LazyJit)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)  # noqa: F821
    j2 = (start + offs).to(tl.uint32) << 1  # noqa: F821
    u1 = k1.to(tl.uint32)  # noqa: F821
    u2 = k2.to(tl.uint32)  # noqa: F821
    a = _mix_tl(_mix_tl(j2 ^ u1) ^ u2)
    b = _mix_tl(_mix_tl((j2 | 1) ^ u1) ^ u2)
    s = (a & 0x7FFF) + ((a >> 16) & 0x7FFF) + (b & 0x7FFF) + ((b >> 16) & 0x7FFF) + ((a >> 15) & 1)
    t = s.to(tl.int32) * 2 - 131069  # noqa: F821
    tl.store(out_ptr + offs, t, mask=offs < n)  # noqa: F821


_DRAW_KERNEL = None  # dataflow_kernels.dispatch.LazyJit of _draw_kernel, made at the first device draw


def _draw_triton(start: int, n: int, k1: int, k2: int, device: torch.device) -> Tensor:
    """_draw_numpy's values in one Triton kernel (uint32 arithmetic wraps modulo 2^32, as numpy's does)."""
    global _DRAW_KERNEL
    from dataflow_kernels.dispatch import LazyJit, cdiv
    if _DRAW_KERNEL is None:
        _DRAW_KERNEL = LazyJit(_draw_kernel, helpers=(_mix_tl,), do_not_specialize=["start", "n", "k1", "k2"])
    out = torch.empty(n, dtype=torch.int32, device=device)
    _DRAW_KERNEL[(cdiv(n, 1024),)](out, start, n, k1, k2, BLOCK=1024)
    return out


def _drawer(device: torch.device, backend: Optional[str] = None):
    """draw(start, n, k1, k2) -> int32 [n] on `device`. `backend`: numpy (host), triton (a CUDA device, or the
    interpreter), torch (any device); default numpy on the host, Triton on CUDA when it imports, else torch. All
    three give the same integers (tests/test_startup_phases.py compares them)."""
    if backend is None:
        if device.type == "cpu":
            backend = "numpy"
        else:
            from dataflow_kernels.dispatch import triton_available
            backend = "triton" if device.type == "cuda" and triton_available() else "torch"
    draws = {"numpy": lambda start, n, k1, k2: _draw_numpy(start, n, k1, k2).to(device),  # (no copy on the host)
             "triton": lambda start, n, k1, k2: _draw_triton(start, n, k1, k2, device),
             "torch": lambda start, n, k1, k2: _draw_torch(start, n, k1, k2, device)}
    if backend not in draws:
        raise ValueError(f"backend {backend!r}: expected numpy, triton or torch")
    return draws[backend]


def _scaled(short: str, t: Tensor, std: float) -> Tensor:
    """A draw of mean 0, std 1 -> the init of tensor kind `short` (in place, fp32; separate multiply and add: no
    fused multiply-add, whose single rounding a device might use and the host not)."""
    if short in _NORMS:
        return t.mul_(0.1).add_(1.0)
    if short == "sinks":
        return t.mul_(0.5)  # logits on the order of the attention scores
    if short == "router.correction_bias":
        return t.mul_(0.1)  # comparable to the sigmoid score spread, so it changes selections
    return t.mul_(std)  # linear weights and biases alike


def _fill(out: Tensor, keys: tuple[int, int], short: str, std: float, draw) -> None:
    """Fill the contiguous `out` (any float dtype) with stream `keys`' values for tensor kind `short`: T * _UNIT
    in float32 (mean 0, std 1: a sum of four uniforms, within +-3.47), _scaled, then rounded to out's dtype."""
    flat = out.view(-1)
    n = flat.numel()
    if n > _MAX_DRAW:
        raise ValueError(f"random init: a tensor of {n} elements; at most {_MAX_DRAW} per tensor or expert")
    step = _CHUNK["cpu" if out.device.type == "cpu" else "device"]
    for j0 in range(0, n, step):
        m = min(step, n - j0)
        z = draw(j0, m, *keys).to(torch.float32).mul_(_UNIT)
        flat[j0:j0 + m].copy_(_scaled(short, z, std))


def random_weights(spec: ModelSpec, seed: Optional[int] = None, device: str | torch.device = "cpu",
                   dtype: Optional[torch.dtype] = None, experts: ExpertSubset = None, *,
                   backend: Optional[str] = None) -> ModelWeights:
    """Seeded random weights of the right shapes (float32 draw, then cast to `dtype`, default spec.dtype),
    built on `device` directly.

    Linear weights ~ init_std * Z; norm weights ~ 1 + 0.1 Z so a wrong norm is visible; Z has mean 0 and
    std 1 (a sum of four uniforms, bounded at +-3.47: near-normal) and is never 0, so every bias, sink and
    correction bias is nonzero and the code paths using them are exercised.
    `experts`: per layer the global expert ids to build (see held_per_layer; None = all): a rank
    builds only the experts the plan places on it.

    Every value is a pure function of (seed, tensor, element): a counter-based draw (_draw_numpy) in exact
    integer arithmetic, then float32 multiplies, so the same (spec, seed) gives bit-identical weights on
    every machine and device (a CUDA build equals the CPU reference's; `backend` picks the implementation of
    the integer draw, for tests). Every routed expert's slice of a stacked `experts.*` tensor is its own stream,
    keyed by (seed, layer, tensor, expert): an expert has the same values whichever subset is built, so a
    sharded run computes exactly what an unsharded one (and the reference) does. Every other tensor is keyed by
    (seed, name): cutting layers keeps the first layers' weights.
    """
    seed = spec.weights.seed if seed is None else seed
    device = torch.device(device)
    draw = _drawer(device, backend)
    std = spec.weights.init_std
    dtype = torch_dtype(spec.dtype) if dtype is None else dtype
    held = held_per_layer(spec, experts)
    tensors: dict[str, Tensor] = {}
    for name, shape in expected_shapes(spec).items():  # (full shapes: a shard's rows are drawn by expert below)
        short = name.split(".", 2)[2] if name.startswith("layers.") else name
        out_dtype = torch.float32 if short in _FP32_ALWAYS else dtype
        if short in EXPERT_TENSORS:
            layer = int(name.split(".", 2)[1])
            ids = range(shape[0]) if held[layer] is None else held[layer]
            t = torch.empty((len(ids),) + shape[1:], dtype=out_dtype, device=device)
            for row, e in enumerate(ids):
                _fill(t[row], _stream_keys(seed, layer, short, e), short, std, draw)
        else:
            t = torch.empty(shape, dtype=out_dtype, device=device)
            _fill(t, _stream_keys(seed, name), short, std, draw)
        tensors[name] = t
    return ModelWeights.from_names(tensors, spec.num_layers, held=None if experts is None else held)


def load_weights(spec: ModelSpec, experts: ExpertSubset = None,
                 device: Optional[str | torch.device] = None) -> ModelWeights:
    """Weights as `spec.weights` says: seeded random, or the checkpoint directory's tensors.
    `experts`: only these routed experts per layer (see held_per_layer; None = all). `device`: where they
    go (default the host): random weights are built there directly (the same values as on the host), a
    checkpoint's are read on the host and moved and cast in one step."""
    if spec.weights.source == "random":
        return random_weights(spec, experts=experts, device="cpu" if device is None else device)
    from models.checkpoint import load_checkpoint  # lazy: safetensors/json only needed here

    _, weights = load_checkpoint(spec.weights.path, experts=experts)
    weights = weights.to(device=device, dtype=torch_dtype(spec.dtype))
    validate_weights(spec, weights, source=str(spec.weights.path))
    return weights
