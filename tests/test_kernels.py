"""kernels/: torch references against naive loops and the models' math, Triton kernels against the
references: the MoE layer's kernels (top-k merge, permute, grouped expert FFN) and the backend dispatch.
tests/test_kernels_attention.py has the attention graph's.

Shapes are odd on purpose (H=72, I=40, E=9, k=3, empty and overfull experts) so nothing passes by symmetry.

Without a GPU the Triton kernels run in Triton's CPU interpreter (tests/triton_interpreter.py: the `triton_device`
fixture, and the subprocess fallback, the last test of this file). Interpreter caveats (handled in kernels/, see
kernels/dispatch.py): its bf16 `tl.dot` is wrong (kernels upcast to fp32 under the interpreter) and its fp32->bf16
cast truncates (kernels store fp32 and the wrapper rounds with torch).
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from dataflow_kernels.dispatch import backend_for
from dataflow_kernels.grouped_ffn import grouped_ffn_torch, grouped_ffn_triton
from dataflow_kernels.permute import permute_to_experts_torch, permute_to_experts_triton
from dataflow_kernels.topk_merge import topk_merge, topk_merge_torch, topk_merge_triton
from triton_interpreter import DTYPES, HAS_TRITON, gen, run_triton_tests_in_subprocess
from triton_interpreter import triton_device  # noqa: F401  (a fixture)

H, I, E, K = 72, 40, 9, 3


def _skewed_ids(T: int, seed: int) -> torch.Tensor:
    """[T, K] expert ids: expert 2 never chosen, expert 0 very hot."""
    g = gen(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    ids = torch.where(ids == 2, torch.zeros_like(ids), ids)  # empty expert (kernels allow repeats)
    ids[: T // 2, 0] = 0  # hot expert: more rows than one 16-row tile
    return ids


# ------------------------------------------------------------------------------------------
# top-k merge


def _merge_inputs(T: int, N: int, dtype, device, seed: int = 0):
    g = gen(seed)
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
# permute


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
    ids = torch.randint(0, 17, (512, 4), generator=gen(7))
    got_o, got_off = permute_to_experts_triton(ids.to(triton_device), 16)
    ref_o, ref_off = permute_to_experts_torch(ids.clamp(max=16), 17)
    n = int(ref_off[16])  # rows of held experts; the sentinel rows sort last in the reference and are unplaced here
    assert torch.equal(got_off.cpu(), ref_off[:17]) and torch.equal(got_o[:n].cpu(), ref_o[:n])


def test_permute_triton_many_experts(triton_device):
    ids = torch.randint(0, 130, (50, 4), generator=gen(3)).to(triton_device)  # E not a power of two
    got, ref = permute_to_experts_triton(ids, 130), permute_to_experts_torch(ids, 130)
    assert torch.equal(got[0], ref[0]) and torch.equal(got[1], ref[1])


# ------------------------------------------------------------------------------------------
# grouped expert FFN


def _ffn_inputs(dtype, device, with_bias: bool, seed: int = 0, T: int = 13):
    g = gen(seed)
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
    g = gen(6)
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


def test_triton_kernels_in_subprocess():
    """Fallback when triton was imported in compiled mode before this file could ask for the interpreter."""
    run_triton_tests_in_subprocess(__file__)
