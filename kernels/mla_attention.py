"""MLA decode attention over a paged latent cache (DeepSeek-V2/V3), and the write of the latent rows into it.

Cache layout: cache [num_blocks, block_size, 1, R + P]: per token the normed kv latent (R = kv_lora_rank channels)
then the roped key (P = qk_rope_head_dim), one kv head shared by all query heads (models.attention.latent_rows). The
absorbed query q [B, nh, R + P] (models.attention.mla_absorb_q) scores against the whole row; a key's value is its
first R channels, so the output is [B, nh, R] (models.attention.mla_unabsorb projects it to the heads' values).
This is the paged decode attention of kernels/paged_attention.py with one kv head and V a view of K: no copy of the
cache, and the same context, window and sink semantics. Row i sits at position context_lens[i] - 1 and sees keys
0..context_lens[i]-1 of its page-table row.

Three forms, one result (`paged_mla_attention` picks one):
- the reference (impl="torch": paged_decode_attention_torch over the cache: a host loop, not capturable);
- `paged_mla_attention_gather`: torch ops without a host sync (capturable in a CUDA graph): every row gathers its
  table row's pages (the table's full width) and masks past its context; the GPU's fallback where the Triton kernel's
  tiles do not fit (`triton_fits`: fp32 caches, more than 16 heads);
- the Triton flash-decoding kernel of kernels/paged_attention.py over the same views (impl="triton" where it fits;
  all query heads of a sequence in one program: their head group is nh).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from dataflow_kernels.dispatch import next_power_of_2
from dataflow_kernels.paged_attention import paged_decode_attention_torch, paged_decode_attention_triton

# The Triton decode kernel keeps a [head group, value width] fp32 accumulator and a [head group, key width] query per
# program, both padded to powers of two. On an H200 (Triton 3.6, 232 KB of shared memory per block) 16 heads x 512
# latent channels (DeepSeek-V2-Lite) in bf16 fit; in fp32 (IEEE dots) they need 264 KB, and 128 heads (DeepSeek-V3)
# need 459 KB in bf16 (the compiler's out-of-resources reports): there the gather form runs.
TRITON_MAX_TILE = 16 * 512


def _check(q: Tensor, cache: Tensor, rank: int) -> None:
    if cache.dim() != 4 or cache.shape[2] != 1 or cache.shape[3] != q.shape[2] or not 0 < rank < cache.shape[3]:
        raise ValueError(f"latent cache {tuple(cache.shape)} with kv_lora_rank {rank} does not match the absorbed "
                         f"query {tuple(q.shape)}: expected [pages, block, 1, {q.shape[2]}]")


def paged_mla_attention_gather(q: Tensor, cache: Tensor, rank: int, block_table: Tensor, context_lens: Tensor,
                               scale: float, sinks: Optional[Tensor] = None, window: Optional[int] = None) -> Tensor:
    """Capturable torch form: [B, nh, rank], fp32 softmax like the reference. Reads block_table's full width of pages
    per row (B x width x block rows of R + P values: the CUDA executor's width is max_context)."""
    _check(q, cache, rank)
    B, nh, _ = q.shape
    L = block_table.shape[1] * cache.shape[1]  # pages x page size
    # in the cache's dtype (the products accumulate in fp32): a float copy of the gathered rows would double them
    rows = cache[block_table.to(torch.int64)].view(B, L, cache.shape[3])  # [B, L, R + P]
    scores = torch.bmm(q.to(rows.dtype), rows.transpose(1, 2)).float() * scale  # [B, nh, L]
    kpos = torch.arange(L, device=q.device)
    ctx = context_lens.to(torch.int64)
    allowed = kpos[None, :] < ctx[:, None]
    if window is not None:
        allowed &= kpos[None, :] >= (ctx[:, None] - window)
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    if sinks is not None:
        scores = torch.cat([scores, sinks.float().view(1, nh, 1).expand(B, nh, 1)], dim=-1)
    else:  # a row with no context (a padded row: context 0) gets zeros, as the kernels give, not NaN
        scores = torch.cat([scores, scores.new_full((B, nh, 1), -1e30)], dim=-1)
    probs = F.softmax(scores, dim=-1)[..., :L]
    return torch.bmm(probs.to(rows.dtype), rows[..., :rank]).to(q.dtype)


def triton_fits(num_heads: int, rank: int, dtype: torch.dtype) -> bool:
    """Whether the Triton decode kernel's per-program tiles fit for this head count, latent width and cache dtype."""
    return dtype != torch.float32 and max(16, next_power_of_2(num_heads)) * next_power_of_2(rank) <= TRITON_MAX_TILE


def paged_mla_attention(q: Tensor, cache: Tensor, rank: int, block_table: Tensor, context_lens: Tensor, scale: float,
                        sinks: Optional[Tensor] = None, window: Optional[int] = None, *, impl: str = "torch") -> Tensor:
    """[B, nh, rank] by `impl`: "torch" (the reference), or "triton" (the GPU's choice): the Triton kernel where
    `triton_fits`, else the capturable gather form. The reference and the kernel are kernels/paged_attention.py's
    over the cache, with V its first `rank` channels (a view)."""
    if impl == "triton" and not triton_fits(q.shape[1], rank, cache.dtype):
        return paged_mla_attention_gather(q, cache, rank, block_table, context_lens, scale, sinks, window)
    _check(q, cache, rank)
    attend = paged_decode_attention_triton if impl == "triton" else paged_decode_attention_torch
    return attend(q, cache, cache[..., :rank], block_table, context_lens, scale, sinks, window)
