"""Checkpoint import against transformers itself: tiny randomly initialized HF models of every family
are saved with `save_pretrained`, imported, and every canonical tensor is compared with the HF
module's in-memory parameter it came from.

The in-memory layout (transformers 5 fuses experts into `gate_up_proj [E, 2I, H]`, GPT-OSS keeps
`[E, H, 2I]` interleaved) differs from what `save_pretrained` writes (per-expert `experts.{e}.*`
for every family but GPT-OSS), so these comparisons check the layout mapping, not a copy of it.
Shapes are unusual on purpose (hidden 40, kv heads != heads, 5-6 experts, top-k 3).
"""
from __future__ import annotations

import json
import math

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from graph_ir.errors import UserError  # noqa: E402
from models.checkpoint import SUPPORTED_ARCHITECTURES, import_spec, load_checkpoint  # noqa: E402

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


def _hf_expected(family: str, model, spec) -> dict[str, torch.Tensor]:
    """Canonical name -> tensor, read from the HF model's in-memory state_dict."""
    sd = {k: v.detach() for k, v in model.state_dict().items()}
    out = {"embed": sd["model.embed_tokens.weight"], "final_norm": sd["model.norm.weight"],
           "lm_head": sd["lm_head.weight"]}
    for l in range(spec.num_layers):
        p, c = f"model.layers.{l}.", f"layers.{l}."
        out[c + "attn_norm"] = sd[p + "input_layernorm.weight"]
        out[c + "mlp_norm"] = sd[p + "post_attention_layernorm.weight"]
        a = p + "self_attn."
        if family in ("deepseek_v2", "deepseek_v3", "glm4_moe_lite"):
            for canon, hf in {"q_a.w": "q_a_proj.weight", "q_a_norm": "q_a_layernorm.weight",
                              "q_b.w": "q_b_proj.weight", "kv_a.w": "kv_a_proj_with_mqa.weight",
                              "kv_a_norm": "kv_a_layernorm.weight", "kv_b.w": "kv_b_proj.weight",
                              "o.w": "o_proj.weight"}.items():
                out[c + canon] = sd[a + hf]
        else:
            for x in "qkvo":
                out[c + f"{x}.w"] = sd[a + f"{x}_proj.weight"]
                if a + f"{x}_proj.bias" in sd:
                    out[c + f"{x}.b"] = sd[a + f"{x}_proj.bias"]
            for n, hf in (("q_norm", "q_norm"), ("k_norm", "k_norm"), ("q_norm", "query_layernorm"),
                          ("k_norm", "key_layernorm")):
                if a + hf + ".weight" in sd:
                    out[c + n] = sd[a + hf + ".weight"]
            if a + "sinks" in sd:
                out[c + "sinks"] = sd[a + "sinks"]
        m = p + ("block_sparse_moe." if family == "granitemoe" else "mlp.")
        if not spec.is_moe_layer(l):
            for x in ("gate", "up", "down"):
                out[c + f"mlp.{x}"] = sd[m + f"{x}_proj.weight"]
            continue
        if family == "gpt_oss":
            out[c + "router.w"], out[c + "router.b"] = sd[m + "router.weight"], sd[m + "router.bias"]
            gu, gub = sd[m + "experts.gate_up_proj"], sd[m + "experts.gate_up_proj_bias"]  # [E, H, 2I]
            out[c + "experts.gate"] = gu[..., ::2].transpose(1, 2)
            out[c + "experts.up"] = gu[..., 1::2].transpose(1, 2)
            out[c + "experts.gate_b"], out[c + "experts.up_b"] = gub[:, ::2], gub[:, 1::2]
            out[c + "experts.down"] = sd[m + "experts.down_proj"].transpose(1, 2)
            out[c + "experts.down_b"] = sd[m + "experts.down_proj_bias"]
            continue
        out[c + "router.w"] = sd[m + {"granitemoe": "router.weight", "hunyuan_v1_moe": "gate.wg.weight"}.get(
            family, "gate.weight")]
        for bias in ("gate.e_score_correction_bias", "e_score_correction_bias",  # MiniMax-M2: on the block
                     "gate.moe_statics.e_score_correction_bias"):  # ERNIE: [1, E]
            if m + bias in sd:
                out[c + "router.correction_bias"] = sd[m + bias].reshape(-1)
        gu = sd[m + "experts.gate_up_proj"]  # [E, 2I, H]
        half = gu.shape[1] // 2
        out[c + "experts.gate"], out[c + "experts.up"] = gu[:, :half], gu[:, half:]
        out[c + "experts.down"] = sd[m + "experts.down_proj"]
        shared = {"qwen2_moe": "shared_expert.", "glm4_moe": "shared_experts.", "deepseek_v2": "shared_experts.",
                  "deepseek_v3": "shared_experts.", "glm4_moe_lite": "shared_experts.",
                  "dots1": "shared_experts.", "ernie4_5_moe": "shared_experts.",
                  "hunyuan_v1_moe": "shared_mlp."}.get(family)
        if shared:
            for x in ("gate", "up", "down"):
                out[c + f"shared.{x}"] = sd[m + shared + f"{x}_proj.weight"]
        if family == "qwen2_moe":
            out[c + "shared_gate.w"] = sd[m + "shared_expert_gate.weight"]
    return out


def _flat(w) -> dict[str, torch.Tensor]:
    out = {"embed": w.embed, "final_norm": w.final_norm}
    if w.lm_head is not None:
        out["lm_head"] = w.lm_head
    for l, layer in enumerate(w.layers):
        out.update({f"layers.{l}.{k}": v for k, v in layer.items()})
    return out


def _assert_same_tensors(got: dict, want: dict) -> None:
    assert sorted(got) == sorted(want)
    for name, t in want.items():
        assert got[name].shape == t.shape, name
        assert torch.equal(got[name], t.to(got[name].dtype)), name


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


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tensor_matches_hf_parameter(saved, family):
    model, path = saved[family]
    spec, w = load_checkpoint(path)
    assert spec.family == family
    assert spec.weights.source == "checkpoint" and spec.weights.path == str(path)
    assert spec.dtype == "float32"
    _assert_same_tensors(_flat(w), _hf_expected(family, model, spec))


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
    assert not hy.dense_layers and hy.rms_norm_eps == 1e-5


def test_sharded_checkpoint_loads(saved, tmp_path):
    model, _ = saved["glm4_moe"]
    path = _save(model, tmp_path / "sharded", max_shard_size="20KB")
    assert (path / "model.safetensors.index.json").is_file()
    assert len(list(path.glob("*.safetensors"))) > 2
    spec, w = load_checkpoint(path)
    _assert_same_tensors(_flat(w), _hf_expected("glm4_moe", model, spec))


def test_fused_in_memory_layout_loads(saved, tmp_path):
    """A checkpoint written straight from transformers 5's state_dict (fused experts)."""
    for fam in ("mixtral", "qwen3_moe"):
        model, src = saved[fam]
        d = tmp_path / fam
        d.mkdir()
        (d / "config.json").write_text((src / "config.json").read_text())
        save_file({k: v.contiguous() for k, v in model.state_dict().items()}, str(d / "model.safetensors"))
        assert any(k.endswith("mlp.experts.gate_up_proj") for k in load_file(str(d / "model.safetensors")))
        spec, w = load_checkpoint(d)
        _assert_same_tensors(_flat(w), _hf_expected(fam, model, spec))


def test_tied_embeddings(tmp_path):
    cfg = _configs()["qwen3_moe"]
    cfg.tie_word_embeddings = True
    model = _build("qwen3_moe", cfg)
    path = _save(model, tmp_path / "tied")
    spec, w = load_checkpoint(path)
    assert spec.tie_embeddings and w.lm_head is None
    assert torch.equal(w.embed, model.lm_head.weight.detach())


def _write(path, config: dict, tensors: dict | None = None):
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, str(path / "model.safetensors"))
    return path


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


def test_mxfp4_experts_dequantize_like_transformers(tmp_path):
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    cfg = transformers.GptOssConfig(**{**COMMON, "hidden_size": 64}, head_dim=12, intermediate_size=32,
                                    num_local_experts=5, num_experts_per_tok=3)
    model = _build("gpt_oss", cfg)
    src = _save(model, tmp_path / "bf")
    tensors = load_file(str(src / "model.safetensors"))
    g = torch.Generator().manual_seed(1)
    want = {}
    E, H, I = 5, 64, 32
    for l in range(3):
        m = f"model.layers.{l}.mlp.experts."
        for proj, (out_d, in_d) in {"gate_up_proj": (2 * I, H), "down_proj": (H, I)}.items():
            del tensors[m + proj]
            blocks = torch.randint(0, 256, (E, out_d, in_d // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(120, 134, (E, out_d, in_d // 32), generator=g, dtype=torch.uint8)
            tensors[m + proj + "_blocks"], tensors[m + proj + "_scales"] = blocks, scales
            want[(l, proj)] = convert_moe_packed_tensors(blocks, scales, dtype=torch.float32)  # HF layout
    conf = json.loads((src / "config.json").read_text())
    conf["quantization_config"] = {"quant_method": "mxfp4"}
    spec, w = load_checkpoint(_write(tmp_path / "mx", conf, tensors))
    for l in range(3):
        gu, down = want[(l, "gate_up_proj")], want[(l, "down_proj")]  # [E, H, 2I], [E, I, H]
        assert torch.equal(w.layers[l]["experts.gate"], gu[..., ::2].transpose(1, 2))
        assert torch.equal(w.layers[l]["experts.up"], gu[..., 1::2].transpose(1, 2))
        assert torch.equal(w.layers[l]["experts.down"], down.transpose(1, 2))


# ---- errors -------------------------------------------------------------------------------------

def _msg(excinfo) -> str:
    return str(excinfo.value)


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


def _copy_with(saved_dir, dst, edit):
    tensors = load_file(str(saved_dir / "model.safetensors"))
    edit(tensors)
    return _write(dst, json.loads((saved_dir / "config.json").read_text()), tensors)


def test_missing_tensor_is_named(saved, tmp_path):
    name = "model.layers.1.mlp.experts.3.up_proj.weight"
    p = _copy_with(saved["qwen3_moe"][1], tmp_path / "miss", lambda t: t.pop(name))
    with pytest.raises(UserError) as e:
        load_checkpoint(p)
    assert name in _msg(e) and "missing" in _msg(e)


def test_wrong_shape_is_named_with_both_shapes(saved, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"

    def edit(t):
        t[name] = torch.zeros(25, 40)

    p = _copy_with(saved["mixtral"][1], tmp_path / "shape", edit)
    with pytest.raises(UserError) as e:
        load_checkpoint(p)
    m = _msg(e)
    assert name in m and "[25, 40]" in m and "[24, 40]" in m and "model.safetensors" in m


def test_unexpected_tensor_is_named(saved, tmp_path):
    name = "model.layers.0.mlp.experts.9.gate_proj.weight"

    def edit(t):
        t[name] = torch.zeros(20, 40)

    p = _copy_with(saved["olmoe"][1], tmp_path / "extra", edit)
    with pytest.raises(UserError, match=name.replace(".", r"\.")):
        load_checkpoint(p)


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


def test_glm_mtp_layers_are_ignored(saved, tmp_path):
    def edit(t):
        t["model.layers.3.eh_proj.weight"] = torch.zeros(40, 80)  # a next-token-prediction layer

    for fam in ("glm4_moe", "deepseek_v3", "glm4_moe_lite"):
        spec, w = load_checkpoint(_copy_with(saved[fam][1], tmp_path / f"mtp_{fam}", edit))
        assert len(w.layers) == spec.num_layers == 3


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
