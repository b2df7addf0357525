"""ModelWeights: every tensor of a model under its canonical name (see ARCHITECTURE.md).

The math in models/ reads only these names, so a checkpoint importer's whole job is to map a
family's tensor names and layouts onto them. `expected_shapes` is the single source of truth for
which tensors a spec needs and their shapes: random init builds from it and checkpoint loading
validates against it, so the two can never disagree.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from typing import Optional, Sequence

import torch
from torch import Tensor

from graph_ir.errors import UserError
from graph_ir.spec import ModelSpec

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

    @property
    def head(self) -> Tensor:
        """The LM head matrix, resolving tied embeddings."""
        return self.embed if self.lm_head is None else self.lm_head

    def to(self, device: torch.device | str | None = None, dtype: torch.dtype | None = None) -> "ModelWeights":
        """Copy to `device` / `dtype`. Tensors in _FP32_ALWAYS keep fp32 when `dtype` is given."""

        def conv(name: str, t: Tensor) -> Tensor:
            dt = torch.float32 if (dtype is not None and name in _FP32_ALWAYS) else dtype
            return t.to(device=device, dtype=dt)

        return ModelWeights(
            embed=conv("embed", self.embed),
            final_norm=conv("final_norm", self.final_norm),
            lm_head=None if self.lm_head is None else conv("lm_head", self.lm_head),
            layers=[{k: conv(k, v) for k, v in layer.items()} for layer in self.layers],
            held=self.held,
        )

    def num_bytes(self) -> int:
        ts = [self.embed, self.final_norm] + ([self.lm_head] if self.lm_head is not None else [])
        ts += [t for layer in self.layers for t in layer.values()]
        return sum(t.numel() * t.element_size() for t in ts)


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


def layer_shapes(spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every tensor layer `layer` needs under `spec`."""
    a, ex, H = spec.attention, spec.experts, spec.hidden_size
    s: dict[str, tuple[int, ...]] = {"attn_norm": (H,), "mlp_norm": (H,)}
    nh, nkv = a.num_heads, a.num_kv_heads
    if a.kind == "gqa":
        hd = a.head_dim
        s["q.w"] = (nh * hd, H)
        s["k.w"] = (nkv * hd, H)
        s["v.w"] = (nkv * hd, H)
        s["o.w"] = (H, nh * hd)
        if a.qkv_bias:
            s["q.b"], s["k.b"], s["v.b"] = (nh * hd,), (nkv * hd,), (nkv * hd,)
        if a.qk_norm == "head":
            s["q_norm"], s["k_norm"] = (hd,), (hd,)
        elif a.qk_norm == "full":
            s["q_norm"], s["k_norm"] = (nh * hd,), (nkv * hd,)
    else:  # mla
        qk, rope, nope, vd, kvr = a.qk_head_dim, a.qk_rope_head_dim, a.qk_nope_head_dim, a.v_head_dim, a.kv_lora_rank
        if a.q_lora_rank is None:
            s["q.w"] = (nh * qk, H)
        else:
            s["q_a.w"] = (a.q_lora_rank, H)
            s["q_a_norm"] = (a.q_lora_rank,)
            s["q_b.w"] = (nh * qk, a.q_lora_rank)
        s["kv_a.w"] = (kvr + rope, H)
        s["kv_a_norm"] = (kvr,)
        s["kv_b.w"] = (nh * (nope + vd), kvr)
        s["o.w"] = (H, nh * vd)
        # HF DeepSeek-V2 `attention_bias` puts biases on q_a / kv_a / o (q_b and kv_b never have one).
        if a.qkv_bias:
            if a.q_lora_rank is not None:
                s["q_a.b"] = (a.q_lora_rank,)
            s["kv_a.b"] = (kvr + rope,)
    if a.o_bias:
        s["o.b"] = (H,)
    if a.sinks:
        s["sinks"] = (nh,)

    if spec.is_moe_layer(layer):
        E, I = ex.num_experts, ex.intermediate_size
        s["router.w"] = (E, H)
        if spec.router.bias:
            s["router.b"] = (E,)
        if spec.router.correction_bias:
            s["router.correction_bias"] = (E,)
        s["experts.gate"] = (E, I, H)
        s["experts.up"] = (E, I, H)
        s["experts.down"] = (E, H, I)
        if ex.bias:
            s["experts.gate_b"], s["experts.up_b"], s["experts.down_b"] = (E, I), (E, I), (E, H)
        if ex.shared_intermediate_size:
            Is = ex.shared_intermediate_size
            s["shared.gate"], s["shared.up"], s["shared.down"] = (Is, H), (Is, H), (H, Is)
            if ex.shared_gate:
                s["shared_gate.w"] = (1, H)
    else:
        Id = spec.dense_intermediate_size
        s["mlp.gate"], s["mlp.up"], s["mlp.down"] = (Id, H), (Id, H), (H, Id)
    return s


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
    got: dict[str, Tensor] = {"embed": w.embed, "final_norm": w.final_norm}
    if w.lm_head is not None:
        got["lm_head"] = w.lm_head
    if len(w.layers) != spec.num_layers:
        raise UserError(f"{source}: {len(w.layers)} layers, the spec has {spec.num_layers}")
    for l, layer in enumerate(w.layers):
        for name, t in layer.items():
            got[f"layers.{l}.{name}"] = t
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


def _is_norm(name: str) -> bool:
    return name in ("attn_norm", "mlp_norm", "final_norm", "q_norm", "k_norm", "q_a_norm", "kv_a_norm")


def _expert_seed(seed: int, layer: int, name: str, expert: int) -> int:
    """The seed of one expert's slice of one stacked tensor. A hash, not Python's hash() (salted per
    process): every rank, process and machine derives the same stream for the same expert."""
    d = hashlib.blake2b(f"{seed}/{layer}/{name}/{expert}".encode(), digest_size=8).digest()
    return int.from_bytes(d, "little") >> 1  # 63 bits: any torch generator takes it


def _scaled(short: str, t: Tensor, std: float) -> Tensor:
    """A standard normal draw -> the init of tensor kind `short` (in place, fp32)."""
    if _is_norm(short):
        return t.mul_(0.1).add_(1.0)
    if short == "sinks":
        return t.mul_(0.5)  # logits on the order of the attention scores
    if short == "router.correction_bias":
        return t.mul_(0.1)  # comparable to the sigmoid score spread, so it changes selections
    return t.mul_(std)  # linear weights and biases alike


def random_weights(spec: ModelSpec, seed: Optional[int] = None, device: str | torch.device = "cpu",
                   dtype: Optional[torch.dtype] = None, experts: ExpertSubset = None) -> ModelWeights:
    """Seeded random weights of the right shapes (fp32 draw, then cast to `dtype`, default spec.dtype).

    Linear weights ~ N(0, init_std); norm weights ~ 1 + N(0, 0.1) so a wrong norm is visible;
    every bias, sink and correction bias is nonzero so the code paths using them are exercised.
    `experts`: per layer the global expert ids to build (see held_per_layer; None = all): a rank
    builds only the experts the plan places on it.

    Every routed expert's slice of a stacked `experts.*` tensor is drawn from its own generator
    state, seeded by (seed, layer, tensor, expert): an expert has the same values whichever subset
    is built, so a sharded run computes exactly what an unsharded one (and the reference) does.
    All other tensors come from one generator, in the order of `expected_shapes`. So the same
    (spec, seed, device kind) gives the same weights on every machine, and cutting layers keeps
    the first layers' weights. `device="cuda"` draws on the GPU (a GPT-OSS-size model drawn on
    the host takes minutes); its numbers differ from a CPU draw.
    """
    seed = spec.weights.seed if seed is None else seed
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    g_expert = torch.Generator(device=device)  # re-seeded per (layer, tensor, expert)
    std = spec.weights.init_std
    dtype = torch_dtype(spec.dtype) if dtype is None else dtype
    held = held_per_layer(spec, experts)
    full = expected_shapes(spec)
    tensors: dict[str, Tensor] = {}
    for name, shape in full.items():
        short = name.split(".", 2)[2] if name.startswith("layers.") else name
        out_dtype = torch.float32 if short in _FP32_ALWAYS else dtype
        if short in EXPERT_TENSORS:
            layer = int(name.split(".", 2)[1])
            ids = range(shape[0]) if held[layer] is None else held[layer]
            # Filled one expert at a time: the fp32 temporary is one expert's, not the layer's.
            t = torch.empty((len(ids),) + shape[1:], dtype=out_dtype, device=device)
            for row, e in enumerate(ids):
                g_expert.manual_seed(_expert_seed(seed, layer, short, e))
                t[row].copy_(_scaled(short, torch.randn(shape[1:], generator=g_expert, dtype=torch.float32,
                                                        device=device), std))
        else:
            t = _scaled(short, torch.randn(shape, generator=g, dtype=torch.float32, device=device), std)
            t = t.to(out_dtype)
        tensors[name] = t
    layers = [{} for _ in range(spec.num_layers)]
    for name, t in tensors.items():
        if name.startswith("layers."):
            _, idx, short = name.split(".", 2)
            layers[int(idx)][short] = t
    return ModelWeights(embed=tensors["embed"], final_norm=tensors["final_norm"],
                        lm_head=tensors.get("lm_head"), layers=layers,
                        held=None if experts is None else held)


def load_weights(spec: ModelSpec, experts: ExpertSubset = None) -> ModelWeights:
    """Weights as `spec.weights` says: seeded random, or the checkpoint directory's tensors.
    `experts`: only these routed experts per layer (see held_per_layer; None = all)."""
    if spec.weights.source == "random":
        return random_weights(spec, experts=experts)
    from models.checkpoint import load_checkpoint  # lazy: safetensors/json only needed here

    _, weights = load_checkpoint(spec.weights.path, experts=experts)
    weights = weights.to(dtype=torch_dtype(spec.dtype))
    validate_weights(spec, weights, source=str(spec.weights.path))
    return weights
