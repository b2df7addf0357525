"""Token sampling: greedy, or temperature / top-k / top-p with one per-(seed, step) uniform.

A token depends only on (logits, params, step): its uniform is a hash of the request's seed and the step index
(`step_seed`, computed on the host, the same on every device), so the same request yields the same tokens whatever
it was batched with, in whatever order ranks processed it, on whatever rank it ran, and the whole batch is sampled
where its logits are (`sample_tokens`).
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


def _filtered(x: Tensor, params: list[SamplingParams], keys: Optional[Tensor] = None) -> Tensor:
    """Probabilities [R, V] in x's dtype (rows not renormalized after the top-p cut: the draw does not need it) of
    logits x [R, V] after each row's temperature, top-k and top-p (nucleus: the smallest set of
    highest-probability tokens whose mass reaches top_p; the top token is always kept). Row by row the same
    operations whatever the batch: a row's result does not depend on the rows beside it. `keys`: the same logits in
    a narrower dtype (fp32 beside fp64 x) that orders tokens as x does, used for the top-k threshold and the top-p
    sort (the sort is most of top-p's time; fewer bytes, the same order and ties: x is keys widened exactly, and the
    temperature, a positive divisor, keeps distinct values distinct)."""
    keys = x if keys is None else keys
    temp = torch.tensor([p.temperature for p in params], dtype=x.dtype, device=x.device)
    x = x / temp[:, None]
    rows = [i for i, p in enumerate(params) if 0 < p.top_k < x.shape[-1]]
    if rows:
        ks = [params[i].top_k for i in rows]
        idx = torch.tensor(rows, dtype=torch.long, device=x.device)
        sub = keys.index_select(0, idx)
        kk = torch.tensor([k - 1 for k in ks], dtype=torch.long, device=x.device)
        kth = torch.topk(sub, max(ks), dim=-1).values.gather(1, kk[:, None])
        drop = sub < kth
        x = x.index_copy(0, idx, x.index_select(0, idx).masked_fill(drop, float("-inf")))
        keys = keys.index_copy(0, idx, sub.masked_fill(drop, float("-inf")))
    probs = torch.softmax(x, dim=-1)
    rows = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if rows:
        idx = torch.tensor(rows, dtype=torch.long, device=x.device)
        sub = probs.index_select(0, idx)
        order = torch.sort(keys.index_select(0, idx), dim=-1, descending=True, stable=True).indices
        sorted_p = sub.gather(1, order)
        before = torch.cumsum(sorted_p, dim=-1) - sorted_p  # mass strictly above each token
        top = torch.tensor([params[i].top_p for i in rows], dtype=x.dtype, device=x.device)
        drop_sorted = before >= top[:, None]
        drop_sorted[:, 0] = False
        drop = torch.zeros_like(drop_sorted).scatter_(1, order, drop_sorted)
        probs = probs.index_copy(0, idx, sub.masked_fill(drop, 0.0))
    return probs


def filtered_probs(logits: Tensor, params: SamplingParams) -> Tensor:
    """The normalized probabilities [V] (fp64) a sampled token of `logits` [V] is drawn from (see _filtered)."""
    p = _filtered(logits.detach().double()[None], [params])[0]
    return p / p.sum()


def _unit(key: int) -> float:
    """A uniform in [0, 1 - 2^-53] from a 63-bit key: its top 53 bits, exact in float64."""
    return (key >> 10) * (1.0 / (1 << 53))


# rows sampled per pass: bounds the [rows, V] temporaries (fp64 logits, probabilities, running sum: 1.6 MB each per
# row at GPT-OSS's V = 201k)
_SAMPLE_CHUNK = 64


def sample_tokens(logits: Tensor, params: list[Optional[SamplingParams]], steps: list[int]) -> Tensor:
    """Token ids [B] (int64, on the logits' device) of logits [B, V]: row i greedy (argmax in fp32, lowest id wins
    ties) when params[i] is None or greedy, else drawn from _filtered's probabilities by the inverse of their
    cumulative sum in token-id order, at one uniform per row from (params[i].seed, steps[i]) (`step_seed`, `_unit`):
    the first token whose running sum exceeds u times the total. A token the filters dropped is never drawn (its
    running sum equals the one before it). Filters, probabilities and running sum are fp64: with fp32 ones a GPU's
    blocked softmax and a CPU's rounded differently enough to move a boundary across u for 1 row in ~256 at V = 201k;
    in fp64 a CPU and a GPU part only where u lands within ~1e-12 of a boundary. Batched and on the device: no row goes to the host (a 201k-token
    row cost 4-22 ms on the CPU, per row and step, before). A row's token depends only on (its logits, its params,
    its step), never on the rows beside it."""
    x = logits.detach().float()
    out = torch.argmax(x, dim=-1)
    rows = [i for i, p in enumerate(params) if p is not None and not p.greedy]
    for a in range(0, len(rows), _SAMPLE_CHUNK):
        part = rows[a:a + _SAMPLE_CHUNK]
        idx = torch.tensor(part, dtype=torch.long, device=x.device)
        ps = [params[i] for i in part]
        sub = x.index_select(0, idx)
        probs = _filtered(sub.double(), ps, keys=sub)
        cdf = torch.cumsum(probs, dim=-1)
        u = torch.tensor([_unit(step_seed(p.seed, steps[i])) for p, i in zip(ps, part)], dtype=torch.float64,
                         device=x.device)
        # u < 1 - 2^-53, so u * total rounds to below the total (never up to it): the search stops at a kept token
        tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None], right=True)[:, 0]
        out = out.index_copy(0, idx, tok)
    return out


def sample(logits: Tensor, params: SamplingParams, step: int) -> int:
    """One token id from logits [V]. Deterministic in (logits, params, step): sample_tokens of one row."""
    if logits.dim() != 1:
        raise ValueError(f"sample expects logits of shape [V], got {list(logits.shape)}")
    return int(sample_tokens(logits[None], [params], [step])[0])

