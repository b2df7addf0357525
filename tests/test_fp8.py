"""Block-scaled FP8 checkpoints (DeepSeek-V3 style: e4m3 weights, a `weight_scale_inv` per block) load dequantized.

A tiny DeepSeek-V3 built by transformers is saved, then every 2-D linear weight but the embedding, LM head and router
is quantized here to torch.float8_e4m3fn with one fp32 scale per block (small blocks, 16 x 8, so every matrix has
several and ragged edge blocks). The loaded weights must equal this test's own dequantization exactly, be within FP8
error of the originals, and give transformers' greedy tokens when transformers runs the dequantized weights.
"""
from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

transformers = pytest.importorskip("transformers")

from graph_ir.errors import UserError  # noqa: E402
from models.checkpoint import load_checkpoint  # noqa: E402
from lab.reference import ReferenceDecoder  # noqa: E402

BLOCK = (16, 8)
FP8_MAX = 448.0  # largest finite float8_e4m3fn


def _quantize(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    bo, bi = BLOCK
    o, i = w.shape
    so, si = -(-o // bo), -(-i // bi)
    pad = torch.zeros(so * bo, si * bi)
    pad[:o, :i] = w
    blocks = pad.view(so, bo, si, bi)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / FP8_MAX  # [so, si]
    q = (blocks / scale[:, None, :, None]).view(so * bo, si * bi)[:o, :i].to(torch.float8_e4m3fn)
    return q, scale


def _dequant(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    bo, bi = BLOCK
    o, i = q.shape
    return q.float() * scale.repeat_interleave(bo, 0)[:o].repeat_interleave(bi, 1)[:, :i]


def _quantized(name: str, t: torch.Tensor) -> bool:
    # DeepSeek-V3's release keeps the embedding, head, norms, router and correction bias unquantized
    return t.ndim == 2 and name.endswith(".weight") and "embed" not in name and "lm_head" not in name \
        and not name.endswith("mlp.gate.weight")


@pytest.fixture(scope="module")
def fp8_checkpoint(tmp_path_factory):
    cfg = transformers.DeepseekV3Config(
        vocab_size=97, hidden_size=44, intermediate_size=50, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=4, num_key_value_heads=4, q_lora_rank=20, kv_lora_rank=18, qk_nope_head_dim=8,
        qk_rope_head_dim=6, v_head_dim=10, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
        first_k_dense_replace=1, n_group=2, topk_group=1, max_position_embeddings=256,
        bos_token_id=1, eos_token_id=2, pad_token_id=0)
    torch.manual_seed(0)
    model = transformers.DeepseekV3ForCausalLM._from_config(cfg, attn_implementation="eager",
                                                              dtype=torch.float32).eval()
    g = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for name, t in list(model.named_parameters()) + list(model.named_buffers()):
            if t.is_floating_point() and "inv_freq" not in name:
                noise = torch.randn(t.shape, generator=g)
                t.copy_(1.0 + 0.2 * noise if "norm" in name else (0.5 if "embed" in name or "lm_head" in name
                                                                   else 0.15) * noise)
    src = tmp_path_factory.mktemp("bf")
    model.save_pretrained(src)
    dst = tmp_path_factory.mktemp("fp8")
    tensors = load_file(str(src / "model.safetensors"))
    out, dequantized = {}, {}
    for name, t in tensors.items():
        if _quantized(name, t):
            q, scale = _quantize(t)
            out[name], out[name.removesuffix(".weight") + ".weight_scale_inv"] = q, scale
            dequantized[name] = _dequant(q, scale)
        else:
            out[name] = t
    save_file(out, str(dst / "model.safetensors"))
    config = json.loads((src / "config.json").read_text())
    config["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                     "weight_block_size": list(BLOCK)}
    (dst / "config.json").write_text(json.dumps(config))
    return model, tensors, dequantized, dst


def test_fp8_weights_dequantize_within_fp8_error(fp8_checkpoint):
    model, original, dequantized, path = fp8_checkpoint
    spec, w = load_checkpoint(path)
    assert spec.dtype == "float32" and len(dequantized) > 20
    ours = {f"model.layers.{l}.self_attn.kv_b_proj.weight": w.layers[l]["kv_b.w"] for l in range(spec.num_layers)}
    ours.update({f"model.layers.{l}.mlp.experts.{e}.down_proj.weight": w.layers[l]["experts.down"][e]
                 for l in spec.moe_layers for e in range(spec.experts.num_experts)})
    ours["model.layers.0.mlp.gate_proj.weight"] = w.layers[0]["mlp.gate"]
    for name, t in ours.items():
        assert torch.equal(t, dequantized[name]), name  # the loader's dequantization is this test's, exactly
        # e4m3 keeps 3 mantissa bits: at most 1/16 relative error per element, plus the subnormal floor
        err = (t - original[name]).abs()
        assert bool((err <= original[name].abs() / 16 + original[name].abs().max() * 2 ** -9 + 1e-12).all()), name


def test_fp8_tokens_equal_transformers_on_the_dequantized_weights(fp8_checkpoint):
    model, original, dequantized, path = fp8_checkpoint
    with torch.no_grad():
        sd = model.state_dict()
        hf = transformers.DeepseekV3ForCausalLM._from_config(model.config, attn_implementation="eager",
                                                             dtype=torch.float32).eval()
        hf.load_state_dict(sd)
        # the in-memory model fuses experts; set every quantized tensor through its saved name
        for name, t in dequantized.items():
            parts = name.split(".")
            if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
                i = parts.index("experts")
                e, proj = int(parts[i + 1]), parts[i + 2]
                experts = hf.get_submodule(".".join(parts[:i + 1]))
                inter = experts.down_proj.shape[-1]
                if proj == "down_proj":
                    experts.down_proj[e].copy_(t)
                else:
                    rows = slice(0, inter) if proj == "gate_proj" else slice(inter, 2 * inter)
                    experts.gate_up_proj[e, rows].copy_(t)
            else:
                hf.get_parameter(name).copy_(t)
    spec, w = load_checkpoint(path)
    dec = ReferenceDecoder(spec, w)
    prompt = torch.randint(0, 97, (12,), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = hf(prompt[None], use_cache=False).logits[0]
        out = hf.generate(prompt[None], max_new_tokens=16, min_new_tokens=16, do_sample=False, eos_token_id=None,
                          pad_token_id=0)
    ours = dec.forward_logits(prompt)
    assert float((ours - ref).abs().max()) <= 1e-4 * float(ref.abs().max())
    assert dec.generate(prompt.tolist(), 16, eos_ids=[], ignore_eos=True).tokens == out[0, 12:].tolist()


def test_fp8_without_scales_or_with_another_format_is_refused(fp8_checkpoint, tmp_path):
    _, _, _, path = fp8_checkpoint
    config = json.loads((path / "config.json").read_text())
    tensors = load_file(str(path / "model.safetensors"))
    name = "model.layers.1.self_attn.o_proj.weight_scale_inv"
    (tmp_path / "noscale").mkdir()
    save_file({k: v for k, v in tensors.items() if k != name}, str(tmp_path / "noscale" / "model.safetensors"))
    (tmp_path / "noscale" / "config.json").write_text(json.dumps(config))
    with pytest.raises(UserError, match=name.replace(".", r"\.")):
        load_checkpoint(tmp_path / "noscale")
    (tmp_path / "e5m2").mkdir()
    (tmp_path / "e5m2" / "config.json").write_text(json.dumps(
        {**config, "quantization_config": {**config["quantization_config"], "fmt": "e5m2"}}))
    with pytest.raises(UserError, match="e5m2"):
        load_checkpoint(tmp_path / "e5m2")
