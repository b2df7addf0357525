"""Field combinations the model math would silently ignore, refused when a ModelSpec is validated.

A spec must never compute something other than what it says. Each rule below is a field that the math in
models/attention.py, models/rope.py, models/moe.py and models/weights.py reads only under some condition: set
outside that condition it would change nothing, so the spec is refused with one line naming the field, its value
and what is supported. `ModelSpec._check` calls `refuse_ignored_fields` after its own shape checks.

This module does not import graph_ir.spec (spec.py imports it): the spec arrives duck-typed.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from graph_ir.spec import AttentionSpec, ModelSpec, RopeSpec

# Fields of AttentionSpec that only `kind: mla` reads (models/attention.py mla_qkv, models/weights.py).
MLA_ONLY = ("q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
# Fields of RopeSpec that only `scaling: yarn` reads (models/rope.py _yarn), with their defaults.
YARN_ONLY = {"original_max_position": None, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": True}


def _v(value) -> str:
    """A value as a YAML author wrote it: 10000 rather than 10000.0, true/false, null."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, float) and value.is_integer() and abs(value) < 1e15:
        return str(int(value))
    return str(value)


def _read_only_with(section: str, obj, defaults: dict, switch: str, reader: str) -> None:
    """Refuse a field of `defaults` set to another value while `obj.<switch>` is not `reader`, the only value under
    which the math reads it (the caller tests that)."""
    for f, default in defaults.items():
        if getattr(obj, f) != default:
            raise ValueError(f"{section}.{f} {_v(getattr(obj, f))} with {section}.{switch} {getattr(obj, switch)} is "
                             f"not read; supported: {f} with {switch} {reader} only")


def refuse_ignored_fields(spec: "ModelSpec") -> None:
    """Raise ValueError (pydantic turns it into the spec's validation error) for the first field the math would
    ignore under the rest of the spec."""
    _attention(spec.attention)
    _rope(spec.attention)
    _router(spec)
    _experts(spec)
    _weights(spec)


def _attention(a: "AttentionSpec") -> None:
    if a.kind == "gqa":
        # gqa_project / layer_shapes read head_dim and never the latent-attention sizes.
        set_mla = [f"{f} {getattr(a, f)}" for f in MLA_ONLY if getattr(a, f) is not None]
        if set_mla:
            raise ValueError(f"attention.{set_mla[0].split()[0]} is set ({', '.join(set_mla)}) but attention.kind "
                             f"is gqa, which does not read it; supported: these fields with kind: mla only")
    else:
        # mla_qkv normalizes only the q / kv latents (q_a_norm, kv_a_norm): no per-head or full q/k norm.
        if a.qk_norm != "none":
            raise ValueError(f"attention.qk_norm {a.qk_norm} with kind mla: latent attention applies no q/k norm; "
                             f"supported with mla: qk_norm none")
        # MLA's head sizes are qk_nope_head_dim + qk_rope_head_dim (queries/keys) and v_head_dim (values);
        # head_dim is not read, so it must state the one value consistent with them.
        want = a.qk_nope_head_dim + a.qk_rope_head_dim
        if a.head_dim != want:
            raise ValueError(f"attention.head_dim {a.head_dim} with kind mla: latent attention does not read it; "
                             f"valid: qk_nope_head_dim + qk_rope_head_dim = {want}")
        # mla_qkv rotates all qk_rope_head_dim channels of the rope part.
        if a.rope.partial_rotary_factor != 1:
            raise ValueError(f"attention.rope.partial_rotary_factor {_v(a.rope.partial_rotary_factor)} with kind mla: "
                             f"latent attention rotates all qk_rope_head_dim ({a.qk_rope_head_dim}) channels; "
                             f"supported with mla: 1")
    # gqa_qkv moves the per-head norm after RoPE; no other norm placement exists.
    if a.qk_norm_after_rope and a.qk_norm != "head":
        raise ValueError(f"attention.qk_norm_after_rope true with attention.qk_norm {a.qk_norm}: only the per-head "
                         f"norm can follow RoPE; supported: qk_norm head, or qk_norm_after_rope false")
    # AttentionSpec.window: with layer_types given, only the 'sliding' layers use sliding_window.
    if a.sliding_window is not None and a.layer_types is not None and "sliding" not in a.layer_types:
        raise ValueError(f"attention.sliding_window {a.sliding_window} is set but attention.layer_types has no "
                         f"'sliding' layer, so no layer uses it; supported: a 'sliding' entry in layer_types, or "
                         f"no layer_types (every layer slides)")


def _rope(a: "AttentionSpec") -> None:
    r: "RopeSpec" = a.rope
    scaling = r.scaling
    # rope_parameters reads factor for linear and yarn; softmax_scale (MLA) only when scaling is not none.
    if scaling == "none" and r.factor != 1:
        raise ValueError(f"attention.rope.factor {_v(r.factor)} with rope.scaling none is not read; supported: "
                         f"scaling linear or yarn for a factor")
    if scaling != "yarn":
        _read_only_with("attention.rope", r, YARN_ONLY, "scaling", "yarn")
    else:
        for f in ("beta_fast", "beta_slow"):
            if getattr(r, f) == 0:
                # models/rope.py (as HF) reads a 0 as the default (`beta_fast or 32`).
                raise ValueError(f"attention.rope.{f} 0 is read as the default {_v(YARN_ONLY[f])}; valid: a nonzero "
                                 f"value")
    for f in ("mscale", "mscale_all_dim"):
        if getattr(r, f) == 0:
            # Both places that read them test truthiness, as HF does: a 0 is the same as unset.
            raise ValueError(f"attention.rope.{f} 0 is read as unset; valid: a nonzero value, or leave it out")
    # _yarn uses the mscale / mscale_all_dim ratio only with scaling yarn and both set (HF's rule).
    yarn_pair = scaling == "yarn" and r.mscale is not None and r.mscale_all_dim is not None
    # softmax_scale: MLA with a scaled rope and no explicit scale multiplies by mscale(factor, mscale_all_dim)^2.
    mla_temp = a.kind == "mla" and scaling != "none" and a.softmax_scale is None and r.mscale_all_dim is not None
    if r.mscale is not None and not yarn_pair:
        raise ValueError(f"attention.rope.mscale {_v(r.mscale)} is not read: it is used only with rope.scaling yarn "
                         f"together with mscale_all_dim (got scaling {scaling}, mscale_all_dim "
                         f"{_v(r.mscale_all_dim)}); supported: both set with yarn, or neither")
    if r.mscale_all_dim is not None and not (yarn_pair or mla_temp):
        raise ValueError(f"attention.rope.mscale_all_dim {_v(r.mscale_all_dim)} is not read: it is used with "
                         f"rope.scaling yarn together with mscale, or by kind mla with a scaled rope and no explicit "
                         f"softmax_scale (got kind {a.kind}, scaling {scaling}, mscale {_v(r.mscale)}, softmax_scale "
                         f"{_v(a.softmax_scale)})")


def _router(spec: "ModelSpec") -> None:
    r, E = spec.router, spec.experts.num_experts
    # route_tokens adds correction_bias to the selection scores of softmax and sigmoid scoring; topk_softmax selects
    # on the raw logits.
    if r.correction_bias and r.scoring == "topk_softmax":
        raise ValueError("router.correction_bias true with router.scoring topk_softmax: the bias steers selection "
                         "only for softmax and sigmoid scoring; supported: scoring softmax or sigmoid, or "
                         "correction_bias false")
    # topk_softmax takes the top-k of the raw logits with no group limit.
    if r.n_group > 1 and r.scoring == "topk_softmax":
        raise ValueError(f"router.n_group {r.n_group} / topk_group {r.topk_group} with router.scoring topk_softmax: "
                         f"no group limit is applied; supported: group-limited top-k with scoring softmax or "
                         f"sigmoid, or n_group 1")
    # sigmoid scores a group by the sum of its two best experts (DeepSeek-V3 / GLM noaux_tc).
    if r.n_group > 1 and r.scoring == "sigmoid" and E // r.n_group < 2:
        raise ValueError(f"router.n_group {r.n_group} leaves {E // r.n_group} expert per group of the "
                         f"{E} experts: sigmoid scoring ranks a group by the sum of its 2 best experts; valid: "
                         f"n_group <= {E // 2}")


def _experts(spec: "ModelSpec") -> None:
    ex = spec.experts
    if ex.activation != "gptoss_glu":
        # glu reads alpha / limit for the clamped GPT-OSS SwiGLU only.
        _read_only_with("experts", ex, {"glu_alpha": 1.702, "glu_limit": 7.0}, "activation", "gptoss_glu")
    # layer_shapes sizes the dense MLP of dense layers only.
    if spec.dense_intermediate_size is not None and not spec.dense_layers:
        raise ValueError(f"dense_intermediate_size {spec.dense_intermediate_size} is set but dense_layers is empty, "
                         f"so no layer uses it; supported: dense_layers listing the dense layers, or leave "
                         f"dense_intermediate_size out")


def _weights(spec: "ModelSpec") -> None:
    w = spec.weights
    if w.source == "random" and w.path is not None:
        raise ValueError(f"weights.path {w.path!r} with weights.source random is not read; supported: source "
                         f"checkpoint to load it, or leave path out")
    if w.source == "checkpoint":
        # random_weights is the only reader of seed and init_std.
        _read_only_with("weights", w, {"seed": 0, "init_std": 0.02}, "source", "random")
