"""Parity with Hugging Face transformers, the numerical oracle, for every supported family.

For each family a tiny randomly initialized transformers model is built offline from a config
object (fp32, eager attention) with deliberately unusual shapes (hidden not a power of two, kv
heads != heads, top-k 3, 9 or 10 experts, dense first layers, shared experts, a sliding window
small enough to matter, YaRN where the family uses it). Every parameter and buffer HF initializes
to zeros or ones (biases, sinks, correction biases, norms) is re-randomized so the features are
live. It is saved with `save_pretrained`, loaded through models.checkpoint.load_checkpoint, and
the reference decoder must match transformers' logits within 1e-4 (relative to the largest
logit) on every prefill position and on 16 greedy decode steps, with identical greedy tokens.
"""
from __future__ import annotations

from typing import Any, Callable

import pytest
import torch

transformers = pytest.importorskip("transformers")

from models.checkpoint import load_checkpoint  # noqa: E402
from lab.reference import ReferenceDecoder  # noqa: E402

VOCAB = 97
DECODE_STEPS = 16
RTOL = 1e-4


def _mixtral() -> Any:
    return transformers.MixtralConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=40, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=12, num_local_experts=9, num_experts_per_tok=3, rope_theta=5000.0,
        max_position_embeddings=256, rms_norm_eps=1e-5)


def _qwen2_moe() -> Any:
    return transformers.Qwen2MoeConfig(
        vocab_size=VOCAB, hidden_size=40, intermediate_size=56, moe_intermediate_size=24,
        shared_expert_intermediate_size=36, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
        num_experts=10, num_experts_per_tok=3, norm_topk_prob=False, mlp_only_layers=[1], qkv_bias=True,
        max_position_embeddings=256, rope_theta=8000.0, tie_word_embeddings=True)


def _qwen3_moe() -> Any:
    return transformers.Qwen3MoeConfig(
        vocab_size=VOCAB, hidden_size=44, moe_intermediate_size=20, intermediate_size=60, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=14, num_experts=9, num_experts_per_tok=3,
        norm_topk_prob=True, attention_bias=True, max_position_embeddings=256, rope_theta=9000.0)


def _olmoe() -> Any:
    return transformers.OlmoeConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=20, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=3, num_experts=10, num_experts_per_tok=3, norm_topk_prob=False,
        max_position_embeddings=256, rope_theta=7000.0)


def _gpt_oss() -> Any:
    return transformers.GptOssConfig(
        vocab_size=VOCAB, hidden_size=36, intermediate_size=28, num_hidden_layers=3, num_attention_heads=6,
        num_key_value_heads=2, head_dim=10, num_local_experts=9, num_experts_per_tok=3, sliding_window=4,
        layer_types=["sliding_attention", "full_attention", "sliding_attention"], swiglu_limit=1.5,
        max_position_embeddings=512,
        rope_parameters={"rope_type": "yarn", "rope_theta": 15000.0, "factor": 8.0, "beta_fast": 32.0,
                         "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 64})


def _glm4_moe() -> Any:
    return transformers.Glm4MoeConfig(
        vocab_size=VOCAB, hidden_size=40, intermediate_size=52, moe_intermediate_size=18, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, n_routed_experts=10, num_experts_per_tok=3,
        n_shared_experts=1, n_group=2, topk_group=1, routed_scaling_factor=2.5, norm_topk_prob=True,
        first_k_dense_replace=1, attention_bias=True, use_qk_norm=True, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 6000.0, "partial_rotary_factor": 0.5})


def _deepseek_v2() -> Any:
    return transformers.DeepseekV2Config(
        vocab_size=VOCAB, hidden_size=44, intermediate_size=50, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=20, kv_lora_rank=18, qk_nope_head_dim=8,
        qk_rope_head_dim=6, v_head_dim=10, n_routed_experts=9, num_experts_per_tok=3, n_shared_experts=2,
        first_k_dense_replace=1, topk_method="group_limited_greedy", n_group=3, topk_group=2,
        routed_scaling_factor=1.5, max_position_embeddings=384,  # = factor * original: no HF warning
        rope_parameters={"rope_type": "yarn", "rope_theta": 4000.0, "factor": 6.0,
                         "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.8,
                         "beta_fast": 32.0, "beta_slow": 1.0})


def _deepseek_v2_no_q_lora() -> Any:
    cfg = _deepseek_v2()
    cfg.q_lora_rank = None
    cfg.topk_method = "greedy"
    return cfg


def _deepseek_v3() -> Any:
    # sigmoid router with a correction bias, 3 of 4 groups' experts eligible (group limit live), MTP layer declared
    return transformers.DeepseekV3Config(
        vocab_size=VOCAB, hidden_size=44, intermediate_size=50, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=20, kv_lora_rank=18, qk_nope_head_dim=8,
        qk_rope_head_dim=6, v_head_dim=10, n_routed_experts=12, num_experts_per_tok=3, n_shared_experts=2,
        first_k_dense_replace=1, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5,
        max_position_embeddings=384, num_nextn_predict_layers=1,
        rope_parameters={"rope_type": "yarn", "rope_theta": 4000.0, "factor": 6.0,
                         "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 0.8,
                         "beta_fast": 32.0, "beta_slow": 1.0})


def _deepseek_v3_plain() -> Any:
    cfg = _deepseek_v3()
    cfg.q_lora_rank, cfg.rope_interleave, cfg.norm_topk_prob, cfg.n_group, cfg.topk_group = None, False, False, 1, 1
    return cfg


def _glm4_moe_lite() -> Any:
    return transformers.Glm4MoeLiteConfig(
        vocab_size=VOCAB, hidden_size=44, intermediate_size=50, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=20, kv_lora_rank=18, qk_nope_head_dim=8,
        qk_rope_head_dim=6, v_head_dim=10, n_routed_experts=10, num_experts_per_tok=3, n_shared_experts=1,
        n_group=2, topk_group=1, routed_scaling_factor=1.8, max_position_embeddings=256,
        mlp_layer_types=["dense", "sparse", "sparse"], rope_parameters={"rope_type": "default", "rope_theta": 7000.0})


def _dots1() -> Any:
    return transformers.Dots1Config(
        vocab_size=VOCAB, hidden_size=40, intermediate_size=52, moe_intermediate_size=18, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, n_routed_experts=9, num_experts_per_tok=3,
        n_shared_experts=1, n_group=3, topk_group=2, routed_scaling_factor=1.5, norm_topk_prob=True,
        first_k_dense_replace=1, attention_bias=True, sliding_window=4, max_window_layers=1,
        max_position_embeddings=256, rope_parameters={"rope_type": "default", "rope_theta": 6000.0})


def _minimax_m2() -> Any:
    return transformers.MiniMaxM2Config(
        vocab_size=VOCAB, hidden_size=36, intermediate_size=20, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, head_dim=10, num_local_experts=9, num_experts_per_tok=3, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 9000.0, "partial_rotary_factor": 0.6})


def _granitemoe() -> Any:
    return transformers.GraniteMoeConfig(
        vocab_size=VOCAB, hidden_size=48, intermediate_size=20, num_hidden_layers=2, num_attention_heads=6,
        num_key_value_heads=2, num_local_experts=9, num_experts_per_tok=3, max_position_embeddings=256,
        embedding_multiplier=3.0, attention_multiplier=0.2, residual_multiplier=0.6, logits_scaling=2.5,
        rope_parameters={"rope_type": "default", "rope_theta": 8000.0})


def _ernie4_5_moe() -> Any:
    # softmax router with a selection bias, shared experts, dense layers 0 and 2 (MoE every 2nd from layer 1),
    # adjacent-pair RoPE, tied embeddings (the family default)
    return transformers.Ernie4_5_MoeConfig(
        vocab_size=VOCAB, hidden_size=40, intermediate_size=52, moe_intermediate_size=18, num_hidden_layers=4,
        num_attention_heads=4, num_key_value_heads=2, head_dim=12, moe_num_experts=9, moe_k=3,
        moe_num_shared_experts=2, moe_layer_start_index=1, moe_layer_interval=2, max_position_embeddings=256,
        rope_parameters={"rope_type": "default", "rope_theta": 6000.0})


def _hunyuan_v1_moe() -> Any:
    # q/k norm after RoPE, attention biases, a shared MLP, NTK-alpha RoPE (a fixed stretched base)
    return transformers.HunYuanMoEV1Config(
        vocab_size=VOCAB, hidden_size=40, intermediate_size=20, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=12, num_experts=9, moe_topk=3, attention_bias=True,
        max_position_embeddings=256,
        rope_parameters={"rope_type": "dynamic", "alpha": 3.0, "factor": 1.0, "rope_theta": 7000.0})


FAMILIES: dict[str, tuple[str, Callable[[], Any]]] = {
    "mixtral": ("MixtralForCausalLM", _mixtral),
    "qwen2_moe": ("Qwen2MoeForCausalLM", _qwen2_moe),
    "qwen3_moe": ("Qwen3MoeForCausalLM", _qwen3_moe),
    "olmoe": ("OlmoeForCausalLM", _olmoe),
    "gpt_oss": ("GptOssForCausalLM", _gpt_oss),
    "glm4_moe": ("Glm4MoeForCausalLM", _glm4_moe),
    "deepseek_v2": ("DeepseekV2ForCausalLM", _deepseek_v2),
    "deepseek_v2_no_q_lora": ("DeepseekV2ForCausalLM", _deepseek_v2_no_q_lora),
    "deepseek_v3": ("DeepseekV3ForCausalLM", _deepseek_v3),
    "deepseek_v3_plain": ("DeepseekV3ForCausalLM", _deepseek_v3_plain),
    "glm4_moe_lite": ("Glm4MoeLiteForCausalLM", _glm4_moe_lite),
    "dots1": ("Dots1ForCausalLM", _dots1),
    "minimax_m2": ("MiniMaxM2ForCausalLM", _minimax_m2),
    "granitemoe": ("GraniteMoeForCausalLM", _granitemoe),
    "ernie4_5_moe": ("Ernie4_5_MoeForCausalLM", _ernie4_5_moe),
    "hunyuan_v1_moe": ("HunYuanMoEV1ForCausalLM", _hunyuan_v1_moe),
}


def _randomize(model: torch.nn.Module, seed: int) -> None:
    """Re-draw every tensor so nothing is trivially zero or one, at a scale where logits spread."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if not t.is_floating_point() or "inv_freq" in name:
                continue
            noise = torch.randn(t.shape, generator=g, dtype=torch.float32)
            if "norm" in name:
                t.copy_(1.0 + 0.2 * noise)
            elif "sinks" in name:
                t.copy_(0.5 * noise)
            elif "correction_bias" in name:
                t.copy_(0.1 * noise)
            elif name.endswith("bias"):
                t.copy_(0.1 * noise)
            elif "embed" in name or "lm_head" in name:
                t.copy_(0.5 * noise)
            else:
                t.copy_(0.15 * noise)


def _build(family: str, tmp_path) -> tuple[torch.nn.Module, ReferenceDecoder]:
    arch, make_cfg = FAMILIES[family]
    cfg = make_cfg()
    cfg.dtype = torch.float32
    # Some families default to special-token ids of their real vocabulary; keep them inside ours.
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = 1, 2, 0
    torch.manual_seed(0)
    model = getattr(transformers, arch)._from_config(
        cfg, attn_implementation="eager", experts_implementation="eager", dtype=torch.float32)
    model = model.eval()
    _randomize(model, seed=sum(map(ord, family)))
    model.save_pretrained(tmp_path)
    spec, weights = load_checkpoint(tmp_path)
    assert spec.dtype == "float32"
    return model, ReferenceDecoder(spec, weights)


def _assert_close(ours: torch.Tensor, ref: torch.Tensor, what: str) -> None:
    scale = float(ref.abs().max())
    err = float((ours - ref).abs().max())
    assert err <= RTOL * scale, f"{what}: max |diff| {err:.3g} > {RTOL} * max |logit| {scale:.3g}"


@pytest.mark.parametrize("family", list(FAMILIES))
def test_hf_parity(family: str, tmp_path) -> None:
    model, dec = _build(family, tmp_path)
    g = torch.Generator().manual_seed(123)
    for prompt_len in (1, 30):
        prompt = torch.randint(0, VOCAB, (prompt_len,), generator=g)
        with torch.no_grad():
            ref_prefill = model(prompt[None], use_cache=False).logits[0]
        _assert_close(dec.forward_logits(prompt), ref_prefill, f"{family} prefill len {prompt_len}")

        with torch.no_grad():
            out = model.generate(prompt[None], max_new_tokens=DECODE_STEPS, min_new_tokens=DECODE_STEPS,
                                 do_sample=False, use_cache=True, output_logits=True, return_dict_in_generate=True,
                                 eos_token_id=None, pad_token_id=0)
        hf_tokens = out.sequences[0, prompt_len:].tolist()
        res = dec.generate(prompt.tolist(), DECODE_STEPS, eos_ids=[], ignore_eos=True)
        assert len(res.logits) == len(out.logits) == DECODE_STEPS
        for step, (ours, ref) in enumerate(zip(res.logits, out.logits)):
            _assert_close(ours, ref[0], f"{family} len {prompt_len} decode step {step}")
        assert res.tokens == hf_tokens, f"{family} len {prompt_len}: greedy tokens differ"
