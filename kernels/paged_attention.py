"""Decode attention over a paged KV cache: one new query token per sequence.

Cache layout: k_cache [num_blocks, block_size, nkv, dk], v_cache [num_blocks, block_size, nkv, dv].
Position p of sequence b lives in physical block block_table[b, p // block_size], slot
p % block_size. The query of sequence b sits at position context_lens[b] - 1 (its own K/V already
written) and attends positions 0..context_lens[b]-1, except:
- window W: only keys with q_pos - k_pos < W, i.e. the last W positions (transformers'
  `sliding_window_overlay`, used by GPT-OSS's sliding layers);
- sinks [nh]: one extra logit per head that joins the softmax denominator but has no value
  (GPT-OSS), so the real keys' weights sum to less than one.
Query head h reads kv head h // (nh // nkv) (transformers' repeat_kv). A sequence with
context_len 0 (a padding slot of a captured batch) yields zeros.

Scores, softmax and the weighted sum are computed in fp32 (the models' eager attention rounds
scores to the activation dtype first, so bf16 results differ from it by rounding only).

The Triton version is flash-decoding: the context of one (sequence, kv head) is cut into
`num_splits` chunks processed by separate programs (enough programs to fill the GPU even with a
few sequences), each an online softmax over BLOCK_T-token tiles gathered through the block
table; a second small kernel merges the chunks and adds the sink. All query heads of one kv head
share a program, so each K/V tile is read once per group.

A prompt's chunk is rows of this kind too (each row at its own position, attending 0..its own), but
row by row each of its rows re-reads the sequence's keys: `paged_row_block_attention_triton` gives
a block of up to 16 of a chunk's rows (times the head group: a 128-query tile) one program, which
reads each K/V tile once for all of them, and leaves the batch's other rows to the decode kernel.
"""

from __future__ import annotations

import functools

import torch

from dataflow_kernels.dispatch import LazyJit, cdiv, interpreting, kernel_store_dtype, next_power_of_2

tl = None  # triton.language, bound by LazyJit at the first launch (see kernels/dispatch.py)


def _check(q, k_cache, v_cache, block_table, context_lens, sinks) -> None:
    B, nh, dk = q.shape
    if k_cache.dim() != 4 or k_cache.shape[3] != dk or v_cache.shape[:3] != k_cache.shape[:3]:
        raise ValueError(f"k_cache {tuple(k_cache.shape)} / v_cache {tuple(v_cache.shape)} do not match q {tuple(q.shape)}")
    if nh % k_cache.shape[2]:
        raise ValueError(f"{nh} query heads are not a multiple of {k_cache.shape[2]} kv heads")
    if block_table.dim() != 2 or block_table.shape[0] != B or context_lens.shape != (B,):
        raise ValueError(f"block_table {tuple(block_table.shape)} / context_lens {tuple(context_lens.shape)}: expected [{B}, max_blocks] / [{B}]")
    if sinks is not None and sinks.shape != (nh,):
        raise ValueError(f"sinks {tuple(sinks.shape)}: expected [{nh}]")


def paged_decode_attention_torch(
    q, k_cache, v_cache, block_table, context_lens, scale: float, sinks=None, window: int | None = None,
) -> torch.Tensor:
    """Reference: gather each sequence's visible positions, plain fp32 softmax attention."""
    _check(q, k_cache, v_cache, block_table, context_lens, sinks)
    B, nh, _ = q.shape
    block_size, nkv, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    group = nh // nkv
    out = torch.zeros((B, nh, dv), dtype=q.dtype, device=q.device)
    for b, length in enumerate(context_lens.tolist()):
        start = max(0, length - window) if window is not None else 0
        pos = torch.arange(start, length, device=q.device)
        blocks = block_table[b, pos // block_size].long()
        slots = pos % block_size
        K = k_cache[blocks, slots].float().repeat_interleave(group, dim=1)  # [n, nh, dk]
        V = v_cache[blocks, slots].float().repeat_interleave(group, dim=1)  # [n, nh, dv]
        scores = torch.einsum("hd,nhd->hn", q[b].float(), K) * scale
        if sinks is not None:
            scores = torch.cat([scores, sinks.float()[:, None]], dim=1)
        probs = torch.softmax(scores, dim=1)[:, : pos.numel()]
        out[b] = torch.einsum("hn,nhd->hd", probs, V).to(q.dtype)
    return out


def _tile_scores(q, k_ptr, table_row_ptr, t0, hi, block_size, kvh, stride_kb, stride_kt, stride_kh, dk, DK,
                 UPCAST: tl.constexpr, IEEE: tl.constexpr, BLOCK_T: tl.constexpr):
    # Keys t0 .. t0 + BLOCK_T - 1 (< hi) of one sequence through its page table row, kv head kvh: (positions, their
    # mask, page, slot, the unscaled q . k scores [queries, BLOCK_T]).
    pos = t0 + tl.arange(0, BLOCK_T)
    tmask = pos < hi
    block = tl.load(table_row_ptr + pos // block_size, mask=tmask, other=0).to(tl.int64)
    slot = (pos % block_size).to(tl.int64)
    k_rows = block * stride_kb + slot * stride_kt + kvh * stride_kh
    kt = tl.load(k_ptr + k_rows[None, :] + dk[:, None], mask=tmask[None, :] & (dk[:, None] < DK), other=0.0)
    if UPCAST:
        kt = kt.to(tl.float32)
    if IEEE:
        s = tl.dot(q, kt, input_precision="ieee")
    else:
        s = tl.dot(q, kt)
    return pos, tmask, block, slot, s


def _online_softmax_step(s, m, l, acc, v_ptr, block, slot, tmask, kvh, stride_vb, stride_vt, stride_vh, dv, DV,
                         UPCAST: tl.constexpr, IEEE: tl.constexpr):
    # One tile of the online softmax: scaled, masked scores s (-inf where not seen) into the running max m,
    # denominator l and weighted sum acc, with the tile's V rows. Returns the new (m, l, acc).
    m_new = tl.maximum(m, tl.max(s, axis=1))
    alpha = tl.exp(m - m_new)
    p = tl.exp(s - m_new[:, None])
    l = l * alpha + tl.sum(p, axis=1)
    v_rows = block * stride_vb + slot * stride_vt + kvh * stride_vh
    v = tl.load(v_ptr + v_rows[:, None] + dv[None, :], mask=tmask[:, None] & (dv[None, :] < DV), other=0.0)
    if UPCAST:
        v = v.to(tl.float32)
    if IEEE:
        acc = acc * alpha[:, None] + tl.dot(p, v, input_precision="ieee")
    else:
        acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v)
    return m_new, l, acc


def _decode_split_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, part_m_ptr, part_l_ptr, part_acc_ptr,
    scale, window, block_size, stride_table,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh,
    NH, GROUP, DK, DV, SPLITS,
    HAS_WINDOW: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    # Program (sequence b, kv head, split s): online softmax over its chunk of the visible
    # positions, for all GROUP query heads of this kv head. Writes unnormalized partials
    # (running max m, denominator l, weighted sum acc) for the merge kernel.
    b = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    split = tl.program_id(2)
    length = tl.load(lens_ptr + b).to(tl.int32)
    start = 0
    if HAS_WINDOW:
        start = tl.maximum(length - window, 0)
    # Chunk size rounded up to whole tiles so chunks start on tile boundaries.
    chunk = tl.cdiv(tl.cdiv(length - start, SPLITS), BLOCK_T) * BLOCK_T
    lo = start + split * chunk
    hi = tl.minimum(lo + chunk, length)

    g = tl.arange(0, BLOCK_G)
    heads = kvh * GROUP + g
    hmask = g < GROUP
    dk = tl.arange(0, BLOCK_DK)
    dv = tl.arange(0, BLOCK_DV)
    q = tl.load(q_ptr + b * stride_qb + heads[:, None] * stride_qh + dk[None, :],
                mask=hmask[:, None] & (dk[None, :] < DK), other=0.0)
    if UPCAST:
        q = q.to(tl.float32)

    # -1e30 rather than -inf: keeps exp(m_old - m_new) finite when a whole tile is masked.
    m = tl.full([BLOCK_G], -1.0e30, dtype=tl.float32)
    l = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_DV], dtype=tl.float32)
    for t0 in range(lo, hi, BLOCK_T):
        pos, tmask, block, slot, s = _tile_scores(q, k_ptr, table_ptr + b * stride_table, t0, hi, block_size, kvh,
                                                  stride_kb, stride_kt, stride_kh, dk, DK, UPCAST, IEEE, BLOCK_T)
        s = tl.where(tmask[None, :], s * scale, float("-inf"))  # [BLOCK_G, BLOCK_T]
        m, l, acc = _online_softmax_step(s, m, l, acc, v_ptr, block, slot, tmask, kvh, stride_vb, stride_vt, stride_vh,
                                         dv, DV, UPCAST, IEEE)

    part = (b * NH + heads) * SPLITS + split
    tl.store(part_m_ptr + part, m, mask=hmask)
    tl.store(part_l_ptr + part, l, mask=hmask)
    tl.store(part_acc_ptr + part[:, None] * DV + dv[None, :], acc, mask=hmask[:, None] & (dv[None, :] < DV))


def _decode_merge_kernel(
    part_m_ptr, part_l_ptr, part_acc_ptr, sinks_ptr, out_ptr, stride_ob, stride_oh,
    NH, DV, SPLITS,
    HAS_SINKS: tl.constexpr, BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    # Program (sequence, head): rescale the splits' partials to a common max, add the sink's
    # exp to the denominator only, normalize.
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    s = tl.arange(0, BLOCK_S)
    smask = s < SPLITS
    dv = tl.arange(0, BLOCK_DV)
    part = (b * NH + h) * SPLITS + s
    m = tl.load(part_m_ptr + part, mask=smask, other=-1.0e30)
    l = tl.load(part_l_ptr + part, mask=smask, other=0.0)
    acc = tl.load(part_acc_ptr + part[:, None] * DV + dv[None, :], mask=smask[:, None] & (dv[None, :] < DV), other=0.0)
    m_all = tl.max(m, axis=0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + h).to(tl.float32)
        m_all = tl.maximum(m_all, sink)
    w = tl.exp(m - m_all)
    denom = tl.sum(l * w, axis=0)
    if HAS_SINKS:
        denom += tl.exp(sink - m_all)
    num = tl.sum(acc * w[:, None], axis=0)
    # Empty context without sinks: denom 0, output 0 (not NaN).
    o = tl.where(denom > 0, num / tl.where(denom > 0, denom, 1.0), 0.0)
    tl.store(out_ptr + b * stride_ob + h * stride_oh + dv, o.to(out_ptr.dtype.element_ty), mask=dv < DV)


def _row_block_kernel(
    q_ptr, k_ptr, v_ptr, table_ptr, lens_ptr, first_ptr, count_ptr, sinks_ptr, out_ptr,
    scale, window, block_size, stride_table,
    stride_qb, stride_qh, stride_kb, stride_kt, stride_kh, stride_vb, stride_vt, stride_vh, stride_ob, stride_oh,
    GROUP, DK, DV,
    HAS_WINDOW: tl.constexpr, HAS_SINKS: tl.constexpr, UPCAST: tl.constexpr, IEEE: tl.constexpr,
    ROWS: tl.constexpr, BLOCK_G: tl.constexpr, BLOCK_T: tl.constexpr, BLOCK_DK: tl.constexpr, BLOCK_DV: tl.constexpr,
):
    # Program (row block j, kv head): rows first[j] .. first[j] + count[j] - 1, all of one sequence (the same page
    # table), times the GROUP query heads of this kv head, as one M = ROWS * BLOCK_G tile of queries: each K/V tile of
    # the sequence is read once for all of them. Row r's queries see keys 0..lens[r]-1 (and the window), as in the
    # decode kernel; one online softmax over the block's whole key range, the sink added at the end.
    j = tl.program_id(0).to(tl.int64)
    kvh = tl.program_id(1)
    n = tl.load(count_ptr + j)
    if n > 0:
        first = tl.load(first_ptr + j).to(tl.int64)
        mi = tl.arange(0, ROWS * BLOCK_G)
        r = mi // BLOCK_G
        g = mi % BLOCK_G
        valid = (r < n) & (g < GROUP)
        row = first + r
        heads = kvh * GROUP + g
        length = tl.load(lens_ptr + row, mask=r < n, other=0).to(tl.int32)
        qpos = length - 1
        hi = tl.max(tl.where(r < n, length, 0), axis=0)
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(tl.min(tl.where(r < n, length, hi), axis=0) - window, 0)
        lo = lo // BLOCK_T * BLOCK_T
        dk = tl.arange(0, BLOCK_DK)
        dv = tl.arange(0, BLOCK_DV)
        q = tl.load(q_ptr + row[:, None] * stride_qb + heads[:, None] * stride_qh + dk[None, :],
                    mask=valid[:, None] & (dk[None, :] < DK), other=0.0)
        if UPCAST:
            q = q.to(tl.float32)
        m = tl.full([ROWS * BLOCK_G], -1.0e30, dtype=tl.float32)
        l = tl.zeros([ROWS * BLOCK_G], dtype=tl.float32)
        acc = tl.zeros([ROWS * BLOCK_G, BLOCK_DV], dtype=tl.float32)
        for t0 in range(lo, hi, BLOCK_T):
            pos, tmask, block, slot, s = _tile_scores(q, k_ptr, table_ptr + first * stride_table, t0, hi, block_size,
                                                      kvh, stride_kb, stride_kt, stride_kh, dk, DK, UPCAST, IEEE,
                                                      BLOCK_T)
            see = tmask[None, :] & (pos[None, :] <= qpos[:, None]) & valid[:, None]  # [M, BLOCK_T]
            if HAS_WINDOW:
                see &= pos[None, :] > (qpos[:, None] - window)
            s = tl.where(see, s * scale, float("-inf"))
            m, l, acc = _online_softmax_step(s, m, l, acc, v_ptr, block, slot, tmask, kvh, stride_vb, stride_vt,
                                             stride_vh, dv, DV, UPCAST, IEEE)
        if HAS_SINKS:  # the sink joins the denominator only (as the decode merge kernel adds it)
            sink = tl.load(sinks_ptr + heads, mask=valid, other=0.0).to(tl.float32)
            m_all = tl.maximum(m, sink)
            w = tl.exp(m - m_all)
            l = l * w + tl.exp(sink - m_all)
            acc = acc * w[:, None]
        o = tl.where(l[:, None] > 0, acc / tl.where(l > 0, l, 1.0)[:, None], 0.0)
        tl.store(out_ptr + row[:, None] * stride_ob + heads[:, None] * stride_oh + dv[None, :],
                 o.to(out_ptr.dtype.element_ty), mask=valid[:, None] & (dv[None, :] < DV))


_SPLIT = LazyJit(_decode_split_kernel, helpers=(_tile_scores, _online_softmax_step))
_MERGE = LazyJit(_decode_merge_kernel)
_ROW_BLOCK = LazyJit(_row_block_kernel, helpers=(_tile_scores, _online_softmax_step))


@functools.cache
def _sm_count(device: torch.device) -> int:
    return torch.cuda.get_device_properties(device).multi_processor_count if device.type == "cuda" else 4


def default_num_splits(batch: int, nkv: int, max_context: int, device: torch.device) -> int:
    """Context splits per (sequence, kv head): enough programs for ~2 waves over the SMs, but each
    split at least 256 positions long. Uses shapes only (no host sync, CUDA-graph safe)."""
    want = cdiv(2 * _sm_count(device), max(batch * nkv, 1))
    return max(1, min(want, cdiv(max_context, 256), 64))


def paged_decode_attention_triton(
    q, k_cache, v_cache, block_table, context_lens, scale: float, sinks=None, window: int | None = None,
    *, num_splits: int | None = None, block_t: int = 32, num_warps: int = 4,
) -> torch.Tensor:
    """Triton flash-decoding version (split count and tile are keyword-only knobs)."""
    _check(q, k_cache, v_cache, block_table, context_lens, sinks)
    out, qk = _out_and_query(q, k_cache, v_cache)
    if q.shape[0]:
        _decode_into(out, qk, k_cache, v_cache, block_table, context_lens, scale, sinks, window, num_splits, block_t,
                     num_warps)
    return out.to(q.dtype)


def _out_and_query(q, k_cache, v_cache) -> tuple[torch.Tensor, torch.Tensor]:
    """The buffer the kernels store into (in dataflow_kernels.dispatch.kernel_store_dtype of q's dtype) and the query in the
    cache's dtype (tl.dot wants both operands in one dtype), contiguous in the head dimension."""
    if k_cache.stride(-1) != 1 or v_cache.stride(-1) != 1:
        raise ValueError("k_cache / v_cache must be contiguous in the head dimension")  # never copy a cache
    out = torch.empty((*q.shape[:2], v_cache.shape[3]), dtype=kernel_store_dtype(q.dtype), device=q.device)
    qk = q.to(k_cache.dtype)
    return out, (qk if qk.stride(-1) == 1 else qk.contiguous())


def _decode_into(out, q, k_cache, v_cache, block_table, context_lens, scale, sinks, window, num_splits, block_t,
                 num_warps) -> None:
    # The flash-decoding launches (split kernel, merge kernel) for every row of q, into out.
    B, nh, dk = q.shape
    block_size, nkv, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    block_table = block_table.contiguous()
    context_lens = context_lens.contiguous()
    group = nh // nkv
    max_context = block_table.shape[1] * block_size
    if window is not None:
        max_context = min(max_context, window)
    splits = num_splits or default_num_splits(B, nkv, max_context, q.device)
    part_m = torch.empty((B, nh, splits), dtype=torch.float32, device=q.device)
    part_l = torch.empty_like(part_m)
    part_acc = torch.empty((B, nh, splits, dv), dtype=torch.float32, device=q.device)
    # tl.dot needs every dimension >= 16: the head group and the head dims are padded (masked).
    block_g = max(16, next_power_of_2(group))
    block_dk, block_dv = max(16, next_power_of_2(dk)), max(16, next_power_of_2(dv))
    _SPLIT[(B, nkv, splits)](
        q, k_cache, v_cache, block_table, context_lens, part_m, part_l, part_acc,
        float(scale), int(window or 0), block_size, block_table.stride(0),
        q.stride(0), q.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        nh, group, dk, dv, splits,
        HAS_WINDOW=window is not None, UPCAST=interpreting(),
        IEEE=q.dtype == torch.float32 and not interpreting(),
        BLOCK_G=block_g, BLOCK_T=max(16, block_t), BLOCK_DK=block_dk, BLOCK_DV=block_dv,
        num_warps=num_warps,
    )
    _MERGE[(B, nh)](
        part_m, part_l, part_acc, sinks if sinks is not None else part_m, out, out.stride(0), out.stride(1),
        nh, dv, splits, HAS_SINKS=sinks is not None, BLOCK_S=max(2, next_power_of_2(splits)), BLOCK_DV=block_dv,
        num_warps=1,
    )


def row_blocks(rows_of_segments, rows_per_block: int) -> tuple[list[int], list[int]]:
    """(first row, row count) of each block of at most `rows_per_block` consecutive rows of one sequence, from a batch's
    segments (sequence, first row, rows) of more than one row: what `paged_row_block_attention_triton` takes. A one-row
    segment (a decode row) is left to the decode kernel (see there)."""
    first, count = [], []
    for _, start, n in rows_of_segments:
        if n > 1:
            for f in range(start, start + n, rows_per_block):
                first.append(f)
                count.append(min(rows_per_block, start + n - f))
    return first, count


def clear_block_rows(lens, first, count):
    """Every row's context (a tensor or an array) with the rows of the blocks set to 0, in place: the `solo_lens` of
    `paged_row_block_attention_triton`."""
    for f, c in zip(first, count):
        lens[f:f + c] = 0
    return lens


def block_rows_for(nh: int, nkv: int) -> int:
    """Rows per block of `paged_row_block_attention`: a 128-query tile (rows x the padded head group)."""
    return max(1, 128 // next_power_of_2(nh // nkv))


def paged_row_block_attention_triton(
    q, k_cache, v_cache, block_table, context_lens, scale: float, sinks=None, window: int | None = None, *,
    first, count, solo_lens, rows_per_block: int, block_t: int = 64, num_warps: int = 8,
) -> torch.Tensor:
    """`paged_decode_attention` (the same result for every row) with prompt chunks scheduled by row blocks. `first` /
    `count` [>= blocks] int tensors give each block's first row and row count (0: an unused block; at most
    `rows_per_block`), the rows of a block being of one sequence (their block_table rows equal): the row-block kernel
    takes a block's rows times a kv head's query heads as one tile and reads each K/V tile once for them, where the
    decode kernel reads it once per row. Every other row (a decode row, a padding row) goes through the decode kernel
    with its context from `solo_lens` (0 for the rows in a block, which that kernel leaves zero and the row-block kernel
    then writes): in a block of its own such a row would fill 1/rows_per_block of the tile and get no context splits
    (128 decode rows at 2048 beside a chunk, 0.73 ms per layer in blocks against 0.49 row by row).
    `row_blocks` makes the blocks, `clear_block_rows` the solo_lens, `block_rows_for` suggests the block size. Tile:
    block_t 64 with 8 warps was the fastest of the shapes measured on an H200 (a 256-row chunk at 3840: 156 us against 172 at 32)."""
    _check(q, k_cache, v_cache, block_table, context_lens, sinks)
    out, qk = _out_and_query(q, k_cache, v_cache)
    if q.shape[0] == 0:
        return out.to(q.dtype)
    _decode_into(out, qk, k_cache, v_cache, block_table, solo_lens, scale, sinks, window, None, 32, 4)
    nh, dk = q.shape[1:]
    block_size, nkv, dv = k_cache.shape[1], k_cache.shape[2], v_cache.shape[3]
    block_table = block_table.contiguous()
    group = nh // nkv
    block_dk, block_dv = max(16, next_power_of_2(dk)), max(16, next_power_of_2(dv))
    _ROW_BLOCK[(first.shape[0], nkv)](
        qk, k_cache, v_cache, block_table, context_lens, first, count, sinks if sinks is not None else qk, out,
        float(scale), int(window or 0), block_size, block_table.stride(0),
        qk.stride(0), qk.stride(1), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2), out.stride(0), out.stride(1),
        group, dk, dv,
        HAS_WINDOW=window is not None, HAS_SINKS=sinks is not None, UPCAST=interpreting(),
        IEEE=qk.dtype == torch.float32 and not interpreting(),
        ROWS=next_power_of_2(rows_per_block), BLOCK_G=next_power_of_2(group), BLOCK_T=max(16, block_t),
        BLOCK_DK=block_dk, BLOCK_DV=block_dv, num_warps=num_warps,
    )
    return out.to(q.dtype)
