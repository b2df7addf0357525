"""Lowering: every plan the compiler returns satisfies the invariants the runtime relies on,
checked here independently of lowering/check.py; user mistakes are UserErrors; never a crash."""
from __future__ import annotations

import json
import time
from pathlib import Path

import pytest
from hypothesis import HealthCheck, event, given, settings
from hypothesis import strategies as st

from graph_ir.errors import UserError
from graph_ir.spec import load_spec, spec_from_dict
from lowering import sizes
from lowering.check import PlanInvariantError, check_plan
from lowering.placement import balanced, contiguous
from lowering.plan import PLAN_VERSION, compile_plan, load_plan, save_plan

SPECS = Path(__file__).resolve().parents[1] / "models" / "specs"
SHIPPED = sorted(p.stem for p in SPECS.glob("*.yaml"))


def assert_invariants(plan) -> None:
    spec, R = plan.spec, plan.cluster.ranks
    E, L = spec.experts.num_experts, spec.num_layers
    # Chain: attn/expert alternate per MoE layer, dense layers have only attn, sample wraps to attn(0).
    names = [(s.kind, s.layer) for s in plan.stages]
    want = [x for l in range(L) for x in ([("attn", l), ("expert", l)] if l not in spec.dense_layers
                                         else [("attn", l)])] + [("sample", L)]
    assert names == want
    assert [s.next for s in plan.stages] == [i + 1 for i in range(len(want) - 1)] + [0]
    # Every expert of every MoE layer is held by exactly one rank's queue.
    for s in plan.stages:
        if s.kind == "expert":
            held = sorted(e for rp in plan.ranks for e in rp.queues[s.id].experts)
            assert held == list(range(E)), (s, held)
            for rp in plan.ranks:
                for e in rp.queues[s.id].experts:
                    assert plan.placement.expert_rank[s.layer][e] == rp.rank
    for l in spec.dense_layers:
        assert plan.placement.expert_rank[l] == []
    # Queue tables mirror the chain on every rank.
    for rp in plan.ranks:
        assert [(q.stage_id, q.kind, q.layer, q.next_stage) for q in rp.queues] == \
            [(s.id, s.kind, s.layer, s.next) for s in plan.stages]
        assert all(q.batch_cap == (plan.caps.expert_rows if q.kind == "expert" else plan.caps.attn_tokens)
                   for q in rp.queues)
    # Routes: one per chain edge; every (home, holder) pair that a token can travel is covered.
    assert [(r.src_stage, r.dst_stage) for r in plan.routes] == [(s.id, s.next) for s in plan.stages]
    for route in plan.routes:
        src = plan.stages[route.src_stage]
        pairs = set(route.pairs())
        if route.kind == "dispatch":
            needed = {(h, plan.placement.expert_rank[src.layer][e]) for h in range(R) for e in range(E)}
        elif route.kind == "combine":
            needed = {(plan.placement.expert_rank[src.layer][e], h) for h in range(R) for e in range(E)}
        else:
            needed = {(h, h) for h in range(R)}
        assert needed == pairs
        if route.kind != "local":
            rows = route.max_message_bytes // (spec.hidden_size * sizes.dtype_bytes(spec))
            assert 0 < rows <= max(plan.caps.attn_tokens * spec.experts.top_k, plan.caps.expert_rows)
    # Memory adds up and fits; weights: replicated everywhere + exactly the experts placed there.
    one_expert = sizes.expert_params(spec) * sizes.dtype_bytes(spec)
    total_expert_bytes = 0
    for m in plan.memory:
        n_experts = sum(len(plan.placement.experts_on(l, m.rank)) for l in spec.moe_layers)
        assert m.expert_weight_bytes == n_experts * one_expert
        total_expert_bytes += m.expert_weight_bytes
        assert m.weight_bytes + m.graph_bytes + m.workspace_bytes + m.kv_bytes + m.free_bytes == m.device_bytes
        assert m.free_bytes >= 0 and m.kv_blocks == plan.kv.num_blocks[m.rank]
        assert m.kv_bytes == m.kv_blocks * plan.kv.block_size * plan.kv.bytes_per_token
    assert total_expert_bytes == one_expert * E * len(spec.moe_layers)
    assert plan.kv.bytes_per_token == sum(plan.kv.bytes_per_token_per_layer)


def tiny(name="tiny"):
    return load_spec(SPECS / f"{name}.yaml")


@pytest.mark.parametrize("name", SHIPPED)
def test_every_shipped_model_compiles_for_1_to_64_ranks(name):
    spec = load_spec(SPECS / f"{name}.yaml")
    # Big models get enough memory that even one rank holds them (bf16 GPT-OSS-120B is ~218 GiB, DeepSeek-V3 ~1255).
    mem = None if name.startswith("tiny") else 2048.0 if name == "deepseek-v3" else 1024.0
    for ranks in (1, 2, 4, 8, 16, 64):
        t = time.perf_counter()
        plan = compile_plan(spec, ranks, device="cuda", device_memory_gib=mem)
        assert time.perf_counter() - t < 3.0, f"{name} on {ranks} ranks is slow"
        assert_invariants(plan)


def test_kv_bytes_per_token_gqa_and_mla():
    mix = load_spec(SPECS / "mixtral-8x7b.yaml")
    assert sizes.kv_bytes_per_token_layer(mix) == 2 * 8 * 128 * 2
    ds = load_spec(SPECS / "deepseek-v2-lite.yaml")
    # MLA caches the latent [512] and the roped key [64] in bf16 (no per-head K/V: 10,240 bytes before).
    assert sizes.kv_bytes_per_token_layer(ds) == (512 + 64) * 2


def test_contiguous_placement_handles_uneven_and_more_ranks_than_experts():
    owners = contiguous(10, 4)
    counts = [owners.count(r) for r in range(4)]
    assert sorted(counts) == [2, 2, 3, 3] and owners == sorted(owners)
    plan = compile_plan(tiny(), 12)  # 8 experts, 12 ranks: 4 ranks hold attention only
    assert_invariants(plan)
    assert sum(1 for r in range(12) if not plan.placement.experts_on(0, r)) == 4
    dispatch = plan.routes[0]
    assert dispatch.kind == "dispatch" and len(dispatch.dst_ranks) == 8


def test_round_robin_placement():
    plan = compile_plan(tiny("tiny-qwen2-moe"), 4, placement="round_robin")
    assert_invariants(plan)
    assert plan.placement.experts_on(1, 1) == [1, 5, 9]


def test_profile_placement_balances_load(tmp_path):
    spec = tiny()  # 8 experts
    hot = [100, 1, 1, 1, 90, 1, 1, 5]
    prof = tmp_path / "load.json"
    prof.write_text(json.dumps({"0": hot}))
    plan = compile_plan(spec, 2, placement="profile", load_profile=prof)
    assert_invariants(plan)
    row = plan.placement.expert_rank[0]
    assert row[0] != row[4]  # the two hot experts go to different ranks
    loads = [sum(hot[e] for e in range(8) if row[e] == r) for r in range(2)]
    assert max(loads) - min(loads) <= 5
    assert plan.placement.load[1] == [1.0] * 8  # layers missing from the profile: uniform
    # Balanced bin packing on uniform loads spreads the count evenly, even when it does not divide.
    owners = balanced([1.0] * 10, 4)
    assert sorted(owners.count(r) for r in range(4)) == [2, 2, 3, 3]


@pytest.mark.parametrize("profile, match", [
    (None, "needs a per-expert load file"),
    ([1, 2], "expected a list of 8 per-expert loads, got 2 entries"),
    ({"9": [1] * 8}, "layer 9 is not an MoE layer"),
    ([1, 2, 3, 4, 5, 6, 7, -1], r"field '\(top level\).7': load must be a number >= 0, got -1"),
    ("missing.json", "no such load profile file"),
])
def test_bad_load_profiles(tmp_path, profile, match):
    if isinstance(profile, str):
        profile = tmp_path / profile
    with pytest.raises(UserError, match=match):
        compile_plan(tiny(), 2, placement="profile", load_profile=profile)


@pytest.mark.parametrize("kwargs, match", [
    (dict(ranks=0), "option 'ranks': got 0; valid: an integer 1..1024"),
    (dict(ranks=5000), "option 'ranks': got 5000"),
    (dict(device="tpu"), "option 'device': got 'tpu'; valid: cpu, cuda"),
    (dict(placement="random"), "option 'placement': got 'random'"),
    (dict(attn_cap=0), "option 'attn_cap': got 0"),
    (dict(home_policy="x"), "option 'home_policy'"),
    (dict(device_memory_gib=-1.0), "option 'device_memory_gib'"),
])
def test_bad_options(kwargs, match):
    args = dict(ranks=2) | kwargs
    with pytest.raises(UserError, match=match):
        compile_plan(tiny(), **args)


def test_model_that_does_not_fit_names_rank_need_and_have():
    spec = load_spec(SPECS / "mixtral-8x7b.yaml")
    with pytest.raises(UserError) as err:
        compile_plan(spec, 2, device="cuda", device_memory_gib=24)
    msg = str(err.value)
    assert "does not fit 2 x cuda" in msg and "rank " in msg and "needs" in msg and "but has" in msg
    assert "--ranks" in msg and "--device-memory" in msg
    # With enough ranks the experts spread out and it fits.
    assert_invariants(compile_plan(spec, 8, device="cuda", device_memory_gib=24))


def test_buckets_follow_caps_and_graph_memory_counts_only_on_cuda():
    plan = compile_plan(tiny(), 2, attn_cap=100, expert_cap=64)
    assert plan.capture.buckets["attn"] == [1, 8, 40, 72, 100]
    assert plan.capture.buckets["expert"] == [64]
    assert not plan.capture.enabled and plan.capture.graph_memory_bytes == [0, 0]
    cuda = compile_plan(tiny(), 2, device="cuda", attn_cap=256)
    assert cuda.capture.buckets["attn"] == [1, 8, 40, 72, 104, 128, 192, 256]
    assert cuda.capture.buckets["expert"] == [128, 256, 512, 1024]
    assert all(b > 0 for b in cuda.capture.graph_memory_bytes)
    # One pool per (kind, bucket), shared by every layer of that kind.
    attn_pools = [p for p in cuda.capture.pools if p.kind == "attn"]
    assert len(attn_pools) == 8 and all(p.layers == [0, 1, 2] for p in attn_pools)
    # The default cap (1,024: a wave follows the load up to it) doubles past the published buckets.
    assert compile_plan(tiny(), 2, device="cuda").capture.buckets["attn"] == [1, 8, 40, 72, 104, 128, 192, 256, 512,
                                                                               1024]


def test_device_routed_expert_cap_holds_every_homes_whole_batch():
    """Device-routed expert batches count slots and a home sends its whole attention batch to every holder: the default
    cap holds every home's batch at once (ranks x attn cap x top-k), with doubling buckets above the published ones;
    host-routed plans and an explicit cap are unchanged."""
    spec = load_spec("models/specs/gpt-oss-20b.yaml")  # top-4
    two = compile_plan(spec, 2, device="cuda", dispatch="device", attn_cap=256)
    assert two.caps.expert_rows == 2 * 256 * 4 and two.capture.buckets["expert"] == [128, 256, 512, 1024, 2048]
    eight = compile_plan(spec, 8, device="cuda", dispatch="device", attn_cap=256)
    assert eight.capture.buckets["expert"] == [128, 256, 512, 1024, 2048, 4096, 8192]
    assert compile_plan(spec, 2, device="cuda", dispatch="device").caps.expert_rows == 2 * 1024 * 4  # the default cap
    assert compile_plan(spec, 2, device="cuda", dispatch="host").caps.expert_rows == 1024
    assert compile_plan(spec, 2, device="cuda", dispatch="device", expert_cap=1024).capture.buckets["expert"] == [
        128, 256, 512, 1024]
    assert compile_plan(spec, 2, device="cuda", dispatch="device", attn_cap=64).caps.expert_rows == 1024


def test_max_kv_tokens_caps_blocks():
    plan = compile_plan(tiny(), 2, max_kv_tokens=4000, block_size=32)
    assert plan.kv.num_blocks == [125, 125]
    assert_invariants(plan)


def test_save_load_roundtrip_and_version_check(tmp_path):
    plan = compile_plan(tiny("tiny-deepseek-v2"), 3, source="test")
    save_plan(plan, tmp_path / "p")
    assert load_plan(tmp_path / "p") == plan
    assert (tmp_path / "p" / "plan.txt").read_text().startswith("dataflow plan v1: tiny-deepseek-v2")
    data = json.loads((tmp_path / "p" / "plan.json").read_text())
    data["version"] = PLAN_VERSION + 1
    (tmp_path / "p" / "plan.json").write_text(json.dumps(data))
    with pytest.raises(UserError, match="plan version 2 is not supported"):
        load_plan(tmp_path / "p")
    with pytest.raises(UserError, match="no plan here"):
        load_plan(tmp_path / "empty")
    (tmp_path / "p" / "plan.json").write_text("{not json")
    with pytest.raises(UserError, match="not a readable plan JSON"):
        load_plan(tmp_path / "p")


def test_check_plan_catches_tampering():
    plan = compile_plan(tiny(), 2)
    plan.ranks[1].queues[1].experts.append(0)  # expert 0 now claimed by two ranks
    with pytest.raises(PlanInvariantError):
        check_plan(plan)
    plan = compile_plan(tiny(), 2)
    plan.routes.pop()
    with pytest.raises(PlanInvariantError, match="routes do not cover"):
        check_plan(plan)


# --- property test: random specs and cluster shapes either compile into a valid plan or fail cleanly.

@st.composite
def random_spec(draw):
    """Mostly valid specs (so compile runs), each knob occasionally wrong (so the errors run too)."""
    def rarely() -> bool:
        return draw(st.sampled_from([False] * 11 + [True]))

    layers = draw(st.integers(1, 5))
    kv = draw(st.integers(1, 4))
    heads = kv * draw(st.integers(1, 4)) + (1 if rarely() else 0)  # occasionally kv does not divide heads
    experts = draw(st.integers(1, 12))
    top_k = draw(st.integers(1, experts)) + (draw(st.integers(1, 3)) if rarely() else 0)
    if draw(st.booleans()):
        attention = dict(kind="mla", num_heads=heads, num_kv_heads=heads, head_dim=12,
                         kv_lora_rank=draw(st.integers(1, 16)), qk_nope_head_dim=8, qk_rope_head_dim=4,
                         v_head_dim=draw(st.integers(1, 12)))
    else:
        attention = dict(kind="gqa", num_heads=heads, num_kv_heads=kv, head_dim=draw(st.integers(1, 24)))
    dense = draw(st.lists(st.integers(0, layers - 1), max_size=layers - 1, unique=True))
    if rarely():
        dense.append(layers)  # out of range
    n_group = draw(st.sampled_from([1, 2, 4])) if rarely() else 1
    d = dict(name="rand", num_layers=layers, hidden_size=draw(st.integers(1, 128)),
             vocab_size=draw(st.integers(1, 600)), attention=attention,
             router=dict(scoring=draw(st.sampled_from(["softmax", "topk_softmax", "sigmoid"])),
                         n_group=n_group, topk_group=draw(st.integers(1, n_group))),
             experts=dict(num_experts=experts, top_k=top_k, intermediate_size=draw(st.integers(1, 96)),
                          shared_intermediate_size=draw(st.sampled_from([0, 16]))),
             dense_layers=dense, dtype=draw(st.sampled_from(["float32", "bfloat16"])))
    if dense and not rarely():
        d["dense_intermediate_size"] = draw(st.integers(1, 64))
    if rarely():
        d["surprise"] = 1  # unknown field
    return d


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(data=random_spec(), ranks=st.integers(-1, 80),
       placement=st.sampled_from(["contiguous", "round_robin", "profile", "contiguous", "bogus"]),
       mem=st.sampled_from([None, 0.001, 0.01, 1.0, None]), attn_cap=st.integers(1, 300),
       expert_cap=st.integers(1, 1100), block=st.integers(1, 64), profile_seed=st.integers(0, 5))
def test_property_compile_yields_valid_plan_or_user_error(data, ranks, placement, mem, attn_cap, expert_cap,
                                                          block, profile_seed):
    try:
        spec = spec_from_dict(data, "random.yaml")
    except UserError:
        event("spec rejected")
        return
    E = spec.experts.num_experts
    profile = [float((e * 7 + profile_seed) % 5) for e in range(E)] if placement == "profile" else None
    try:
        plan = compile_plan(spec, ranks, device="cpu", device_memory_gib=mem, placement=placement,
                            load_profile=profile, attn_cap=attn_cap, expert_cap=expert_cap, block_size=block,
                            min_kv_tokens=64)
    except UserError as err:
        assert str(err) and "\n" not in str(err)
        event("compile rejected")
        return
    event("plan compiled")
    assert_invariants(plan)
