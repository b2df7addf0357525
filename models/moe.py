"""Routers, routed experts, shared experts and dense MLPs as plain functions over canonical weights.

Router variants (spec.router.scoring):
  softmax       softmax(logits) in fp32, top-k, optional renormalization (Mixtral, Qwen, OLMoE). With
                correction_bias (ERNIE-4.5-MoE) the top-k is taken on probability + bias and the weights
                are the unbiased probabilities.
                With n_group > 1: DeepSeek-V2 `group_limited_greedy`: a group's score is its best
                expert's probability, experts outside the best topk_group groups are zeroed.
  topk_softmax  top-k of the raw logits (router bias included), softmax over those k (GPT-OSS).
  sigmoid       sigmoid scores; selection uses score + correction_bias, groups scored by the sum
                of their top-2 selection scores (GLM-4.5 / DeepSeek-V3 `noaux_tc`); the weights
                are the unbiased scores, optionally renormalized.
All variants end with `* routed_scaling`. Weights come back in fp32, ids in int64, slots sorted by
descending selection score.
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from graph_ir.spec import ModelSpec


def _router_logits_fp32(spec: ModelSpec) -> bool:
    """GLM-4.5, DeepSeek, ERNIE-4.5 and Hunyuan (its gate is an fp32 Linear) compute the router matmul in fp32; the
    others (MiniMax-M2's sigmoid router too: it multiplies in the weight dtype and takes the sigmoid in fp32) in the
    model dtype."""
    return spec.family != "minimax_m2" and (spec.router.scoring == "sigmoid" or spec.family in (
        "deepseek_v2", "glm4_moe", "ernie4_5_moe", "hunyuan_v1_moe"))


def router_logits(spec: ModelSpec, w: dict[str, Tensor], x: Tensor) -> Tensor:
    b = w["router.b"] if spec.router.bias else None
    if _router_logits_fp32(spec):
        return F.linear(x.float(), w["router.w"].float(), None if b is None else b.float())
    return F.linear(x, w["router.w"], b)


def _group_mask(choice: Tensor, n_group: int, topk_group: int, by_top2_sum: bool) -> Tensor:
    """Bool mask [T, E] of experts in the topk_group best groups of `choice` scores."""
    T, E = choice.shape
    grouped = choice.view(T, n_group, E // n_group)
    if by_top2_sum:
        group_scores = grouped.topk(2, dim=-1)[0].sum(dim=-1)
    else:
        group_scores = grouped.max(dim=-1).values
    group_idx = torch.topk(group_scores, k=topk_group, dim=-1)[1]
    gmask = torch.zeros_like(group_scores, dtype=torch.bool).scatter_(1, group_idx, True)
    return gmask.unsqueeze(-1).expand(T, n_group, E // n_group).reshape(T, E)


def route_tokens(spec: ModelSpec, w: dict[str, Tensor], x: Tensor) -> tuple[Tensor, Tensor]:
    """(expert_ids [T, k] int64, weights [T, k] fp32) for MoE input x [T, H]."""
    r, k = spec.router, spec.experts.top_k
    logits = router_logits(spec, w, x)
    if r.scoring == "softmax":
        scores = F.softmax(logits, dim=-1, dtype=torch.float32)
        keep = _group_mask(scores, r.n_group, r.topk_group, by_top2_sum=False) if r.n_group > 1 else None
        if keep is not None:
            scores = scores.masked_fill(~keep, 0.0)
        if r.correction_bias:
            choice = scores + w["router.correction_bias"].float()
            if keep is not None:  # groups are ranked on the unbiased probabilities; the bias only picks within
                choice = choice.masked_fill(~keep, float("-inf"))
            ids = torch.topk(choice, k, dim=-1)[1]
            weights = scores.gather(1, ids)
        else:
            weights, ids = torch.topk(scores, k, dim=-1)
        if r.renormalize:
            weights = weights / weights.sum(dim=-1, keepdim=True)
    elif r.scoring == "topk_softmax":
        top, ids = torch.topk(logits, k, dim=-1)
        weights = F.softmax(top, dim=-1, dtype=top.dtype).float()
    else:  # sigmoid
        scores = logits.float().sigmoid()
        choice = scores + w["router.correction_bias"].float() if r.correction_bias else scores
        if r.n_group > 1:
            choice = choice.masked_fill(~_group_mask(choice, r.n_group, r.topk_group, by_top2_sum=True),
                                        float("-inf"))
        ids = torch.topk(choice, k, dim=-1)[1]
        weights = scores.gather(1, ids)
        if r.renormalize:
            weights = weights / (weights.sum(dim=-1, keepdim=True) + 1e-20)
    if r.routed_scaling != 1.0:
        weights = weights * r.routed_scaling
    return ids.to(torch.int64), weights.to(torch.float32)


def swiglu(x: Tensor, gate: Tensor, up: Tensor, down: Tensor) -> Tensor:
    """down(silu(gate x) * up x): the MLP of every family except GPT-OSS."""
    return F.linear(F.silu(F.linear(x, gate)) * F.linear(x, up), down)


def gptoss_glu(gate: Tensor, up: Tensor, alpha: float, limit: float) -> Tensor:
    """GPT-OSS clamped SwiGLU on already-projected gate/up (biases included):
    gate clamped to <= limit, up to [-limit, limit], out = (up + 1) * gate * sigmoid(alpha * gate)."""
    gate = gate.clamp(max=limit)
    up = up.clamp(min=-limit, max=limit)
    return (up + 1) * (gate * torch.sigmoid(gate * alpha))


def glu(g: Tensor, u: Tensor, activation: str, alpha: float, limit: float) -> Tensor:
    """An expert's activation of its projected gate and up rows (ExpertSpec.activation): the one definition, which
    the grouped FFN kernels' torch reference calls too (kernels/grouped_ffn.py; its Triton version refuses an
    activation it does not implement)."""
    if activation == "gptoss_glu":
        return gptoss_glu(g, u, alpha, limit)
    if activation == "silu_glu":
        return F.silu(g) * u
    raise ValueError(f"expert activation {activation!r} has no definition in models/moe.py")


def experts_rows(spec: ModelSpec, w: dict[str, Tensor], x: Tensor, expert_of_row: Tensor) -> Tensor:
    """Apply expert expert_of_row[i] to row x[i] (rows in any order). Returns [N, H] (unweighted).
    expert_of_row indexes the stacked `experts.*` tensors of `w`: the global expert id when they hold
    every expert, else a row of the shard (layers.experts_forward translates, ModelWeights.local_rows)."""
    ex = spec.experts
    y = x.new_zeros(x.shape)  # (no rows: no expert, y stays empty)
    eids = expert_of_row.to(torch.long)
    for e in torch.unique(eids).tolist():
        rows = (eids == e).nonzero(as_tuple=True)[0]
        xe = x[rows]
        g = F.linear(xe, w["experts.gate"][e], w["experts.gate_b"][e] if ex.bias else None)
        u = F.linear(xe, w["experts.up"][e], w["experts.up_b"][e] if ex.bias else None)
        h = glu(g, u, ex.activation, ex.glu_alpha, ex.glu_limit)
        y[rows] = F.linear(h, w["experts.down"][e], w["experts.down_b"][e] if ex.bias else None)
    return y


def shared_expert_out(spec: ModelSpec, w: dict[str, Tensor], x: Tensor) -> Optional[Tensor]:
    """Shared expert on every token (None when the spec has none), with Qwen2-MoE's sigmoid gate."""
    if not spec.experts.shared_intermediate_size:
        return None
    y = swiglu(x, w["shared.gate"], w["shared.up"], w["shared.down"])
    if spec.experts.shared_gate:
        y = torch.sigmoid(F.linear(x, w["shared_gate.w"])) * y
    return y


def dense_mlp_out(spec: ModelSpec, w: dict[str, Tensor], x: Tensor) -> Tensor:
    return swiglu(x, w["mlp.gate"], w["mlp.up"], w["mlp.down"])


def combine(h_res: Tensor, shared: Optional[Tensor], y: Tensor, weights: Tensor) -> Tensor:
    """h_res + (sum_j weights[:, j] * y[:, j] + shared), accumulated in fp32 in slot order j = 0..k-1.

    The order is part of the contract: the distributed runtime calls this same function with rows
    put back in slot order, so reference and runtime agree bit for bit.
    """
    acc = torch.zeros(y.shape[0], y.shape[2], dtype=torch.float32, device=y.device)
    for j in range(y.shape[1]):
        acc = acc + y[:, j].float() * weights[:, j, None].float()
    if shared is not None:
        acc = acc + shared.float()
    return (h_res.float() + acc).to(h_res.dtype)
