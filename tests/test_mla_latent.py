"""MLA's latent KV cache (models/attention.py, kernels/mla_attention.py): the runtime's paged cache keeps per token the
normed kv latent and the roped key; prompt chunks decompress, decode rows attend in the absorbed form. Checked against
the decompressed form (the reference decoder's, the oracle) in fp32: one layer's attention, prefill + 16 decode steps
through the torch executor and the CUDA executor's CPU twin (mixed prompt / decode batches, pages of 4 tokens so every
sequence crosses page boundaries), the paged kernels' forms against each other, and the memory plan's bytes."""
from __future__ import annotations

import math
import random

import pytest
import torch

from graph_ir.spec import ModelSpec, load_spec
from dataflow_kernels.mla_attention import paged_mla_attention, paged_mla_attention_gather
from lowering import sizes
from lowering.plan import compile_plan
from models import attention as attn
from models import layers
from lab.reference import DenseKVStore, ReferenceDecoder
from models.weights import random_weights
from runtime.core.kv_cache import BlockAllocator, PagedKVStore
from runtime.executors.cuda_executor import CudaExecutor
from runtime.executors.torch_executor import TorchExecutor

torch.set_num_threads(1)

BLOCK = 4  # small pages: every sequence below spans several


def _custom() -> ModelSpec:
    """q lora, a dense first layer, shared experts, a head count and widths unlike tiny-deepseek-v2's."""
    return ModelSpec.model_validate(dict(
        name="mla-latent", family="custom", num_layers=3, hidden_size=40, vocab_size=97, max_position=256,
        rms_norm_eps=1e-6, dtype="float32", weights=dict(source="random", seed=3, init_std=0.1), eos_token_ids=[],
        attention=dict(kind="mla", num_heads=5, num_kv_heads=5, head_dim=14, q_lora_rank=12, kv_lora_rank=20,
                       qk_nope_head_dim=10, qk_rope_head_dim=4, v_head_dim=6,
                       rope=dict(theta=10000.0, interleaved=True)),
        router=dict(scoring="softmax", renormalize=True),
        experts=dict(num_experts=6, top_k=2, intermediate_size=16, shared_intermediate_size=24),
        dense_layers=[0], dense_intermediate_size=32))


SPECS = {"tiny-deepseek-v2": lambda: load_spec("models/specs/tiny-deepseek-v2.yaml"), "custom": _custom}


def _model(name: str):
    spec = SPECS[name]()
    return spec, random_weights(spec)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / b.abs().max().clamp_min(1e-30))


@pytest.mark.parametrize("name", list(SPECS))
def test_latent_attention_equals_decompressed(name):
    """One layer: prompts (multi-row segments: decompressed from the latent), then a pure decode batch and a mixed
    batch (decode rows beside a new prompt's chunk and a lone second chunk of a sequence), over the latent paged store,
    the decompressed paged store and the reference's dense store."""
    spec, w = _model(name)
    gen = torch.Generator().manual_seed(0)
    lw = w.layers[1]
    stores = {"latent": PagedKVStore(spec.num_layers, BlockAllocator(64, BLOCK)),
              "decompressed": PagedKVStore(spec.num_layers, BlockAllocator(64, BLOCK), mla_latent=False),
              "dense": DenseKVStore(),
              "dense-latent": DenseKVStore(mla_latent=True)}
    lens = [5, 9, 2]
    for kv in stores.values():
        for sid in range(5):
            if hasattr(kv, "reserve"):
                assert kv.reserve(sid, 32)

    def run(x, pos, segs) -> dict:
        return {n: attn.attention(spec, lw, 1, x, torch.tensor(pos), segs, kv) for n, kv in stores.items()}

    def check(out: dict) -> None:
        for n in ("latent", "decompressed", "dense-latent"):
            assert _rel(out[n], out["dense"]) < 1e-5, n

    segs, pos, row = [], [], 0
    for sid, n in enumerate(lens):
        segs.append((sid, row, n))
        pos += list(range(n))
        row += n
    check(run(torch.randn(row, spec.hidden_size, generator=gen), pos, segs))
    for step in range(3):  # pure decode batches
        pos = [n + step for n in lens]
        check(run(torch.randn(3, spec.hidden_size, generator=gen), pos, [(i, i, 1) for i in range(3)]))
    # mixed: decode rows of 0 and 2, a new prompt (3) and a lone row of a new sequence's prompt (4)
    segs = [(0, 0, 1), (3, 1, 6), (2, 7, 1), (4, 8, 1)]
    pos = [lens[0] + 3, 0, 1, 2, 3, 4, 5, lens[2] + 3, 0]
    check(run(torch.randn(9, spec.hidden_size, generator=gen), pos, segs))
    k, v = stores["latent"].storage(1)
    a = spec.attention
    assert tuple(k.shape[2:]) == (1, a.kv_lora_rank + a.qk_rope_head_dim) and v.numel() == 0


def _executor_generate(ex, spec, prompts: list[list[int]], steps: int, late: list[int]):
    """Greedy generation through an executor's attention over one paged store: the prompts prefilled in one batch,
    then `steps` decode batches of every sequence; `late` (another prompt) arrives with the third decode batch (a
    mixed batch). The MLP parts by the model's functions. Returns per sequence (tokens, fp32 logits per step)."""
    kv = PagedKVStore(spec.num_layers, BlockAllocator(64, BLOCK))
    seqs = prompts + [late]
    for sid, p in enumerate(seqs):
        assert kv.reserve(sid, len(p) + steps + 1)
    toks: list[list[int]] = [[] for _ in seqs]
    logs: list[list[torch.Tensor]] = [[] for _ in seqs]
    done = [0] * len(seqs)  # positions written per sequence
    active = list(range(len(prompts)))
    feed = {sid: list(p) for sid, p in enumerate(prompts)}
    for step in range(steps + 1):
        if step == 3:
            feed[len(seqs) - 1] = list(late)
            active.append(len(seqs) - 1)
        ids, pos, segs = [], [], []
        for sid in active:
            segs.append((sid, len(ids), len(feed[sid])))
            pos += list(range(done[sid], done[sid] + len(feed[sid])))
            ids += feed[sid]
        h = ex.embed(ids)
        for layer in range(spec.num_layers):
            h_res, x = ex.attention(layer, h, pos, segs, kv)
            if not spec.is_moe_layer(layer):
                h = h_res + layers.dense_mlp(spec, ex.w, layer, x)
                continue
            e, wts = layers.route(spec, ex.w, layer, x)
            k = e.shape[1]
            y = layers.experts_forward(spec, ex.w, layer, x.repeat_interleave(k, dim=0), e.reshape(-1))
            h = layers.moe_combine(h_res, layers.shared_expert(spec, ex.w, layer, x), y.view(x.shape[0], k, -1), wts)
        logits = layers.final_logits(spec, ex.w, h).float()
        for sid, start, n in segs:
            done[sid] += n
            row = logits[start + n - 1]
            logs[sid].append(row)
            toks[sid].append(int(row.argmax()))
            feed[sid] = [toks[sid][-1]]
    return toks, logs


@pytest.mark.parametrize("executor", ["torch", "cuda-twin"])
@pytest.mark.parametrize("name", list(SPECS))
def test_prefill_and_16_decode_steps_equal_the_decompressed_reference(name, executor):
    spec, w = _model(name)
    rng = random.Random(5)
    prompts = [[rng.randrange(3, spec.vocab_size) for _ in range(n)] for n in (1, 7, 13)]
    late = [rng.randrange(3, spec.vocab_size) for _ in range(6)]
    steps = 16
    ex = TorchExecutor(spec, w) if executor == "torch" else \
        CudaExecutor(spec, w, device="cpu", buckets={"attn": [4, 8, 16, 32], "expert": [64]})
    toks, logs = _executor_generate(ex, spec, prompts, steps, late)
    ref = ReferenceDecoder(spec, w)
    late_steps = steps + 1 - 3
    for sid, p in enumerate(prompts + [late]):
        want = ref.generate(p, steps + 1 if sid < len(prompts) else late_steps, ignore_eos=True)
        assert toks[sid] == want.tokens, (sid, toks[sid], want.tokens)
        for got, exp in zip(logs[sid], want.logits):
            assert _rel(got, exp) < 1e-4
    if executor == "cuda-twin":  # the bucketed paged body ran the decode and the mixed batches
        assert ex.stats.attn_paged_prompt > 0 and ex.stats.attn_eager == 0


def test_reference_latent_equals_decompressed():
    """The reference decoder over a latent dense store: prefill + 16 decode steps, logits within 1e-4."""
    spec, w = _model("custom")
    prompt = list(range(5, 16))
    a = ReferenceDecoder(spec, w).generate(prompt, 17, ignore_eos=True)
    b = ReferenceDecoder(spec, w, mla_latent=True).generate(prompt, 17, ignore_eos=True)
    assert a.tokens == b.tokens
    assert max(_rel(y, x) for x, y in zip(a.logits, b.logits)) < 1e-4


@pytest.mark.parametrize("window,sinks", [(None, False), (5, False), (None, True)])
def test_paged_latent_gather_form_equals_the_reference(window, sinks):
    """kernels/mla_attention.py: the capturable gather form (the GPU's fallback) against the reference over a paged
    latent cache with shuffled pages, padded rows (context 0: zeros) and rows ending on a page boundary."""
    gen = torch.Generator().manual_seed(1)
    B, nh, R, P, pages, width = 6, 3, 16, 4, 32, 5
    cache = torch.randn(pages, BLOCK, 1, R + P, generator=gen)
    table = torch.randperm(pages, generator=gen)[:B * width].view(B, width).to(torch.int32)
    ctx = torch.tensor([1, BLOCK, 2 * BLOCK + 1, 0, width * BLOCK, 7], dtype=torch.int32)
    q = torch.randn(B, nh, R + P, generator=gen)
    s = torch.randn(nh, generator=gen) if sinks else None
    want = paged_mla_attention(q, cache, R, table, ctx, 0.3, s, window)
    got = paged_mla_attention_gather(q, cache, R, table, ctx, 0.3, s, window)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    assert got[3].abs().max() == 0 and got.shape == (B, nh, R)


def test_memory_plan_counts_the_latent():
    """KV bytes per token per layer = (kv_lora_rank + qk_rope_head_dim) x dtype bytes, in the plan and in what the
    CUDA executor allocates per page; DeepSeek-V2-Lite's 576 values against 3,072 decompressed: more pages fit."""
    for name, b in (("deepseek-v2-lite", 2), ("tiny-deepseek-v2", 4)):
        spec = load_spec(f"models/specs/{name}.yaml")
        a = spec.attention
        assert sizes.kv_bytes_per_token_layer(spec) == (a.kv_lora_rank + a.qk_rope_head_dim) * b
    lite = load_spec("models/specs/deepseek-v2-lite.yaml").attention
    assert lite.num_heads * (lite.qk_head_dim + lite.v_head_dim) // (lite.kv_lora_rank + lite.qk_rope_head_dim) >= 5
    spec, w = _model("tiny-deepseek-v2")
    plan = compile_plan(spec, 2, block_size=BLOCK)
    per_layer = (spec.attention.kv_lora_rank + spec.attention.qk_rope_head_dim) * 4
    assert plan.kv.bytes_per_token_per_layer == [per_layer] * spec.num_layers
    assert plan.kv.bytes_per_token == per_layer * spec.num_layers
    k_row, v_row, dtype = CudaExecutor(spec, w, device="cpu").kv_rows()
    assert (math.prod(k_row) + math.prod(v_row)) * torch.empty((), dtype=dtype).element_size() == per_layer


def test_gpu_path_choice():
    """Which form the CUDA executor's Triton setting takes (dataflow_kernels.mla_attention.paged_mla_attention): the Triton
    kernel where its tiles fit on an H200 (bf16, up to 16 heads x 512 latent channels), else the gather form; on
    this CPU an fp32 cache takes the gather form and equals the reference."""
    from dataflow_kernels.mla_attention import triton_fits
    assert triton_fits(16, 512, torch.bfloat16) and not triton_fits(16, 512, torch.float32)
    assert not triton_fits(128, 512, torch.bfloat16)
    gen = torch.Generator().manual_seed(2)
    cache = torch.randn(8, BLOCK, 1, 12, generator=gen)
    table = torch.arange(8, dtype=torch.int32).view(2, 4)
    ctx = torch.tensor([3, 13], dtype=torch.int32)
    q = torch.randn(2, 4, 12, generator=gen)
    torch.testing.assert_close(paged_mla_attention(q, cache, 8, table, ctx, 0.5, impl="triton"),
                               paged_mla_attention(q, cache, 8, table, ctx, 0.5), rtol=1e-5, atol=1e-6)
