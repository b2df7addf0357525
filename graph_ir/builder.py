"""Declare a model in Python instead of YAML. A thin fluent layer over ModelSpec: every call sets
fields, `build()` validates through the same path as a YAML file, so a mistake is the same UserError.

    spec = (ModelBuilder("my-moe").layers(4).hidden(96).vocab(512)
            .gqa(heads=6, kv_heads=2, head_dim=16)
            .router("softmax", renormalize=True)
            .experts(10, top_k=3, intermediate=64)
            .dense_first(1, intermediate=128)
            .build())
"""
from __future__ import annotations

from typing import Any, Optional

from graph_ir.spec import ModelSpec, spec_from_dict


class ModelBuilder:
    def __init__(self, name: str, family: str = "custom") -> None:
        self._d: dict[str, Any] = {"name": name, "family": family}

    def _set(self, **fields: Any) -> "ModelBuilder":
        self._d.update({k: v for k, v in fields.items() if v is not None})
        return self

    def layers(self, n: int) -> "ModelBuilder":
        return self._set(num_layers=n)

    def hidden(self, n: int) -> "ModelBuilder":
        return self._set(hidden_size=n)

    def vocab(self, n: int, tie_embeddings: bool = False, eos: Optional[list[int]] = None) -> "ModelBuilder":
        return self._set(vocab_size=n, tie_embeddings=tie_embeddings, eos_token_ids=eos)

    def dtype(self, dtype: str) -> "ModelBuilder":
        return self._set(dtype=dtype)

    def norm_eps(self, eps: float) -> "ModelBuilder":
        return self._set(rms_norm_eps=eps)

    def max_position(self, n: int) -> "ModelBuilder":
        return self._set(max_position=n)

    def gqa(self, heads: int, kv_heads: int, head_dim: int, **attention: Any) -> "ModelBuilder":
        """Grouped-query attention; extra keywords are AttentionSpec fields (qkv_bias, qk_norm, sinks, ...)."""
        self._d["attention"] = {"kind": "gqa", "num_heads": heads, "num_kv_heads": kv_heads,
                                "head_dim": head_dim, **attention}
        return self

    def mla(self, heads: int, kv_lora_rank: int, qk_nope_head_dim: int, qk_rope_head_dim: int,
            v_head_dim: int, q_lora_rank: Optional[int] = None, **attention: Any) -> "ModelBuilder":
        """Multi-head latent attention (DeepSeek-V2). head_dim is the q/k head dim (nope + rope)."""
        self._d["attention"] = {"kind": "mla", "num_heads": heads, "num_kv_heads": heads,
                                "head_dim": qk_nope_head_dim + qk_rope_head_dim,
                                "kv_lora_rank": kv_lora_rank, "qk_nope_head_dim": qk_nope_head_dim,
                                "qk_rope_head_dim": qk_rope_head_dim, "v_head_dim": v_head_dim,
                                "q_lora_rank": q_lora_rank, **attention}  # (None: no q compression)
        return self

    def rope(self, theta: float = 10000.0, **rope: Any) -> "ModelBuilder":
        """RoPE settings (scaling, factor, original_max_position, partial_rotary_factor, ...)."""
        self._d.setdefault("attention", {})["rope"] = {"theta": theta, **rope}
        return self

    def router(self, scoring: str = "softmax", **router: Any) -> "ModelBuilder":
        self._d["router"] = {"scoring": scoring, **router}
        return self

    def experts(self, n: int, top_k: int, intermediate: int, **experts: Any) -> "ModelBuilder":
        self._d["experts"] = {**self._d.get("experts", {}), "num_experts": n, "top_k": top_k,
                              "intermediate_size": intermediate, **experts}
        return self

    def shared_expert(self, intermediate: int, gate: bool = False) -> "ModelBuilder":
        self._d.setdefault("experts", {}).update(shared_intermediate_size=intermediate, shared_gate=gate)
        return self

    def dense_layers(self, layers: list[int], intermediate: int) -> "ModelBuilder":
        return self._set(dense_layers=list(layers), dense_intermediate_size=intermediate)

    def dense_first(self, k: int, intermediate: int) -> "ModelBuilder":
        return self.dense_layers(list(range(k)), intermediate)

    def weights(self, seed: int = 0, **weights: Any) -> "ModelBuilder":
        self._d["weights"] = {"seed": seed, **weights}
        return self

    def to_dict(self) -> dict[str, Any]:
        return {k: (dict(v) if isinstance(v, dict) else v) for k, v in self._d.items()}

    def build(self) -> ModelSpec:
        """Validate into a ModelSpec; problems raise UserError naming the builder and the field."""
        return spec_from_dict(self.to_dict(), f"ModelBuilder({self._d['name']!r})")
