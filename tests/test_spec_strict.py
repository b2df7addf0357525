"""A spec never computes something other than what it says (issue 32).

1. Every field combination the math would ignore is refused with one line naming the field and what is supported
   (graph_ir/spec_checks.py), and for each such combination the premise is checked too: with the rule switched off,
   the reference decoder's logits are exactly those of the spec without the field, i.e. the math really ignores it
   (a rule whose premise stops holding, because the math learned the feature, fails here and should go).
2. A YAML spec naming a checkpoint is cross-checked against the checkpoint's config.json field by field
   (models/checkpoint.py check_checkpoint, called by `dataflow compile` and `dataflow run`).
"""
from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest
import torch
import yaml

import graph_ir.spec_checks as spec_checks
from graph_ir.errors import UserError
from graph_ir.spec import load_spec, spec_from_dict
from lowering.plan import compile_plan

SPECS = Path(__file__).resolve().parents[1] / "models" / "specs"

BASE = dict(
    name="strict", family="custom", num_layers=2, hidden_size=32, vocab_size=64, max_position=256,
    rms_norm_eps=1e-6, dtype="float32", weights=dict(source="random", seed=0, init_std=0.1),
    attention=dict(kind="gqa", num_heads=4, num_kv_heads=2, head_dim=8, rope=dict(theta=10000.0)),
    router=dict(scoring="softmax", renormalize=True),
    experts=dict(num_experts=6, top_k=2, intermediate_size=16),
)
MLA = dict(kind="mla", num_heads=4, num_kv_heads=4, head_dim=12, kv_lora_rank=16, qk_nope_head_dim=8,
           qk_rope_head_dim=4, v_head_dim=8, rope=dict(theta=10000.0, interleaved=True))
YARN = dict(theta=10000.0, scaling="yarn", factor=4.0, original_max_position=64)


def _merge(base: dict, edit: dict) -> dict:
    out = copy.deepcopy(base)
    for k, v in edit.items():
        out[k] = _merge(out[k], v) if isinstance(v, dict) and isinstance(out.get(k), dict) else copy.deepcopy(v)
    return out


# rule -> (the spec the math computes (an edit of BASE), the field combination it ignores (an edit of that),
#          what the one-line error must contain, whether the premise is checked on logits)
RULES = {
    "topk-softmax-correction-bias": ({"router": {"scoring": "topk_softmax"}}, {"router": {"correction_bias": True}},
                                     ["router.correction_bias", "topk_softmax", "supported"], True),
    "topk-softmax-groups": ({"router": {"scoring": "topk_softmax"}}, {"router": {"n_group": 2, "topk_group": 1}},
                            ["router.n_group 2", "topk_softmax", "no group limit", "supported"], True),
    "sigmoid-one-expert-groups": ({"router": {"scoring": "sigmoid"}}, {"router": {"n_group": 6, "topk_group": 2}},
                                  ["router.n_group 6", "1 expert per group", "valid: n_group <= 3"], False),
    "qk-norm-after-rope-none": ({}, {"attention": {"qk_norm_after_rope": True}},
                                ["attention.qk_norm_after_rope", "qk_norm none", "supported: qk_norm head"], True),
    "qk-norm-after-rope-full": ({"attention": {"qk_norm": "full"}}, {"attention": {"qk_norm_after_rope": True}},
                                ["attention.qk_norm_after_rope", "qk_norm full"], True),
    "mla-qk-norm": ({"attention": MLA}, {"attention": {"qk_norm": "head"}},
                    ["attention.qk_norm head", "kind mla", "supported with mla: qk_norm none"], True),
    "mla-qk-norm-full": ({"attention": MLA}, {"attention": {"qk_norm": "full"}},
                         ["attention.qk_norm full", "kind mla"], True),
    "mla-head-dim": ({"attention": MLA}, {"attention": {"head_dim": 16}},
                     ["attention.head_dim 16", "kind mla", "valid: qk_nope_head_dim + qk_rope_head_dim = 12"], True),
    "mla-partial-rotary": ({"attention": MLA}, {"attention": {"rope": {"partial_rotary_factor": 0.5}}},
                           ["attention.rope.partial_rotary_factor 0.5", "kind mla", "supported with mla: 1"], True),
    "gqa-mla-fields": ({}, {"attention": {"kv_lora_rank": 16, "v_head_dim": 8}},
                       ["attention.kv_lora_rank", "kind is gqa", "kind: mla only"], True),
    "window-no-sliding-layer": ({"attention": {"layer_types": ["full", "full"]}}, {"attention": {"sliding_window": 4}},
                                ["attention.sliding_window 4", "no 'sliding' layer", "supported"], True),
    "factor-without-scaling": ({}, {"attention": {"rope": {"factor": 4.0}}},
                               ["attention.rope.factor 4", "scaling none", "supported: scaling linear or yarn"], True),
    "mla-factor-without-scaling": ({"attention": MLA}, {"attention": {"rope": {"factor": 4.0}}},
                                   ["attention.rope.factor 4", "scaling none"], True),
    "original-max-position-linear": ({"attention": {"rope": {"scaling": "linear", "factor": 2.0}}},
                                     {"attention": {"rope": {"original_max_position": 64}}},
                                     ["attention.rope.original_max_position 64", "scaling linear",
                                      "with scaling yarn only"], True),
    "beta-fast-without-yarn": ({}, {"attention": {"rope": {"beta_fast": 16.0}}},
                               ["attention.rope.beta_fast 16", "scaling none", "yarn only"], True),
    "beta-slow-linear": ({"attention": {"rope": {"scaling": "linear", "factor": 2.0}}},
                         {"attention": {"rope": {"beta_slow": 2.0}}}, ["attention.rope.beta_slow 2", "yarn only"], True),
    "truncate-without-yarn": ({}, {"attention": {"rope": {"truncate": False}}},
                              ["attention.rope.truncate false", "yarn only"], True),
    "yarn-beta-fast-zero": ({"attention": {"rope": {**YARN, "beta_fast": 32.0}}},
                            {"attention": {"rope": {"beta_fast": 0.0}}},
                            ["attention.rope.beta_fast 0", "read as the default 32"], True),
    "mscale-alone": ({"attention": {"rope": YARN}}, {"attention": {"rope": {"mscale": 0.8}}},
                     ["attention.rope.mscale 0.8", "together with mscale_all_dim", "supported"], True),
    "mscale-without-yarn": ({"attention": {"rope": {"scaling": "linear", "factor": 2.0}}},
                            {"attention": {"rope": {"mscale": 0.8, "mscale_all_dim": 0.8}}},
                            ["attention.rope.mscale 0.8", "scaling linear"], True),
    "mscale-all-dim-gqa": ({"attention": {"rope": YARN}}, {"attention": {"rope": {"mscale_all_dim": 0.8}}},
                           ["attention.rope.mscale_all_dim 0.8", "kind gqa"], True),
    "mscale-all-dim-explicit-scale": ({"attention": {**MLA, "softmax_scale": 0.3, "rope": {**YARN, "interleaved": True}}},
                                      {"attention": {"rope": {"mscale_all_dim": 0.8}}},
                                      ["attention.rope.mscale_all_dim 0.8", "softmax_scale 0.3"], True),
    "mscale-zero": ({"attention": {**MLA, "rope": {**YARN, "interleaved": True, "mscale_all_dim": 0.8}}},
                    {"attention": {"rope": {"mscale": 0.0}}}, ["attention.rope.mscale 0", "read as unset"], True),
    "glu-alpha-silu": ({}, {"experts": {"glu_alpha": 2.0}},
                       ["experts.glu_alpha 2", "activation silu_glu", "gptoss_glu only"], True),
    "glu-limit-silu": ({}, {"experts": {"glu_limit": 3.0}}, ["experts.glu_limit 3", "gptoss_glu only"], True),
    "dense-size-no-dense-layer": ({}, {"dense_intermediate_size": 40},
                                  ["dense_intermediate_size 40", "dense_layers is empty", "supported"], True),
    "path-with-random-weights": ({}, {"weights": {"path": "/ckpt"}},
                                 ["weights.path '/ckpt'", "source random", "supported: source checkpoint"], False),
    "seed-with-checkpoint": ({"weights": {"source": "checkpoint", "path": "/ckpt", "init_std": 0.02}},
                             {"weights": {"seed": 3}}, ["weights.seed 3", "source checkpoint", "random only"], False),
    "init-std-with-checkpoint": ({"weights": {"source": "checkpoint", "path": "/ckpt", "init_std": 0.02}},
                                 {"weights": {"init_std": 0.5}}, ["weights.init_std 0.5", "random only"], False),
}


@pytest.mark.parametrize("rule", list(RULES))
def test_ignored_field_is_refused_in_one_line(rule, tmp_path):
    clean, ignored, needles, _ = RULES[rule]
    good = _merge(BASE, clean)
    spec_from_dict(good)  # what the math computes is a valid spec...
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump(_merge(good, ignored)))
    with pytest.raises(UserError) as err:  # ...and the same with the ignored field is not
        load_spec(p)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(f"{p}: ")
    for needle in needles:
        assert needle in msg, f"{rule}: {needle!r} not in {msg!r}"


def _unchecked(data: dict, monkeypatch):
    """The spec as the math would run it if the rules were off."""
    with monkeypatch.context() as m:
        m.setattr(spec_checks, "refuse_ignored_fields", lambda spec: None)
        return spec_from_dict(data)


@pytest.mark.parametrize("rule", [r for r, v in RULES.items() if v[3]])
def test_refused_field_is_really_ignored_by_the_math(rule, monkeypatch):
    """The premise of each rule: the reference decoder's logits with the field are those without it, bit for bit."""
    from lab.reference import ReferenceDecoder
    from models.weights import random_weights

    clean, ignored, _, _ = RULES[rule]
    good = spec_from_dict(_merge(BASE, clean))
    bad = _unchecked(_merge(_merge(BASE, clean), ignored), monkeypatch)
    w = random_weights(bad, seed=1)  # the ignored spec's tensors (a superset where it adds any)
    prompt = [3, 17, 5, 40, 9, 22, 11, 1, 60, 33, 7, 2]
    want = ReferenceDecoder(good, w).forward_logits(prompt)
    got = ReferenceDecoder(bad, w).forward_logits(prompt)
    assert torch.equal(want, got), f"{rule}: the math reads the field after all; drop the rule"


ACCEPTED = {
    # each field where the math does read it
    "sigmoid-correction-bias-groups": {"router": {"scoring": "sigmoid", "correction_bias": True, "n_group": 2,
                                                  "topk_group": 1}},
    "softmax-groups": {"router": {"n_group": 3, "topk_group": 2}},
    "softmax-correction-bias": {"router": {"correction_bias": True}},
    "qk-norm-after-rope": {"attention": {"qk_norm": "head", "qk_norm_after_rope": True}},
    "softmax-correction-bias-groups": {"router": {"correction_bias": True, "n_group": 3, "topk_group": 2}},
    "topk-softmax-any-renormalize": {"router": {"scoring": "topk_softmax", "renormalize": False}},
    "mla-yarn-mscale-pair": {"attention": {**MLA, "rope": {**YARN, "interleaved": True, "mscale": 0.707,
                                                           "mscale_all_dim": 0.707}}},
    "mla-scaled-rope-mscale-all-dim": {"attention": {**MLA, "rope": {**YARN, "interleaved": True,
                                                                     "mscale_all_dim": 0.8}}},
    "mla-linear-mscale-all-dim": {"attention": {**MLA, "rope": {"scaling": "linear", "factor": 2.0,
                                                                "interleaved": True, "mscale_all_dim": 0.8}}},
    "gqa-yarn-mscale-pair": {"attention": {"rope": {**YARN, "mscale": 1.0, "mscale_all_dim": 0.8, "truncate": False,
                                                    "beta_fast": 16.0, "beta_slow": 2.0}}},
    "linear-factor": {"attention": {"rope": {"scaling": "linear", "factor": 2.0}}},
    "window-every-layer": {"attention": {"sliding_window": 4}},
    "window-some-layers": {"attention": {"sliding_window": 4, "layer_types": ["full", "sliding"]}},
    "gptoss-glu-knobs": {"experts": {"activation": "gptoss_glu", "glu_alpha": 2.0, "glu_limit": 3.0}},
    "dense-layer": {"dense_layers": [0], "dense_intermediate_size": 40},
    "checkpoint-weights": {"weights": {"source": "checkpoint", "path": "/ckpt", "init_std": 0.02}},
}


@pytest.mark.parametrize("case", list(ACCEPTED))
def test_fields_the_math_reads_are_accepted(case):
    spec_from_dict(_merge(BASE, ACCEPTED[case]))


# Ranks a big spec needs beyond 8 x 132 GiB (bf16 DeepSeek-V3 671B: 16).
BIG_RANKS = {"deepseek-v3": 16}


@pytest.mark.parametrize("path", sorted(SPECS.glob("*.yaml")), ids=lambda p: p.stem)
def test_every_shipped_spec_loads_and_compiles(path):
    spec = load_spec(path)
    tiny = path.stem.startswith("tiny")
    compile_plan(spec, 2 if tiny else BIG_RANKS.get(path.stem, 8), "cpu" if tiny else "cuda")


# ---------------------------------------------------------------- a YAML naming a checkpoint vs its config.json

MIXTRAL = dict(architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=48, intermediate_size=64,
               num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
               num_experts_per_tok=2, vocab_size=300, rms_norm_eps=1e-5, rope_theta=1000000.0,
               max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=2, torch_dtype="float32")
# DeepSeek-V2 with YaRN and mscale_all_dim alone: config.json implies an explicit softmax scale.
DEEPSEEK = dict(architectures=["DeepseekV2ForCausalLM"], model_type="deepseek_v2", hidden_size=32,
                intermediate_size=40, moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=4, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=4,
                v_head_dim=8, n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1,
                vocab_size=64, max_position_embeddings=256, torch_dtype="float32",
                rope_scaling={"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 64,
                              "mscale_all_dim": 0.8})


def _checkpoint(tmp_path: Path, config: dict) -> Path:
    """A config.json-only checkpoint: the cross-check reads no tensor (compile then notes the missing weights)."""
    d = tmp_path / "hf"
    d.mkdir()
    (d / "config.json").write_text(json.dumps(config))
    return d


def _yaml_of(ckpt: Path, tmp_path: Path, edit=None, name: str = "m.yaml") -> Path:
    """The YAML a user would write for the checkpoint: what it imports as, with weights pointing at it."""
    from models.checkpoint import import_spec

    data = import_spec(ckpt).model_dump(mode="json")
    data["name"] = "mine"
    if edit:
        edit(data)
    p = tmp_path / name
    p.write_text(yaml.safe_dump(data, sort_keys=False))
    return p


def _compile(monkeypatch, capsys, *args):
    from test_cli_compile import run
    return run(monkeypatch, capsys, "compile", *args)


def test_matching_yaml_compiles(tmp_path, monkeypatch, capsys):
    ckpt = _checkpoint(tmp_path, MIXTRAL)
    code, _, err = _compile(monkeypatch, capsys, str(_yaml_of(ckpt, tmp_path)), "-o", str(tmp_path / "p"))
    assert code == 0, err
    assert "no *.safetensors" in err  # the note of a config-only checkpoint, not a mismatch


def test_fields_free_to_differ_compile(tmp_path, monkeypatch, capsys):
    """Name, stop ids, max_position and dtype change no tensor and no forward math: a YAML may set its own."""
    ckpt = _checkpoint(tmp_path, MIXTRAL)

    def edit(d):
        d.update(dtype="bfloat16", max_position=128, eos_token_ids=[5, 6])
    code, _, err = _compile(monkeypatch, capsys, str(_yaml_of(ckpt, tmp_path, edit)), "-o", str(tmp_path / "p"))
    assert code == 0, err


def test_rope_theta_mismatch_names_both_values(tmp_path, monkeypatch, capsys):
    """The issue's case: a Mixtral checkpoint re-declared with the default rope theta."""
    ckpt = _checkpoint(tmp_path, MIXTRAL)
    yml = _yaml_of(ckpt, tmp_path, lambda d: d["attention"]["rope"].pop("theta"))
    code, out, err = _compile(monkeypatch, capsys, str(yml), "-o", str(tmp_path / "p"))
    assert code == 2 and "Traceback" not in out + err
    lines = err.strip().splitlines()
    assert len(lines) == 1, err
    assert (f"{yml}: field 'attention.rope.theta': the YAML says 10000, {ckpt / 'config.json'} says 1000000"
            in lines[0]), lines[0]


MISMATCHES = {
    "family": (lambda d: d.update(family="custom"), "field 'family': the YAML says custom", "says mixtral"),
    "eps": (lambda d: d.update(rms_norm_eps=1e-6), "field 'rms_norm_eps': the YAML says 1e-06", "says 1e-05"),
    "top_k": (lambda d: d["experts"].update(top_k=3), "field 'experts.top_k': the YAML says 3", "says 2"),
    "renormalize": (lambda d: d["router"].update(renormalize=False), "field 'router.renormalize': the YAML says false",
                    "says true"),
    "window": (lambda d: d["attention"].update(sliding_window=16), "field 'attention.sliding_window': the YAML says "
               "window 16 on every layer", "says no sliding window"),
    "tie": (lambda d: d.update(tie_embeddings=True), "field 'tie_embeddings': the YAML says true", "says false"),
    "rope-scaling": (lambda d: d["attention"]["rope"].update(scaling="linear", factor=2.0),
                     "field 'attention.rope.scaling': the YAML says linear", "says none"),
}


@pytest.mark.parametrize("case", list(MISMATCHES))
def test_math_field_mismatch_is_refused(case, tmp_path):
    from models.checkpoint import SpecCheckpointMismatch, check_checkpoint

    edit, mine, theirs = MISMATCHES[case]
    ckpt = _checkpoint(tmp_path, MIXTRAL)
    yml = _yaml_of(ckpt, tmp_path, edit)
    with pytest.raises(SpecCheckpointMismatch) as err:
        check_checkpoint(ckpt, require_weights=False, spec=load_spec(yml), source=str(yml))
    msg = str(err.value)
    assert "\n" not in msg and mine in msg and theirs in msg, msg


def test_every_mismatch_is_listed(tmp_path):
    from models.checkpoint import spec_mismatches, import_spec

    ckpt = _checkpoint(tmp_path, MIXTRAL)

    def edit(d):
        d["attention"]["rope"]["theta"] = 500.0
        d["experts"]["intermediate_size"] = 32
    bad = spec_mismatches(load_spec(_yaml_of(ckpt, tmp_path, edit)), import_spec(ckpt))
    assert sorted(f for f, _, _ in bad) == ["attention.rope.theta", "experts.intermediate_size"]


def test_mismatch_at_run_names_the_spec(tmp_path):
    """`dataflow run` checks the plan's spec (no YAML at hand): the message says 'the spec'."""
    from models.checkpoint import SpecCheckpointMismatch, check_checkpoint

    ckpt = _checkpoint(tmp_path, MIXTRAL)
    spec = load_spec(_yaml_of(ckpt, tmp_path, lambda d: d["experts"].update(top_k=1)))
    with pytest.raises(SpecCheckpointMismatch, match=r"^mine: field 'experts.top_k': the spec says 1, .* says 2"):
        check_checkpoint(ckpt, require_weights=False, spec=spec)


def test_equivalent_forms_of_the_same_math_match(tmp_path, monkeypatch, capsys):
    """The YAML may say a derived value as the math derives it: DeepSeek's softmax scale left to mscale_all_dim
    (config.json's import writes it out), a window on every layer without layer_types."""
    ckpt = _checkpoint(tmp_path, DEEPSEEK)

    def edit(d):
        d["attention"].pop("softmax_scale")
        d["attention"]["rope"]["mscale_all_dim"] = 0.8
    yml = _yaml_of(ckpt, tmp_path, edit)
    assert load_spec(yml).attention.softmax_scale is None
    code, _, err = _compile(monkeypatch, capsys, str(yml), "-o", str(tmp_path / "p"))
    assert code == 0, err

    # and a different mscale_all_dim is a different softmax scale: refused, naming it
    def edit2(d):
        edit(d)
        d["attention"]["rope"]["mscale_all_dim"] = 0.5
    yml2 = _yaml_of(ckpt, tmp_path, edit2, name="m2.yaml")
    code, _, err = _compile(monkeypatch, capsys, str(yml2), "-o", str(tmp_path / "p2"))
    assert code == 2 and "field 'attention.softmax_scale': the YAML says" in err, err


def test_checkpoint_dir_itself_is_not_cross_checked_against_itself(tmp_path, monkeypatch, capsys):
    ckpt = _checkpoint(tmp_path, MIXTRAL)
    code, _, err = _compile(monkeypatch, capsys, str(ckpt), "-o", str(tmp_path / "p"))
    assert code == 0, err
