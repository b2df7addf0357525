"""The stage functions: the only model math the reference decoder and the runtime call.

Signatures are the contract in ARCHITECTURE.md. Each takes the ModelSpec and the ModelWeights so
a caller never needs to know which family it runs. Activations stay in the weights' dtype; the
places where HF accumulates in fp32 (norm statistics, softmax, router, MoE combine) do too.
"""
from __future__ import annotations

from typing import Callable, Optional, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from graph_ir.spec import ModelSpec
from models.attention import KVStore, PagedAttend, Segment, attention, norm_in_fp32, rms_norm
from models.moe import combine, dense_mlp_out, experts_rows, route_tokens, shared_expert_out
from models.weights import ModelWeights

# The stage functions: embed, attention_stage, dense_mlp, route, experts_forward, shared_expert, moe_combine,
# final_logits (Segment: models.attention's).


def embed(w: ModelWeights, token_ids: Tensor, out: Optional[Tensor] = None) -> Tensor:
    """h [T, H] = embedding rows of token_ids [T]; written into `out` [T, H] when given (the CUDA executor's
    static graph input)."""
    ids = token_ids
    if ids.dtype != torch.long or ids.device != w.embed.device:  # (a no-op .to() is still a torch call on a hot path)
        ids = ids.to(device=w.embed.device, dtype=torch.long)
    return torch.index_select(w.embed, 0, ids) if out is None else torch.index_select(w.embed, 0, ids, out=out)


def attention_stage(spec: ModelSpec, w: ModelWeights, layer: int, h: Tensor, positions: Optional[Tensor],
                    segments: Sequence[Segment], kv: KVStore, host_positions: Optional[Sequence[int]] = None, *,
                    paged: Optional[PagedAttend] = None, norm: Callable = rms_norm,
                    out: Optional[Tensor] = None) -> tuple[Tensor, Tensor]:
    """(h_res, x): h_res = h + attn(norm(h)) (writes this batch's K/V to kv), x = post-attention norm of h_res.
    `host_positions`: `positions` as the host knows them (models.attention._attend_rows).
    The CUDA executor's forms, each an implementation of one step and nothing more: `paged` the attend step over
    its paged cache (models.attention.PagedAttend), `norm` an RMSNorm kernel with `rms_norm`'s signature
    (kernels/rms_norm.py), `out` where h_res is written (a graph's static output)."""
    lw = w.layers[layer]
    fp32w = norm_in_fp32(spec)
    if layer == 0 and spec.embedding_multiplier != 1.0:
        # The embedding's multiplier (Granite) is applied where the first layer reads it, so `embed` stays a plain
        # row lookup every executor can write into its static input, and the residual stream carries the scaled h.
        h = h * spec.embedding_multiplier
    a = attention(spec, lw, layer, norm(h, lw["attn_norm"], spec.rms_norm_eps, fp32w), positions, segments, kv,
                  host_positions, paged)
    if spec.residual_multiplier != 1.0:
        a = a * spec.residual_multiplier
    h_res = h + a if out is None else torch.add(h, a, out=out)
    return h_res, norm(h_res, lw["mlp_norm"], spec.rms_norm_eps, fp32w)


def dense_mlp(spec: ModelSpec, w: ModelWeights, layer: int, x: Tensor) -> Tensor:
    """MLP of a dense layer (times residual_multiplier); the caller adds the residual: h_next = h_res + y."""
    y = dense_mlp_out(spec, w.layers[layer], x)
    return y if spec.residual_multiplier == 1.0 else y * spec.residual_multiplier


def route(spec: ModelSpec, w: ModelWeights, layer: int, x: Tensor) -> tuple[Tensor, Tensor]:
    """(expert_ids [T, k] int64, weights [T, k] fp32), routed scaling included, and the residual multiplier: the
    MoE output is the weighted sum of the experts', so scaling the weights scales it (moe_combine stays spec-free)."""
    ids, weights = route_tokens(spec, w.layers[layer], x)
    return (ids, weights) if spec.residual_multiplier == 1.0 else (ids, weights * spec.residual_multiplier)


def experts_forward(spec: ModelSpec, w: ModelWeights, layer: int, x: Tensor, expert_of_row: Tensor) -> Tensor:
    """y [N, H]: row i through expert expert_of_row[i] (a global id), unweighted. Rows may come in
    any order. Weights holding only some experts (a rank's shard) translate the ids to their rows."""
    return experts_rows(spec, w.layers[layer], x, w.local_rows(layer, expert_of_row))


def shared_expert(spec: ModelSpec, w: ModelWeights, layer: int, x: Tensor) -> Optional[Tensor]:
    """Shared-expert output [T, H] (gated for Qwen2-MoE, times residual_multiplier), or None if the model has none."""
    y = shared_expert_out(spec, w.layers[layer], x)
    return y if y is None or spec.residual_multiplier == 1.0 else y * spec.residual_multiplier


# moe_combine(h_res, shared, y, weights): h_next = h_res + sum_j weights[:, j] * y[:, j] (+ shared), fp32, slot order
# j = 0..k-1 (models.moe.combine; spec-free, so the stage function is that one)
moe_combine = combine


def final_logits(spec: ModelSpec, w: ModelWeights, h: Tensor) -> Tensor:
    """logits [T, V] = LM head(final norm(h)) / logits_scaling; the head is the embedding when tied."""
    x = rms_norm(h, w.final_norm, spec.rms_norm_eps, norm_in_fp32(spec))
    logits = F.linear(x, w.head)
    return logits if spec.logits_scaling == 1.0 else logits / spec.logits_scaling
