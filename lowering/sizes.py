"""How many elements / bytes each piece of a model takes: the arithmetic behind the memory,
capture and route passes, kept in one place so they agree.

Parameter counts follow the canonical weight names of models/weights.py (ARCHITECTURE.md).
"""
from __future__ import annotations

from graph_ir.spec import ModelSpec

DTYPE_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def dtype_bytes(spec: ModelSpec) -> int:
    return DTYPE_BYTES[spec.dtype]


def attention_params(spec: ModelSpec) -> int:
    """Attention weights of one layer, its two RMSNorms included."""
    a, h = spec.attention, spec.hidden_size
    n = 2 * h  # attn_norm, mlp_norm
    if a.kind == "gqa":
        q, kv = a.num_heads * a.head_dim, a.num_kv_heads * a.head_dim
        n += q * h + 2 * kv * h + h * q
        if a.qkv_bias:
            n += q + 2 * kv
        if a.o_bias:
            n += h
        if a.qk_norm == "head":
            n += 2 * a.head_dim
        elif a.qk_norm == "full":
            n += q + kv
        if a.sinks:
            n += a.num_heads
    else:
        qk = a.num_heads * a.qk_head_dim
        if a.q_lora_rank:
            n += a.q_lora_rank * h + a.q_lora_rank + qk * a.q_lora_rank
        else:
            n += qk * h
        n += (a.kv_lora_rank + a.qk_rope_head_dim) * h + a.kv_lora_rank
        n += a.num_heads * (a.qk_nope_head_dim + a.v_head_dim) * a.kv_lora_rank
        n += h * a.num_heads * a.v_head_dim
    return n


def router_params(spec: ModelSpec) -> int:
    e = spec.experts.num_experts
    r = spec.router
    return e * spec.hidden_size + (e if r.bias else 0) + (e if r.correction_bias else 0)


def expert_params(spec: ModelSpec) -> int:
    """One routed expert (gate, up, down and their biases)."""
    x, h = spec.experts, spec.hidden_size
    n = 3 * x.intermediate_size * h
    if x.bias:
        n += 2 * x.intermediate_size + h
    return n


def shared_params(spec: ModelSpec) -> int:
    x, h = spec.experts, spec.hidden_size
    return 3 * x.shared_intermediate_size * h + (h if x.shared_gate else 0)


def dense_mlp_params(spec: ModelSpec) -> int:
    return 3 * (spec.dense_intermediate_size or 0) * spec.hidden_size


def replicated_params(spec: ModelSpec) -> int:
    """Everything every rank holds: embedding, head, final norm and, per layer, attention plus the
    home-rank MLP parts (router and shared expert of MoE layers, the MLP of dense layers)."""
    h, v = spec.hidden_size, spec.vocab_size
    n = v * h + h + (0 if spec.tie_embeddings else v * h)
    for layer in range(spec.num_layers):
        n += attention_params(spec)
        if spec.is_moe_layer(layer):
            n += router_params(spec) + shared_params(spec)
        else:
            n += dense_mlp_params(spec)
    return n


def kv_bytes_per_token_layer(spec: ModelSpec) -> int:
    """KV cache bytes one token takes in one layer.

    GQA caches K and V of every kv head. MLA caches the latent form the runtime keeps (models.attention): the normed
    kv latent and the roped key, (kv_lora_rank + qk_rope_head_dim) values shared by all heads, not the per-head
    K [nh, nope+rope] and V [nh, v_head_dim] they decompress to (71x as much at DeepSeek-V3).
    """
    a, b = spec.attention, dtype_bytes(spec)
    if a.kind == "gqa":
        return 2 * a.num_kv_heads * a.head_dim * b
    return (a.kv_lora_rank + a.qk_rope_head_dim) * b


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
