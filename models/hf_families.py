"""config.json -> spec fields of the MLA families and those added later (models/hf_config.py dispatches here):
DeepSeek-V2, DeepSeek-V3 (V3/R1, Kimi-K2, Moonlight), GLM-4.7-Flash (glm4_moe_lite), dots1, MiniMax-M2, GraniteMoE,
ERNIE-4.5-MoE and Hunyuan-MoE.

As in hf_config.py, every default is the installed transformers' (5.x) `configuration_*.py` default, because
published checkpoints omit keys whose value is the default, and a setting we cannot honour is a UserError naming
config.json and the key. Each function fills the `attn`, `router`, `experts` and `spec` dicts of
`spec_dict_from_config` in place.

Multi-token-prediction layers (DeepSeek-V3 `num_nextn_predict_layers`, GLM-4.7-Flash's layer 47): transformers'
causal LM never runs them, and neither do we; their weights (decoder layers numbered past num_hidden_layers) are
skipped at load (models/hf_weights.py `_ignorable`).
"""
from __future__ import annotations

from typing import Any

# Families whose MTP layers follow the decoder layers in the checkpoint (see the module docstring).
MTP_FAMILIES = ("glm4_moe", "deepseek_v3", "glm4_moe_lite")

# Each config class's RMSNorm eps and rope `default_theta` where they differ from 1e-6 and 10000.
EPS_DEFAULTS = {"mixtral": 1e-5, "olmoe": 1e-5, "gpt_oss": 1e-5, "glm4_moe": 1e-5, "glm4_moe_lite": 1e-5,
                "ernie4_5_moe": 1e-5, "hunyuan_v1_moe": 1e-5}
THETA_DEFAULTS = {"mixtral": 1.0e6, "gpt_oss": 150000.0, "minimax_m2": 5.0e6, "ernie4_5_moe": 500000.0}

ARCHITECTURES = {
    "DeepseekV3ForCausalLM": "deepseek_v3",
    "Glm4MoeLiteForCausalLM": "glm4_moe_lite",
    "Dots1ForCausalLM": "dots1",
    "MiniMaxM2ForCausalLM": "minimax_m2",
    "GraniteMoeForCausalLM": "granitemoe",
    "Ernie4_5_MoeForCausalLM": "ernie4_5_moe",
    "HunYuanMoEV1ForCausalLM": "hunyuan_v1_moe",
}


def _mla(cfg, attn: dict, *, q_lora: int, nope: int, rope_hd: int, v_hd: int) -> None:
    """DeepseekV2Attention / DeepseekV3Attention (GLM-4.7-Flash's too): attention_bias puts biases on q_a_proj,
    kv_a_proj_with_mqa and o_proj (never q_b / kv_b / q_proj); V3's rope_interleave (default true) rotates adjacent
    pairs (hf_config `_rope`)."""
    nope, rope_hd = cfg.int("qk_nope_head_dim", nope), cfg.int("qk_rope_head_dim", rope_hd)
    cfg.biases(attn, kind="mla", num_kv_heads=attn["num_heads"], head_dim=nope + rope_hd,
               # an explicit null q_lora_rank means no q compression (q_proj), an absent one the default rank
               q_lora_rank=cfg.int("q_lora_rank") if "q_lora_rank" in cfg.data else q_lora,
               kv_lora_rank=cfg.int("kv_lora_rank", 512), qk_nope_head_dim=nope, qk_rope_head_dim=rope_hd,
               v_head_dim=cfg.int("v_head_dim", v_hd))


def _noaux_router(cfg, router: dict, *, renorm: bool, n_group: int, topk_group: int, scaling: float) -> None:
    """DeepseekV3TopkRouter (also GLM's and dots1's): fp32 sigmoid scores; selection on score + correction bias,
    restricted to the topk_group best of n_group groups (a group scores the sum of its two best); the weights are
    the unbiased scores, renormalized with norm_topk_prob, times routed_scaling_factor."""
    # Published DeepSeek-V3 configs say how the original code routes; transformers hard-wires the one below.
    cfg.reject_set("scoring_func", "sigmoid", "the DeepSeek-V3 router scores with sigmoid")
    cfg.reject_set("topk_method", "noaux_tc", "the DeepSeek-V3 router selects with noaux_tc")
    router.update(scoring="sigmoid", correction_bias=True, renormalize=cfg.bool("norm_topk_prob", renorm),
                  n_group=cfg.int("n_group", n_group), topk_group=cfg.int("topk_group", topk_group),
                  routed_scaling=cfg.float("routed_scaling_factor", scaling))


def _deepseek_experts(cfg, experts: dict, num: Any, top_k: Any, moe_i: int, shared: Any,
                      alias: str = "num_local_experts") -> None:
    """DeepseekV2MoE's / DeepseekV3MoE's keys (n_routed_experts or its `alias`, num_experts_per_tok,
    moe_intermediate_size, n_shared_experts), with the family's transformers defaults; a None default makes the key
    required (transformers multiplies moe_intermediate_size by n_shared_experts: an absent value cannot build)."""
    cfg.routed(experts, ("n_routed_experts", alias), num, top_k, "moe_intermediate_size", moe_i)
    experts["shared_intermediate_size"] = \
        experts["intermediate_size"] * cfg.int("n_shared_experts", shared, required=shared is None)


def deepseek_v2(cfg, n_layers: int, attn: dict, router: dict, experts: dict, spec: dict) -> None:
    cfg.reject_set("mlp_bias", False, "MLP biases are not implemented")
    cfg.reject_set("moe_layer_freq", 1, "transformers' DeepseekV2 ignores it; only 1 is supported")
    # transformers' DeepseekV2TopkRouter never renormalizes, while the original DeepSeek code
    # renormalizes *instead of* applying routed_scaling_factor. Rather than pick one silently:
    cfg.reject_set("norm_topk_prob", False,
                   "transformers ignores it and the original DeepSeek code differs; refusing to guess")
    _mla(cfg, attn, q_lora=1536, nope=128, rope_hd=64, v_hd=128)
    method = cfg.get("topk_method", "greedy")
    router.update(scoring="softmax", renormalize=False,
                  routed_scaling=cfg.float("routed_scaling_factor", 1.0))
    if method == "group_limited_greedy":
        if not (cfg.has("n_group") and cfg.has("topk_group")):
            raise cfg.fail("topk_method group_limited_greedy needs 'n_group' and 'topk_group'")
        router.update(n_group=cfg.int("n_group"), topk_group=cfg.int("topk_group"))
    elif method != "greedy":
        raise cfg.unsupported("topk_method", method, "supported: greedy, group_limited_greedy")
    _deepseek_experts(cfg, experts, num=64, top_k=None, moe_i=1407, shared=0, alias="num_experts")
    cfg.dense(spec, list(range(min(cfg.int("first_k_dense_replace", 0), n_layers))), 11008)


def deepseek_v3(cfg, n_layers: int, attn: dict, router: dict, experts: dict, spec: dict) -> None:
    cfg.reject_set("moe_layer_freq", 1, "transformers' DeepseekV3 ignores it; only 1 is supported")
    _mla(cfg, attn, q_lora=1536, nope=128, rope_hd=64, v_hd=128)
    _noaux_router(cfg, router, renorm=True, n_group=8, topk_group=4, scaling=2.5)
    _deepseek_experts(cfg, experts, num=256, top_k=8, moe_i=2048, shared=1)
    cfg.dense(spec, list(range(min(cfg.int("first_k_dense_replace", 3), n_layers))), 18432)


def glm4_moe_lite(cfg, n_layers: int, attn: dict, router: dict, experts: dict, spec: dict) -> None:
    _mla(cfg, attn, q_lora=768, nope=192, rope_hd=64, v_hd=256)
    _noaux_router(cfg, router, renorm=True, n_group=1, topk_group=1, scaling=1.8)
    _deepseek_experts(cfg, experts, num=64, top_k=4, moe_i=1536, shared=1)
    # Glm4MoeLiteConfig: mlp_layer_types, default one dense layer then sparse ones
    if not cfg.has("mlp_layer_types"):
        # not a Glm4MoeLiteConfig field: transformers makes layer 0 dense whatever it says
        cfg.reject_set("first_k_dense_replace", 1, "transformers' Glm4MoeLite ignores it; give mlp_layer_types")
    types = cfg.get("mlp_layer_types", ["dense"] + ["sparse"] * (n_layers - 1))
    if not isinstance(types, list) or len(types) != n_layers or any(t not in ("dense", "sparse") for t in types):
        raise cfg.unsupported("mlp_layer_types", types, f"a list of {n_layers} entries 'dense' or 'sparse'")
    cfg.dense(spec, [i for i, t in enumerate(types) if t == "dense"], 10240)


def dots1(cfg, n_layers: int, attn: dict, router: dict, experts: dict, spec: dict) -> None:
    """Qwen3 attention (per-head q/k norm, attention_bias on q/k/v/o, sliding layers from max_window_layers) with
    DeepSeek-V3's MoE."""
    cfg.biases(attn, qk_norm="head")
    window = cfg.int("sliding_window", 4096) if "sliding_window" not in cfg.data else cfg.int("sliding_window")
    cfg.sliding(attn, cfg.layer_types(n_layers) or [
        "sliding" if window is not None and i >= cfg.int("max_window_layers", 62) else "full"
        for i in range(n_layers)], window)
    _noaux_router(cfg, router, renorm=False, n_group=1, topk_group=1, scaling=1.0)
    _deepseek_experts(cfg, experts, num=None, top_k=None, moe_i=1408, shared=None)
    cfg.dense(spec, list(range(min(cfg.int("first_k_dense_replace", 0), n_layers))), 10944)


def minimax_m2(cfg, n_layers: int, attn: dict, router: dict, experts: dict, spec: dict) -> None:
    """FlexOlmo attention (q/k RMSNorm over all heads, no biases), partial RoPE, a sigmoid router with a
    selection bias and no groups, always renormalized (MiniMaxM2TopKRouter)."""
    # Released configs describe the router and the norms with keys transformers does not read: it always does this.
    cfg.reject_set("scoring_func", "sigmoid", "MiniMax-M2's router scores with sigmoid")
    cfg.reject_set("use_routing_bias", True, "MiniMax-M2's router always adds its selection bias")
    cfg.reject_set("use_qk_norm", True, "MiniMax-M2's attention always normalizes q and k")
    attn.update(qk_norm="full", head_dim=cfg.int("head_dim", 128))
    router.update(scoring="sigmoid", correction_bias=True, renormalize=True)
    cfg.routed(experts, ("num_local_experts", "num_experts"), 256, 8, "intermediate_size", 1536)


def granitemoe(cfg, n_layers: int, attn: dict, router: dict, experts: dict, spec: dict) -> None:
    """Mixtral-like, with multipliers: embedding_multiplier on the embeddings, attention_multiplier as the softmax
    scale, residual_multiplier on every block's output, logits divided by logits_scaling; the router takes the
    top-k logits and a softmax over those k."""
    # GraniteMoeAttention: head_dim is hidden // heads (the config class has no head_dim field)
    cfg.biases(attn, head_dim=spec["hidden_size"] // attn["num_heads"],
               softmax_scale=cfg.float("attention_multiplier", 1.0))
    router.update(scoring="topk_softmax", renormalize=False)
    cfg.routed(experts, ("num_local_experts", "num_experts"), 8, 2, "intermediate_size", 11008)
    spec.update(embedding_multiplier=cfg.float("embedding_multiplier", 1.0),
                residual_multiplier=cfg.float("residual_multiplier", 1.0),
                logits_scaling=cfg.float("logits_scaling", 1.0))


def ernie4_5_moe(cfg, n_layers: int, attn: dict, router: dict, experts: dict, spec: dict) -> None:
    """Ernie4_5_MoeTopKRouter: fp32 softmax; selection on probability + e_score_correction_bias, weights the unbiased
    probabilities renormalized; a shared expert of moe_intermediate_size * moe_num_shared_experts; MoE layers from
    moe_layer_start_index to moe_layer_end_index every moe_layer_interval, dense MLPs elsewhere; RoPE on adjacent
    pairs (models/hf_config.py `_rope`)."""
    # use_bias adds biases to q/k/v/o and to every dense and shared MLP projection: the MLP ones are not implemented.
    cfg.reject_set("use_bias", False, "MLP biases are not implemented")
    norm_min = cfg.float("moe_norm_min", 1e-12)
    if norm_min > 1e-6:
        # the renormalization divides by max(sum, moe_norm_min); we divide by the sum, the same for any tiny floor
        raise cfg.unsupported("moe_norm_min", norm_min, "supported: at most 1e-6")
    router.update(scoring="softmax", correction_bias=True, renormalize=True)
    moe_i = cfg.int("moe_intermediate_size", 1536)
    experts.update(num_experts=cfg.alias(("moe_num_experts", "num_experts"), 64),
                   top_k=cfg.alias(("moe_k", "num_experts_per_tok"), 6), intermediate_size=moe_i,
                   shared_intermediate_size=moe_i * cfg.int("moe_num_shared_experts", 2))
    start, interval = cfg.int("moe_layer_start_index", 1), cfg.int("moe_layer_interval", 1)
    end = cfg.int("moe_layer_end_index", -1)
    end = n_layers - 1 if end == -1 else end
    if interval < 1:
        raise cfg.unsupported("moe_layer_interval", interval, "valid: >= 1")
    cfg.dense(spec, [i for i in range(n_layers) if not ((i + 1) % interval == 0 and start <= i <= end)], 12288)
    spec["tie_embeddings"] = cfg.bool("tie_word_embeddings", True)  # Ernie4_5_MoeConfig's default


def _per_layer_int(cfg, key: str, default: int, n_layers: int) -> int:
    """An int, or a per-layer list of one repeated value (Hunyuan's released configs): transformers sizes every
    layer's experts by config.num_local_experts, so differing values cannot load."""
    value = cfg.get(key, default)
    if isinstance(value, list) and len(value) == n_layers and value and all(v == value[0] for v in value):
        value = value[0]
    if isinstance(value, bool) or not isinstance(value, int):
        raise cfg.unsupported(key, value, f"an integer, or a list of {n_layers} equal integers")
    return value


def hunyuan_v1_moe(cfg, n_layers: int, attn: dict, router: dict, experts: dict, spec: dict) -> None:
    """HunYuanMoEV1: per-head q/k RMSNorm after RoPE (query_layernorm / key_layernorm), a softmax router renormalized
    over the top-k, routed experts and one shared MLP all of intermediate_size, every layer MoE."""
    # Released Hunyuan configs describe options transformers' HunYuanMoEV1 does not have; it always does this.
    cfg.reject_set("use_cla", False, "cross-layer attention (CLA, K/V shared across layers) is not implemented")
    cfg.reject_set("use_qk_norm", True, "HunYuanMoEV1's attention always normalizes q and k")
    cfg.reject_set("use_mixed_mlp_moe", True, "HunYuanMoEV1 always adds its shared MLP")
    inter = cfg.int("intermediate_size", 11008)
    for key, want in (("num_shared_expert", 1), ("moe_intermediate_size", inter)):
        if cfg.has(key) and _per_layer_int(cfg, key, want, n_layers) != want:
            raise cfg.unsupported(key, cfg.get(key), f"HunYuanMoEV1 has one shared MLP and sizes every MLP by "
                                                     f"intermediate_size ({inter}); supported: {want}")
    cfg.biases(attn, qk_norm="head", qk_norm_after_rope=True)
    router.update(scoring="softmax", renormalize=True)
    experts.update(num_experts=_per_layer_int(cfg, "num_experts", 1, n_layers),
                   top_k=_per_layer_int(cfg, "moe_topk", 1, n_layers), intermediate_size=inter,
                   shared_intermediate_size=inter)


def hunyuan_ntk_alpha(cfg, key: str, rp: dict, head_dim: int) -> dict:
    """HunYuanMoEV1RotaryEmbedding: a `dynamic` rope with `alpha` is NTK-alpha, a fixed base
    theta * alpha ** (head_dim / (head_dim - 2)) (the dict's other keys unread): the default rope at that theta."""
    alpha = rp.get("alpha")
    if (rp.get("rope_type") or rp.get("type")) != "dynamic" or not alpha:
        return rp
    if isinstance(alpha, bool) or not isinstance(alpha, (int, float)) or alpha <= 0:
        raise cfg.unsupported(f"{key}.alpha", alpha, "a positive number")
    theta = rp.get("rope_theta") or cfg.float("rope_theta", 10000.0)
    out = {"rope_type": "default", "rope_theta": float(theta) * float(alpha) ** (head_dim / (head_dim - 2))}
    if "partial_rotary_factor" in rp:
        out["partial_rotary_factor"] = rp["partial_rotary_factor"]
    return out


BUILDERS = {"deepseek_v2": deepseek_v2, "deepseek_v3": deepseek_v3, "glm4_moe_lite": glm4_moe_lite, "dots1": dots1,
            "minimax_m2": minimax_m2, "granitemoe": granitemoe, "ernie4_5_moe": ernie4_5_moe,
            "hunyuan_v1_moe": hunyuan_v1_moe}
