"""Checkpoint import against transformers itself: tiny randomly initialized HF models of every family
are saved with `save_pretrained`, imported, and every canonical tensor is compared with the HF
module's in-memory parameter it came from; sharded, fused, tied and MXFP4 checkpoints load alike, and a
missing, misshapen or unexpected tensor is named. (config.json -> spec: tests/test_checkpoint_config.py; the
models: tests/hf_checkpoints.py.)

The in-memory layout (transformers 5 fuses experts into `gate_up_proj [E, 2I, H]`, GPT-OSS keeps
`[E, H, 2I]` interleaved) differs from what `save_pretrained` writes (per-expert `experts.{e}.*`
for every family but GPT-OSS), so these comparisons check the layout mapping, not a copy of it.
Shapes are unusual on purpose (hidden 40, kv heads != heads, 5-6 experts, top-k 3).
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from graph_ir.errors import UserError  # noqa: E402
from models.checkpoint import load_checkpoint  # noqa: E402

# COMMON, _build, _save and _write are also imported from here by tests/test_sharded_weights.py.
from hf_checkpoints import COMMON, FAMILIES, _build, _configs, _msg, _save, _write  # noqa: E402
from hf_checkpoints import saved  # noqa: E402,F401  (a fixture)


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


@pytest.mark.parametrize("family", FAMILIES)
def test_every_tensor_matches_hf_parameter(saved, family):
    model, path = saved[family]
    spec, w = load_checkpoint(path)
    assert spec.family == family
    assert spec.weights.source == "checkpoint" and spec.weights.path == str(path)
    assert spec.dtype == "float32"
    _assert_same_tensors(_flat(w), _hf_expected(family, model, spec))


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


def test_glm_mtp_layers_are_ignored(saved, tmp_path):
    def edit(t):
        t["model.layers.3.eh_proj.weight"] = torch.zeros(40, 80)  # a next-token-prediction layer

    for fam in ("glm4_moe", "deepseek_v3", "glm4_moe_lite"):
        spec, w = load_checkpoint(_copy_with(saved[fam][1], tmp_path / f"mtp_{fam}", edit))
        assert len(w.layers) == spec.num_layers == 3
