"""kernels/: torch references against naive loops and the models' math, Triton kernels against the
references.

Shapes are odd on purpose (H=72, I=40, E=9, k=3, 6 query heads on 2 kv heads, block size 4, ragged
contexts including 0 and 1, empty and overfull experts) so nothing passes by symmetry.

Without a GPU the Triton kernels run in Triton's CPU interpreter. Triton fixes interpret mode
when it is imported, and `kernels` only imports it at the first launch, so the `triton_device`
fixture sets TRITON_INTERPRET=1 before that. If some earlier test already imported triton in
compiled mode, the Triton tests are re-run in a subprocess instead (last test of this file).
Interpreter caveats (handled in kernels/, see kernels/dispatch.py): its bf16 `tl.dot` is wrong
(kernels upcast to fp32 under the interpreter) and its fp32->bf16 cast truncates (kernels store
fp32 and the wrapper rounds with torch).
"""

from __future__ import annotations

import importlib.util
import math
import os
import subprocess
import sys
from types import SimpleNamespace

import pytest
import torch

from dataflow_kernels.dispatch import backend_for
from dataflow_kernels.grouped_ffn import grouped_ffn, grouped_ffn_torch, grouped_ffn_triton
from dataflow_kernels.paged_attention import (block_rows_for, clear_block_rows, paged_decode_attention_torch,
                                     paged_decode_attention_triton, paged_row_block_attention_triton, row_blocks)
from dataflow_kernels.permute import gather_rows_torch, gather_rows_triton, permute_to_experts_torch, permute_to_experts_triton
from dataflow_kernels.topk_merge import topk_merge, topk_merge_torch, topk_merge_triton

H, I, E, K = 72, 40, 9, 3
HAS_TRITON = importlib.util.find_spec("triton") is not None
DTYPES = [torch.float32, torch.bfloat16]


def _interpreter_blocked() -> bool:
    """True when triton was imported in compiled mode before we could ask for the interpreter."""
    return not torch.cuda.is_available() and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"


@pytest.fixture(scope="module")
def triton_device() -> str:
    if not HAS_TRITON:
        pytest.skip("triton is not importable: only the torch references are tested")
    if torch.cuda.is_available():
        return "cuda"
    if _interpreter_blocked():
        pytest.skip("triton was imported without TRITON_INTERPRET=1 earlier in this process; "
                    "test_triton_kernels_in_subprocess runs these tests instead")
    os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import (it happens at first launch)
    return "cpu"


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _skewed_ids(T: int, seed: int) -> torch.Tensor:
    """[T, K] expert ids: expert 2 never chosen, expert 0 very hot."""
    g = _gen(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids = torch.where(ids == 2, torch.zeros_like(ids), ids)  # empty expert (kernels allow repeats)
    ids[: T // 2, 0] = 0  # hot expert: more rows than one 16-row tile
    return ids


# ------------------------------------------------------------------------------------------
# top-k merge


def _merge_inputs(T: int, N: int, dtype, device, seed: int = 0):
    g = _gen(seed)
    h_res = torch.randn(T, H, generator=g).to(dtype)
    shared = torch.randn(T, H, generator=g).to(dtype)
    # rows as a strided view into a wider receive buffer: the kernel must honour the row stride.
    buf = torch.randn(N, H + 8, generator=g).to(dtype)
    rows = buf[:, 3 : 3 + H]
    row_index = torch.stack([torch.randperm(N, generator=g)[:K] for _ in range(T)] or [torch.zeros(0, K, dtype=torch.int64)])
    row_index = row_index.view(T, K)
    weights = torch.rand(T, K, generator=g)
    return [t.to(device) for t in (h_res, shared, rows, row_index, weights)]


def _topk_merge_naive(h_res, shared, rows, row_index, weights):
    out = torch.empty_like(h_res)
    for t in range(h_res.shape[0]):
        acc = torch.zeros(h_res.shape[1], dtype=torch.float32)
        for j in range(row_index.shape[1]):
            acc = acc + weights[t, j] * rows[row_index[t, j]].float()
        if shared is not None:
            acc = acc + shared[t].float()
        out[t] = (acc + h_res[t].float()).to(h_res.dtype)
    return out


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_shared", [True, False])
def test_topk_merge_reference_is_moe_combine_bitwise(dtype, with_shared):
    layers = pytest.importorskip("models.layers")
    h_res, shared, rows, row_index, weights = _merge_inputs(7, 25, dtype, "cpu")
    shared = shared if with_shared else None
    ref = topk_merge_torch(h_res, shared, rows, row_index, weights)
    assert torch.equal(ref, layers.moe_combine(h_res, shared, rows[row_index], weights))
    assert torch.equal(ref, _topk_merge_naive(h_res, shared, rows, row_index, weights))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("with_shared", [True, False])
def test_topk_merge_triton_bitwise(triton_device, dtype, with_shared):
    h_res, shared, rows, row_index, weights = _merge_inputs(7, 25, dtype, triton_device, seed=1)
    shared = shared if with_shared else None
    ref = topk_merge_torch(h_res, shared, rows, row_index, weights)
    # Same op order, no FMA contraction: bit-identical, which the runtime relies on.
    assert torch.equal(topk_merge_triton(h_res, shared, rows, row_index, weights), ref)


@pytest.mark.parametrize("dtype", DTYPES)
def test_topk_merge_into_given_rows_of_a_larger_buffer(triton_device, dtype):
    """out= (the CUDA executor writes a combine straight into an attention bucket's static input rows): the same bits
    as a new tensor, written in place and returned, the buffer's other rows untouched; a wrong shape is refused."""
    h_res, shared, rows, row_index, weights = _merge_inputs(7, 25, dtype, triton_device, seed=2)
    ref = topk_merge_torch(h_res, shared, rows, row_index, weights)
    for merge in (topk_merge_torch, topk_merge_triton):
        buf = torch.full((9, H), 5.0, dtype=dtype, device=triton_device)
        got = merge(h_res, shared, rows, row_index, weights, buf[:7])
        assert got.data_ptr() == buf.data_ptr() and torch.equal(got, ref) and torch.equal(buf[:7], ref)
        assert bool((buf[7:] == 5.0).all())
        with pytest.raises(ValueError, match="out"):
            merge(h_res, shared, rows, row_index, weights, buf[:6])


def test_topk_merge_triton_empty_batch(triton_device):
    h_res, shared, rows, row_index, weights = _merge_inputs(0, 4, torch.float32, triton_device)
    assert topk_merge_triton(h_res, shared, rows, row_index, weights).shape == (0, H)


# ------------------------------------------------------------------------------------------
# permute + gather


def _permute_naive(expert_ids, num_experts):
    flat = expert_ids.reshape(-1).tolist()
    order = sorted(range(len(flat)), key=lambda r: (flat[r], r))
    counts = [flat.count(e) for e in range(num_experts)]
    offsets = [0]
    for c in counts:
        offsets.append(offsets[-1] + c)
    return torch.tensor(order, dtype=torch.int64), torch.tensor(offsets, dtype=torch.int64)


@pytest.mark.parametrize("T", [0, 1, 11, 300])  # 300*3 rows: several chunks in the Triton kernel
def test_permute_reference_is_stable_counting_sort(T):
    ids = _skewed_ids(T, seed=T) if T else torch.zeros(0, K, dtype=torch.int64)
    order, offsets = permute_to_experts_torch(ids, E)
    n_order, n_offsets = _permute_naive(ids, E)
    assert torch.equal(order, n_order) and torch.equal(offsets, n_offsets)
    if T:
        assert offsets[3] == offsets[2]  # expert 2 is empty


@pytest.mark.parametrize("T", [0, 1, 11, 300])
def test_permute_triton(triton_device, T):
    ids = (_skewed_ids(T, seed=T) if T else torch.zeros(0, K, dtype=torch.int64)).to(triton_device)
    order, offsets = permute_to_experts_triton(ids, E)
    r_order, r_offsets = permute_to_experts_torch(ids, E)
    assert torch.equal(order, r_order) and torch.equal(offsets, r_offsets)


def test_permute_triton_chunks_with_sentinels(triton_device):
    """A routed expert batch's shape: 2,048 slots over a rank's 16 held experts with sentinel ids (16: not held or
    padding) anywhere; several chunks, each ranked by its own program, give the stable sort with sentinels unplaced."""
    ids = torch.randint(0, 17, (512, 4), generator=_gen(7))
    got_o, got_off = permute_to_experts_triton(ids.to(triton_device), 16)
    ref_o, ref_off = permute_to_experts_torch(ids.clamp(max=16), 17)
    n = int(ref_off[16])  # rows of held experts; the sentinel rows sort last in the reference and are unplaced here
    assert torch.equal(got_off.cpu(), ref_off[:17]) and torch.equal(got_o[:n].cpu(), ref_o[:n])


def test_permute_triton_many_experts(triton_device):
    ids = torch.randint(0, 130, (50, 4), generator=_gen(3)).to(triton_device)  # E not a power of two
    got, ref = permute_to_experts_triton(ids, 130), permute_to_experts_torch(ids, 130)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_rows_triton(triton_device, dtype):
    x = torch.randn(11, H, generator=_gen(4)).to(dtype).to(triton_device)
    src = torch.randint(0, 11, (33,), generator=_gen(5)).to(triton_device)
    assert torch.equal(gather_rows_triton(x, src), gather_rows_torch(x, src))
    assert gather_rows_triton(x, src[:0]).shape == (0, H)


# ------------------------------------------------------------------------------------------
# grouped expert FFN


def _ffn_inputs(dtype, device, with_bias: bool, seed: int = 0, T: int = 13):
    g = _gen(seed)
    ids = _skewed_ids(T, seed)
    order, offsets = permute_to_experts_torch(ids, E)
    x = torch.randn(T, H, generator=g)[order // K]  # token rows in expert order
    # Scales chosen so pre-activations reach past GPT-OSS's clamp limit (7) on both sides.
    w_gate = torch.randn(E, I, H, generator=g) * 0.5
    w_up = torch.randn(E, I, H, generator=g) * 0.5
    w_down = torch.randn(E, H, I, generator=g) * 0.2
    biases = (torch.randn(E, I, generator=g), torch.randn(E, I, generator=g), torch.randn(E, H, generator=g))
    if not with_bias:
        biases = (None, None, None)
    cast = lambda t: None if t is None else t.to(dtype).to(device)  # noqa: E731
    return [cast(x), offsets.to(device), cast(w_gate), cast(w_up), cast(w_down), *map(cast, biases)]


def _ffn_naive(x, offsets, w_gate, w_up, w_down, b_gate, b_up, b_down, activation, alpha=1.702, limit=7.0):
    """float64, one row at a time, from the formula in kernels/grouped_ffn.py's docstring."""
    y = torch.zeros(x.shape, dtype=torch.float64)
    for r in range(x.shape[0]):
        e = int(torch.searchsorted(offsets[1:], torch.tensor(r), right=True))
        xr = x[r].double()
        gt = w_gate[e].double() @ xr + (b_gate[e].double() if b_gate is not None else 0)
        up = w_up[e].double() @ xr + (b_up[e].double() if b_up is not None else 0)
        if activation == "gptoss_glu":
            gt, up = gt.clamp(max=limit), up.clamp(-limit, limit)
            h = (up + 1) * gt * torch.sigmoid(alpha * gt)
        else:
            h = gt * torch.sigmoid(gt) * up
        y[r] = w_down[e].double() @ h + (b_down[e].double() if b_down is not None else 0)
    return y


@pytest.mark.parametrize("activation", ["silu_glu", "gptoss_glu"])
def test_grouped_ffn_reference(activation):
    args = _ffn_inputs(torch.float32, "cpu", with_bias=True)
    ref = grouped_ffn_torch(*args, activation=activation)
    torch.testing.assert_close(ref.double(), _ffn_naive(*args, activation), rtol=1e-4, atol=1e-4)
    moe = pytest.importorskip("models.moe")
    # Op for op the same as the models' expert math, hence bit-equal.
    x, offsets, w_gate, w_up, w_down, b_gate, b_up, b_down = args
    spec = SimpleNamespace(experts=SimpleNamespace(bias=True, activation=activation, glu_alpha=1.702, glu_limit=7.0))
    w = {"experts.gate": w_gate, "experts.up": w_up, "experts.down": w_down,
         "experts.gate_b": b_gate, "experts.up_b": b_up, "experts.down_b": b_down}
    expert_of_row = torch.searchsorted(offsets[1:], torch.arange(x.shape[0]), right=True)
    assert torch.equal(ref, moe.experts_rows(spec, w, x, expert_of_row))


def test_gptoss_glu_matches_transformers():
    modeling = pytest.importorskip("transformers.models.gpt_oss.modeling_gpt_oss")
    g = _gen(6)
    gate_up = torch.randn(5, 2 * I, generator=g) * 6  # interleaved: gate = [..., ::2], up = [..., 1::2]
    expected = modeling.GptOssExperts._apply_gate(SimpleNamespace(alpha=1.702, limit=7.0), gate_up)
    from models.moe import glu  # (the grouped FFN's torch reference applies the model's own activation)

    assert torch.equal(glu(gate_up[:, ::2], gate_up[:, 1::2], "gptoss_glu", 1.702, 7.0), expected)


def _ffn_tol(ref: torch.Tensor, dtype) -> dict:
    # fp32: accumulation order only. bf16: the reference rounds g/u to bf16 before the activation
    # and h to bf16 before the down projection; the kernel rounds h only: a few bf16 ulps.
    scale = ref.abs().max().item()
    return dict(rtol=1e-4, atol=1e-4 * scale) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2 * scale)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("activation", ["silu_glu", "gptoss_glu"])
@pytest.mark.parametrize("with_bias", [True, False])
def test_grouped_ffn_triton(triton_device, dtype, activation, with_bias):
    args = _ffn_inputs(dtype, triton_device, with_bias, seed=7)
    ref = grouped_ffn_torch(*args, activation=activation).float()
    for block_m in (None, 16, 32):  # the hot expert spans several 16-row tiles
        got = grouped_ffn_triton(*args, activation=activation, block_m=block_m).float()
        torch.testing.assert_close(got, ref, **_ffn_tol(ref, dtype))


def test_grouped_ffn_triton_empty_batch(triton_device):
    x, offsets, *rest = _ffn_inputs(torch.float32, triton_device, True)
    assert grouped_ffn_triton(x[:0], torch.zeros_like(offsets), *rest).shape == (0, H)


# ------------------------------------------------------------------------------------------
# paged decode attention

NH, NKV, DK, DV, BLOCK = 6, 2, 24, 20, 4
LENS = [1, 7, 0, 30, 13, 4]  # ragged, one empty (a padding slot), one exactly one block


def _paged_inputs(dtype, device, seed: int = 0):
    g = _gen(seed)
    B, max_blocks = len(LENS), math.ceil(max(LENS) / BLOCK) + 1
    num_blocks = B * max_blocks + 3
    q = torch.randn(B, NH, DK, generator=g)
    k_cache = torch.randn(num_blocks, BLOCK, NKV, DK, generator=g)
    v_cache = torch.randn(num_blocks, BLOCK, NKV, DV, generator=g)
    # Physical blocks scattered and out of order.
    table = torch.randperm(num_blocks, generator=g)[: B * max_blocks].view(B, max_blocks).to(torch.int32)
    sinks = torch.randn(NH, generator=g)
    cast = lambda t: t.to(dtype).to(device)  # noqa: E731
    return cast(q), cast(k_cache), cast(v_cache), table.to(device), torch.tensor(LENS, dtype=torch.int32, device=device), cast(sinks)


def _contiguous_kv(k_cache, v_cache, table, b, length):
    pos = torch.arange(length)
    blocks, slots = table[b, pos // BLOCK].long(), pos % BLOCK
    return k_cache[blocks, slots], v_cache[blocks, slots]


def _paged_naive(q, k_cache, v_cache, table, lens, scale, sinks, window):
    out = torch.zeros(q.shape[0], NH, DV, dtype=torch.float64)
    for b, length in enumerate(lens.tolist()):
        Kc, Vc = _contiguous_kv(k_cache, v_cache, table, b, length)
        for h in range(NH):
            kvh = h // (NH // NKV)
            keys = [p for p in range(length) if window is None or (length - 1) - p < window]
            logits = [float(q[b, h].double() @ Kc[p, kvh].double()) * scale for p in keys]
            extra = [float(sinks[h])] if sinks is not None else []
            if not logits:
                continue
            mx = max(logits + extra)
            den = sum(math.exp(x - mx) for x in logits + extra)
            for p, x in zip(keys, logits):
                out[b, h] += math.exp(x - mx) / den * Vc[p, kvh].double()
    return out


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("with_sinks", [True, False])
def test_paged_attention_reference(window, with_sinks):
    q, k_cache, v_cache, table, lens, sinks = _paged_inputs(torch.float32, "cpu")
    sinks = sinks if with_sinks else None
    ref = paged_decode_attention_torch(q, k_cache, v_cache, table, lens, 0.3, sinks, window)
    torch.testing.assert_close(ref.double(), _paged_naive(q, k_cache, v_cache, table, lens, 0.3, sinks, window),
                               rtol=1e-5, atol=1e-5)
    attention = pytest.importorskip("models.attention")
    for b, length in enumerate(LENS):
        if length == 0:
            continue
        Kc, Vc = _contiguous_kv(k_cache, v_cache, table, b, length)
        expected = attention.attend(q[b : b + 1], Kc, Vc, torch.tensor([length - 1]), 0.3, window, sinks)
        torch.testing.assert_close(ref[b], expected[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("with_sinks", [True, False])
def test_paged_attention_triton(triton_device, dtype, window, with_sinks):
    q, k_cache, v_cache, table, lens, sinks = _paged_inputs(dtype, triton_device, seed=1)
    sinks = sinks if with_sinks else None
    ref = paged_decode_attention_torch(q, k_cache, v_cache, table, lens, 0.3, sinks, window).float()
    # bf16 on the GPU: probabilities are rounded to bf16 for the P @ V tensor-core dot.
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    for splits in (1, 3):  # 3 splits: chunks of 16 positions, some of them empty
        got = paged_decode_attention_triton(q, k_cache, v_cache, table, lens, 0.3, sinks, window,
                                            num_splits=splits, block_t=16).float()
        torch.testing.assert_close(got, ref, **tol)
        assert torch.all(got[2] == 0)  # empty context


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("with_sinks", [True, False])
def test_paged_row_block_attention_equals_the_decode_kernel_row_by_row(triton_device, dtype, window, with_sinks):
    """A batch of prompt chunks and decode rows (rows of one sequence share its page-table row; a 40-row chunk spans
    two blocks; a padding row of context 0) through the row-block schedule, the chunks' rows by blocks and the others
    through the decode kernel: each row's result is paged_decode_attention's for that row."""
    q0, k_cache, v_cache, table, _, sinks = _paged_inputs(dtype, triton_device, seed=2)
    sinks = sinks if with_sinks else None
    # (table row, first position, rows): a 6-row chunk at 3.., a decode row at 29, a 40-row chunk at 0.., padding
    segs = [(1, 3, 6), (3, 29, 1), (0, 0, 40), (2, -1, 1)]
    T = sum(n for *_, n in segs)
    big = torch.cat([table] * 6, dim=1)[:, : math.ceil(41 / BLOCK)]  # room for 40 positions (pages reused: reads only)
    rows = [t for t, _, n in segs for _ in range(n)]
    lens = torch.tensor([p + i + 1 for _, p, n in segs for i in range(n)], dtype=torch.int32, device=triton_device)
    bt = big[torch.tensor(rows)].to(triton_device)
    q = torch.randn(T, NH, DK, generator=_gen(5)).to(dtype).to(triton_device)
    ref = paged_decode_attention_torch(q, k_cache, v_cache, bt, lens, 0.3, sinks, window).float()
    per = block_rows_for(NH, NKV)
    first, count = row_blocks([(t, sum(n for *_, n in segs[:i]), n) for i, (t, _, n) in enumerate(segs)], per)
    assert count == [6, per, 40 - per]  # the one-row segments are left to the decode kernel
    solo = clear_block_rows(lens.clone(), first, count)
    solo[-1] = 0  # the padding row, as the executor writes it
    assert solo.count_nonzero() == 1  # the decode row
    pad = 3  # unused blocks (count 0), as a captured bucket has
    as_t = lambda v: torch.tensor(v + [0] * pad, dtype=torch.int32, device=triton_device)  # noqa: E731
    got = paged_row_block_attention_triton(q, k_cache, v_cache, bt, lens, 0.3, sinks, window,
                                           first=as_t(first), count=as_t(count), solo_lens=solo, rows_per_block=per,
                                           block_t=16).float()
    tol = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=2e-2, atol=2e-2)
    torch.testing.assert_close(got, ref, **tol)
    assert torch.all(got[-1] == 0)  # the padding row: empty context


# ------------------------------------------------------------------------------------------
# dispatch


def test_dispatch(monkeypatch, use_options):
    """The `kernels` option (runtime/settings.py) picks every kernel call's backend."""
    x = torch.zeros(2, 2)
    assert backend_for(x, None) == "torch"  # CPU tensors, auto
    use_options(kernels="torch")
    assert backend_for(x) == "torch"
    from graph_ir.errors import UserError
    with pytest.raises(UserError, match="kernels"):
        use_options(kernels="bogus")
    if HAS_TRITON:
        use_options(kernels="triton")
        monkeypatch.setenv("TRITON_INTERPRET", "0")
        with pytest.raises(RuntimeError, match="TRITON_INTERPRET"):
            backend_for(x)
        monkeypatch.setenv("TRITON_INTERPRET", "1")
        assert backend_for(x) == "triton"


def test_dispatch_runs_triton_when_forced(triton_device, use_options):
    use_options(kernels="triton")
    h_res, shared, rows, row_index, weights = _merge_inputs(3, 9, torch.float32, triton_device)
    assert torch.equal(topk_merge(h_res, shared, rows, row_index, weights),
                       topk_merge_torch(h_res, shared, rows, row_index, weights))
    x, offsets, *rest = _ffn_inputs(torch.float32, triton_device, False)
    torch.testing.assert_close(grouped_ffn(x, offsets, *rest), grouped_ffn_torch(x, offsets, *rest), rtol=1e-4, atol=1e-3)


def test_triton_kernels_in_subprocess():
    """Fallback when triton was imported in compiled mode before this file could ask for the
    interpreter (see module docstring): run this file's Triton tests in a fresh interpreter."""
    if not HAS_TRITON or not _interpreter_blocked():
        pytest.skip("not needed: the Triton tests ran in this process")
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__, "-k", "triton and not subprocess"],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("weight_in_fp32", [True, False])
def test_rms_norm_triton_matches_the_reference(triton_device, dtype, weight_in_fp32):
    """One program per row (kernels/rms_norm.py) against models.attention.rms_norm: equal up to the order of the fp32
    sum of squares (fp32), within one bf16 ulp (bf16; the interpreter also truncates where the GPU rounds, see
    dataflow_kernels.dispatch.kernel_store_dtype); a hidden size that is not a power of two; rows of a larger buffer."""
    from dataflow_kernels.rms_norm import rms_norm_torch, rms_norm_triton
    g = _gen(11)
    for T, Hn in ((5, 72), (1, 64), (0, 72)):
        x = (torch.randn(T, Hn + 8, generator=g) * 3).to(dtype)[:, :Hn]  # rows of a wider buffer: a row stride
        w = (torch.rand(Hn, generator=g) + 0.5).to(dtype)
        got = rms_norm_triton(x.to(triton_device), w.to(triton_device), 1e-5, weight_in_fp32).cpu()
        ref = rms_norm_torch(x, w, 1e-5, weight_in_fp32)
        assert got.dtype == ref.dtype and got.shape == ref.shape
        tol = dict(rtol=1e-6, atol=1e-6) if dtype == torch.float32 else dict(rtol=2 ** -7, atol=2 ** -7)
        torch.testing.assert_close(got.float(), ref.float(), **tol)


def _rope_kv_inputs(dtype, nh: int, nkv: int, D: int, rdim: int, seed: int):
    """A decode batch over a paged cache: q/k/v as strided views of one projection output (the layout a fused
    projection gives), ragged positions incl. a padded row (-1 -> the trash row and page), a partial rotary width."""
    from dataflow_kernels.rope_kv_write import rope_table
    g = _gen(seed)
    bs, pages, width = 4, 24, 5
    pos = torch.tensor([0, 5, 17, 3, -1], dtype=torch.int32)
    b = pos.shape[0]
    table = torch.randperm(pages, generator=g)[: 4 * width].view(4, width).to(torch.int32)
    table = torch.cat([table, torch.full((1, width), pages, dtype=torch.int32)])  # trash row -> trash page
    rows = torch.tensor([2, 0, 3, 1, 4], dtype=torch.int32)
    qkv = (torch.randn(b, (nh + 2 * nkv) * D + 3, generator=g) * 2).to(dtype)
    q = qkv[:, : nh * D].view(b, nh, D)
    k = qkv[:, nh * D: (nh + nkv) * D].view(b, nkv, D)
    v = qkv[:, (nh + nkv) * D: (nh + 2 * nkv) * D].view(b, nkv, D)
    inv_freq = 1.0 / (10000.0 ** (torch.arange(0, rdim, 2, dtype=torch.float32) / rdim))
    cos_t, sin_t = rope_table(inv_freq, 1.3, width * bs)
    kc = torch.randn(pages + 1, bs, nkv, D, generator=g).to(dtype)
    vc = torch.randn(pages + 1, bs, nkv, D, generator=g).to(dtype)
    return q, k, v, pos, rows, table, bs, cos_t, sin_t, kc, vc


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("nh,nkv,D,rdim", [(6, 2, 16, 16), (4, 4, 16, 8), (8, 1, 12, 12)])
def test_rope_kv_write_triton_matches_the_reference(triton_device, dtype, nh, nkv, D, rdim):
    """One program per row (kernels/rope_kv_write.py) against its torch reference: the rotated q, the whole K/V cache
    after the write (untouched pages included) and the context lengths. Bit for bit in fp32, and in bf16 on a GPU; the
    interpreter truncates each of the kernel's bf16 roundings where the GPU rounds to nearest (cos/sin, two products,
    the sum: a few ulps of the largest input). Shapes: odd head counts, a partial rotary width, a head dim that is not a
    power of two, strided q/k/v."""
    from dataflow_kernels.rope_kv_write import rope_kv_write_torch, rope_kv_write_triton
    args = _rope_kv_inputs(dtype, nh, nkv, D, rdim, seed=21)
    ref_kc, ref_vc = args[9].clone(), args[10].clone()
    got_kc, got_vc = args[9].clone().to(triton_device), args[10].clone().to(triton_device)
    dev = [a.to(triton_device) if isinstance(a, torch.Tensor) else a for a in args[:9]]
    q_ref, ctx_ref = rope_kv_write_torch(*args[:9], ref_kc, ref_vc)
    q_got, ctx_got = rope_kv_write_triton(*dev, got_kc, got_vc)
    assert ctx_got.dtype == torch.int32 and ctx_got.cpu().tolist() == ctx_ref.tolist() == [1, 6, 18, 4, 0]
    assert q_got.dtype == dtype and q_got.shape == q_ref.shape
    exact = dtype == torch.float32 or triton_device == "cuda"
    tol = dict(rtol=0, atol=0 if exact else 2 ** -5 * float(args[0].abs().max()))
    for got, ref in ((q_got, q_ref), (got_kc, ref_kc), (got_vc, ref_vc)):
        torch.testing.assert_close(got.cpu().float(), ref.float(), **tol)
    assert not torch.equal(ref_kc, args[9]) and not torch.equal(ref_vc, args[10])  # the write happened


def test_rope_kv_write_reference_is_the_model_math():
    """The reference against the model's own pieces: models.rope.cos_sin / apply_rope for q and k, and each row's K/V
    at the page its table names (the padded row's at the trash page)."""
    from dataflow_kernels.rope_kv_write import rope_kv_write_torch
    from models.rope import apply_rope
    q, k, v, pos, rows, table, bs, cos_t, sin_t, kc, vc = _rope_kv_inputs(torch.float32, 6, 2, 16, 8, seed=22)
    q_out, _ = rope_kv_write_torch(q, k, v, pos, rows, table, bs, cos_t, sin_t, kc, vc)
    posc = pos.long().clamp(min=0)
    freqs = posc.float()[:, None] * (1.0 / (10000.0 ** (torch.arange(0, 8, 2).float() / 8)))[None, :]
    cos, sin = freqs.cos() * 1.3, freqs.sin() * 1.3
    assert torch.equal(q_out, apply_rope(q, cos, sin))
    k_rot = apply_rope(k, cos, sin)
    for i, (p, r) in enumerate(zip(posc.tolist(), rows.tolist())):
        page = int(table[r, p // bs])
        assert torch.equal(kc[page, p % bs], k_rot[i]) and torch.equal(vc[page, p % bs], v[i])
    assert int(table[rows[4], 0]) == kc.shape[0] - 1  # the padded row went to the trash page


@pytest.mark.parametrize("name", ["tiny-gpt-oss", "tiny-glm4-moe", "tiny-olmoe", "tiny-qwen3-moe", "tiny-deepseek-v2"])
def test_cuda_executor_attention_body_with_the_triton_kernels(triton_device, use_options, name):
    """The attention graph's body as the GPU runs it (attn_impl="triton": the paged decode kernel, the fused RMSNorm,
    one q/k/v GEMM, RoPE and the KV write in one kernel), here through the interpreter, against the torch executor:
    the same hidden rows up to fp32 rounding. Families: sinks and windows (GPT-OSS), a partial rotary width (GLM),
    q/k norms over all heads (OLMoE) and per head (Qwen3), and MLA (DeepSeek: interleaved RoPE, the torch ops).
    Then a batch with a new prompt's 3-row chunk between the decode rows, padded to bucket 8: the row-block attention
    (dataflow_kernels.paged_attention.paged_row_block_attention_triton: the chunk by row blocks, the decode and padding rows
    through the decode kernel)."""
    import copy

    from graph_ir.spec import load_spec
    from models.weights import random_weights
    from runtime.executors.torch_executor import TorchExecutor
    from runtime.executors.cuda_executor import CudaExecutor
    from runtime.core.kv_cache import BlockAllocator, PagedKVStore
    if triton_device != "cpu":  # (on a GPU host the CPU tensors below would need the interpreter)
        pytest.skip("the interpreter's check of the attention body over a CPU KV store; on a GPU, "
                    "benchmarks/gpu_bench.py's correctness section checks the body against the torch executor")
    use_options(kernels="triton")
    spec = load_spec(f"models/specs/{name}.yaml")
    w = random_weights(spec)
    ref = TorchExecutor(spec, w)
    kv_a = PagedKVStore(spec.num_layers, BlockAllocator(32, 4))
    lens = [3, 6]
    for sid, n in enumerate(lens):
        assert kv_a.reserve(sid, n + 8)
        h = ref.embed([5 + i for i in range(n)])
        for layer in range(spec.num_layers):
            h_res, x = ref.attention(layer, h, list(range(n)), [(sid, 0, n)], kv_a)
            h = h_res + x
    kv_b = copy.deepcopy(kv_a)
    h = torch.randn(2, spec.hidden_size, generator=_gen(12))
    ex = CudaExecutor(spec, w, device="cpu", attn_impl="triton", buckets={"attn": [4, 8], "expert": [16]})
    segs = [(0, 0, 1), (1, 1, 1)]
    want = ref.attention(1, h, lens, segs, kv_a)
    got = ex.attention(1, h, lens, segs, kv_b)
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_, rtol=1e-4, atol=1e-4)
    for kv_ in (kv_a, kv_b):
        assert kv_.reserve(2, 8)
    segs, pos = [(0, 0, 1), (2, 1, 3), (1, 4, 1)], [4, 0, 1, 2, 7]
    h = torch.randn(5, spec.hidden_size, generator=_gen(13))
    want = ref.attention(1, h, pos, segs, kv_a)
    got = ex.attention(1, h, pos, segs, kv_b)
    assert ex.stats.attn_paged_prompt == 1 and ex.block_rows > 0 and ex.stats.attn_eager == 0
    for g_, w_ in zip(got, want):
        torch.testing.assert_close(g_, w_, rtol=1e-4, atol=1e-4)
