"""Self-attention of every family as plain functions over canonical weights, plus the KV store protocol.

GQA covers Mixtral / Qwen2-MoE / Qwen3-MoE / OLMoE / GPT-OSS / GLM-4.5 / Hunyuan-MoE (biases, qk-norm per head
(before or after RoPE) or over all heads, sinks, per-layer sliding window, partial rotary). MLA is DeepSeek-V2/V3's
latent attention. A store whose `mla_latent` is true (the runtime's paged cache) keeps per token only the normed kv
latent and the roped key, [1, kv_lora_rank + rope] (576 values at DeepSeek-V3 against 40,960 decompressed): a
prompt's chunk decompresses its context through kv_b, a decode row attends in the absorbed form (`mla_absorb_q` /
`mla_unabsorb`: q_nope through kv_b's key half into the latent space, the probabilities' latent sum back through its
value half), one kv head whose value is the first kv_lora_rank channels of the key. Other stores (the reference
decoder's, the oracle) keep the decompressed per-head K [nope+rope] and V.

The score math follows HF's eager attention: scores = (q @ k^T) * scale in the activation dtype, masked, softmax
in fp32 (sinks: softmax in the activation dtype after subtracting the row max, as GPT-OSS does), then probs @ v.

`attend` (per segment) is the reference. `attend_decode_batch` is the same math for a batch of
one-row segments over padded K/V; `_attend_rows` (GQA and latent MLA alike) uses it when the store offers the batched
decode API (`write_rows` / `gather`, see runtime/kv_cache.PagedKVStore), because a Python loop of
~12 small torch ops per request per layer was the largest host cost of CPU serving.
"""
from __future__ import annotations

from collections import Counter
from typing import Callable, Optional, Protocol, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from graph_ir.spec import AttentionSpec, ModelSpec
from models.rope import apply_rope, cos_sin, rotary_dim, yarn_get_mscale

# HF builds DeepSeek-V2's q_a_layernorm / kv_a_layernorm without passing rms_norm_eps, so they
# always use the RMSNorm default.
MLA_LATENT_NORM_EPS = 1e-6

Segment = tuple[int, int, int]  # (seq_id, start_row, n_rows)


def rms_norm(x: Tensor, weight: Tensor, eps: float, weight_in_fp32: bool = False) -> Tensor:
    """RMSNorm over the last dim with fp32 statistics.

    Llama-style families cast the normalized value back to the input dtype before multiplying by
    the weight; GPT-OSS multiplies in fp32 and casts after (`weight_in_fp32=True`). Identical in fp32.
    """
    dtype = x.dtype
    xf = x.to(torch.float32)
    xf = xf * torch.rsqrt(xf.pow(2).mean(-1, keepdim=True) + eps)
    return (weight.to(torch.float32) * xf).to(dtype) if weight_in_fp32 else weight * xf.to(dtype)


def norm_in_fp32(spec: ModelSpec) -> bool:
    """Whether this family multiplies the RMSNorm weight in fp32 (see `rms_norm`)."""
    return spec.family == "gpt_oss"


class KVStore(Protocol):
    """Per (layer, sequence) key/value history. Positions of one sequence are written in order."""

    def write(self, layer: int, seq_id: int, positions: Tensor, k: Tensor, v: Tensor) -> None:
        """Store k [n, nkv, dk] and v [n, nkv, dv] at `positions` [n] of sequence `seq_id`."""
        ...

    def read(self, layer: int, seq_id: int, length: int) -> tuple[Tensor, Tensor]:
        """K [length, nkv, dk], V [length, nkv, dv] for positions 0..length-1."""
        ...


def latent_cache(kv) -> bool:
    """Whether MLA layers keep the latent (not the decompressed K/V) in this store (module docstring)."""
    return bool(getattr(kv, "mla_latent", False))


def softmax_scale(a: AttentionSpec) -> float:
    """1/sqrt(qk head dim), times DeepSeek's YaRN mscale(factor, mscale_all_dim)^2 for MLA."""
    if a.softmax_scale is not None:
        return a.softmax_scale
    scale = a.qk_head_dim ** -0.5
    # HF applies this temperature only in DeepSeek-V2's attention (yarn_apply_mscale), for any
    # non-default rope type with mscale_all_dim set.
    if a.kind == "mla" and a.rope.scaling != "none" and a.rope.mscale_all_dim:
        m = yarn_get_mscale(a.rope.factor, a.rope.mscale_all_dim)
        scale = scale * m * m
    return scale


def window_mask(q_pos: Tensor, k_pos: Tensor, window: Optional[int]) -> Tensor:
    """allowed[i, j]: causal, and with a window W key j is within the last W positions of query i
    (itself included), i.e. k > q - W: HF's `sliding_window_overlay`. GPT-OSS W=128 sees 127
    previous tokens plus itself."""
    allowed = k_pos[None, :] <= q_pos[:, None]
    if window is not None:
        allowed &= k_pos[None, :] > (q_pos[:, None] - window)
    return allowed


def attend(q: Tensor, k: Tensor, v: Tensor, q_pos: Tensor, scale: float, window: Optional[int] = None,
           sinks: Optional[Tensor] = None) -> Tensor:
    """Attention of queries q [n, nh, dk] at positions q_pos over keys/values k [L, nkv, dk],
    v [L, nkv, dv] at positions 0..L-1. Query head h uses kv head h // (nh/nkv) (HF repeat_kv).
    Returns [n, nh, dv]."""
    nh, nkv = q.shape[1], k.shape[1]
    rep = nh // nkv
    qh = q.transpose(0, 1)  # [nh, n, dk]
    kh = k.transpose(0, 1).repeat_interleave(rep, dim=0)  # [nh, L, dk]
    vh = v.transpose(0, 1).repeat_interleave(rep, dim=0)
    scores = torch.matmul(qh, kh.transpose(1, 2)) * scale  # [nh, n, L]
    allowed = window_mask(q_pos, torch.arange(k.shape[0], device=q.device), window)
    scores = scores.masked_fill(~allowed[None], float("-inf"))
    probs = _probs(scores, None if sinks is None else sinks.view(nh, 1, 1), q.dtype, v.dtype)
    return torch.matmul(probs, vh).transpose(0, 1)  # [n, nh, dv]


def _probs(scores: Tensor, sinks: Optional[Tensor], q_dtype: torch.dtype, v_dtype: torch.dtype) -> Tensor:
    """Softmax of masked scores over the last dim, in fp32. With `sinks` (GPT-OSS, broadcastable to the scores
    but for the last dim): one extra logit per head competes in the softmax, in the activation dtype after
    subtracting the row max, and is then dropped, so the real keys' weights sum to < 1."""
    if sinks is None:
        return F.softmax(scores, dim=-1, dtype=torch.float32).to(q_dtype)
    combined = torch.cat([scores, sinks.to(scores.dtype).expand(*scores.shape[:-1], 1)], dim=-1)
    combined = combined - combined.max(dim=-1, keepdim=True).values
    return F.softmax(combined, dim=-1, dtype=combined.dtype)[..., :-1].to(v_dtype)


def attend_decode_batch(q: Tensor, k: Tensor, v: Tensor, lengths: Tensor, scale: float,
                        window: Optional[int] = None, sinks: Optional[Tensor] = None) -> Tensor:
    """`attend` of B one-row queries at once: q [B, nh, dk] of row i sits at position lengths[i]-1
    and sees keys 0..lengths[i]-1 of k [B, L, nkv, dk], v [B, L, nkv, dv] (L >= max(lengths);
    keys at or past a row's length are padding, masked). Returns [B, nh, dv].

    GQA groups the query heads of one kv head ([B, nkv, rep, dk] against [B, nkv, dk, L]) rather
    than copying K/V per query head with repeat_interleave: the same head mapping (query head h
    uses kv head h // rep) and the same products, without materializing K/V rep times."""
    B, nh, dk = q.shape
    L, nkv = k.shape[1], k.shape[2]
    rep = nh // nkv
    kt = k.permute(0, 2, 3, 1)  # [B, nkv, dk, L]
    scores = (torch.matmul(q.view(B, nkv, rep, dk), kt) * scale).view(B, nh, L)
    qpos = (lengths - 1).to(torch.int64)
    kpos = torch.arange(L, device=q.device)
    allowed = window_mask(qpos, kpos, window)  # also masks the padding: key >= length
    scores = scores.masked_fill(~allowed[:, None, :], float("-inf"))
    probs = _probs(scores, None if sinks is None else sinks.view(1, nh, 1), q.dtype, v.dtype)
    out = torch.matmul(probs.view(B, nkv, rep, L), v.permute(0, 2, 1, 3))  # [B, nkv, rep, dv]
    return out.reshape(B, nh, v.shape[3])


def _batched_store(kv) -> bool:
    """Whether the store's class implements the batched decode API. Looked up on the type, not the
    instance: wrappers that delegate unknown attributes (runtime/decode_only.RandomPrefixKV fills a
    sequence's random prefix inside `write`) would otherwise be bypassed; they must opt in."""
    t = type(kv)
    return callable(getattr(t, "write_rows", None)) and callable(getattr(t, "gather", None))


def _decode_batch(segments: Sequence[Segment], T: int) -> Optional[tuple]:
    """seq ids when the batch is T one-row segments of distinct sequences at rows 0..T-1, else None."""
    if T == 0 or len(segments) != T:
        return None
    seq_ids, starts, ns = zip(*segments)
    if ns.count(1) != T or starts != tuple(range(T)) or len(set(seq_ids)) != T:
        return None
    return seq_ids


def split_one_row(segments: Sequence[Segment]) -> tuple[list[tuple[int, int]], list]:
    """([(seq id, row)] of the one-row segments whose sequence has no other segment in the batch, [the others])."""
    count = Counter(seq_id for seq_id, _, _ in segments)
    alone = [n == 1 and count[seq_id] == 1 for seq_id, _, n in segments]
    return [(s[0], s[1]) for s, a in zip(segments, alone) if a], [s for s, a in zip(segments, alone) if not a]


def _linear(x: Tensor, w: dict[str, Tensor], name: str) -> Tensor:
    return F.linear(x, w[f"{name}.w"], w.get(f"{name}.b"))


def _attend_rows(kv: KVStore, layer: int, segments: Sequence[Segment], positions: Tensor,
                 host_positions: Optional[Sequence[int]], k: Tensor, v: Tensor, shape: tuple[int, int, int],
                 decode: Callable, prefill: Callable) -> Tensor:
    """Write each segment's rows of k / v into `kv`, then attend its queries over its whole context: [T, nh, dv]
    (`shape`). The attention itself is the caller's: `decode(rows, K, V, lengths)` for one-row segments of distinct
    sequences over padded K/V, `prefill(rows, K, V)` for one segment (rows a slice) over its context.

    A pure decode batch over a store with the batched API takes one batched write, gather and `decode` (no row
    indexing); anything else (prefill, mixed batches, the reference's dense store) goes segment by segment, except
    that a mixed batch's one-row segments still go through the batched path when there are several.
    `host_positions`: the positions as the caller knows them on the host (the stores' page bookkeeping reads them
    there; else they are read back from `positions` once per batch)."""
    pos_cpu = torch.as_tensor(host_positions, dtype=torch.int64) if host_positions is not None else positions.cpu()
    batched = _batched_store(kv)
    seq_ids = _decode_batch(segments, shape[0]) if batched else None
    if seq_ids is not None:
        kv.write_rows(layer, seq_ids, pos_cpu, k, v)
        K, V = kv.gather(layer, seq_ids, (pos_cpu + 1).tolist())
        return decode(slice(None), K, V, positions.to(torch.int64) + 1)
    out = k.new_empty(shape)
    one, rest = split_one_row(segments) if batched else ([], segments)
    if len(one) > 1:
        # A mixed batch (decode rows with a prompt's chunk: what a serving rank runs whenever a request arrives
        # during decode) takes its one-row segments through the batched path and loops over the rest only: one by
        # one, 256 decode rows beside a 40-row chunk cost 18x a pure decode batch on the CPU.
        # Segments of different sequences touch different K/V, so their order does not matter.
        idx = torch.tensor([r for _, r in one], dtype=torch.long)
        rows, seq_ids, pc = idx.to(k.device), [s for s, _ in one], pos_cpu[idx]
        kv.write_rows(layer, seq_ids, pc, k[rows], v[rows])
        K, V = kv.gather(layer, seq_ids, (pc + 1).tolist())
        out[rows] = decode(rows, K, V, positions.index_select(0, rows.to(positions.device)).to(torch.int64) + 1)
        segments = rest
    for seq_id, start, n in segments:
        rows = slice(start, start + n)
        pc = pos_cpu[rows]
        kv.write(layer, seq_id, pc, k[rows], v[rows])
        K, V = kv.read(layer, seq_id, int(pc[-1]) + 1)
        out[rows] = prefill(rows, K, V)
    return out


def _attend_segments(spec: ModelSpec, w: dict[str, Tensor], layer: int, q: Tensor, k: Tensor, v: Tensor,
                     positions: Tensor, segments: Sequence[Segment], kv: KVStore,
                     host_positions: Optional[Sequence[int]] = None) -> Tensor:
    """Write each segment's K/V, then attend its queries over its whole context (`_attend_rows`). [T, nh, dv]."""
    a = spec.attention
    scale, window, sinks = softmax_scale(a), a.window(layer), w.get("sinks")
    return _attend_rows(kv, layer, segments, positions, host_positions, k, v, (q.shape[0], q.shape[1], v.shape[2]),
                        lambda rows, K, V, lengths: attend_decode_batch(q[rows], K, V, lengths, scale, window, sinks),
                        lambda rows, K, V: attend(q[rows], K, V, positions[rows], scale, window, sinks))


def gqa_project(spec: ModelSpec, w: dict[str, Tensor], x: Tensor) -> tuple[Tensor, Tensor, Tensor]:
    """q [T, nh, hd], k/v [T, nkv, hd] of normed x before RoPE (projections, then the q/k norms that precede RoPE).

    Where the weights also hold "qkv.w" (q.w, k.w and v.w stacked: models.weights.stack_qkv), one GEMM makes
    all three and q/k/v are column views of its output: the same products, in another GEMM's summation order."""
    a = spec.attention
    T, nh, nkv, hd = x.shape[0], a.num_heads, a.num_kv_heads, a.head_dim
    eps = spec.rms_norm_eps
    if "qkv.w" in w:
        q, k, v = _linear(x, w, "qkv").split((nh * hd, nkv * hd, nkv * hd), dim=1)
    else:
        q, k, v = _linear(x, w, "q"), _linear(x, w, "k"), _linear(x, w, "v")
    if a.qk_norm == "full":  # OLMoE: one norm over all heads' channels, before the head split
        q, k = rms_norm(q, w["q_norm"], eps), rms_norm(k, w["k_norm"], eps)
    q, k, v = q.view(T, nh, hd), k.view(T, nkv, hd), v.view(T, nkv, hd)
    if a.qk_norm == "head" and not a.qk_norm_after_rope:  # Qwen3 / GLM: per head over head_dim, before RoPE
        q, k = rms_norm(q, w["q_norm"], eps), rms_norm(k, w["k_norm"], eps)
    return q, k, v


def gqa_qkv(spec: ModelSpec, w: dict[str, Tensor], x: Tensor, positions: Tensor,
            rope_cs: Optional[tuple[Tensor, Tensor]] = None) -> tuple[Tensor, Tensor, Tensor]:
    """q [T, nh, hd], k/v [T, nkv, hd] of normed x, RoPE applied. `rope_cs` = precomputed
    (cos, sin) for `positions` (the CUDA executor passes device-side ones so no host copy happens
    inside a CUDA graph); None computes them with `cos_sin`."""
    a = spec.attention
    q, k, v = gqa_project(spec, w, x)
    cos, sin = rope_cs if rope_cs is not None else cos_sin(a.rope, rotary_dim(a.rope, a.head_dim), positions)
    q = apply_rope(q, cos, sin, a.rope.interleaved)
    k = apply_rope(k, cos, sin, a.rope.interleaved)
    if a.qk_norm == "head" and a.qk_norm_after_rope:  # Hunyuan-MoE: the per-head norm of the rotated q / k
        q, k = rms_norm(q, w["q_norm"], spec.rms_norm_eps), rms_norm(k, w["k_norm"], spec.rms_norm_eps)
    return q, k, v


def mla_project(spec: ModelSpec, w: dict[str, Tensor], x: Tensor, positions: Optional[Tensor],
                rope_cs: Optional[tuple[Tensor, Tensor]] = None) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """MLA's per-token parts of normed x: q_nope [T, nh, nope], roped q_pe [T, nh, rope], the normed kv latent
    [T, kv_lora_rank] and the roped shared key k_pe [T, 1, rope] (see `gqa_qkv` for `rope_cs`)."""
    a = spec.attention
    T, nh = x.shape[0], a.num_heads
    nope, rope_d, kvr = a.qk_nope_head_dim, a.qk_rope_head_dim, a.kv_lora_rank
    if a.q_lora_rank is None:
        q = _linear(x, w, "q")
    else:
        q = F.linear(rms_norm(_linear(x, w, "q_a"), w["q_a_norm"], MLA_LATENT_NORM_EPS), w["q_b.w"])
    q = q.view(T, nh, nope + rope_d)
    q_nope, q_pe = q[..., :nope], q[..., nope:]
    ckv = _linear(x, w, "kv_a")
    latent, k_pe = ckv[:, :kvr], ckv[:, kvr:].reshape(T, 1, rope_d)
    latent = rms_norm(latent, w["kv_a_norm"], MLA_LATENT_NORM_EPS)
    cos, sin = rope_cs if rope_cs is not None else cos_sin(a.rope, rope_d, positions)
    q_pe = apply_rope(q_pe, cos, sin, a.rope.interleaved)
    k_pe = apply_rope(k_pe, cos, sin, a.rope.interleaved)
    return q_nope, q_pe, latent, k_pe


def mla_decompress(spec: ModelSpec, w: dict[str, Tensor], latent: Tensor, k_pe: Tensor) -> tuple[Tensor, Tensor]:
    """k [L, nh, nope+rope], v [L, nh, v_hd] of latents [L, kv_lora_rank] and roped keys k_pe [L, 1, rope] (kv_b)."""
    a = spec.attention
    L, nh, nope, vd = latent.shape[0], a.num_heads, a.qk_nope_head_dim, a.v_head_dim
    kvb = F.linear(latent, w["kv_b.w"]).view(L, nh, nope + vd)
    k = torch.cat([kvb[..., :nope], k_pe.expand(L, nh, a.qk_rope_head_dim)], dim=-1)
    return k, kvb[..., nope:].contiguous()


def mla_qkv(spec: ModelSpec, w: dict[str, Tensor], x: Tensor, positions: Tensor,
            rope_cs: Optional[tuple[Tensor, Tensor]] = None) -> tuple[Tensor, Tensor, Tensor]:
    """q/k [T, nh, nope+rope], v [T, nh, v_hd] of normed x, decompressed (see `gqa_qkv` for `rope_cs`)."""
    q_nope, q_pe, latent, k_pe = mla_project(spec, w, x, positions, rope_cs)
    k, v = mla_decompress(spec, w, latent, k_pe)
    return torch.cat([q_nope, q_pe], dim=-1), k, v


def _kv_b_halves(spec: ModelSpec, w: dict[str, Tensor]) -> tuple[Tensor, Tensor]:
    """kv_b's key half [nh, nope, kv_lora_rank] and value half [nh, v_hd, kv_lora_rank] (views, no copy)."""
    a = spec.attention
    kvb = w["kv_b.w"].view(a.num_heads, a.qk_nope_head_dim + a.v_head_dim, a.kv_lora_rank)
    return kvb[:, :a.qk_nope_head_dim], kvb[:, a.qk_nope_head_dim:]


def mla_absorb_q(spec: ModelSpec, w: dict[str, Tensor], q_nope: Tensor, q_pe: Tensor) -> Tensor:
    """The absorbed query [T, nh, kv_lora_rank + rope]: q_nope [T, nh, nope] through kv_b's key half into the latent
    space, then q_pe. Its dot product with a cached row [latent, k_pe] is q . k of the decompressed key."""
    w_uk, _ = _kv_b_halves(spec, w)
    q_lat = torch.bmm(q_nope.transpose(0, 1), w_uk).transpose(0, 1)  # [nh, T, nope] @ [nh, nope, kvr]
    return torch.cat([q_lat, q_pe], dim=-1)


def mla_unabsorb(spec: ModelSpec, w: dict[str, Tensor], out_lat: Tensor) -> Tensor:
    """[T, nh, v_hd] of the attention's latent output [T, nh, kv_lora_rank] (the probabilities' sum of latents)
    through kv_b's value half: the decompressed values' weighted sum."""
    _, w_uv = _kv_b_halves(spec, w)
    return torch.bmm(out_lat.transpose(0, 1), w_uv.transpose(1, 2)).transpose(0, 1)


def latent_rows(latent: Tensor, k_pe: Tensor) -> Tensor:
    """The cached rows [T, 1, kv_lora_rank + rope] of an MLA latent store: latent, then the roped key."""
    return torch.cat([latent, k_pe.reshape(latent.shape[0], -1)], dim=-1).unsqueeze(1)


def _attend_latent_segments(spec: ModelSpec, w: dict[str, Tensor], layer: int, q_nope: Tensor, q_pe: Tensor,
                            latent: Tensor, k_pe: Tensor, positions: Tensor, segments: Sequence[Segment], kv: KVStore,
                            host_positions: Optional[Sequence[int]] = None) -> Tensor:
    """`_attend_segments` over a latent store: [T, nh, v_hd]. The store holds one kv head per token, the latent row
    (`latent_rows`) as K and nothing as V (width 0). One-row segments (decode) attend absorbed, batched where the
    store has the batched API, with the first kv_lora_rank channels of each key as its value; a longer segment (a
    prompt's chunk) decompresses its whole context and attends as the reference does."""
    a = spec.attention
    kvr = a.kv_lora_rank
    scale, window, sinks = softmax_scale(a), a.window(layer), w.get("sinks")
    c = latent_rows(latent, k_pe)

    def absorbed(rows, C, attend_fn, at):
        """Attention in the absorbed form, `attend_fn` being `attend` (`at`: positions) or `attend_decode_batch`
        (`at`: lengths)."""
        q_abs = mla_absorb_q(spec, w, q_nope[rows], q_pe[rows])
        return mla_unabsorb(spec, w, attend_fn(q_abs, C, C[..., :kvr], at, scale, window, sinks))

    def prefill(rows, C, _):
        if rows.stop - rows.start == 1:  # a lone decode row
            return absorbed(rows, C, attend, positions[rows])
        K, V = mla_decompress(spec, w, C[:, 0, :kvr], C[:, :, kvr:])
        return attend(torch.cat([q_nope[rows], q_pe[rows]], dim=-1), K, V, positions[rows], scale, window, sinks)

    # the store's V: none (the latent is K's first channels)
    return _attend_rows(kv, layer, segments, positions, host_positions, c, c.new_empty((c.shape[0], 1, 0)),
                        (c.shape[0], a.num_heads, a.v_head_dim),
                        lambda rows, C, _, lengths: absorbed(rows, C, attend_decode_batch, lengths), prefill)


class PagedAttend(Protocol):
    """The attend step in the form the CUDA executor needs for speed (runtime/executors/cuda_attention.py): K/V
    written into a paged cache through device page tables, optionally fused with RoPE, capturable in a CUDA graph.
    It replaces only `_attend_rows` (and, when `fuses_rope`, the rotation): `attention` still computes the
    projections, biases, q/k norms, the softmax scale, the window and the sinks, so a model feature lives here once."""

    fuses_rope: bool  # attend() rotates q and k itself (GQA, rotate-half): they come to it unrotated

    def cos_sin(self) -> tuple[Tensor, Tensor]:
        """cos, sin [T, rotated/2] of the batch's positions, on the device (the model's RoPE applies them)."""
        ...

    def attend(self, q: Tensor, k: Tensor, v: Tensor, scale: float, window: Optional[int],
               sinks: Optional[Tensor]) -> Tensor:
        """Write k [T, nkv, dk] / v [T, nkv, dv] at the batch's positions, attend q [T, nh, dk]: [T, nh, dv]."""
        ...

    def attend_latent(self, q: Tensor, c: Tensor, kv_lora_rank: int, scale: float, window: Optional[int],
                      sinks: Optional[Tensor]) -> Tensor:
        """MLA over a latent cache: write the rows c [T, 1, kv_lora_rank + rope] (`latent_rows`) at the batch's
        positions, attend the absorbed q [T, nh, kv_lora_rank + rope] with each key's first kv_lora_rank channels as
        its value: [T, nh, kv_lora_rank]."""
        ...


def attention(spec: ModelSpec, w: dict[str, Tensor], layer: int, x: Tensor, positions: Optional[Tensor],
              segments: Sequence[Segment], kv: KVStore, host_positions: Optional[Sequence[int]] = None,
              paged: Optional[PagedAttend] = None) -> Tensor:
    """Self-attention of normed input x [T, H] -> [T, H] (after the output projection): grouped-query
    attention, or DeepSeek's multi-head latent attention (over the latent when `paged` is given or the store's
    `mla_latent`, else decompressed: module docstring). Writes this batch's K/V to `kv` (`host_positions`: see
    _attend_rows), or through `paged` (which then knows the positions; `positions`, `segments` and `kv` are not
    read)."""
    a = spec.attention
    if a.kind == "mla" and (paged is not None or latent_cache(kv)):
        q_nope, q_pe, latent, k_pe = mla_project(spec, w, x, positions,
                                                 rope_cs=paged.cos_sin() if paged is not None else None)
        if paged is None:
            out = _attend_latent_segments(spec, w, layer, q_nope, q_pe, latent, k_pe, positions, segments, kv,
                                          host_positions)
        else:
            o = paged.attend_latent(mla_absorb_q(spec, w, q_nope, q_pe), latent_rows(latent, k_pe), a.kv_lora_rank,
                                    softmax_scale(a), a.window(layer), w.get("sinks"))
            out = mla_unabsorb(spec, w, o)
    elif paged is None:
        q, k, v = (mla_qkv if a.kind == "mla" else gqa_qkv)(spec, w, x, positions)
        out = _attend_segments(spec, w, layer, q, k, v, positions, segments, kv, host_positions)
    else:
        if not paged.fuses_rope:
            q, k, v = gqa_qkv(spec, w, x, positions, rope_cs=paged.cos_sin())
        elif a.rope.interleaved:
            raise ValueError("a fused RoPE + KV write rotates GQA's rotate-half pairs only")
        elif a.qk_norm == "head" and a.qk_norm_after_rope:
            raise ValueError("a fused RoPE + KV write cannot normalize q / k after RoPE (qk_norm_after_rope)")
        else:
            q, k, v = gqa_project(spec, w, x)
        out = paged.attend(q, k, v, softmax_scale(a), a.window(layer), w.get("sinks"))
    return F.linear(out.reshape(x.shape[0], -1), w["o.w"], w.get("o.b"))
