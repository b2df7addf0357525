"""ModelWeights: every tensor of a model under its canonical name (see ARCHITECTURE.md).

The math in models/ reads only these names, so a checkpoint importer's whole job is to map a
family's tensor names and layouts onto them. `expected_shapes` is the single source of truth for
which tensors a spec needs and their shapes: random init builds from it and checkpoint loading
validates against it, so the two can never disagree.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

import torch
from torch import Tensor

from graph_ir.errors import UserError
from graph_ir.spec import ModelSpec

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}

# Tensors that HF keeps in fp32 whatever the model dtype (GLM/DeepSeek-V3 keep the selection bias
# as an fp32 buffer); rounding them to bf16 would change which experts win close races.
_FP32_ALWAYS = frozenset({"router.correction_bias"})


def torch_dtype(name: str) -> torch.dtype:
    return _DTYPES[name]


@dataclass
class ModelWeights:
    embed: Tensor  # [V, H]
    final_norm: Tensor  # [H]
    lm_head: Optional[Tensor]  # [V, H]; None when tied to `embed`
    layers: list[dict[str, Tensor]] = field(default_factory=list)

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
        )

    def num_bytes(self) -> int:
        ts = [self.embed, self.final_norm] + ([self.lm_head] if self.lm_head is not None else [])
        ts += [t for layer in self.layers for t in layer.values()]
        return sum(t.numel() * t.element_size() for t in ts)


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


def expected_shapes(spec: ModelSpec) -> dict[str, tuple[int, ...]]:
    """Flat map of every tensor the spec needs: `embed`, `final_norm`, `lm_head` (untied only) and
    `layers.{i}.{name}`. Used by `random_weights` and by checkpoint validation."""
    V, H = spec.vocab_size, spec.hidden_size
    out: dict[str, tuple[int, ...]] = {"embed": (V, H), "final_norm": (H,)}
    if not spec.tie_embeddings:
        out["lm_head"] = (V, H)
    for l in range(spec.num_layers):
        for name, shape in layer_shapes(spec, l).items():
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
    want = expected_shapes(spec)
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


def random_weights(spec: ModelSpec, seed: Optional[int] = None, device: str | torch.device = "cpu",
                   dtype: Optional[torch.dtype] = None) -> ModelWeights:
    """Seeded random weights of the right shapes (fp32 draw, then cast to `dtype`, default spec.dtype).

    Linear weights ~ N(0, init_std); norm weights ~ 1 + N(0, 0.1) so a wrong norm is visible;
    every bias, sink and correction bias is nonzero so the code paths using them are exercised.
    Tensors are drawn in the order of `expected_shapes`, so the same (spec, seed, device kind) gives
    the same weights on every machine. `device="cuda"` draws on the GPU with its own generator
    (a GPT-OSS-size model drawn on the host takes minutes); its numbers differ from a CPU draw.
    """
    seed = spec.weights.seed if seed is None else seed
    device = torch.device(device)
    g = torch.Generator(device=device).manual_seed(seed)
    std = spec.weights.init_std
    dtype = torch_dtype(spec.dtype) if dtype is None else dtype
    tensors: dict[str, Tensor] = {}
    for name, shape in expected_shapes(spec).items():
        short = name.split(".", 2)[2] if name.startswith("layers.") else name
        t = torch.randn(shape, generator=g, dtype=torch.float32, device=device)
        if _is_norm(short):
            t = 1.0 + 0.1 * t
        elif short == "sinks":
            t = 0.5 * t  # logits on the order of the attention scores
        elif short == "router.correction_bias":
            t = 0.1 * t  # comparable to the sigmoid score spread, so it changes selections
        else:  # linear weights and biases alike
            t = std * t
        tensors[name] = t.to(torch.float32 if short in _FP32_ALWAYS else dtype)
    layers = [{} for _ in range(spec.num_layers)]
    for name, t in tensors.items():
        if name.startswith("layers."):
            _, idx, short = name.split(".", 2)
            layers[int(idx)][short] = t
    return ModelWeights(embed=tensors["embed"], final_norm=tensors["final_norm"],
                        lm_head=tensors.get("lm_head"), layers=layers)


def load_weights(spec: ModelSpec) -> ModelWeights:
    """Weights as `spec.weights` says: seeded random, or the checkpoint directory's tensors."""
    if spec.weights.source == "random":
        return random_weights(spec)
    from models.checkpoint import load_checkpoint  # lazy: safetensors/json only needed here

    _, weights = load_checkpoint(spec.weights.path)
    weights = weights.to(dtype=torch_dtype(spec.dtype))
    validate_weights(spec, weights, source=str(spec.weights.path))
    return weights
