"""How many elements / bytes each piece of a model takes: the arithmetic behind the memory,
capture and route passes, kept in one place so they agree.

Parameter counts are those of the canonical tensors (graph_ir.spec.layer_shapes).
"""
from __future__ import annotations

import math

from graph_ir.spec import ModelSpec, layer_shapes

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(spec: ModelSpec) -> int:
    return DTYPE_BYTES[spec.dtype]


def replicated_params(spec: ModelSpec) -> int:
    """Everything every rank holds: embedding, head, final norm and every layer's tensors but its routed experts
    (norms, attention, the router and shared expert of MoE layers, the MLP of dense layers)."""
    h, v = spec.hidden_size, spec.vocab_size
    n = v * h + h + (0 if spec.tie_embeddings else v * h)
    return n + sum(math.prod(shape) for layer in range(spec.num_layers)
                   for name, shape in layer_shapes(spec, layer).items() if not name.startswith("experts."))


def expert_params(spec: ModelSpec) -> int:
    """One routed expert (gate, up, down and their biases)."""
    shapes = layer_shapes(spec, spec.moe_layers[0])
    return sum(math.prod(shape[1:]) for name, shape in shapes.items() if name.startswith("experts."))


def kv_bytes_per_token_layer(spec: ModelSpec) -> int:
    """KV cache bytes one token takes in one layer.

    GQA caches K and V of every kv head. MLA caches the latent form the runtime keeps (models.attention): the normed
    kv latent and the roped key, (kv_lora_rank + qk_rope_head_dim) values shared by all heads, not the per-head
    K [nh, nope+rope] and V [nh, v_head_dim] they decompress to (71x as much at DeepSeek-V3).
    """
    a = spec.attention
    per_token = 2 * a.num_kv_heads * a.head_dim if a.kind == "gqa" else a.kv_lora_rank + a.qk_rope_head_dim
    return per_token * dtype_bytes(spec)


def attn_row_elems(spec: ModelSpec, layer: int) -> int:
    """Activation elements one token needs in an attention stage of `layer`: input, residual and
    normed output, q/k/v/attention output, and the home-rank MLP (shared expert or dense MLP)."""
    a, h = spec.attention, spec.hidden_size
    n = 3 * h
    n += a.num_heads * a.qk_head_dim + a.num_kv_heads * (a.qk_head_dim + a.value_head_dim)
    n += a.num_heads * a.value_head_dim
    if a.kind == "mla":  # q's and the kv latent's projections; the absorbed query and the latent attention output
        n += (a.q_lora_rank or 0) + a.kv_lora_rank + a.qk_rope_head_dim
        n += a.num_heads * (2 * a.kv_lora_rank + a.qk_rope_head_dim)
    if spec.is_moe_layer(layer):
        n += spec.experts.num_experts + 2 * spec.experts.shared_intermediate_size  # router logits
    else:
        n += 2 * (spec.dense_intermediate_size or 0)
    return n


def expert_row_elems(spec: ModelSpec) -> int:
    """Activation elements of one routed row in an expert stage: input, gate, up, output."""
    return 2 * spec.hidden_size + 2 * spec.experts.intermediate_size


def sample_row_bytes(spec: ModelSpec) -> int:
    """Per token in the sample stage: the normed hidden state and fp32 logits over the vocabulary."""
    return spec.hidden_size * dtype_bytes(spec) + spec.vocab_size * 4
