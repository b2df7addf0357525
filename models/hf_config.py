"""Hugging Face `config.json` -> `ModelSpec`, for the MoE families we implement.

Every default here was read off the installed transformers (5.x) `configuration_*.py` and
`modeling_*.py` of each family, because published checkpoints omit keys whose value is the
default: an absent key must mean exactly what transformers would do with it. transformers itself is
deliberately not imported (it is a test-only dependency); the tests compare against it.

Both config dialects are read:
- older keys written by published checkpoints: `rope_theta`, `rope_scaling` with `type` or
  `rope_type`, top-level `partial_rotary_factor`, `torch_dtype`;
- transformers 5 keys: `rope_parameters` (theta and partial factor inside), `dtype`.

A setting we cannot represent (a rope type we do not implement, OLMoE's `clip_qkv`, biases on MLA
projections, ...) that is set to a non-default value is a `UserError` naming config.json and the
key, never silently dropped: a silently wrong model is worse than one that refuses to load.
"""
from __future__ import annotations

import json
import math
import warnings
from pathlib import Path
from typing import Any, Callable, Optional

from graph_ir.errors import UserError
from graph_ir.spec import ModelSpec, spec_from_dict
from models.rope import yarn_get_mscale
from models import hf_families, hf_keys

# `architectures[0]` -> our family name. model_type is the fallback when `architectures` is absent.
ARCHITECTURES = {
    "MixtralForCausalLM": "mixtral",
    "Qwen2MoeForCausalLM": "qwen2_moe",
    "Qwen3MoeForCausalLM": "qwen3_moe",
    "OlmoeForCausalLM": "olmoe",
    "GptOssForCausalLM": "gpt_oss",
    "Glm4MoeForCausalLM": "glm4_moe",
    "DeepseekV2ForCausalLM": "deepseek_v2",
    **hf_families.ARCHITECTURES,
}

# What transformers' rope validation accepts as keys of a rope dict; anything else inside the rope
# dict would be a setting we do not know how to honour.
_ROPE_KEYS = {
    "default": set(),
    "linear": {"factor"},
    "yarn": {"factor", "original_max_position_embeddings", "attention_factor", "beta_fast", "beta_slow",
             "mscale", "mscale_all_dim", "truncate"},
}
_ROPE_COMMON_KEYS = {"rope_type", "type", "rope_theta", "partial_rotary_factor"}

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16",
           "fp32": "float32", "bf16": "bfloat16", "fp16": "float16", "float": "float32", "half": "float16"}


class _Cfg:
    """config.json as a dict, with getters that name the file and key in every error."""

    def __init__(self, data: dict, source: str):
        self.data = data
        self.source = source
        self.read: set[str] = set()  # every key a mapping looked at (models/hf_keys.py: the others)

    def has(self, key: str) -> bool:
        self.read.add(key)
        return self.data.get(key) is not None

    def get(self, key: str, default: Any = None) -> Any:
        self.read.add(key)
        value = self.data.get(key)
        return default if value is None else value

    def require(self, key: str) -> Any:
        self.read.add(key)
        if self.data.get(key) is None:
            raise UserError(f"{self.source}: missing required key '{key}'")
        return self.data[key]

    def _typed(self, key: str, default: Any, required: bool, types: tuple[type, ...], what: str) -> Any:
        """The value of `key` (None when absent and no default), refused unless of `types` (never a bool)."""
        value = self.require(key) if required else self.get(key, default)
        if value is not None and (isinstance(value, bool) or not isinstance(value, types)):
            raise self.fail(f"'{key}' must be {what}, got {value!r}")
        return value

    def int(self, key: str, default: Any = None, *, required: bool = False) -> Optional[int]:
        return self._typed(key, default, required, (int,), "an integer")

    def float(self, key: str, default: Any = None) -> Optional[float]:
        value = self._typed(key, default, False, (int, float), "a number")
        return None if value is None else float(value)

    def alias(self, keys: tuple[str, ...], default: Optional[int]) -> int:
        """An integer stored under any of `keys`: transformers' config `attribute_map` lets the same
        setting be written under two names (e.g. Qwen3-MoE saves `num_local_experts` while published
        configs say `num_experts`). The first key present wins; none present: `default`, or with a None default
        a missing required key (named by `keys[0]`)."""
        for k in keys:
            if self.has(k):
                return self.int(k)
        if default is None:
            raise self.fail(f"missing required key '{keys[0]}'")
        return default

    def bool(self, key: str, default: bool) -> bool:
        value = self.get(key, default)
        if not isinstance(value, bool):
            raise UserError(f"{self.source}: '{key}' must be true or false, got {value!r}")
        return value

    def fail(self, msg: str) -> UserError:
        return UserError(f"{self.source}: {msg}")

    def unsupported(self, key: str, value: Any, why: str = "") -> UserError:
        extra = f" ({why})" if why else ""
        return UserError(f"{self.source}: '{key}' = {value!r} is not supported by dataflow{extra}")

    def reject_set(self, key: str, default: Any, why: str = "") -> None:
        """Fail when `key` is present with a value other than the one we implement."""
        value = self.get(key, default)
        if value != default:
            raise self.unsupported(key, value, why)

    def layer_types(self, n_layers: int) -> Optional[list[str]]:
        """`layer_types` as the spec's per-layer "full" / "sliding", None when absent."""
        lt = self.get("layer_types")
        if lt is None:
            return None
        names = {"full_attention": "full", "sliding_attention": "sliding"}
        if not isinstance(lt, list) or any(t not in names for t in lt):
            raise self.unsupported("layer_types", lt, "entries must be full_attention or sliding_attention")
        if len(lt) != n_layers:
            raise self.fail(f"'layer_types' has {len(lt)} entries, num_hidden_layers is {n_layers}")
        return [names[t] for t in lt]

    def biases(self, attn: dict, default: bool = False, **fields: Any) -> None:
        """`attention_bias` (default `default`) as the q/k/v and o biases, with more attention `fields`."""
        bias = self.bool("attention_bias", default)
        attn.update(qkv_bias=bias, o_bias=bias, **fields)

    def sliding(self, attn: dict, layer_types: list[str], window: Optional[int]) -> None:
        """Per-layer sliding attention into `attn` when `layer_types` has sliding layers (which need a window)."""
        if "sliding" in layer_types:
            if not window:
                raise self.fail("layer_types has sliding_attention layers but sliding_window is not set")
            attn.update(layer_types=layer_types, sliding_window=window)

    def routed(self, experts: dict, count_keys: tuple[str, str], num: Optional[int], top_k: Optional[int],
               size_key: str, size: int, **fields: Any) -> None:
        """The routed experts into `experts`: their count (under either of `count_keys`), num_experts_per_tok and
        their size (under `size_key`), with the family's defaults (a None default makes the key required), plus
        more expert `fields`."""
        experts.update(num_experts=self.alias(count_keys, num),
                       top_k=self.int("num_experts_per_tok", top_k, required=top_k is None),
                       intermediate_size=self.int(size_key, size), **fields)

    def dense(self, spec: dict, layers: list[int], size_default: int) -> None:
        """Dense `layers` (if any) into `spec`, their MLP of `intermediate_size`."""
        if layers:
            spec["dense_layers"] = layers
            spec["dense_intermediate_size"] = self.int("intermediate_size", size_default)


def read_config(path: str | Path) -> tuple[dict, Path]:
    """Load `<dir>/config.json` (or a config.json path). Returns (dict, the config file path)."""
    path = Path(path)
    cfg_path = path / "config.json" if path.is_dir() else path
    if not path.exists():
        raise UserError(f"{path}: no such checkpoint directory")
    if not cfg_path.is_file():
        raise UserError(f"{cfg_path}: not found; a Hugging Face checkpoint directory needs a config.json")
    try:
        data = json.loads(cfg_path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise UserError(f"{cfg_path}: not valid JSON: {err}") from None
    if not isinstance(data, dict):
        raise UserError(f"{cfg_path}: expected a JSON object at the top level")
    return data, cfg_path


def detect_family(cfg: _Cfg) -> str:
    supported = ", ".join(sorted(ARCHITECTURES))
    archs = cfg.get("architectures")
    if archs is not None:
        if isinstance(archs, str):
            archs = [archs]
        for arch in archs:
            if arch in ARCHITECTURES:
                return ARCHITECTURES[arch]
        raise cfg.fail(f"architectures {archs!r} (model_type {cfg.get('model_type')!r}) is not supported; "
                       f"supported architectures: {supported}")
    mt = cfg.get("model_type")
    if mt in ARCHITECTURES.values():
        return mt
    raise cfg.fail(f"no supported 'architectures' entry and model_type {mt!r} is not supported; "
                   f"supported architectures: {supported}")


def _dtype(cfg: _Cfg, fallback: Optional[Callable[[], Optional[str]]]) -> str:
    # transformers 5 writes `dtype`; older checkpoints `torch_dtype`.
    for key in ("dtype", "torch_dtype"):
        raw = cfg.get(key)
        if raw is None or raw == "auto":
            continue
        name = str(raw).removeprefix("torch.")
        if name not in _DTYPES:
            raise cfg.unsupported(key, raw, "supported: float32, bfloat16, float16")
        return _DTYPES[name]
    return (fallback() if fallback else None) or "float32"


def _eos(cfg: _Cfg) -> list[int]:
    eos = cfg.get("eos_token_id")
    if eos is None:
        return []
    ids = eos if isinstance(eos, list) else [eos]
    if not all(isinstance(t, int) and not isinstance(t, bool) for t in ids):
        raise cfg.fail(f"'eos_token_id' must be an integer or a list of integers, got {eos!r}")
    # Deduplicate, keep order: some configs repeat ids.
    return list(dict.fromkeys(ids))


def _rope(cfg: _Cfg, family: str, head_dim: int, max_position: int) -> dict:
    """The rope dict of the spec, following transformers' `convert_rope_params_to_dict` +
    `standardize_rope_params` precedence: a `rope_scaling` dict wins over `rope_parameters`; keys
    inside the dict win over the top-level `rope_theta` / `partial_rotary_factor`; then the class
    default (`default_theta`, GLM's partial factor 0.5)."""
    key = "rope_scaling" if cfg.has("rope_scaling") else "rope_parameters"
    rp = cfg.get(key)
    if rp is None and family == "gpt_oss":
        # GptOssConfig.__post_init__ installs this when no rope dict is given.
        rp = {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0,
              "truncate": False, "original_max_position_embeddings": 4096}
    if rp is not None and not isinstance(rp, dict):
        raise cfg.fail(f"'{key}' must be an object, got {rp!r}")
    rp = dict(rp or {})

    # Per-layer-type rope dicts (transformers 5 nests them under layer type names). We have one
    # rope per model, so accept nesting only when every entry is the same.
    nested = [v for v in rp.values() if isinstance(v, dict)]
    if nested:
        if any(v != nested[0] for v in nested) or len(nested) != len(rp):
            raise cfg.unsupported(key, rp, "different rope settings per layer type")
        rp = dict(nested[0])

    if family == "hunyuan_v1_moe":
        rp = hf_families.hunyuan_ntk_alpha(cfg, key, rp, head_dim)
    rope_type = rp.get("rope_type") or rp.get("type") or "default"
    if rope_type not in _ROPE_KEYS:
        raise cfg.unsupported(f"{key}.rope_type", rope_type,
                              f"supported rope types: {', '.join(sorted(_ROPE_KEYS))}")
    unknown = set(rp) - _ROPE_COMMON_KEYS - _ROPE_KEYS[rope_type]
    if unknown:
        raise cfg.fail(f"'{key}' has keys {sorted(unknown)} that rope type '{rope_type}' does not use; "
                       f"dataflow cannot honour them")

    theta = rp.get("rope_theta")
    if theta is None:
        theta = cfg.float("rope_theta", hf_families.THETA_DEFAULTS.get(family, 10000.0))
    partial = rp.get("partial_rotary_factor")
    if partial is None and family == "minimax_m2" and cfg.has("rotary_dim"):
        # Released MiniMax-M2 configs give partial RoPE as `rotary_dim` (transformers: factor rotary_dim / head_dim).
        partial = cfg.int("rotary_dim") / head_dim
    if partial is None:
        partial = cfg.float("partial_rotary_factor", 0.5 if family == "glm4_moe" else 1.0)
    # (its range and the even rotated width it leaves are checked by the spec: graph_ir/spec.py)
    out: dict[str, Any] = {"theta": float(theta), "partial_rotary_factor": float(partial)}
    # Not a RopeSpec field: DeepSeek-V2's softmax scale needs mscale_all_dim even when mscale is
    # absent (then the rope spec itself stores neither). Popped by the caller.
    out["_mscale_all_dim"] = rp.get("mscale_all_dim") or 0
    if family in ("deepseek_v2", "ernie4_5_moe"):
        # DeepSeek-V2 rotates adjacent pairs (view_as_complex over [..., 2]), not halves; so does
        # Ernie4_5_MoeAttention (rotate_half over x[0::2], x[1::2]).
        out["interleaved"] = True
    elif family in ("deepseek_v3", "glm4_moe_lite"):
        # DeepseekV3Attention: adjacent pairs unless rope_interleave is false (its output order differs from
        # V2's, but q and k alike, so q.k is the same)
        out["interleaved"] = cfg.bool("rope_interleave", True)
    if rope_type == "default":
        return out
    factor = rp.get("factor")
    if rope_type == "linear":
        if factor is None:
            raise cfg.fail(f"'{key}' of type linear needs 'factor'")
        out.update(scaling="linear", factor=float(factor))
        return out

    # yarn. transformers: original_max_position_embeddings defaults to max_position_embeddings
    # (a top-level key of that name wins, as for Phi-3); factor None -> the implicit ratio.
    orig = cfg.int("original_max_position_embeddings") or rp.get("original_max_position_embeddings") or max_position
    if factor is None:
        factor = max_position / orig
    mscale, mscale_all_dim = rp.get("mscale"), rp.get("mscale_all_dim")
    # transformers uses the mscale ratio only when both are non-zero; otherwise plain 0.1*ln(s)+1.
    # Store them only in that case, so the spec's fields mean the same thing as HF's computation.
    both = bool(mscale) and bool(mscale_all_dim)
    out.update(
        scaling="yarn", factor=float(factor), original_max_position=int(orig),
        # HF: `rope_parameters.get("beta_fast") or 32` -- a 0 also means the default.
        beta_fast=float(rp.get("beta_fast") or 32.0), beta_slow=float(rp.get("beta_slow") or 1.0),
        mscale=float(mscale) if both else None, mscale_all_dim=float(mscale_all_dim) if both else None,
        truncate=bool(rp.get("truncate", True)),
    )
    attention_factor = rp.get("attention_factor")
    if attention_factor is not None:
        implied = (yarn_get_mscale(factor, mscale) / yarn_get_mscale(factor, mscale_all_dim)) if both \
            else yarn_get_mscale(factor)
        if not math.isclose(float(attention_factor), implied, rel_tol=1e-6):
            raise cfg.unsupported(f"{key}.attention_factor", attention_factor,
                                  f"only the value implied by factor/mscale ({implied:.6g}) is supported")
    return out


def _decoder_sparse_dense_layers(cfg: _Cfg, n_layers: int) -> list[int]:
    # Qwen2/3-MoE decoder layer: MoE iff not in mlp_only_layers and (i+1) % decoder_sparse_step == 0.
    only = cfg.get("mlp_only_layers", [])
    if not isinstance(only, list) or not all(isinstance(i, int) for i in only):
        raise cfg.fail(f"'mlp_only_layers' must be a list of layer indices, got {only!r}")
    step = cfg.int("decoder_sparse_step", 1)
    if step < 1:
        raise cfg.fail(f"'decoder_sparse_step' must be >= 1, got {step}")
    return [i for i in range(n_layers) if i in only or (i + 1) % step != 0]


def eos_in_vocab(ids: list[int], vocab_size: int, source: str) -> list[int]:
    """`ids` without those outside the vocabulary, with a warning naming `source`: transformers warns and keeps
    loading; the ids can never be generated, so dropping them changes nothing."""
    outside = [t for t in ids if not 0 <= t < vocab_size]
    if outside:
        warnings.warn(f"{source}: eos_token_id {outside} outside the vocabulary 0..{vocab_size - 1}: dropped",
                      stacklevel=3)
    return [t for t in ids if t not in outside]


def spec_dict_from_config(data: dict, source: str, *, name: str = "model",
                          dtype_fallback: Optional[Callable[[], Optional[str]]] = None,
                          ignored: Optional[list[str]] = None) -> dict:
    """config.json dict -> ModelSpec field dict (not yet validated). `source` names the file in errors. A key no
    mapping reads that changes the forward pass is a UserError (models/hf_keys.py); the other unread keys are
    appended to `ignored` when given (for the compile summary)."""
    cfg = _Cfg(data, source)
    family = detect_family(cfg)

    qc = cfg.get("quantization_config")
    if qc is not None:
        method = qc.get("quant_method") if isinstance(qc, dict) else qc
        # GPT-OSS ships its routed experts as MXFP4, DeepSeek-V3 style checkpoints block-scaled FP8 (e4m3); both
        # are dequantized at load (models/hf_weights.py); nothing else is.
        if method == "fp8":
            from models.hf_weights import fp8_block_size
            fp8_block_size(cfg.data, source)
        elif not (family == "gpt_oss" and method == "mxfp4"):
            raise cfg.unsupported("quantization_config.quant_method", method,
                                  "dequantized: GPT-OSS MXFP4 experts, block-scaled fp8 (e4m3); "
                                  "else use an unquantized checkpoint")

    n_layers = cfg.int("num_hidden_layers", required=True)
    hidden = cfg.int("hidden_size", required=True)
    n_heads = cfg.int("num_attention_heads", required=True)
    n_kv = cfg.int("num_key_value_heads") or n_heads
    max_pos = cfg.int("max_position_embeddings", required=True)
    if family == "gpt_oss":
        # GptOssConfig: an absent head_dim is 64; an explicit null means hidden // heads.
        head_dim = hidden // n_heads if ("head_dim" in data and data["head_dim"] is None) \
            else cfg.int("head_dim", 64)
    else:
        head_dim = cfg.int("head_dim") or hidden // n_heads

    attn: dict[str, Any] = {"kind": "gqa", "num_heads": n_heads, "num_kv_heads": n_kv, "head_dim": head_dim}
    router: dict[str, Any] = {}
    experts: dict[str, Any] = {}
    spec: dict[str, Any] = {"name": name, "family": family, "num_layers": n_layers, "hidden_size": hidden,
                            "vocab_size": cfg.int("vocab_size", required=True), "max_position": max_pos,
                            "tie_embeddings": cfg.bool("tie_word_embeddings", False)}
    spec["rms_norm_eps"] = cfg.float("rms_norm_eps", hf_families.EPS_DEFAULTS.get(family, 1e-6))
    if family != "gpt_oss":  # (GPT-OSS's experts have their own clamped GLU: experts.activation)
        cfg.reject_set("hidden_act", "silu", "experts and MLPs are SwiGLU (silu) only")

    if family in hf_families.BUILDERS:
        hf_families.BUILDERS[family](cfg, n_layers, attn, router, experts, spec)

    elif family == "mixtral":
        # MixtralTopKRouter always renormalizes the top-k softmax weights (no norm_topk_prob).
        router.update(scoring="softmax", renormalize=True)
        cfg.routed(experts, ("num_local_experts", "num_experts"), 8, 2, "intermediate_size", 14336)
        if cfg.has("sliding_window"):
            attn["sliding_window"] = cfg.int("sliding_window")

    elif family in ("qwen2_moe", "qwen3_moe"):
        qwen2 = family == "qwen2_moe"
        router.update(scoring="softmax", renormalize=cfg.bool("norm_topk_prob", False))
        cfg.routed(experts, ("num_experts", "num_local_experts"), 60 if qwen2 else 128, 4 if qwen2 else 8,
                   "moe_intermediate_size", 1408 if qwen2 else 768)
        cfg.dense(spec, _decoder_sparse_dense_layers(cfg, n_layers), 5632 if qwen2 else 6144)
        if qwen2:
            attn["qkv_bias"] = cfg.bool("qkv_bias", True)
            shared = cfg.int("shared_expert_intermediate_size", 5632)
            if shared:
                experts.update(shared_intermediate_size=shared, shared_gate=True)
            if cfg.bool("use_sliding_window", False):
                # Qwen2MoeConfig: sliding on odd-numbered (1-based) layers below max_window_layers,
                # unless layer_types is given.
                lt = cfg.layer_types(n_layers) or [
                    "sliding" if (i + 1) % 2 and i < cfg.int("max_window_layers", 28) else "full"
                    for i in range(n_layers)]
                if "sliding" in lt:
                    attn["layer_types"] = lt
                    attn["sliding_window"] = cfg.int("sliding_window", 4096)
        else:
            cfg.biases(attn, qk_norm="head")  # Qwen3MoeAttention: RMSNorm over head_dim, per head
            if cfg.bool("use_sliding_window", False):
                # Qwen3MoeAttention applies config.sliding_window on every layer.
                attn["sliding_window"] = cfg.int("sliding_window", 4096)

    elif family == "olmoe":
        cfg.reject_set("clip_qkv", None, "q/k/v clipping is not implemented")
        if head_dim * n_heads != hidden:
            raise cfg.fail(f"OLMoE needs head_dim * num_attention_heads == hidden_size "
                           f"({head_dim} * {n_heads} != {hidden}): its q/k norms span the full projection")
        cfg.biases(attn, qk_norm="full")
        router.update(scoring="softmax", renormalize=cfg.bool("norm_topk_prob", False))
        cfg.routed(experts, ("num_experts", "num_local_experts"), 64, 8, "intermediate_size", 2048)

    elif family == "gpt_oss":
        cfg.biases(attn, True, sinks=True)
        lt = cfg.layer_types(n_layers) or ["sliding" if (i + 1) % 2 else "full" for i in range(n_layers)]
        cfg.sliding(attn, lt, cfg.int("sliding_window", 128))
        # GptOssTopKRouter: top-k of the raw (biased) logits, softmax over those k.
        router.update(scoring="topk_softmax", renormalize=False, bias=True)
        cfg.routed(experts, ("num_local_experts", "num_experts"), 128, 4, "intermediate_size", 2880, bias=True,
                   activation="gptoss_glu", glu_alpha=cfg.float("swiglu_alpha", 1.702),
                   glu_limit=cfg.float("swiglu_limit", 7.0))

    elif family == "glm4_moe":
        # q/k/v take attention_bias; Glm4MoeAttention's o_proj never has a bias.
        attn["qkv_bias"] = cfg.bool("attention_bias", False)
        if cfg.bool("use_qk_norm", False):
            attn["qk_norm"] = "head"
        router.update(scoring="sigmoid", correction_bias=True, renormalize=cfg.bool("norm_topk_prob", True),
                      n_group=cfg.int("n_group", 1), topk_group=cfg.int("topk_group", 1),
                      routed_scaling=cfg.float("routed_scaling_factor", 1.0))
        cfg.routed(experts, ("n_routed_experts", "num_local_experts"), 128, 8, "moe_intermediate_size", 1408)
        experts["shared_intermediate_size"] = experts["intermediate_size"] * cfg.int("n_shared_experts", 1)
        cfg.dense(spec, list(range(min(cfg.int("first_k_dense_replace", 1), n_layers))), 10944)

    # Rope: for MLA only the qk_rope_head_dim part rotates (DeepseekV2Config sets head_dim to it).
    rope_head_dim = attn["qk_rope_head_dim"] if attn["kind"] == "mla" else attn["head_dim"]
    attn["rope"] = _rope(cfg, family, rope_head_dim, max_pos)
    mad = attn["rope"].pop("_mscale_all_dim")
    if attn["kind"] == "mla" and attn["rope"].get("scaling", "none") != "none" and mad:
        # DeepseekV2Attention: softmax scale = qk_head_dim**-0.5 * yarn_mscale(factor, mscale_all_dim)**2
        # whenever the rope type is not default (this is on top of the cos/sin attention factor).
        # Written out explicitly so the spec says the scale rather than leaving it to be re-derived.
        m = yarn_get_mscale(attn["rope"]["factor"], float(mad))
        attn["softmax_scale"] = attn["head_dim"] ** -0.5 * m * m

    eos = eos_in_vocab(_eos(cfg), spec["vocab_size"], source)
    spec.update(attention=attn, router=router, experts=experts, eos_token_ids=eos,
                dtype=_dtype(cfg, dtype_fallback))
    unread = hf_keys.check_unread(data, cfg.read, family, source)
    if ignored is not None:
        ignored.extend(unread)
    return spec


def ignored_keys(data: dict, source: str) -> list[str]:
    """The config.json keys the mapping does not read and that do not change the forward pass (sorted), for the
    compile summary to list; raises what importing the config raises."""
    out: list[str] = []
    spec_dict_from_config(data, source, ignored=out)
    return out


def spec_from_config(data: dict, source: str, *, name: str = "model", path: Optional[str] = None,
                     dtype_fallback: Optional[Callable[[], Optional[str]]] = None) -> ModelSpec:
    spec = spec_dict_from_config(data, source, name=name, dtype_fallback=dtype_fallback)
    if path is not None:
        spec["weights"] = {"source": "checkpoint", "path": path}
    return spec_from_dict(spec, source)
