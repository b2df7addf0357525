"""Token sampling: greedy, or temperature / top-k / top-p with per-(seed, step) random numbers.

A token depends only on (logits, params, step): its random numbers are a hash of the request's seed, the step
index and the token id (`uniforms`: integer arithmetic, the same bits on every device), so the same request yields
the same tokens whatever it was batched with, in whatever order ranks processed it, on whatever rank it ran, and
the whole batch is sampled where its logits are (`sample_tokens`).
"""
from __future__ import annotations

from typing import Optional

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


def _filtered(x: Tensor, params: list[SamplingParams]) -> Tensor:
    """Probabilities [R, V] in fp32 (rows not renormalized after the top-p cut: the draw does not need it) of
    logits x [R, V] fp32 after each row's temperature, top-k and top-p (nucleus: the smallest set of
    highest-probability tokens whose mass reaches top_p; the top token is always kept). Row by row the same
    operations whatever the batch: a row's result does not depend on the rows beside it."""
    temp = torch.tensor([p.temperature for p in params], dtype=torch.float32, device=x.device)
    x = x / temp[:, None]
    V = x.shape[-1]
    ks = [p.top_k if 0 < p.top_k < V else 0 for p in params]
    if any(ks):
        rows = [i for i, k in enumerate(ks) if k]
        idx = torch.tensor(rows, dtype=torch.long, device=x.device)
        sub = x.index_select(0, idx)
        kk = torch.tensor([ks[i] - 1 for i in rows], dtype=torch.long, device=x.device)
        kth = torch.topk(sub, max(ks), dim=-1).values.gather(1, kk[:, None])
        x = x.index_copy(0, idx, sub.masked_fill(sub < kth, float("-inf")))
    probs = torch.softmax(x, dim=-1)
    ps = [p.top_p for p in params]
    if any(t < 1.0 for t in ps):
        rows = [i for i, t in enumerate(ps) if t < 1.0]
        idx = torch.tensor(rows, dtype=torch.long, device=x.device)
        sub = probs.index_select(0, idx)
        sorted_p, order = torch.sort(sub, dim=-1, descending=True, stable=True)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each token
        top = torch.tensor([ps[i] for i in rows], dtype=torch.float32, device=x.device)
        drop_sorted = before >= top[:, None]
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        probs = probs.index_copy(0, idx, sub.masked_fill(drop, 0.0))
    return probs


def filtered_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """The normalized probabilities [V] a sampled token of `logits` [V] is drawn from (see _filtered)."""
    p = _filtered(logits.detach().float()[None], [params])[0]
    return p / p.sum()


_M32 = 0xFFFFFFFF


def _mul32(x: Tensor, c: int) -> Tensor:
    """(x * c) mod 2^32 for int64 x in [0, 2^32): in two 16-bit halves of c, so no product leaves int64 (an
    overflowing product is undefined behaviour in C++, whatever the hardware does)."""
    return (x * (c & 0xFFFF) + (((x * (c >> 16)) & 0xFFFF) << 16)) & _M32


def _fmix32(x: Tensor) -> Tensor:
    """MurmurHash3's 32-bit finalizer (every input bit flips each output bit with probability ~1/2)."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def uniforms(keys: list[int], n: int, device) -> Tensor:
    """[R, n] fp32 uniforms in (0, 1), entry (r, i) a hash of (keys[r], i): 24 bits, so exact in fp32 and equal on
    every device (integer arithmetic only)."""
    ids = torch.arange(n, dtype=torch.int64, device=device)[None]
    k = torch.tensor([[key & _M32, (key >> 32) & _M32] for key in keys], dtype=torch.int64, device=device)
    x = _fmix32(_mul32(ids, 0x9E3779B1) ^ k[:, :1])
    x = _fmix32(x ^ k[:, 1:])
    return ((x >> 8).to(torch.float32) + 0.5) * (1.0 / (1 << 24))


# rows sampled per pass: bounds the [rows, V] temporaries (int64 hashes: 1.6 MB per row at V = 201k)
_SAMPLE_CHUNK = 32


def sample_tokens(logits: Tensor, params: list[Optional[SamplingParams]], steps: list[int]) -> Tensor:
    """Token ids [B] (int64, on the logits' device) of logits [B, V]: row i greedy (argmax in fp32, lowest id wins
    ties) when params[i] is None or greedy, else drawn from _filtered's probabilities with (params[i].seed,
    steps[i]): by an exponential race, token = argmax_v p_v / E_v with E_v = -log(u_v) and u_v = uniforms(seed,
    step)'s entry v, which picks v with probability p_v exactly (for u's 24-bit resolution). Batched and on the
    device: no row goes to the host (a 201k-token row cost 4-22 ms on the CPU, per row and step, before). A row's
    token depends only on (its logits, its params, its step), never on the rows beside it. Across devices, `log`,
    `softmax` and `cumsum` may round differently in the last bit, so a CPU and a GPU run can part only where two
    candidates' scores (or a top-p cut) tie within that rounding."""
    x = logits.detach().float()
    out = torch.argmax(x, dim=-1)
    rows = [i for i, p in enumerate(params) if p is not None and not p.greedy]
    for a in range(0, len(rows), _SAMPLE_CHUNK):
        part = rows[a:a + _SAMPLE_CHUNK]
        idx = torch.tensor(part, dtype=torch.long, device=x.device)
        ps = [params[i] for i in part]
        probs = _filtered(x.index_select(0, idx), ps)
        u = uniforms([step_seed(p.seed, steps[i]) for p, i in zip(ps, part)], x.shape[-1], x.device)
        out = out.index_copy(0, idx, torch.argmax(probs / -torch.log(u), dim=-1))
    return out


def sample(logits: Tensor, params: SamplingParams, step: int) -> int:
    """One token id from logits [V]. Deterministic in (logits, params, step): sample_tokens of one row."""
    if logits.dim() != 1:
        raise ValueError(f"sample expects logits of shape [V], got {list(logits.shape)}")
    return int(sample_tokens(logits[None], [params], [step])[0])


def sample_rows(logits: Tensor, params: list[SamplingParams], steps: list[int]) -> list[int]:
    """sample() for each row of logits [B, V]; row i uses params[i] and steps[i]."""
    return sample_tokens(logits, params, steps).tolist()
