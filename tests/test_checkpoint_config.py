"""Checkpoint import, config.json -> spec: the spec fields every family's saved config gives, the published
old-style keys (rope_theta, rope_scaling with "type", torch_dtype) read as transformers reads them, and the
settings the import refuses or drops, each named. (The tensors: tests/test_checkpoint.py; the models:
tests/hf_checkpoints.py.)
"""
from __future__ import annotations

import json
import math

import pytest

transformers = pytest.importorskip("transformers")

from graph_ir.errors import UserError  # noqa: E402
from models.checkpoint import SUPPORTED_ARCHITECTURES, import_spec  # noqa: E402

from hf_checkpoints import FAMILIES, _msg, _write  # noqa: E402
from hf_checkpoints import saved  # noqa: E402,F401  (a fixture)


def test_spec_fields_follow_config(saved):
    s = {fam: import_spec(saved[fam][1]) for fam in FAMILIES}
    for fam, spec in s.items():
        assert (spec.num_layers, spec.hidden_size, spec.vocab_size) == (3, 40, 97), fam
        assert spec.eos_token_ids == [5, 7], fam
        assert spec.experts.top_k == 3, fam

    mx = s["mixtral"]
    assert mx.router.renormalize and mx.attention.head_dim == 12 and mx.experts.num_experts == 5
    assert mx.attention.rope.theta == 5e5 and mx.rms_norm_eps == 1e-5

    q2 = s["qwen2_moe"]
    assert q2.attention.qkv_bias and not q2.attention.o_bias and q2.attention.head_dim == 10
    assert q2.router.renormalize  # norm_topk_prob=True
    assert q2.experts.shared_intermediate_size == 28 and q2.experts.shared_gate
    assert q2.dense_layers == [1] and q2.dense_intermediate_size == 36

    q3 = s["qwen3_moe"]
    assert q3.attention.qk_norm == "head" and not q3.router.renormalize
    assert q3.dense_layers == [0, 2]  # decoder_sparse_step=2: layers 1 is sparse
    assert q3.experts.num_experts == 5  # saved as num_local_experts by transformers 5

    ol = s["olmoe"]
    assert ol.attention.qk_norm == "full" and not ol.router.renormalize and ol.experts.intermediate_size == 24

    go = s["gpt_oss"]
    a = go.attention
    assert a.sinks and a.qkv_bias and a.o_bias and a.sliding_window == 7
    assert a.layer_types == ["sliding", "full", "sliding"]
    assert (a.rope.scaling, a.rope.factor, a.rope.original_max_position, a.rope.truncate) == ("yarn", 32.0, 4096, False)
    assert a.rope.theta == 150000.0
    assert go.router.scoring == "topk_softmax" and go.router.bias
    assert go.experts.activation == "gptoss_glu" and go.experts.bias and go.experts.glu_limit == 7.0

    gl = s["glm4_moe"]
    assert gl.router.scoring == "sigmoid" and gl.router.correction_bias and gl.router.renormalize
    assert (gl.router.n_group, gl.router.topk_group, gl.router.routed_scaling) == (2, 1, 2.5)
    assert gl.attention.rope.partial_rotary_factor == 0.5 and gl.attention.qk_norm == "head"
    assert gl.attention.qkv_bias and not gl.attention.o_bias
    assert gl.experts.shared_intermediate_size == 40 and gl.dense_layers == [0]

    ds = s["deepseek_v2"]
    a = ds.attention
    assert a.kind == "mla" and a.num_kv_heads == 4 and a.rope.interleaved
    assert (a.q_lora_rank, a.kv_lora_rank, a.qk_nope_head_dim, a.qk_rope_head_dim, a.v_head_dim) == (16, 12, 8, 6, 10)
    assert (ds.router.n_group, ds.router.topk_group, ds.router.routed_scaling) == (3, 2, 1.5)
    assert ds.router.scoring == "softmax" and not ds.router.renormalize
    assert ds.experts.shared_intermediate_size == 40 and ds.dense_layers == [0]

    v3 = s["deepseek_v3"]
    a = v3.attention
    assert a.kind == "mla" and a.rope.interleaved and (a.q_lora_rank, a.kv_lora_rank, a.v_head_dim) == (16, 12, 10)
    assert v3.router.scoring == "sigmoid" and v3.router.correction_bias and not v3.router.renormalize
    assert (v3.router.n_group, v3.router.topk_group, v3.router.routed_scaling) == (3, 2, 1.5)
    assert v3.experts.shared_intermediate_size == 40 and v3.dense_layers == [0] and v3.rms_norm_eps == 1e-6

    lite = s["glm4_moe_lite"]
    assert lite.attention.kind == "mla" and lite.dense_layers == [0] and lite.router.renormalize
    assert (lite.router.n_group, lite.router.routed_scaling, lite.rms_norm_eps) == (1, 1.8, 1e-5)

    d1 = s["dots1"]
    a = d1.attention
    assert a.qk_norm == "head" and a.qkv_bias and a.o_bias and a.layer_types == ["full", "full", "sliding"]
    assert a.sliding_window == 16 and d1.router.scoring == "sigmoid" and not d1.router.renormalize
    assert d1.experts.shared_intermediate_size == 40 and d1.dense_layers == [0]

    mm = s["minimax_m2"]
    assert mm.attention.qk_norm == "full" and mm.attention.rope.partial_rotary_factor == 0.5
    assert mm.attention.rope.theta == 5e6 and mm.router.correction_bias and mm.router.renormalize

    gr = s["granitemoe"]
    assert (gr.embedding_multiplier, gr.residual_multiplier, gr.logits_scaling) == (12.0, 0.22, 6.0)
    assert gr.attention.softmax_scale == 0.015625 and gr.router.scoring == "topk_softmax"

    er = s["ernie4_5_moe"]
    assert er.router.scoring == "softmax" and er.router.correction_bias and er.router.renormalize
    assert er.attention.rope.interleaved and er.attention.rope.theta == 500000.0 and er.rms_norm_eps == 1e-5
    assert er.experts.shared_intermediate_size == 40 and er.dense_layers == [0] and er.dense_intermediate_size == 36

    hy = s["hunyuan_v1_moe"]
    assert hy.attention.qk_norm == "head" and hy.attention.qk_norm_after_rope and hy.attention.qkv_bias
    assert hy.attention.o_bias and hy.router.scoring == "softmax" and hy.router.renormalize
    assert (hy.experts.num_experts, hy.experts.intermediate_size, hy.experts.shared_intermediate_size) == (5, 24, 24)


def test_old_style_deepseek_config_yarn(tmp_path):
    """Published DeepSeek-V2 keys: rope_theta + rope_scaling {"type": "yarn", mscale...}, torch_dtype."""
    cfg = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 97,
           "hidden_size": 40, "num_hidden_layers": 2, "num_attention_heads": 4, "intermediate_size": 36,
           "moe_intermediate_size": 20, "n_routed_experts": 6, "n_shared_experts": 2, "num_experts_per_tok": 3,
           "q_lora_rank": None, "kv_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 6,
           "v_head_dim": 10, "first_k_dense_replace": 1, "max_position_embeddings": 163840,
           "rope_theta": 20000, "torch_dtype": "bfloat16", "eos_token_id": 3, "topk_method": "greedy",
           "rope_scaling": {"type": "yarn", "factor": 40, "beta_fast": 32, "beta_slow": 1, "mscale": 0.707,
                            "mscale_all_dim": 0.707, "original_max_position_embeddings": 4096}}
    spec = import_spec(_write(tmp_path / "ds", cfg))
    a, r = spec.attention, spec.attention.rope
    assert spec.dtype == "bfloat16" and spec.eos_token_ids == [3] and a.q_lora_rank is None
    assert (r.scaling, r.theta, r.factor, r.original_max_position) == ("yarn", 20000.0, 40.0, 4096)
    assert (r.mscale, r.mscale_all_dim, r.interleaved) == (0.707, 0.707, True)
    # transformers parses the same file; its attention uses this softmax scale and rope scaling.
    hf = transformers.AutoConfig.from_pretrained(tmp_path / "ds")
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention, DeepseekV2RotaryEmbedding
    assert math.isclose(a.softmax_scale, DeepseekV2Attention(hf, 0).scaling, rel_tol=1e-12)
    assert math.isclose(r.theta, hf.rope_parameters["rope_theta"])
    rot = DeepseekV2RotaryEmbedding(hf)
    from models.rope import yarn_get_mscale  # H2's math: the attention factor the spec implies
    assert math.isclose(yarn_get_mscale(r.factor, r.mscale) / yarn_get_mscale(r.factor, r.mscale_all_dim),
                        rot.attention_scaling, rel_tol=1e-9)


def test_old_style_keys_other_families(tmp_path):
    # GLM-4.5 as published: top-level rope_theta + partial_rotary_factor, no rope dict. No
    # `architectures` here: model_type alone identifies the family.
    glm = {"model_type": "glm4_moe", "vocab_size": 97, "hidden_size": 40, "num_hidden_layers": 2,
           "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12, "intermediate_size": 36,
           "moe_intermediate_size": 20, "n_routed_experts": 6, "num_experts_per_tok": 3,
           "max_position_embeddings": 4096, "rope_theta": 1e6, "partial_rotary_factor": 0.5,
           "rope_scaling": None, "torch_dtype": "bfloat16"}
    r = import_spec(_write(tmp_path / "glm", glm)).attention.rope
    assert (r.theta, r.partial_rotary_factor, r.scaling) == (1e6, 0.5, "none")
    # Qwen3 with rope_scaling {"rope_type": "yarn"} and no original_max_position_embeddings key:
    # transformers falls back to max_position_embeddings.
    q3 = {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "vocab_size": 97, "hidden_size": 40, "num_hidden_layers": 2,
          "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 12, "moe_intermediate_size": 20,
          "num_experts": 5, "num_experts_per_tok": 3, "max_position_embeddings": 8192, "rope_theta": 1e6,
          "rope_scaling": {"rope_type": "yarn", "factor": 4.0}, "dtype": "float16"}
    spec = import_spec(_write(tmp_path / "q3", q3))
    r = spec.attention.rope
    assert (r.scaling, r.factor, r.original_max_position, r.mscale) == ("yarn", 4.0, 8192, None)
    assert spec.experts.num_experts == 5 and spec.dtype == "float16"
    hf = transformers.AutoConfig.from_pretrained(tmp_path / "q3")
    assert hf.rope_parameters["original_max_position_embeddings"] == 8192
    # Linear scaling with the old "type" key.
    q3["rope_scaling"] = {"type": "linear", "factor": 2.0}
    r = import_spec(_write(tmp_path / "q3lin", q3)).attention.rope
    assert (r.scaling, r.factor) == ("linear", 2.0)


# ---- errors -------------------------------------------------------------------------------------

def test_unknown_architecture_names_it_and_the_supported_list(tmp_path):
    p = _write(tmp_path / "llama", {"architectures": ["LlamaForCausalLM"], "model_type": "llama"})
    with pytest.raises(UserError) as e:
        import_spec(p)
    m = _msg(e)
    assert "config.json" in m and "LlamaForCausalLM" in m and "llama" in m
    assert all(a in m for a in SUPPORTED_ARCHITECTURES)
    with pytest.raises(UserError, match="no such checkpoint directory"):
        import_spec(tmp_path / "nope")
    (tmp_path / "empty").mkdir()
    with pytest.raises(UserError, match="config.json"):
        import_spec(tmp_path / "empty")


def test_unsupported_settings_fail_loudly(saved, tmp_path):
    base = json.loads((saved["olmoe"][1] / "config.json").read_text())
    for key, value, needle in [
        ("clip_qkv", 8.0, "clip_qkv"),
        ("rope_parameters", {"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e4}, "dynamic"),
        ("rope_parameters", {"rope_type": "default", "rope_theta": 1e4, "low_freq_factor": 1.0}, "low_freq_factor"),
        ("hidden_act", "gelu", "hidden_act"),
        ("quantization_config", {"quant_method": "fp8"}, "fp8"),
    ]:
        with pytest.raises(UserError) as e:
            import_spec(_write(tmp_path / f"bad_{key}_{needle}", {**base, key: value}))
        assert needle in _msg(e) and "config.json" in _msg(e), _msg(e)
    ds = json.loads((saved["deepseek_v2"][1] / "config.json").read_text())
    with pytest.raises(UserError, match="topk_method"):
        import_spec(_write(tmp_path / "ds_noaux", {**ds, "topk_method": "noaux_tc"}))
    with pytest.raises(UserError, match="norm_topk_prob"):
        import_spec(_write(tmp_path / "ds_norm", {**ds, "norm_topk_prob": True}))
    er = json.loads((saved["ernie4_5_moe"][1] / "config.json").read_text())
    for key, value in (("use_bias", True), ("moe_norm_min", 0.5)):
        with pytest.raises(UserError) as e:
            import_spec(_write(tmp_path / f"er_{key}", {**er, key: value}))
        assert key in _msg(e) and "config.json" in _msg(e), _msg(e)
    hy = json.loads((saved["hunyuan_v1_moe"][1] / "config.json").read_text())
    for key, value in (("use_cla", True), ("use_qk_norm", False), ("moe_intermediate_size", [8, 8, 8]),
                       ("num_experts", [5, 6, 5])):
        with pytest.raises(UserError) as e:
            import_spec(_write(tmp_path / f"hy_{key}", {**hy, key: value}))
        assert key in _msg(e) and "config.json" in _msg(e), _msg(e)
    # released configs write per-layer lists of one value
    spec = import_spec(_write(tmp_path / "hy_lists", {**hy, "num_experts": [5] * 3, "moe_topk": [3] * 3,
                                                      "moe_intermediate_size": [24] * 3, "use_cla": False}))
    assert (spec.experts.num_experts, spec.experts.top_k) == (5, 3)


def test_deepseek_softmax_scale_without_mscale(tmp_path):
    """mscale_all_dim alone: HF's cos/sin factor is plain YaRN, but the softmax scale still uses it."""
    ds = {"architectures": ["DeepseekV2ForCausalLM"], "model_type": "deepseek_v2", "vocab_size": 97,
          "hidden_size": 40, "num_hidden_layers": 2, "num_attention_heads": 4, "num_experts_per_tok": 2,
          "n_routed_experts": 4, "kv_lora_rank": 12, "qk_nope_head_dim": 8, "qk_rope_head_dim": 6,
          "v_head_dim": 10, "max_position_embeddings": 8192,
          "rope_parameters": {"rope_type": "yarn", "factor": 8.0, "mscale_all_dim": 1.0, "rope_theta": 1e4,
                              "original_max_position_embeddings": 1024}}
    spec = import_spec(_write(tmp_path / "ds", ds))
    hf = transformers.AutoConfig.from_pretrained(tmp_path / "ds")
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2Attention
    assert spec.attention.rope.mscale is None and spec.attention.rope.mscale_all_dim is None
    assert math.isclose(spec.attention.softmax_scale, DeepseekV2Attention(hf, 0).scaling, rel_tol=1e-12)
    assert spec.attention.q_lora_rank == 1536  # DeepseekV2Config default when the key is absent


def test_unknown_forward_keys_are_refused_others_listed(saved, tmp_path):
    """A Granite config relabelled as Mixtral would compile into another model: its multipliers are refused, naming
    the key and the family; keys that do not change the forward pass come back as ignored."""
    from models.hf_config import ignored_keys

    gr = json.loads((saved["granitemoe"][1] / "config.json").read_text())
    relabelled = {**gr, "architectures": ["MixtralForCausalLM"], "model_type": "mixtral"}
    with pytest.raises(UserError) as e:
        import_spec(_write(tmp_path / "relabelled", relabelled))
    assert "attention_multiplier" in _msg(e) and "mixtral" in _msg(e) and "config.json" in _msg(e)
    assert import_spec(saved["granitemoe"][1]).embedding_multiplier == 12.0  # its own family reads them
    mx = json.loads((saved["mixtral"][1] / "config.json").read_text())
    assert "some_future_key" in ignored_keys({**mx, "some_future_key": 3}, "config.json")
    assert "transformers_version" not in ignored_keys(mx, "config.json")
    neutral = {**mx, "residual_multiplier": 1.0}  # a neutral value changes nothing: ignored, not refused
    assert "residual_multiplier" in ignored_keys(neutral, "config.json")


def test_eos_outside_the_vocabulary_is_dropped_with_a_warning(saved, tmp_path):
    mx = json.loads((saved["mixtral"][1] / "config.json").read_text())
    with pytest.warns(UserWarning, match="outside the vocabulary"):
        spec = import_spec(_write(tmp_path / "eos", {**mx, "eos_token_id": [5, 200020]}))
    assert spec.eos_token_ids == [5]
    gen_dir = _write(tmp_path / "gen_eos", mx)  # generation_config.json's eos ids, which generate stops at, alike
    (gen_dir / "generation_config.json").write_text(json.dumps({"eos_token_id": [7, 300000]}))
    with pytest.warns(UserWarning, match=r"generation_config.json: eos_token_id \[300000\] outside the vocabulary"):
        assert import_spec(gen_dir).eos_token_ids == [7]
