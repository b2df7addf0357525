"""Every model feature through every executor, against the reference decoder: the safety net for adding a model.

A feature lives in models/ once (the stage functions of models/layers.py; the CUDA executor calls them, or kernels
registered as the implementation of one step whose torch reference is the model's own code). This test is what holds
that promise: each row below is a tiny model with one feature switched on (or one family whose math differs), and
each family's shipped tiny spec (models/specs/tiny-*.yaml: its features together), run as a serving workload by
- the torch executor (runtime/executors/torch_executor.py),
- the CUDA executor's CPU twin (the bucketed, padded, paged body the GPU captures in graphs) with host-routed dispatch,
- the CUDA executor's CPU twin with device-routed dispatch (the routing packed in the attention body, the experts'
  slots selected on the device),
and each request's greedy tokens must equal lab/reference.py's (up to a step whose top two logits nearly tie).
A feature added to models/ that an executor's path does not take shows up here as a row that fails on that executor.
Adding a spec feature: add a row.
"""
from __future__ import annotations

import copy
import random
from functools import lru_cache
from pathlib import Path

import pytest
import torch

from graph_ir.spec import ModelSpec, load_spec
from lowering.plan import compile_plan
from lab.reference import ReferenceDecoder
from models.weights import random_weights
from runtime.core.requests import Request
from runtime.drivers.cluster import RunOptions, run_workload

torch.set_num_threads(1)

BASE = dict(
    name="feature-matrix", family="custom", num_layers=2, hidden_size=32, vocab_size=96, max_position=256,
    # init_std 0.1 rather than the default 0.02: sharp enough attention and routing that every feature's row
    # changes the tokens (test_every_feature_changes_the_tokens), so a path that ignores it cannot pass
    rms_norm_eps=1e-6, dtype="float32", weights=dict(source="random", seed=0, init_std=0.1), eos_token_ids=[],
    attention=dict(kind="gqa", num_heads=4, num_kv_heads=2, head_dim=8, rope=dict(theta=10000.0)),
    router=dict(scoring="softmax", renormalize=True),
    experts=dict(num_experts=6, top_k=2, intermediate_size=16),
)
_MLA = dict(kind="mla", num_heads=4, num_kv_heads=4, head_dim=12, kv_lora_rank=16, qk_nope_head_dim=8,
            qk_rope_head_dim=4, v_head_dim=8, rope=dict(theta=10000.0, interleaved=True))
_YARN = dict(theta=10000.0, scaling="yarn", factor=4.0, original_max_position=64, beta_fast=32.0, beta_slow=1.0)

# feature -> what it changes in BASE (merged into it, dicts recursively)
FEATURES = {
    "gqa": {},
    "mla": {"attention": _MLA},
    "mla_q_lora": {"attention": {**_MLA, "q_lora_rank": 12}},
    "mla_yarn_mscale": {"attention": {**_MLA, "rope": {**_YARN, "interleaved": True, "mscale": 0.707,
                                                       "mscale_all_dim": 0.707}}},
    "sliding_window": {"attention": {"sliding_window": 4, "layer_types": ["sliding", "full"]}},
    "sinks": {"attention": {"sinks": True}},
    "qk_norm_head": {"attention": {"qk_norm": "head"}},
    "qk_norm_full": {"attention": {"qk_norm": "full"}},
    "qk_norm_after_rope": {"attention": {"qk_norm": "head", "qk_norm_after_rope": True}},
    "qkv_bias": {"attention": {"qkv_bias": True}},
    "o_bias": {"attention": {"o_bias": True}},
    "softmax_scale": {"attention": {"softmax_scale": 0.2}},
    "partial_rotary": {"attention": {"rope": {"theta": 10000.0, "partial_rotary_factor": 0.5}}},
    "rope_linear": {"attention": {"rope": {"theta": 10000.0, "scaling": "linear", "factor": 2.0}}},
    "rope_yarn": {"attention": {"rope": _YARN}},
    "router_softmax_no_renormalize": {"router": {"renormalize": False}},
    "router_softmax_grouped": {"router": {"n_group": 2, "topk_group": 1}},
    "router_topk_softmax": {"router": {"scoring": "topk_softmax", "renormalize": False}},
    "router_softmax_correction_bias": {"router": {"correction_bias": True}},
    "router_sigmoid": {"router": {"scoring": "sigmoid"}},
    "router_sigmoid_correction_bias_grouped": {"router": {"scoring": "sigmoid", "correction_bias": True,
                                                          "n_group": 2, "topk_group": 1}},
    "router_bias": {"router": {"bias": True}},
    "routed_scaling": {"router": {"routed_scaling": 2.5}},
    "activation_gptoss_glu": {"experts": {"activation": "gptoss_glu", "glu_alpha": 1.702, "glu_limit": 7.0}},
    "expert_bias": {"experts": {"bias": True}},
    "shared_expert": {"experts": {"shared_intermediate_size": 24}},
    "shared_expert_gate": {"experts": {"shared_intermediate_size": 24, "shared_gate": True}},
    "dense_layers": {"dense_layers": [0], "dense_intermediate_size": 40},
    "tie_embeddings": {"tie_embeddings": True},
    "family_gpt_oss_norm_weight_fp32": {"family": "gpt_oss"},
    "family_glm4_moe_router_fp32": {"family": "glm4_moe"},
    "family_minimax_m2_router_model_dtype": {"family": "minimax_m2", "router": {"scoring": "sigmoid",
                                                                                "correction_bias": True}},
    "embedding_multiplier": {"embedding_multiplier": 6.0},
    "residual_multiplier": {"residual_multiplier": 0.4, "experts": {"shared_intermediate_size": 24},
                            "dense_layers": [0], "dense_intermediate_size": 40},
    "logits_scaling": {"logits_scaling": 4.0},
}

# Rows whose math equals the base's in float32 (they differ in rounding or in bf16 only): here so that their code
# runs through every executor, not to tell their tokens apart.
SAME_IN_FP32 = {"router_topk_softmax",  # softmax over the top-k logits = top-k of the softmax, renormalized
                "family_gpt_oss_norm_weight_fp32", "family_glm4_moe_router_fp32",
                "logits_scaling"}  # dividing the logits keeps their argmax (it matters to sampling only)

SPECS = Path(__file__).resolve().parents[1] / "models" / "specs"
FAMILY_SPECS = sorted(p.stem for p in SPECS.glob("tiny-*.yaml"))

# (executor, dispatch option)
EXECUTORS = [("torch", "host"), ("torch", "device"), ("cuda", "host"), ("cuda", "device")]


def _merge(base: dict, over: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in over.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


@lru_cache(maxsize=None)
def feature_model(feature: str):
    return _served_model(ModelSpec.model_validate(_merge(BASE, {**FEATURES[feature], "name": f"fm-{feature}"})))


@lru_cache(maxsize=None)
def family_model(name: str):
    """A shipped tiny spec (one per family: models/specs/tiny-*.yaml), with the same prompts as the feature rows."""
    return _served_model(load_spec(SPECS / f"{name}.yaml"))


def _served_model(spec: ModelSpec):
    w = random_weights(spec)
    ref = ReferenceDecoder(spec, w)
    rng = random.Random(11)
    # a one-token prompt runs the decode (bucketed) path from its first step; the longer ones prompt chunks, and
    # outlive the sliding window
    prompts = [[rng.randrange(3, spec.vocab_size) for _ in range(n)] for n in (1, 6, 11)]
    want = [ref.generate(p, 5, ignore_eos=True) for p in prompts]
    return spec, w, prompts, want


def _margin(logits: torch.Tensor) -> float:
    v = torch.topk(logits.float(), 2).values
    return float(v[0] - v[1])


@pytest.mark.parametrize("executor,dispatch", EXECUTORS, ids=[f"{e}-{d}" for e, d in EXECUTORS])
@pytest.mark.parametrize("feature", list(FEATURES))
def test_feature_through_executor_equals_the_reference(feature, executor, dispatch, use_options):
    use_options(dispatch=dispatch)
    _served_equals_the_reference(feature, feature_model(feature), executor, dispatch)


@pytest.mark.parametrize("executor,dispatch", EXECUTORS, ids=[f"{e}-{d}" for e, d in EXECUTORS])
@pytest.mark.parametrize("name", FAMILY_SPECS)
def test_family_through_executor_equals_the_reference(name, executor, dispatch, use_options):
    """Each family's tiny spec, its features together, through every executor."""
    use_options(dispatch=dispatch)
    _served_equals_the_reference(name, family_model(name), executor, dispatch)


def _served_equals_the_reference(feature: str, model: tuple, executor: str, dispatch: str) -> None:
    spec, w, prompts, want = model
    reqs = [Request(i, f"r{i}", p, 5, ignore_eos=True, arrival=0.0) for i, p in enumerate(prompts)]
    plan = compile_plan(spec, 2)
    res = run_workload(plan, reqs, RunOptions(policy="defrag", executor=executor, kv_blocks=32, clock="virtual"),
                       weights=w)
    compared = 0
    for r, ref in zip(res.requests, want):
        for s, tok in enumerate(ref.tokens):
            if _margin(ref.logits[s]) < 1e-3:
                break
            assert r.output[s] == tok, (f"{feature} on {executor} ({dispatch}-routed): {r.name} step {s}: "
                                        f"{r.output} vs the reference's {ref.tokens}")
            compared += 1
    assert compared >= 5


def test_every_feature_changes_the_tokens():
    """A row whose reference tokens equal the base model's would pass on a path that ignores its feature."""
    base = [r.tokens for r in feature_model("gqa")[3]]
    same = [f for f in FEATURES if f != "gqa" and [r.tokens for r in feature_model(f)[3]] == base]
    assert sorted(same) == sorted(SAME_IN_FP32)
