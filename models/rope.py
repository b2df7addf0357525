"""Rotary position embeddings: inverse frequencies, attention scaling, and the rotation itself.

Follows transformers' `modeling_rope_utils` (default / linear / YaRN) and each family's
`apply_rotary_pos_emb`. cos/sin are computed in fp32 from fp32 positions and then cast to the
activation dtype, as HF does, so bf16 runs round at the same place.
"""
from __future__ import annotations

import math
from functools import lru_cache

import torch
from torch import Tensor

from graph_ir.spec import RopeSpec


def rotary_dim(rope: RopeSpec, head_dim: int) -> int:
    """Number of leading channels of a head that are rotated (HF: int(head_dim * partial_rotary_factor))."""
    return int(head_dim * rope.partial_rotary_factor)


def yarn_get_mscale(scale: float, mscale: float = 1.0) -> float:
    """YaRN attention temperature 0.1 * mscale * ln(scale) + 1 (1 when not extrapolating)."""
    return 1.0 if scale <= 1 else 0.1 * mscale * math.log(scale) + 1.0


def _yarn(rope: RopeSpec, dim: int) -> tuple[Tensor, float]:
    """HF `_compute_yarn_parameters`: blend interpolated and extrapolated frequencies over a ramp."""
    base, factor = rope.theta, rope.factor
    if rope.mscale and rope.mscale_all_dim:
        attention_factor = float(yarn_get_mscale(factor, rope.mscale) / yarn_get_mscale(factor, rope.mscale_all_dim))
    else:
        attention_factor = yarn_get_mscale(factor)
    beta_fast = rope.beta_fast or 32
    beta_slow = rope.beta_slow or 1
    orig = rope.original_max_position

    def correction_dim(num_rotations: float) -> float:
        return (dim * math.log(orig / (num_rotations * 2 * math.pi))) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if rope.truncate:
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001  # HF: prevent a zero-width ramp
    ramp = torch.clamp((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    extrapolation_factor = 1 - ramp

    pos_freqs = base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim)
    inv_extra = 1.0 / pos_freqs
    inv_inter = 1.0 / (factor * pos_freqs)
    inv_freq = inv_inter * (1 - extrapolation_factor) + inv_extra * extrapolation_factor
    return inv_freq, attention_factor


@lru_cache(maxsize=64)
def _rope_params_cached(rope_json: str, dim: int) -> tuple[Tensor, float]:
    rope = RopeSpec.model_validate_json(rope_json)
    if rope.scaling == "yarn":
        return _yarn(rope, dim)
    inv_freq = 1.0 / (rope.theta ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if rope.scaling == "linear":
        inv_freq = inv_freq / rope.factor  # linear = positions divided by factor
    return inv_freq, 1.0


def rope_parameters(rope: RopeSpec, dim: int) -> tuple[Tensor, float]:
    """(inv_freq [dim/2] fp32, attention_scaling) for a rotated width of `dim` channels.

    attention_scaling multiplies cos and sin (HF does it that way), so q.k scales by its square.
    """
    inv_freq, scaling = _rope_params_cached(rope.model_dump_json(), dim)
    return inv_freq.clone(), scaling


def cos_sin(rope: RopeSpec, dim: int, positions: Tensor) -> tuple[Tensor, Tensor]:
    """cos, sin of shape [T, dim/2] in fp32 (already multiplied by the attention scaling)."""
    inv_freq, scaling = rope_parameters(rope, dim)
    return rotation(inv_freq.to(positions.device), scaling, positions)


def rotation(inv_freq: Tensor, scaling: float, positions: Tensor) -> tuple[Tensor, Tensor]:
    """cos, sin [T, dim/2] fp32 of `positions` from `rope_parameters`' values. A caller that keeps inv_freq on the
    device (the CUDA executor: no host copy may happen inside a CUDA graph) computes exactly what `cos_sin` does."""
    freqs = positions.to(torch.float32)[:, None] * inv_freq[None, :]
    return freqs.cos() * scaling, freqs.sin() * scaling


def apply_rope(x: Tensor, cos: Tensor, sin: Tensor, interleaved: bool = False) -> Tensor:
    """Rotate the first 2*cos.shape[-1] channels of x [T, n_heads, d]; the rest pass through.

    interleaved=False: pairs (i, i + r/2) as HF's rotate_half (Llama, Mixtral, Qwen, GLM partial,
    GPT-OSS). The rotate-half form x1*c - x2*s / x2*c + x1*s is bitwise what HF computes.
    interleaved=True: pairs (2i, 2i+1) as DeepSeek-V2's complex multiplication in fp32, the
    output stays interleaved (HF does not de-interleave in transformers 5).
    """
    half = cos.shape[-1]
    r = 2 * half
    rot, rest = x[..., :r], x[..., r:]
    c, s = cos[:, None, :], sin[:, None, :]
    if interleaved:
        xf = rot.float()
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).flatten(-2).to(x.dtype)
    else:
        c, s = c.to(x.dtype), s.to(x.dtype)
        x1, x2 = rot[..., :half], rot[..., half:]
        out = torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1)
    return torch.cat((out, rest), dim=-1) if rest.shape[-1] else out
