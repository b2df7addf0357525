"""Tiny randomly initialized transformers models of every supported family, saved with `save_pretrained`, shared
by tests/test_checkpoint.py (tensors) and tests/test_checkpoint_config.py (config.json -> spec), as
tests/triton_interpreter.py is shared by the kernels' tests.

Shapes are unusual on purpose (hidden 40, kv heads != heads, 5-6 experts, top-k 3). `saved` is a module-scoped
fixture: a test file imports it (`from hf_checkpoints import saved  # noqa: F401  (a fixture)`) and builds every
family once for that file.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import save_file

transformers = pytest.importorskip("transformers")

COMMON = dict(vocab_size=97, hidden_size=40, num_hidden_layers=3, num_attention_heads=4,
              num_key_value_heads=2, eos_token_id=[5, 7], tie_word_embeddings=False)


def _configs():
    T = transformers
    return {
        "mixtral": T.MixtralConfig(**COMMON, head_dim=12, intermediate_size=24, num_local_experts=5,
                                   num_experts_per_tok=3, rope_parameters={"rope_type": "default", "rope_theta": 5e5}),
        "qwen2_moe": T.Qwen2MoeConfig(**COMMON, intermediate_size=36, num_experts=5, num_experts_per_tok=3,
                                      moe_intermediate_size=20, shared_expert_intermediate_size=28,
                                      decoder_sparse_step=1, mlp_only_layers=[1], norm_topk_prob=True),
        "qwen3_moe": T.Qwen3MoeConfig(**COMMON, head_dim=12, intermediate_size=36, num_experts=5,
                                      num_experts_per_tok=3, moe_intermediate_size=20, decoder_sparse_step=2),
        "olmoe": T.OlmoeConfig(**COMMON, intermediate_size=24, num_experts=5, num_experts_per_tok=3),
        "gpt_oss": T.GptOssConfig(**COMMON, head_dim=12, intermediate_size=24, num_local_experts=5,
                                  num_experts_per_tok=3, sliding_window=7),
        "glm4_moe": T.Glm4MoeConfig(**COMMON, head_dim=12, intermediate_size=36, n_routed_experts=6,
                                    num_experts_per_tok=3, moe_intermediate_size=20, n_shared_experts=2,
                                    n_group=2, topk_group=1, routed_scaling_factor=2.5, use_qk_norm=True,
                                    attention_bias=True, first_k_dense_replace=1),
        "deepseek_v2": T.DeepseekV2Config(**{**COMMON, "num_key_value_heads": 4}, intermediate_size=36,
                                          n_routed_experts=6, num_experts_per_tok=3, moe_intermediate_size=20,
                                          n_shared_experts=2, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
                                          qk_rope_head_dim=6, v_head_dim=10, first_k_dense_replace=1,
                                          topk_method="group_limited_greedy", n_group=3, topk_group=2,
                                          routed_scaling_factor=1.5),
        "deepseek_v3": T.DeepseekV3Config(**{**COMMON, "num_key_value_heads": 4}, intermediate_size=36,
                                          n_routed_experts=6, num_experts_per_tok=3, moe_intermediate_size=20,
                                          n_shared_experts=2, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
                                          qk_rope_head_dim=6, v_head_dim=10, first_k_dense_replace=1, n_group=3,
                                          topk_group=2, routed_scaling_factor=1.5, norm_topk_prob=False),
        "glm4_moe_lite": T.Glm4MoeLiteConfig(**{**COMMON, "num_key_value_heads": 4}, intermediate_size=36,
                                             n_routed_experts=6, num_experts_per_tok=3, moe_intermediate_size=20,
                                             n_shared_experts=1, q_lora_rank=16, kv_lora_rank=12, qk_nope_head_dim=8,
                                             qk_rope_head_dim=6, v_head_dim=10),
        "dots1": T.Dots1Config(**COMMON, head_dim=12, intermediate_size=36, n_routed_experts=6, num_experts_per_tok=3,
                               moe_intermediate_size=20, n_shared_experts=2, first_k_dense_replace=1,
                               attention_bias=True, sliding_window=16, max_window_layers=2),
        "minimax_m2": T.MiniMaxM2Config(**COMMON, head_dim=12, intermediate_size=24, num_local_experts=5,
                                        num_experts_per_tok=3, rotary_dim=6),
        "granitemoe": T.GraniteMoeConfig(**COMMON, intermediate_size=24, num_local_experts=5, num_experts_per_tok=3,
                                         embedding_multiplier=12.0, attention_multiplier=0.015625,
                                         residual_multiplier=0.22, logits_scaling=6.0),
        "ernie4_5_moe": T.Ernie4_5_MoeConfig(**COMMON, head_dim=12, intermediate_size=36, moe_num_experts=5, moe_k=3,
                                             moe_intermediate_size=20, moe_num_shared_experts=2),
        "hunyuan_v1_moe": T.HunYuanMoEV1Config(**COMMON, head_dim=12, intermediate_size=24, num_experts=5, moe_topk=3,
                                               attention_bias=True),
    }


def _build(family: str, cfg=None):
    cfg = cfg or _configs()[family]
    torch.manual_seed(0)
    model = transformers.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        # Default init leaves norms at 1 and biases at 0: identical tensors would hide a swapped
        # mapping. Randomize everything, buffers with state (correction bias) included.
        for _, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.is_floating_point() and "inv_freq" not in _:
                t.copy_(torch.randn_like(t))
    return model


def _save(model, path, **kw):
    model.save_pretrained(path, **kw)
    return path


def _write(path, config: dict, tensors: dict | None = None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, str(path / "model.safetensors"))
    return path


FAMILIES = ["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "glm4_moe", "deepseek_v2", "deepseek_v3",
            "glm4_moe_lite", "dots1", "minimax_m2", "granitemoe", "ernie4_5_moe",
            "hunyuan_v1_moe"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Each family built and saved once for the module: (model, checkpoint dir)."""
    out = {}
    for fam in FAMILIES:
        model = _build(fam)
        out[fam] = (model, _save(model, tmp_path_factory.mktemp(fam)))
    return out


def _msg(excinfo) -> str:
    return str(excinfo.value)
