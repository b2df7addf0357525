"""The reference decoder and the stage functions on random-weight specs: KV-cache consistency,
multi-segment batches, eos handling, seeded sampling, bf16."""
from __future__ import annotations

import pytest
import torch

from graph_ir.spec import ModelSpec
from lab.reference import DenseKVStore
from models.layers import attention_stage, embed, final_logits
from lab.reference import ReferenceDecoder
from models.sampling import SamplingParams
from models.weights import load_weights, random_weights


def _gqa_spec(dtype: str = "float32") -> ModelSpec:
    return ModelSpec.model_validate(dict(
        name="tiny-gqa", family="gpt_oss", num_layers=3, hidden_size=36, vocab_size=61, dtype=dtype,
        dense_layers=[1], dense_intermediate_size=20, eos_token_ids=[3],
        attention=dict(num_heads=6, num_kv_heads=2, head_dim=10, qkv_bias=True, o_bias=True, sinks=True,
                       sliding_window=3, layer_types=["sliding", "full", "sliding"], qk_norm="head",
                       rope=dict(theta=1000.0, scaling="yarn", factor=4.0, original_max_position=32,
                                 truncate=False, partial_rotary_factor=0.6)),
        router=dict(scoring="topk_softmax", renormalize=False, bias=True),
        experts=dict(num_experts=7, top_k=3, intermediate_size=16, activation="gptoss_glu", glu_limit=1.0,
                     bias=True, shared_intermediate_size=12, shared_gate=True),
        weights=dict(source="random", seed=5, init_std=0.2)))


def _mla_spec() -> ModelSpec:
    return ModelSpec.model_validate(dict(
        name="tiny-mla", family="deepseek_v2", num_layers=2, hidden_size=28, vocab_size=53, dtype="float32",
        dense_layers=[0], dense_intermediate_size=24,
        attention=dict(kind="mla", num_heads=3, num_kv_heads=3, head_dim=10, q_lora_rank=12, kv_lora_rank=10,
                       qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=8,
                       rope=dict(theta=500.0, interleaved=True, scaling="yarn", factor=4.0,
                                 original_max_position=16, mscale=1.0, mscale_all_dim=0.7)),
        router=dict(scoring="sigmoid", correction_bias=True, n_group=3, topk_group=2, routed_scaling=2.0),
        experts=dict(num_experts=9, top_k=3, intermediate_size=8, shared_intermediate_size=8),
        weights=dict(source="random", seed=2, init_std=0.25)))


SPECS = {"gqa": _gqa_spec, "mla": _mla_spec}


@pytest.mark.parametrize("kind", list(SPECS))
def test_incremental_decode_matches_full_forward(kind: str) -> None:
    spec = SPECS[kind]()
    dec = ReferenceDecoder(spec, load_weights(spec))
    prompt = [5, 9, 1, 0, 17, 22, 8]
    res = dec.generate(prompt, 8, eos_ids=[], ignore_eos=True)
    full = dec.forward_logits(prompt + res.tokens[:-1])
    for s, logits in enumerate(res.logits):
        torch.testing.assert_close(logits, full[len(prompt) - 1 + s], rtol=1e-5, atol=1e-5)
        assert res.tokens[s] == int(torch.argmax(logits))


@pytest.mark.parametrize("kind", list(SPECS))
def test_segments_in_one_batch_equal_separate_calls(kind: str) -> None:
    """Rows of different requests batched together (as the runtime does) see only their own KV."""
    spec = SPECS[kind]()
    w = random_weights(spec)
    a_ids, b_ids = torch.tensor([4, 8, 15, 16]), torch.tensor([23, 42])
    # Separate: a prefill of 4, b prefill of 2.
    kv1 = DenseKVStore()
    ha = attention_stage(spec, w, 0, embed(w, a_ids), torch.arange(4), [(10, 0, 4)], kv1)[0]
    hb = attention_stage(spec, w, 0, embed(w, b_ids), torch.arange(2), [(11, 0, 2)], kv1)[0]
    # Together: b first, then a, in one call.
    kv2 = DenseKVStore()
    h = embed(w, torch.cat([b_ids, a_ids]))
    pos = torch.tensor([0, 1, 0, 1, 2, 3])
    hab = attention_stage(spec, w, 0, h, pos, [(11, 0, 2), (10, 2, 4)], kv2)[0]
    torch.testing.assert_close(hab[:2], hb, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(hab[2:], ha, rtol=1e-6, atol=1e-6)
    # A decode step of a batched with a prefill continuation of b.
    kv1_next = attention_stage(spec, w, 0, embed(w, torch.tensor([7])), torch.tensor([4]), [(10, 0, 1)], kv1)[0]
    both = attention_stage(spec, w, 0, embed(w, torch.tensor([7, 9, 9])), torch.tensor([4, 2, 3]),
                           [(10, 0, 1), (11, 1, 2)], kv2)[0]
    torch.testing.assert_close(both[:1], kv1_next, rtol=1e-6, atol=1e-6)


def test_eos_stops_unless_ignored() -> None:
    spec = _gqa_spec()
    dec = ReferenceDecoder(spec, load_weights(spec))
    free = dec.generate([1, 2, 3], 6, eos_ids=[], ignore_eos=True)
    eos_tok = free.tokens[2]
    stopped = dec.generate([1, 2, 3], 6, eos_ids=[eos_tok])
    first = free.tokens.index(eos_tok)
    assert stopped.tokens == free.tokens[: first + 1] and stopped.finish_reason == "eos"
    ignored = dec.generate([1, 2, 3], 6, eos_ids=[eos_tok], ignore_eos=True)
    assert ignored.tokens == free.tokens and ignored.finish_reason == "length"


def test_seeded_sampling_is_reproducible() -> None:
    spec = _gqa_spec()
    dec = ReferenceDecoder(spec, load_weights(spec))
    p = SamplingParams(temperature=1.5, top_p=0.95, top_k=20, seed=7)
    a = dec.generate([3, 1, 4], 10, sampling=p, eos_ids=[])
    assert a.tokens == dec.generate([3, 1, 4], 10, sampling=p, eos_ids=[]).tokens
    others = [dec.generate([3, 1, 4], 10, sampling=p.model_copy(update={"seed": s}), eos_ids=[]).tokens
              for s in range(8, 12)]
    assert any(o != a.tokens for o in others)


def test_bf16_runs_and_tracks_fp32() -> None:
    spec32 = _gqa_spec()
    spec16 = _gqa_spec("bfloat16")
    w32 = load_weights(spec32)
    w16 = w32.to(dtype=torch.bfloat16)
    assert w16.layers[0]["q.w"].dtype == torch.bfloat16
    prompt = [2, 7, 1, 8, 2, 8]
    l32 = ReferenceDecoder(spec32, w32).forward_logits(prompt)
    l16 = ReferenceDecoder(spec16, w16).forward_logits(prompt)
    assert l16.dtype == torch.bfloat16
    assert float((l16.float() - l32).abs().max()) < 0.1 * float(l32.abs().max())


def test_tied_head_uses_embedding() -> None:
    spec = _gqa_spec().model_copy(update={"tie_embeddings": True})
    w = random_weights(spec)
    assert w.lm_head is None
    h = torch.randn(2, spec.hidden_size)
    x = h / torch.sqrt((h * h).mean(-1, keepdim=True) + spec.rms_norm_eps) * w.final_norm
    torch.testing.assert_close(final_logits(spec, w, h), x @ w.embed.T)
