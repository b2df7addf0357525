"""Token sampling: greedy, or temperature / top-k / top-p with a per-(seed, step) generator.

A token depends only on (logits, params, step): each call seeds its own CPU generator from the
request's seed and the step index, so the same request yields the same tokens whatever it was
batched with, in whatever order ranks processed it, and on whatever rank it ran.
"""
from __future__ import annotations

import torch
from pydantic import BaseModel, ConfigDict, Field
from torch import Tensor

_MASK64 = (1 << 64) - 1


class SamplingParams(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    temperature: float = Field(0.0, ge=0)  # 0: greedy (argmax, lowest id wins ties)
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int = Field(0, ge=0)  # 0: no top-k filter
    seed: int = 0

    @property
    def greedy(self) -> bool:
        return self.temperature == 0.0


def _splitmix64(x: int) -> int:
    x = (x + 0x9E3779B97F4A7C15) & _MASK64
    x = ((x ^ (x >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    x = ((x ^ (x >> 27)) * 0x94D049BB133111EB) & _MASK64
    return x ^ (x >> 31)


def step_seed(seed: int, step: int) -> int:
    """A well-mixed 63-bit seed for (request seed, step); neighbouring steps get unrelated streams."""
    return _splitmix64(_splitmix64(seed & _MASK64) ^ (step & _MASK64)) >> 1


def filtered_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """Probabilities [V] in fp32 after temperature, top-k and top-p (nucleus: the smallest set of
    highest-probability tokens whose mass reaches top_p; the top token is always kept)."""
    x = logits.detach().to("cpu", torch.float32) / params.temperature
    if params.top_k and params.top_k < x.shape[-1]:
        kth = torch.topk(x, params.top_k).values[-1]
        x = x.masked_fill(x < kth, float("-inf"))
    probs = torch.softmax(x, dim=-1)
    if params.top_p < 1.0:
        sorted_p, order = torch.sort(probs, descending=True, stable=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each token
        drop_sorted = before >= params.top_p
        drop_sorted[0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(0, order, drop_sorted)
        probs = probs.masked_fill(drop, 0.0)
        probs = probs / probs.sum()
    return probs


def sample(logits: Tensor, params: SamplingParams, step: int) -> int:
    """One token id from logits [V]. Deterministic in (logits, params, step)."""
    if logits.dim() != 1:
        raise ValueError(f"sample expects logits of shape [V], got {list(logits.shape)}")
    if params.greedy:
        return int(torch.argmax(logits.detach().to("cpu", torch.float32)))
    probs = filtered_probs(logits, params)
    g = torch.Generator(device="cpu").manual_seed(step_seed(params.seed, step))
    return int(torch.multinomial(probs, 1, generator=g))


def sample_rows(logits: Tensor, params: list[SamplingParams], steps: list[int]) -> list[int]:
    """sample() for each row of logits [B, V]; row i uses params[i] and steps[i]."""
    return [sample(logits[i], params[i], steps[i]) for i in range(logits.shape[0])]
