"""ModelSpec: shipped YAMLs load with their published numbers; bad YAML is a UserError naming the
file, the field path and the bad value; the builder produces the same spec as YAML."""
from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from graph_ir.builder import ModelBuilder
from graph_ir.errors import UserError
from graph_ir.spec import load_spec, spec_from_dict
from lowering import sizes

SPECS = Path(__file__).resolve().parents[1] / "models" / "specs"
SHIPPED = sorted(p.stem for p in SPECS.glob("*.yaml"))
BIG = ["gpt-oss-120b", "gpt-oss-20b", "glm-4.5-air", "qwen3-30b-a3b", "mixtral-8x7b", "deepseek-v2-lite", "olmoe-1b-7b",
       "deepseek-v3"]
TINY = ["tiny-gpt-oss", "tiny-glm4-moe", "tiny-qwen3-moe", "tiny-qwen2-moe", "tiny-mixtral", "tiny-deepseek-v2",
        "tiny-deepseek-v3", "tiny-olmoe", "tiny-glm4-moe-lite", "tiny-dots1", "tiny-minimax-m2", "tiny-granitemoe",
        "tiny-ernie4-5-moe", "tiny-hunyuan-moe", "tiny"]


def test_every_model_the_issue_names_is_shipped():
    assert set(BIG + TINY) <= set(SHIPPED)


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_spec_loads(name):
    spec = load_spec(SPECS / f"{name}.yaml")
    assert spec.name == name
    assert spec.family != "custom"
    assert spec.weights.source == "random" and spec.weights.seed == 0
    assert spec.eos_token_ids


# (layers, hidden, routed experts, top-k, expert intermediate, heads, kv heads, total params in billions)
PUBLISHED = {
    "gpt-oss-120b": (36, 2880, 128, 4, 2880, 64, 8, 116.8),
    "gpt-oss-20b": (24, 2880, 32, 4, 2880, 64, 8, 20.9),
    "glm-4.5-air": (46, 4096, 128, 8, 1408, 96, 8, 106.9),  # without the MTP layer
    "qwen3-30b-a3b": (48, 2048, 128, 8, 768, 32, 4, 30.5),
    "mixtral-8x7b": (32, 4096, 8, 2, 14336, 32, 8, 46.7),
    "deepseek-v2-lite": (27, 2048, 64, 6, 1408, 16, 16, 15.7),
    "olmoe-1b-7b": (16, 2048, 64, 8, 1024, 16, 16, 6.9),
    "deepseek-v3": (61, 7168, 256, 8, 2048, 128, 128, 671.0),  # without the MTP layer
}


@pytest.mark.parametrize("name", BIG)
def test_published_numbers(name):
    s = load_spec(SPECS / f"{name}.yaml")
    L, H, E, k, inter, nh, nkv, billions = PUBLISHED[name]
    assert (s.num_layers, s.hidden_size, s.experts.num_experts, s.experts.top_k, s.experts.intermediate_size,
            s.attention.num_heads, s.attention.num_kv_heads) == (L, H, E, k, inter, nh, nkv)
    assert s.dtype == "bfloat16"
    total = sizes.replicated_params(s) + sizes.expert_params(s) * E * len(s.moe_layers)
    # The parameter count from our weight layout matches the published model size.
    assert total / 1e9 == pytest.approx(billions, rel=0.01)


def test_family_features_survive_in_tiny_variants():
    g = load_spec(SPECS / "tiny-gpt-oss.yaml")
    assert g.attention.sinks and g.attention.rope.scaling == "yarn" and g.experts.activation == "gptoss_glu"
    assert g.attention.window(0) is not None and g.attention.window(1) is None
    glm = load_spec(SPECS / "tiny-glm4-moe.yaml")
    assert glm.router.scoring == "sigmoid" and glm.router.correction_bias and glm.router.n_group > 1
    assert glm.router.routed_scaling != 1.0 and glm.attention.rope.partial_rotary_factor < 1
    assert glm.dense_layers == [0] and glm.experts.shared_intermediate_size > 0
    assert load_spec(SPECS / "tiny-qwen3-moe.yaml").attention.qk_norm == "head"
    assert load_spec(SPECS / "tiny-qwen2-moe.yaml").experts.shared_gate
    ds = load_spec(SPECS / "tiny-deepseek-v2.yaml")
    assert ds.attention.kind == "mla" and ds.dense_layers == [0] and ds.experts.shared_intermediate_size > 0
    ol = load_spec(SPECS / "tiny-olmoe.yaml")
    assert ol.attention.qk_norm == "full" and not ol.router.renormalize
    lite = load_spec(SPECS / "tiny-glm4-moe-lite.yaml")
    assert lite.attention.kind == "mla" and lite.attention.v_head_dim != lite.attention.qk_nope_head_dim
    assert lite.router.scoring == "sigmoid" and lite.router.correction_bias and lite.router.n_group > 1
    assert lite.dense_layers == [0] and lite.experts.shared_intermediate_size > 0
    dots = load_spec(SPECS / "tiny-dots1.yaml")
    assert dots.attention.qk_norm == "head" and dots.attention.qkv_bias and dots.attention.window(2) is not None
    assert dots.router.scoring == "sigmoid" and dots.router.correction_bias and dots.router.n_group > 1
    assert dots.dense_layers == [0] and dots.experts.shared_intermediate_size > 0
    mm = load_spec(SPECS / "tiny-minimax-m2.yaml")
    assert mm.attention.qk_norm == "full" and mm.attention.rope.partial_rotary_factor < 1
    assert mm.router.scoring == "sigmoid" and mm.router.correction_bias and mm.router.n_group == 1
    gr = load_spec(SPECS / "tiny-granitemoe.yaml")
    assert gr.embedding_multiplier != 1 and gr.residual_multiplier != 1 and gr.logits_scaling != 1
    assert gr.attention.softmax_scale is not None and gr.router.scoring == "topk_softmax"
    er = load_spec(SPECS / "tiny-ernie4-5-moe.yaml")
    assert er.router.scoring == "softmax" and er.router.correction_bias and er.experts.shared_intermediate_size > 0
    assert er.dense_layers == [0, 2] and er.attention.rope.interleaved and er.tie_embeddings
    hy = load_spec(SPECS / "tiny-hunyuan-moe.yaml")
    assert hy.attention.qk_norm == "head" and hy.attention.qk_norm_after_rope and hy.attention.qkv_bias
    assert hy.router.scoring == "softmax" and hy.experts.shared_intermediate_size == hy.experts.intermediate_size
    for name in TINY:
        s = load_spec(SPECS / f"{name}.yaml")
        assert s.dtype == "float32" and 2 <= s.num_layers <= 4
        assert s.hidden_size & (s.hidden_size - 1), f"{name}: hidden should not be a power of two"
        assert s.attention.kind == "mla" or s.attention.num_kv_heads != s.attention.num_heads


def _write(tmp_path, data, name="m.yaml") -> Path:
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data))
    return p


def _base() -> dict:
    return yaml.safe_load((SPECS / "tiny-mixtral.yaml").read_text())


@pytest.mark.parametrize("mutate, field, value", [
    (lambda d: d["attention"].update(num_kv_heds=2), "attention.num_kv_heds", "unknown field"),
    (lambda d: d.update(num_layers="four"), "num_layers", "'four'"),
    (lambda d: d["experts"].update(top_k=9), "experts", "top_k (9) must be <= num_experts (8)"),
    (lambda d: d["attention"].update(num_kv_heads=4), "attention", "num_kv_heads (4) must divide num_heads (6)"),
    (lambda d: d.update(dtype="fp8"), "dtype", "'fp8'"),
    (lambda d: d.update(dense_layers=[7], dense_intermediate_size=8), "(top level)", "[7]"),
    (lambda d: d["router"].update(n_group=8, topk_group=1, scoring="sigmoid"), "(top level)", "top_k (2)"),
])
def test_bad_yaml_names_file_field_and_value(tmp_path, mutate, field, value):
    data = _base()
    mutate(data)
    path = _write(tmp_path, data)
    with pytest.raises(UserError) as err:
        load_spec(path)
    msg = str(err.value)
    assert str(path) in msg and f"field '{field}'" in msg and value in msg


def test_missing_and_unparsable_files(tmp_path):
    with pytest.raises(UserError, match="no such model file"):
        load_spec(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: [unclosed\n")
    with pytest.raises(UserError, match="not valid YAML"):
        load_spec(bad)
    bad.write_text("- a list\n")
    with pytest.raises(UserError, match="mapping"):
        load_spec(bad)


def test_builder_matches_yaml():
    built = (ModelBuilder("tiny-mixtral", family="mixtral").layers(4).hidden(96).vocab(512, eos=[2])
             .max_position(512).norm_eps(1e-5).dtype("float32")
             .gqa(heads=6, kv_heads=2, head_dim=16).rope(theta=1000000)
             .router("softmax", renormalize=True).experts(8, top_k=2, intermediate=64).weights(seed=0).build())
    assert built == load_spec(SPECS / "tiny-mixtral.yaml")


def test_builder_covers_mla_dense_and_shared():
    s = (ModelBuilder("my-ds").layers(3).hidden(72).vocab(400)
         .mla(heads=4, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16)
         .router("softmax", renormalize=False).experts(10, top_k=3, intermediate=32).shared_expert(64)
         .dense_first(1, intermediate=128).build())
    assert s.attention.kind == "mla" and s.attention.qk_head_dim == 24 and s.moe_layers == [1, 2]
    assert s.experts.shared_intermediate_size == 64


def test_builder_errors_are_user_errors():
    with pytest.raises(UserError, match=r"ModelBuilder\('x'\): field 'experts'.*top_k \(3\)"):
        (ModelBuilder("x").layers(2).hidden(8).vocab(10).gqa(heads=2, kv_heads=1, head_dim=4)
         .experts(2, top_k=3, intermediate=4).build())
    with pytest.raises(UserError, match="field 'hidden_size'"):
        ModelBuilder("x").layers(2).vocab(10).gqa(heads=2, kv_heads=1, head_dim=4).experts(2, 1, 4).build()


def test_spec_from_dict_rejects_non_mapping():
    with pytest.raises(UserError, match="expected a mapping"):
        spec_from_dict([1, 2], "x.yaml")


def test_cut_layers_keeps_per_layer_settings_consistent():
    from graph_ir.spec import cut_layers, load_spec
    spec = load_spec("models/specs/gpt-oss-120b.yaml")
    cut = cut_layers(spec, 18)
    assert (cut.num_layers, cut.name) == (18, "gpt-oss-120b-L18")
    assert cut.attention.layer_types == spec.attention.layer_types[:18]
    assert cut.hidden_size == spec.hidden_size and cut.experts == spec.experts
    glm = cut_layers(load_spec("models/specs/glm-4.5-air.yaml"), 2)
    assert glm.dense_layers == [0] and glm.num_layers == 2
    assert cut_layers(spec, 99) is spec
