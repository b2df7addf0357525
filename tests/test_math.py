"""Unit tests of the model math: RoPE variants, attention masks and sinks, routers, combine, KV store,
sampling, weights. Each checks against a direct formula or an independent property, not against
the implementation itself."""
from __future__ import annotations

import math

import pytest
import torch

from graph_ir.errors import UserError
from graph_ir.spec import ModelSpec, RopeSpec
from lab.reference import DenseKVStore
from models.attention import attend, rms_norm, softmax_scale, window_mask
from models.moe import combine, experts_rows, gptoss_glu, route_tokens
from models.rope import apply_rope, cos_sin, rope_parameters, rotary_dim
from models.sampling import SamplingParams, filtered_probs, sample, step_seed
from models.weights import expected_shapes, random_weights, validate_weights


# ---------------------------------------------------------------- RoPE

def test_default_inv_freq_formula() -> None:
    inv, scale = rope_parameters(RopeSpec(theta=500.0), 12)
    want = torch.tensor([1.0 / 500.0 ** (2 * i / 12) for i in range(6)])
    torch.testing.assert_close(inv, want)
    assert scale == 1.0


def test_linear_divides_by_factor() -> None:
    base, _ = rope_parameters(RopeSpec(theta=500.0), 12)
    lin, scale = rope_parameters(RopeSpec(theta=500.0, scaling="linear", factor=3.0), 12)
    torch.testing.assert_close(lin, base / 3.0)
    assert scale == 1.0


@pytest.mark.parametrize("kw", [
    dict(truncate=True),
    dict(truncate=False),  # GPT-OSS
    dict(mscale=1.0, mscale_all_dim=0.707),  # DeepSeek-V2 style temperature ratio
    dict(partial_rotary_factor=0.5, beta_fast=16.0, beta_slow=2.0),
])
def test_yarn_matches_transformers(kw: dict) -> None:
    tf = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    rope = RopeSpec(theta=5000.0, scaling="yarn", factor=4.0, original_max_position=128, **kw)
    params = {"rope_type": "yarn", "rope_theta": 5000.0, "factor": 4.0, "original_max_position_embeddings": 128}
    params.update({k: v for k, v in kw.items()})
    cfg = tf.LlamaConfig(hidden_size=64, num_attention_heads=4, head_dim=16, max_position_embeddings=512,
                         rope_parameters=params)
    want_inv, want_scale = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    inv, scale = rope_parameters(rope, rotary_dim(rope, 16))
    torch.testing.assert_close(inv, want_inv, rtol=0, atol=0)
    assert scale == pytest.approx(want_scale, rel=1e-12)


def test_yarn_truncate_changes_frequencies() -> None:
    a, _ = rope_parameters(RopeSpec(scaling="yarn", factor=8.0, original_max_position=256, truncate=True), 32)
    b, _ = rope_parameters(RopeSpec(scaling="yarn", factor=8.0, original_max_position=256, truncate=False), 32)
    assert not torch.equal(a, b)


def _complex_rotate(pairs_re: torch.Tensor, pairs_im: torch.Tensor, pos: torch.Tensor, inv: torch.Tensor):
    z = torch.complex(pairs_re.double(), pairs_im.double())
    ang = pos.double()[:, None, None] * inv.double()[None, None, :]
    return z * torch.exp(1j * ang)


def test_rotate_half_is_complex_rotation_of_split_pairs() -> None:
    torch.manual_seed(0)
    T, nh, d = 5, 3, 8
    rope = RopeSpec(theta=100.0)
    x = torch.randn(T, nh, d)
    pos = torch.tensor([0, 1, 7, 20, 33])
    cos, sin = cos_sin(rope, d, pos)
    out = apply_rope(x, cos, sin, interleaved=False)
    inv, _ = rope_parameters(rope, d)
    z = _complex_rotate(x[..., : d // 2], x[..., d // 2:], pos, inv)
    torch.testing.assert_close(out.double(), torch.cat([z.real, z.imag], -1), atol=1e-5, rtol=1e-5)


def test_interleaved_is_complex_rotation_of_adjacent_pairs() -> None:
    torch.manual_seed(1)
    T, nh, d = 4, 2, 6
    rope = RopeSpec(theta=50.0, interleaved=True)
    x = torch.randn(T, nh, d)
    pos = torch.tensor([0, 3, 9, 11])
    cos, sin = cos_sin(rope, d, pos)
    out = apply_rope(x, cos, sin, interleaved=True)
    inv, _ = rope_parameters(rope, d)
    z = _complex_rotate(x[..., 0::2], x[..., 1::2], pos, inv)
    want = torch.stack([z.real, z.imag], -1).flatten(-2)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


def test_partial_rotary_passes_tail_through_and_scores_are_relative() -> None:
    torch.manual_seed(2)
    rope = RopeSpec(theta=1000.0, partial_rotary_factor=0.5)
    d = 12
    r = rotary_dim(rope, d)
    assert r == 6
    q, k = torch.randn(1, 1, d), torch.randn(1, 1, d)

    def rot(x: torch.Tensor, p: int) -> torch.Tensor:
        c, s = cos_sin(rope, r, torch.tensor([p]))
        return apply_rope(x, c, s)

    assert torch.equal(rot(q, 17)[..., r:], q[..., r:])
    # q(m).k(n) depends only on m - n.
    s1 = (rot(q, 10) * rot(k, 4)).sum()
    s2 = (rot(q, 40) * rot(k, 34)).sum()
    torch.testing.assert_close(s1, s2, atol=1e-5, rtol=1e-5)


# ---------------------------------------------------------------- norms and attention

def test_rms_norm_formula() -> None:
    torch.manual_seed(3)
    x, w = torch.randn(4, 10), torch.randn(10)
    want = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 1e-5) * w
    torch.testing.assert_close(rms_norm(x, w, 1e-5), want)
    torch.testing.assert_close(rms_norm(x, w, 1e-5, weight_in_fp32=True), want)


@pytest.mark.parametrize("window,expected", [(None, [1, 2, 3, 4, 5, 6]), (1, [1] * 6), (4, [1, 2, 3, 4, 4, 4])])
def test_window_mask_counts(window, expected) -> None:
    # HF sliding_window_overlay: kv > q - W, so W keys including the query itself.
    pos = torch.arange(6)
    m = window_mask(pos, pos, window)
    assert m.sum(-1).tolist() == expected
    assert not torch.triu(m, diagonal=1).any()


def _naive_attention(q, k, v, q_pos, scale, window=None, sinks=None):
    n, nh, _ = q.shape
    nkv = k.shape[1]
    out = torch.zeros(n, nh, v.shape[-1], dtype=torch.float64)
    for i in range(n):
        p = int(q_pos[i])
        keys = [j for j in range(k.shape[0]) if j <= p and (window is None or j > p - window)]
        for h in range(nh):
            g = h // (nh // nkv)
            s = torch.tensor([float(q[i, h].double() @ k[j, g].double()) * scale for j in keys], dtype=torch.float64)
            z = torch.exp(s - s.max())
            denom = z.sum() + (math.exp(float(sinks[h]) - float(s.max())) if sinks is not None else 0.0)
            out[i, h] = sum(z[t] / denom * v[keys[t], g].double() for t in range(len(keys)))
    return out


@pytest.mark.parametrize("window", [None, 3])
@pytest.mark.parametrize("with_sinks", [False, True])
def test_attend_matches_naive_gqa(window, with_sinks) -> None:
    torch.manual_seed(4)
    L, nh, nkv, dk, dv = 9, 6, 2, 5, 7
    k, v = torch.randn(L, nkv, dk), torch.randn(L, nkv, dv)
    q_pos = torch.tensor([2, 6, 7, 8])
    q = torch.randn(4, nh, dk)
    sinks = torch.randn(nh) if with_sinks else None
    out = attend(q, k, v, q_pos, 0.37, window, sinks)
    torch.testing.assert_close(out.double(), _naive_attention(q, k, v, q_pos, 0.37, window, sinks),
                               atol=1e-5, rtol=1e-5)


def test_sinks_absorb_mass() -> None:
    torch.manual_seed(5)
    k, v = torch.randn(5, 1, 4), torch.ones(5, 1, 3)  # v = 1: output = total weight on real keys
    q = torch.randn(1, 2, 4)
    pos = torch.tensor([4])
    plain = attend(q, k, v, pos, 0.5)
    torch.testing.assert_close(plain, torch.ones_like(plain))
    out = attend(q, k, v, pos, 0.5, sinks=torch.tensor([-1e4, 3.0]))
    assert torch.allclose(out[:, 0], torch.ones(3))  # a hugely negative sink changes nothing
    assert (out[:, 1] < 0.99).all() and (out[:, 1] > 0).all()


def test_mla_softmax_scale_has_mscale_squared() -> None:
    from graph_ir.spec import AttentionSpec

    a = AttentionSpec(kind="mla", num_heads=2, num_kv_heads=2, head_dim=12, kv_lora_rank=8, qk_nope_head_dim=8,
                      qk_rope_head_dim=4, v_head_dim=6,
                      rope=RopeSpec(scaling="yarn", factor=40.0, original_max_position=64, mscale=0.707,
                                    mscale_all_dim=0.707))
    m = 0.1 * 0.707 * math.log(40.0) + 1.0
    assert softmax_scale(a) == pytest.approx(12 ** -0.5 * m * m)
    a_plain = a.model_copy(update={"kind": "gqa", "head_dim": 12})
    assert softmax_scale(a_plain) == pytest.approx(12 ** -0.5)


def test_dense_kv_store_roundtrip_and_gap() -> None:
    kv = DenseKVStore(initial_capacity=2)
    k, v = torch.randn(3, 2, 4), torch.randn(3, 2, 5)
    kv.write(0, 7, torch.arange(3), k, v)
    k2, v2 = torch.randn(1, 2, 4), torch.randn(1, 2, 5)
    kv.write(0, 7, torch.tensor([3]), k2, v2)
    K, V = kv.read(0, 7, 4)
    assert torch.equal(K, torch.cat([k, k2])) and torch.equal(V, torch.cat([v, v2]))
    with pytest.raises(ValueError):
        kv.write(0, 7, torch.tensor([6]), k2, v2)
    with pytest.raises(ValueError):
        kv.read(1, 7, 1)


# ---------------------------------------------------------------- routers

def _spec(**router) -> ModelSpec:
    experts = router.pop("experts", dict(num_experts=12, top_k=3, intermediate_size=8))
    return ModelSpec.model_validate(dict(
        name="t", num_layers=1, hidden_size=10, vocab_size=20, dtype="float32",
        attention=dict(num_heads=2, num_kv_heads=1, head_dim=4), router=router, experts=experts))


def _router_weights(spec: ModelSpec, seed: int = 0) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    E, H = spec.experts.num_experts, spec.hidden_size
    return {"router.w": torch.randn(E, H, generator=g), "router.b": torch.randn(E, generator=g),
            "router.correction_bias": 0.3 * torch.randn(E, generator=g)}


def test_softmax_router_renormalized_and_not() -> None:
    x = torch.randn(16, 10, generator=torch.Generator().manual_seed(1))
    for renorm in (True, False):
        spec = _spec(scoring="softmax", renormalize=renorm)
        w = _router_weights(spec)
        ids, wts = route_tokens(spec, w, x)
        probs = torch.softmax(x @ w["router.w"].T, -1)
        want_ids = probs.topk(3, -1).indices
        assert torch.equal(ids, want_ids) and ids.dtype == torch.int64 and wts.dtype == torch.float32
        want = probs.gather(1, ids)
        if renorm:
            want = want / want.sum(-1, keepdim=True)
            torch.testing.assert_close(wts.sum(-1), torch.ones(16))
        torch.testing.assert_close(wts, want)


def test_topk_softmax_router_uses_bias() -> None:
    spec = _spec(scoring="topk_softmax", renormalize=False, bias=True)
    w = _router_weights(spec)
    x = torch.randn(16, 10, generator=torch.Generator().manual_seed(2))
    ids, wts = route_tokens(spec, w, x)
    logits = x @ w["router.w"].T + w["router.b"]
    top = logits.topk(3, -1)
    assert torch.equal(ids, top.indices)
    torch.testing.assert_close(wts, torch.softmax(top.values, -1))


def test_sigmoid_group_limited_router() -> None:
    spec = _spec(scoring="sigmoid", correction_bias=True, n_group=4, topk_group=2, routed_scaling=2.5)
    w = _router_weights(spec)
    x = torch.randn(64, 10, generator=torch.Generator().manual_seed(3))
    ids, wts = route_tokens(spec, w, x)
    scores = torch.sigmoid(x @ w["router.w"].T)
    choice = scores + w["router.correction_bias"]
    for t in range(64):
        gs = choice[t].view(4, 3).topk(2, -1).values.sum(-1)
        allowed_groups = set(gs.topk(2).indices.tolist())
        assert {int(e) // 3 for e in ids[t]} <= allowed_groups
        # the chosen experts are the best by biased score among allowed experts
        allowed = [e for e in range(12) if e // 3 in allowed_groups]
        best = sorted(allowed, key=lambda e: -float(choice[t, e]))[:3]
        assert set(ids[t].tolist()) == set(best)
    # weights: unbiased scores, renormalized, then scaled
    want = scores.gather(1, ids)
    want = want / want.sum(-1, keepdim=True) * 2.5
    torch.testing.assert_close(wts, want)


def test_correction_bias_changes_selection_not_weights_formula() -> None:
    spec_b = _spec(scoring="sigmoid", correction_bias=True, renormalize=False)
    spec_n = _spec(scoring="sigmoid", correction_bias=False, renormalize=False)
    w = _router_weights(spec_b)
    w["router.correction_bias"] = torch.zeros(12)
    w["router.correction_bias"][5] = 10.0  # expert 5 always selected
    x = torch.randn(8, 10, generator=torch.Generator().manual_seed(4))
    ids_b, wts_b = route_tokens(spec_b, w, x)
    ids_n, _ = route_tokens(spec_n, w, x)
    assert (ids_b == 5).any(-1).all()
    assert not torch.equal(ids_b, ids_n)
    torch.testing.assert_close(wts_b, torch.sigmoid(x @ w["router.w"].T).gather(1, ids_b))


def test_softmax_group_limited_greedy_uses_group_max() -> None:
    spec = _spec(scoring="softmax", renormalize=False, n_group=3, topk_group=1, routed_scaling=1.5)
    w = _router_weights(spec)
    x = torch.randn(32, 10, generator=torch.Generator().manual_seed(5))
    ids, wts = route_tokens(spec, w, x)
    probs = torch.softmax(x @ w["router.w"].T, -1)
    best_group = probs.view(32, 3, 4).max(-1).values.argmax(-1)
    assert ((ids // 4) == best_group[:, None]).all()
    torch.testing.assert_close(wts, probs.gather(1, ids) * 1.5)


# ---------------------------------------------------------------- experts and combine

def test_gptoss_glu_formula_and_clamp() -> None:
    g = torch.tensor([-10.0, -1.0, 0.5, 3.0, 10.0])
    u = torch.tensor([-10.0, 0.2, 0.5, 3.0, 10.0])
    out = gptoss_glu(g, u, alpha=1.702, limit=2.0)
    gc, uc = g.clamp(max=2.0), u.clamp(-2.0, 2.0)
    torch.testing.assert_close(out, (uc + 1) * gc * torch.sigmoid(1.702 * gc))


def test_experts_rows_order_independent_and_formula() -> None:
    spec = _spec(experts=dict(num_experts=4, top_k=2, intermediate_size=6, bias=True))
    w = random_weights(spec, seed=3).layers[0]
    g = torch.Generator().manual_seed(9)
    x = torch.randn(10, 10, generator=g)
    e = torch.randint(0, 4, (10,), generator=g)
    y = experts_rows(spec, w, x, e)
    perm = torch.randperm(10, generator=g)
    # Not bitwise: CPU GEMM rounding depends on the batch shape, so only per-row agreement to fp32 noise.
    torch.testing.assert_close(experts_rows(spec, w, x[perm], e[perm]), y[perm], rtol=1e-6, atol=1e-6)
    i = 3
    gg = w["experts.gate"][e[i]] @ x[i] + w["experts.gate_b"][e[i]]
    uu = w["experts.up"][e[i]] @ x[i] + w["experts.up_b"][e[i]]
    want = w["experts.down"][e[i]] @ (torch.nn.functional.silu(gg) * uu) + w["experts.down_b"][e[i]]
    torch.testing.assert_close(y[i], want)


def test_combine_slot_order_fp32() -> None:
    g = torch.Generator().manual_seed(6)
    h = torch.randn(3, 5, generator=g).bfloat16()
    y = torch.randn(3, 4, 5, generator=g).bfloat16()
    wts = torch.rand(3, 4, generator=g)
    sh = torch.randn(3, 5, generator=g).bfloat16()
    acc = torch.zeros(3, 5)
    for j in range(4):
        acc = acc + y[:, j].float() * wts[:, j, None]
    want = (h.float() + (acc + sh.float())).bfloat16()
    out = combine(h, sh, y, wts)
    assert out.dtype == torch.bfloat16 and torch.equal(out, want)


# ---------------------------------------------------------------- sampling

def test_greedy_and_degenerate_filters_pick_argmax() -> None:
    logits = torch.randn(50, generator=torch.Generator().manual_seed(7))
    best = int(logits.argmax())
    assert sample(logits, SamplingParams(), 0) == best
    for p in (SamplingParams(temperature=1.0, top_k=1, seed=3), SamplingParams(temperature=1.0, top_p=1e-6, seed=3)):
        assert all(sample(logits, p, s) == best for s in range(10))


def test_sampling_deterministic_per_seed_and_step() -> None:
    logits = torch.zeros(1000)
    p = SamplingParams(temperature=1.0, seed=42)
    a = [sample(logits, p, s) for s in range(20)]
    assert a == [sample(logits, p, s) for s in range(20)]
    assert len(set(a)) > 10  # steps use different streams
    assert a != [sample(logits, SamplingParams(temperature=1.0, seed=43), s) for s in range(20)]
    assert step_seed(1, 2) != step_seed(2, 1)


def test_sampled_frequencies_follow_the_filtered_probabilities(monkeypatch) -> None:
    """The inverse-CDF draw (models.sampling.sample_tokens) picks each token with its filtered probability, never a
    dropped one, also at the uniform's ends (the largest, 1 - 2^-53, still lands below the total: the last kept token)."""
    import models.sampling as sampling
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    for p, want in ((SamplingParams(temperature=1.0, seed=3), [0.5, 0.3, 0.15, 0.05]),
                    (SamplingParams(temperature=1.0, top_p=0.7, seed=3), [0.625, 0.375, 0.0, 0.0]),
                    (SamplingParams(temperature=1.0, top_k=3, seed=5), [0.5 / 0.95, 0.3 / 0.95, 0.15 / 0.95, 0.0])):
        n = 4000
        got = torch.bincount(sampling.sample_tokens(logits.repeat(n, 1), [p] * n, list(range(n))), minlength=4) / n
        assert torch.allclose(got, torch.tensor(want), atol=0.03), (p, got)
        assert all(got[i] == 0 for i, w in enumerate(want) if w == 0)
    drop_tail = torch.log(torch.tensor([0.3, 0.4, 0.2, 0.1]))  # top-k 2 drops the last two tokens
    for u, tok in ((0.0, 0), (1.0 - 2.0 ** -53, 1)):
        monkeypatch.setattr(sampling, "_unit", lambda key, u=u: u)
        assert sample(drop_tail, SamplingParams(temperature=1.0, top_k=2), 0) == tok


def test_batched_sampling_equals_row_by_row() -> None:
    g = torch.Generator().manual_seed(9)
    x = torch.randn(70, 3000, generator=g) * 3  # more rows than one pass of the batched sampler takes
    ps = [None if i % 4 == 0 else SamplingParams(temperature=0.5 + i / 50, top_p=[1.0, 0.9, 0.5][i % 3],
                                                 top_k=[0, 40][i % 2], seed=i) for i in range(70)]
    steps = [3 * i for i in range(70)]
    from models.sampling import sample_tokens
    assert sample_tokens(x, ps, steps).tolist() == [sample(x[i], ps[i] or SamplingParams(), steps[i]) for i in range(70)]


def test_filters_ordered_by_narrower_keys_equal_the_wide_ones() -> None:
    """sample_tokens sorts the fp32 logits for top-k / top-p (faster) while it filters fp64 ones: the same result,
    ties included (bf16-rounded logits have many)."""
    from models.sampling import _filtered
    x = (torch.randn(40, 5000, generator=torch.Generator().manual_seed(1)) * 3).to(torch.bfloat16).float()
    ps = [SamplingParams(temperature=0.3 + i / 20, top_p=[1.0, 0.9, 0.5, 0.95][i % 4], top_k=[0, 40, 0, 3][i % 4])
          for i in range(40)]
    assert torch.equal(_filtered(x.double(), ps), _filtered(x.double(), ps, keys=x))


def test_top_p_top_k_filter() -> None:
    logits = torch.log(torch.tensor([0.5, 0.3, 0.15, 0.05]))
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_p=0.7))
    torch.testing.assert_close(p, torch.tensor([0.625, 0.375, 0.0, 0.0], dtype=torch.float64))
    p = filtered_probs(logits, SamplingParams(temperature=1.0, top_k=3))
    torch.testing.assert_close(p, torch.tensor([0.5, 0.3, 0.15, 0.0], dtype=torch.float64) / 0.95)


# ---------------------------------------------------------------- weights

def test_random_weights_shapes_seeded_and_features_nonzero() -> None:
    spec = ModelSpec.model_validate(dict(
        name="t", num_layers=3, hidden_size=12, vocab_size=30, dtype="bfloat16", dense_layers=[0],
        dense_intermediate_size=14,
        attention=dict(num_heads=4, num_kv_heads=2, head_dim=6, qkv_bias=True, o_bias=True, sinks=True,
                       qk_norm="head"),
        router=dict(scoring="sigmoid", correction_bias=True, bias=True),
        experts=dict(num_experts=5, top_k=2, intermediate_size=8, bias=True, shared_intermediate_size=6,
                     shared_gate=True)))
    w = random_weights(spec, seed=1)
    validate_weights(spec, w)
    assert set(w.layers[0]) >= {"mlp.gate", "mlp.up", "mlp.down"} and "router.w" not in w.layers[0]
    assert w.layers[1]["router.correction_bias"].dtype == torch.float32
    assert w.layers[1]["q.w"].dtype == torch.bfloat16
    for name in ("router.b", "router.correction_bias", "sinks", "q.b", "experts.down_b"):
        assert w.layers[1][name].abs().min() > 0
    assert torch.equal(random_weights(spec, seed=1).layers[2]["experts.up"], w.layers[2]["experts.up"])
    assert not torch.equal(random_weights(spec, seed=2).layers[2]["experts.up"], w.layers[2]["experts.up"])
    assert len(expected_shapes(spec)) == 2 + 1 + sum(len(l) for l in w.layers)
    del w.layers[2]["k.b"]
    with pytest.raises(UserError, match="layers.2.k.b"):
        validate_weights(spec, w)
