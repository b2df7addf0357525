"""What a model IS: the typed, validated description of an MoE architecture.

A `ModelSpec` is loaded from YAML (`load_spec`), built in Python (`graph_ir.builder`), or imported
from a Hugging Face checkpoint directory (`models.checkpoint`). Every other layer of the system reads
only this object, never a raw config dict. All models forbid unknown fields so a typo in a YAML is an
error naming the field, not a silently ignored setting.
"""
from __future__ import annotations

from pathlib import Path
from typing import Literal, Optional

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from graph_ir.errors import UserError

# Upper bounds on sizes, so that a typo (num_layers: 1e26, num_experts: 10000000) is an error naming the field
# rather than an OOM or a hang in compile, whose tables grow with layers x experts x ranks. Each is at least twice
# the largest published model: 94 MoE layers (Qwen3-235B), 512 experts (Qwen3-Next), 128 heads of 256 channels,
# hidden 16384 / intermediate 53248 (Llama-3.1-405B), a 262k vocabulary (Gemma 3), 10M positions (Llama 4 Scout).
MAX_LAYERS = 256
MAX_EXPERTS = 1024
MAX_HEADS = 1024
MAX_HEAD_DIM = 1024
MAX_HIDDEN = 1 << 16
MAX_INTERMEDIATE = 1 << 18
MAX_VOCAB = 1 << 21
MAX_POSITION = 1 << 24


class _Strict(BaseModel):
    # allow_inf_nan=False: `theta: .inf` or `rms_norm_eps: .nan` is an error, not NaN logits at run time.
    model_config = ConfigDict(extra="forbid", frozen=False, validate_assignment=True, allow_inf_nan=False)


class RopeSpec(_Strict):
    """Rotary position embedding. `scaling` picks how positions past the trained length are handled."""

    theta: float = Field(10000.0, gt=0)
    scaling: Literal["none", "linear", "yarn"] = "none"
    factor: float = Field(1.0, gt=0)
    original_max_position: Optional[int] = Field(None, gt=0, le=MAX_POSITION)
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    # YaRN attention-temperature knobs as DeepSeek-V2 uses them (None: the plain YaRN 0.1*ln(s)+1).
    mscale: Optional[float] = None
    mscale_all_dim: Optional[float] = None
    # GPT-OSS keeps the YaRN correction range un-rounded (HF `truncate: false`).
    truncate: bool = True
    # Fraction of head_dim that is rotated (GLM-4.5: 0.5); the rest passes through.
    partial_rotary_factor: float = Field(1.0, gt=0, le=1)
    # Pair layout: False = rotate halves (Llama/Mixtral/GPT-OSS), True = adjacent pairs
    # (the DeepSeek-V2 checkpoint layout, which HF de-interleaves before rotate-half).
    interleaved: bool = False

    @model_validator(mode="after")
    def _check(self) -> "RopeSpec":
        if self.scaling == "yarn" and self.original_max_position is None:
            raise ValueError("yarn scaling needs original_max_position")
        return self


class AttentionSpec(_Strict):
    """Self-attention of every layer. `gqa` covers MHA/MQA/GQA; `mla` is DeepSeek-V2's latent attention."""

    kind: Literal["gqa", "mla"] = "gqa"
    num_heads: int = Field(gt=0, le=MAX_HEADS)
    num_kv_heads: int = Field(gt=0, le=MAX_HEADS)
    head_dim: int = Field(gt=0, le=MAX_HEAD_DIM)
    qkv_bias: bool = False
    o_bias: bool = False
    # "head": RMSNorm over head_dim per head (Qwen3); "full": over all heads' q / k (OLMoE).
    qk_norm: Literal["none", "head", "full"] = "none"
    # The per-head q/k norm after RoPE instead of before it (Hunyuan-MoE); needs qk_norm head.
    qk_norm_after_rope: bool = False
    sinks: bool = False  # GPT-OSS: a learned per-head logit that absorbs attention mass
    sliding_window: Optional[int] = Field(None, gt=0, le=MAX_POSITION)
    # Per-layer kind when some layers slide (GPT-OSS alternates). None: all layers use
    # `sliding_window` if it is set, else full attention.
    layer_types: Optional[list[Literal["full", "sliding"]]] = None
    softmax_scale: Optional[float] = Field(None, gt=0)  # None: 1/sqrt(qk head dim)
    rope: RopeSpec = Field(default_factory=RopeSpec)
    # MLA only.
    q_lora_rank: Optional[int] = Field(None, gt=0, le=MAX_HIDDEN)
    kv_lora_rank: Optional[int] = Field(None, gt=0, le=MAX_HIDDEN)
    qk_nope_head_dim: Optional[int] = Field(None, gt=0, le=MAX_HEAD_DIM)
    qk_rope_head_dim: Optional[int] = Field(None, gt=0, le=MAX_HEAD_DIM)
    v_head_dim: Optional[int] = Field(None, gt=0, le=MAX_HEAD_DIM)

    @model_validator(mode="after")
    def _check(self) -> "AttentionSpec":
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({self.num_heads})")
        if self.kind == "mla":
            missing = [f for f in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim")
                       if getattr(self, f) is None]
            if missing:
                raise ValueError(f"mla attention needs {', '.join(missing)}")
            if self.num_kv_heads != self.num_heads:
                raise ValueError("mla attention has num_kv_heads == num_heads")
            if self.qk_rope_head_dim % 2:
                raise ValueError(f"qk_rope_head_dim {self.qk_rope_head_dim} is odd; RoPE rotates channel pairs, "
                                 f"so valid: an even number")
        else:
            # models/rope.py rotary_dim: HF's int(head_dim * partial_rotary_factor) leading channels, rotated as
            # pairs (x1 = first half, x2 = second half), so the rotated width must be even.
            rot = int(self.head_dim * self.rope.partial_rotary_factor)
            if rot < 2 or rot % 2:
                f = self.rope.partial_rotary_factor
                if f == 1:
                    raise ValueError(f"head_dim {self.head_dim}: RoPE rotates channel pairs, so valid: an even "
                                     f"head_dim (e.g. {self.head_dim + 1 if self.head_dim % 2 else 2})")
                raise ValueError(f"head_dim {self.head_dim} x rope.partial_rotary_factor {f:g} = {rot} rotated "
                                 f"channels: RoPE rotates channel pairs, so valid: an even number >= 2 of them")
        if self.layer_types is not None and "sliding" in self.layer_types and self.sliding_window is None:
            raise ValueError("layer_types has 'sliding' layers but sliding_window is not set")
        return self

    @property
    def qk_head_dim(self) -> int:
        return (self.qk_nope_head_dim + self.qk_rope_head_dim) if self.kind == "mla" else self.head_dim

    @property
    def value_head_dim(self) -> int:
        return self.v_head_dim if self.kind == "mla" else self.head_dim

    def window(self, layer: int) -> Optional[int]:
        """Sliding window of `layer` in tokens, None for full attention."""
        return self.sliding_window if self.layer_types is None or self.layer_types[layer] == "sliding" else None


class RouterSpec(_Strict):
    """How a token picks its experts and their weights.

    scoring:
      softmax       softmax over all experts, then top-k (Mixtral, Qwen, OLMoE, DeepSeek-V2)
      topk_softmax  top-k on raw logits, softmax over those k (GPT-OSS)
      sigmoid       sigmoid scores; selection adds `correction_bias` (GLM-4.5, DeepSeek-V3)
    softmax and sigmoid can add `correction_bias` for selection only (softmax: ERNIE-4.5-MoE).
    """

    scoring: Literal["softmax", "topk_softmax", "sigmoid"] = "softmax"
    renormalize: bool = True  # divide the k weights by their sum
    bias: bool = False  # router linear has a bias (GPT-OSS)
    correction_bias: bool = False  # per-expert bias added for selection only
    n_group: int = Field(1, gt=0, le=MAX_EXPERTS)  # group-limited top-k: experts split into n_group groups...
    topk_group: int = Field(1, gt=0, le=MAX_EXPERTS)  # ...and only the best topk_group groups are eligible
    routed_scaling: float = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> "RouterSpec":
        if self.topk_group > self.n_group:
            raise ValueError(f"topk_group ({self.topk_group}) must be <= n_group ({self.n_group})")
        return self


class ExpertSpec(_Strict):
    """Routed experts (all the same shape) and the optional shared expert of each MoE layer."""

    num_experts: int = Field(gt=0, le=MAX_EXPERTS)
    top_k: int = Field(gt=0, le=MAX_EXPERTS)
    intermediate_size: int = Field(gt=0, le=MAX_INTERMEDIATE)
    activation: Literal["silu_glu", "gptoss_glu"] = "silu_glu"
    # GPT-OSS clamped SwiGLU: gate clamped to <= limit, up to [-limit, limit], out = (up+1)*gate*sigmoid(alpha*gate)
    glu_alpha: float = 1.702
    glu_limit: float = 7.0
    bias: bool = False
    # Shared expert: one dense SwiGLU MLP on every token of the home rank (0 = none).
    shared_intermediate_size: int = Field(0, ge=0, le=MAX_INTERMEDIATE)
    shared_gate: bool = False  # Qwen2-MoE: sigmoid(x @ w) scales the shared output

    @model_validator(mode="after")
    def _check(self) -> "ExpertSpec":
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k ({self.top_k}) must be <= num_experts ({self.num_experts})")
        if self.shared_gate and not self.shared_intermediate_size:
            raise ValueError("shared_gate needs shared_intermediate_size > 0")
        return self


class WeightsSpec(_Strict):
    source: Literal["random", "checkpoint"] = "random"
    seed: int = Field(0, ge=0, lt=1 << 63)  # torch generators take 64-bit seeds
    path: Optional[str] = None  # checkpoint directory (config.json + *.safetensors)
    init_std: float = Field(0.02, gt=0)  # random weights only

    @model_validator(mode="after")
    def _check(self) -> "WeightsSpec":
        if self.source == "checkpoint" and not self.path:
            raise ValueError("source 'checkpoint' needs path")
        return self


class ModelSpec(_Strict):
    name: str
    # Which reference implementation the math follows; `custom` for user-declared models.
    family: Literal["mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "gpt_oss", "glm4_moe",
                    "deepseek_v2", "deepseek_v3", "glm4_moe_lite", "dots1", "minimax_m2", "granitemoe",
                    "ernie4_5_moe", "hunyuan_v1_moe", "custom"] = "custom"
    num_layers: int = Field(gt=0, le=MAX_LAYERS)
    hidden_size: int = Field(gt=0, le=MAX_HIDDEN)
    vocab_size: int = Field(gt=0, le=MAX_VOCAB)
    max_position: int = Field(4096, gt=0, le=MAX_POSITION)
    rms_norm_eps: float = Field(1e-6, gt=0)
    tie_embeddings: bool = False
    attention: AttentionSpec
    router: RouterSpec = Field(default_factory=RouterSpec)
    experts: ExpertSpec
    # Layers with one dense MLP instead of experts (e.g. DeepSeek/GLM "first k dense").
    dense_layers: list[int] = Field(default_factory=list, max_length=MAX_LAYERS)
    dense_intermediate_size: Optional[int] = Field(None, gt=0, le=MAX_INTERMEDIATE)
    dtype: Literal["float32", "bfloat16", "float16"] = "bfloat16"
    weights: WeightsSpec = Field(default_factory=WeightsSpec)
    eos_token_ids: list[int] = Field(default_factory=list)
    # Granite-style multipliers (1.0: none): the embedding output is scaled by embedding_multiplier, every block's
    # output (attention, MLP / MoE) by residual_multiplier before its residual add, the logits divided by
    # logits_scaling.
    embedding_multiplier: float = Field(1.0, gt=0)
    residual_multiplier: float = Field(1.0, gt=0)
    logits_scaling: float = Field(1.0, gt=0)

    @model_validator(mode="after")
    def _check(self) -> "ModelSpec":
        bad = [l for l in self.dense_layers if not 0 <= l < self.num_layers]
        if bad:
            raise ValueError(f"dense_layers {bad} outside 0..{self.num_layers - 1}")
        twice = sorted({l for l in self.dense_layers if self.dense_layers.count(l) > 1})
        if twice:
            raise ValueError(f"dense_layers lists layer(s) {twice} more than once")
        if self.dense_layers and self.dense_intermediate_size is None:
            raise ValueError("dense_layers needs dense_intermediate_size")
        if len(set(self.dense_layers)) == self.num_layers:
            raise ValueError("every layer is dense: an MoE model needs at least one expert layer")
        lt = self.attention.layer_types
        if lt is not None and len(lt) != self.num_layers:
            raise ValueError(f"attention.layer_types has {len(lt)} entries, num_layers is {self.num_layers}")
        if self.router.n_group > 1:
            if self.experts.num_experts % self.router.n_group:
                raise ValueError(f"router.n_group ({self.router.n_group}) must divide "
                                 f"experts.num_experts ({self.experts.num_experts})")
            # Group-limited routing only lets top-k pick inside the best topk_group groups.
            eligible = self.router.topk_group * (self.experts.num_experts // self.router.n_group)
            if self.experts.top_k > eligible:
                raise ValueError(f"experts.top_k ({self.experts.top_k}) exceeds the {eligible} experts that "
                                 f"router.topk_group ({self.router.topk_group}) of router.n_group "
                                 f"({self.router.n_group}) groups leave eligible")
        bad_eos = [t for t in self.eos_token_ids if not 0 <= t < self.vocab_size]
        if bad_eos:
            raise ValueError(f"eos_token_ids {bad_eos} outside the vocabulary 0..{self.vocab_size - 1}")
        __import__("graph_ir.spec_checks").spec_checks.refuse_ignored_fields(self)  # fields the math ignores
        return self

    def is_moe_layer(self, layer: int) -> bool:
        return layer not in self.dense_layers

    @property
    def moe_layers(self) -> list[int]:
        return [l for l in range(self.num_layers) if self.is_moe_layer(l)]


def layer_shapes(spec: ModelSpec, layer: int) -> dict[str, tuple[int, ...]]:
    """Canonical name -> shape of every tensor layer `layer` needs under `spec` (the names of models/weights.py,
    ARCHITECTURE.md): what random init builds, a checkpoint must hold and lowering/sizes.py counts."""
    a, ex, H = spec.attention, spec.experts, spec.hidden_size
    s: dict[str, tuple[int, ...]] = {"attn_norm": (H,), "mlp_norm": (H,)}
    nh, nkv = a.num_heads, a.num_kv_heads
    if a.kind == "gqa":
        hd = a.head_dim
        s["q.w"], s["k.w"], s["v.w"], s["o.w"] = (nh * hd, H), (nkv * hd, H), (nkv * hd, H), (H, nh * hd)
        if a.qkv_bias:
            s["q.b"], s["k.b"], s["v.b"] = (nh * hd,), (nkv * hd,), (nkv * hd,)
        if a.qk_norm == "head":
            s["q_norm"], s["k_norm"] = (hd,), (hd,)
        elif a.qk_norm == "full":
            s["q_norm"], s["k_norm"] = (nh * hd,), (nkv * hd,)
    else:  # mla
        qk, rope, nope, vd, kvr = a.qk_head_dim, a.qk_rope_head_dim, a.qk_nope_head_dim, a.v_head_dim, a.kv_lora_rank
        ql = a.q_lora_rank
        if ql is None:
            s["q.w"] = (nh * qk, H)
        else:
            s["q_a.w"], s["q_a_norm"], s["q_b.w"] = (ql, H), (ql,), (nh * qk, ql)
        s["kv_a.w"], s["kv_a_norm"], s["kv_b.w"] = (kvr + rope, H), (kvr,), (nh * (nope + vd), kvr)
        s["o.w"] = (H, nh * vd)
        # HF DeepSeek-V2 `attention_bias` puts biases on q_a / kv_a / o (q_b and kv_b never have one).
        if a.qkv_bias:
            if a.q_lora_rank is not None:
                s["q_a.b"] = (a.q_lora_rank,)
            s["kv_a.b"] = (kvr + rope,)
    if a.o_bias:
        s["o.b"] = (H,)
    if a.sinks:
        s["sinks"] = (nh,)

    if spec.is_moe_layer(layer):
        E, I = ex.num_experts, ex.intermediate_size
        s["router.w"] = (E, H)
        if spec.router.bias:
            s["router.b"] = (E,)
        if spec.router.correction_bias:
            s["router.correction_bias"] = (E,)
        s["experts.gate"], s["experts.up"], s["experts.down"] = (E, I, H), (E, I, H), (E, H, I)
        if ex.bias:
            s["experts.gate_b"], s["experts.up_b"], s["experts.down_b"] = (E, I), (E, I), (E, H)
        if ex.shared_intermediate_size:
            Is = ex.shared_intermediate_size
            s["shared.gate"], s["shared.up"], s["shared.down"] = (Is, H), (Is, H), (H, Is)
            if ex.shared_gate:
                s["shared_gate.w"] = (1, H)
    else:
        Id = spec.dense_intermediate_size
        s["mlp.gate"], s["mlp.up"], s["mlp.down"] = (Id, H), (Id, H), (H, Id)
    return s


def cut_layers(spec: ModelSpec, layers: int) -> ModelSpec:
    """The same model with only its first `layers` layers (per-layer settings cut alike), for
    benchmarks that keep a big model's layer shapes but not its depth (e.g. GPT-OSS-120B cut to 18
    layers to fit two GPUs). The name gets an -L<layers> suffix."""
    if layers >= spec.num_layers:
        return spec
    data = spec.model_dump()
    data["num_layers"] = layers
    a = data["attention"]
    if a["layer_types"]:
        a["layer_types"] = a["layer_types"][:layers]
        if "sliding" not in a["layer_types"]:  # (a field no layer reads is refused: graph_ir/spec_checks.py)
            a["layer_types"] = a["sliding_window"] = None
    data["dense_layers"] = [l for l in data["dense_layers"] if l < layers]
    if not data["dense_layers"]:
        data["dense_intermediate_size"] = None
    data["name"] = f"{spec.name}-L{layers}"
    return ModelSpec.model_validate(data)


def _int_range(model: type[BaseModel], loc: tuple) -> Optional[str]:
    """"an integer LO..HI" for the int field at `loc` of `model` (its Field bounds), None when not found."""
    import annotated_types as at

    field = None
    for part in loc:
        if not isinstance(part, str) or model is None or part not in model.model_fields:
            return None
        field = model.model_fields[part]
        ann = field.annotation
        model = ann if isinstance(ann, type) and issubclass(ann, BaseModel) else None
    if field is None:
        return None
    lo = hi = None
    for m in field.metadata:
        if isinstance(m, at.Gt):
            lo = m.gt + 1
        elif isinstance(m, at.Ge):
            lo = m.ge
        elif isinstance(m, at.Lt):
            hi = m.lt - 1
        elif isinstance(m, at.Le):
            hi = m.le
    if lo is None and hi is None:
        return None
    return f"an integer {lo if lo is not None else ''}..{hi if hi is not None else ''}"


def format_validation_error(err: ValidationError, source: str, model: Optional[type[BaseModel]] = None) -> str:
    """One line: the file, then per problem the dotted field path, the bad value and what pydantic says is
    valid ("; "-separated, at most 5 shown)."""
    lines = []
    for e in err.errors():
        loc = ".".join(str(p) for p in e["loc"]) or "(top level)"
        msg = e["msg"]
        if e["type"] == "extra_forbidden":
            msg = "unknown field"
        # Our own cross-field checks already name the values involved.
        msg = msg.removeprefix("Value error, ")
        if e["type"] in ("int_parsing", "int_parsing_size", "int_from_float", "int_type") and model is not None:
            # pydantic says only "a valid integer" (for 1e26: "unable to parse input string"): name the range too.
            if e["type"] == "int_parsing_size":
                msg = "Input should be a valid integer, got a number far too large"
            valid = _int_range(model, e["loc"])
            if valid:
                msg += f"; valid: {valid}"
        value = e.get("input")
        if isinstance(value, dict):
            # A whole mapping tells the reader nothing; the message names the offending fields.
            lines.append(f"field '{loc}': {msg}")
            continue
        shown = repr(value)
        if len(shown) > 80:
            shown = shown[:77] + "..."
        lines.append(f"field '{loc}': {msg} (got {shown})")
    more = f"; and {len(lines) - 5} more problems" if len(lines) > 5 else ""
    return f"{source}: " + "; ".join(lines[:5]) + more


def spec_from_dict(data: dict, source: str = "<spec>") -> ModelSpec:
    if not isinstance(data, dict):
        raise UserError(f"{source}: expected a mapping of model fields at the top level, got {type(data).__name__}")
    try:
        return ModelSpec.model_validate(data)
    except ValidationError as err:
        raise UserError(format_validation_error(err, source, ModelSpec)) from None


def load_spec(path: str | Path) -> ModelSpec:
    """Read a model YAML. Every problem becomes a `UserError` naming the file and field."""
    from graph_ir.files import load_yaml

    path = Path(path)
    return spec_from_dict(load_yaml(path, "model file"), str(path))

