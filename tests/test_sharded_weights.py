"""Expert-sharded weights: a rank builds (or loads) only the experts the plan places on it.

What must hold for sharded runs to give exactly the tokens of unsharded ones: an owned expert has
the same values whichever subset is built; the executors map the engine's global expert ids to the
shard's rows; a row for an expert the shard does not hold fails loudly (a placement bug), never
indexes another expert's weights.
"""
from __future__ import annotations

import json
import math
import re

import pytest
import torch

from graph_ir.spec import cut_layers, load_spec
from lowering.plan import compile_plan
from models.weights import EXPERT_TENSORS, expected_shapes, random_weights, torch_dtype, validate_weights
from runtime.drivers.cluster import RunOptions
from runtime.executors.torch_executor import TorchExecutor
from runtime.executors.cuda_executor import CudaExecutor
from runtime.drivers.multiproc import run_workloads_multiprocess
from test_runtime import assert_matches_reference, make_requests, model

SPECS = "models/specs"


def _assert_shard_of(shard, full, held: list) -> None:
    """Every tensor of `shard` equals `full`'s, expert tensors restricted to the held rows."""
    assert torch.equal(shard.embed, full.embed) and torch.equal(shard.head, full.head)
    for l, (ls, lf) in enumerate(zip(shard.layers, full.layers)):
        assert set(ls) == set(lf)
        for name, t in lf.items():
            want = t[torch.tensor(held[l], dtype=torch.long)] if name in EXPERT_TENSORS else t
            assert t.dtype == ls[name].dtype and torch.equal(ls[name], want), (l, name)


@pytest.mark.parametrize("name", ["tiny-gpt-oss", "tiny-glm4-moe"])
def test_sharded_draw_is_the_slice_of_the_full_draw(name):
    """Biased experts (GPT-OSS), dense layers and an fp32 correction bias (GLM); uneven, non-contiguous
    subsets and a layer with no expert held."""
    spec = load_spec(f"{SPECS}/{name}.yaml").model_copy(update={"dtype": "bfloat16"})
    full = random_weights(spec, seed=7)
    E = spec.experts.num_experts
    subsets = [[3, 0], [E - 1], list(range(1, E, 2)), []]
    held = [sorted(subsets[l % len(subsets)]) if spec.is_moe_layer(l) else [] for l in range(spec.num_layers)]
    shard = random_weights(spec, seed=7, experts=held)
    validate_weights(spec, shard)  # shapes follow the held counts
    for l in spec.moe_layers:
        assert shard.layers[l]["experts.gate"].shape[0] == len(held[l]) and shard.held_experts(l) == held[l]
    _assert_shard_of(shard, full, held)
    assert shard.num_bytes() < full.num_bytes()
    # every expert held (None entries, or full lists) is the unsharded build
    assert random_weights(spec, seed=7, experts=[None] * spec.num_layers).held_experts(spec.moe_layers[0]) is None


def _global_ids(E: int, n: int) -> torch.Tensor:
    return torch.tensor([(5 * i + 1) % E for i in range(n)], dtype=torch.int64)


@pytest.mark.parametrize("executor", ["torch", "cuda-twin"])
def test_executors_map_global_ids_to_shard_rows(executor):
    """A shard's expert outputs equal the full model's for the same global ids; an unheld id raises,
    naming the layer, the expert and the held set."""
    spec, full, _ = model("tiny-gpt-oss")
    E, layer = spec.experts.num_experts, spec.moe_layers[1]
    held = [[e for e in range(E) if e % 3 != 2] for _ in range(spec.num_layers)]
    shard = random_weights(spec, experts=held)
    make = (lambda w: TorchExecutor(spec, w)) if executor == "torch" else \
        (lambda w: CudaExecutor(spec, w, device="cpu", buckets={"attn": [8], "expert": [16]}))
    ex_full, ex_shard = make(full), make(shard)
    ids = torch.tensor([e for e in _global_ids(E, 40).tolist() if e % 3 != 2], dtype=torch.int64)
    for n in (len(ids), 11):  # above the largest bucket (eager) and padded into one
        x = torch.randn(n, spec.hidden_size, generator=torch.Generator().manual_seed(n))
        assert torch.equal(ex_shard.experts(layer, x, ids[:n]), ex_full.experts(layer, x, ids[:n]))
    bad = torch.tensor([0, 2, 5], dtype=torch.int64)
    with pytest.raises(LookupError, match=rf"layer {layer}: expert\(s\) \[2, 5\] not held.*\[0, 1, 3, 4, 6, 7, 9\]"):
        ex_shard.experts(layer, torch.zeros(3, spec.hidden_size), bad)


def test_checkpoint_loads_only_the_held_experts(tmp_path):
    """Per-expert tensors (save_pretrained of Mixtral), fused GPT-OSS tensors (interleaved gate/up,
    biases; bf16 and MXFP4) and the fused in-memory layout: a subset load equals the slice of the
    full load."""
    transformers = pytest.importorskip("transformers")
    from safetensors.torch import load_file, save_file

    from models.checkpoint import load_checkpoint
    from test_checkpoint import COMMON, _build, _save, _write

    dirs = {fam: _save(_build(fam), tmp_path / fam) for fam in ("mixtral", "gpt_oss")}
    fused = tmp_path / "mixtral-fused"
    fused.mkdir()
    (fused / "config.json").write_text((dirs["mixtral"] / "config.json").read_text())
    save_file({k: v.contiguous() for k, v in _build("mixtral").state_dict().items()}, str(fused / "model.safetensors"))
    dirs["fused"] = fused
    # MXFP4 experts (as tests/test_checkpoint.py builds them: input dims divisible by 32)
    cfg = transformers.GptOssConfig(**{**COMMON, "hidden_size": 64}, head_dim=12, intermediate_size=32,
                                    num_local_experts=5, num_experts_per_tok=3)
    src = _save(_build("gpt_oss", cfg), tmp_path / "gpt_oss-64")
    tensors, g = load_file(str(src / "model.safetensors")), torch.Generator().manual_seed(1)
    for l in range(3):
        for proj, (out_d, in_d) in {"gate_up_proj": (64, 64), "down_proj": (64, 32)}.items():
            base = f"model.layers.{l}.mlp.experts.{proj}"
            del tensors[base]
            tensors[base + "_blocks"] = torch.randint(0, 256, (5, out_d, in_d // 32, 16), generator=g, dtype=torch.uint8)
            tensors[base + "_scales"] = torch.randint(120, 134, (5, out_d, in_d // 32), generator=g, dtype=torch.uint8)
    conf = json.loads((src / "config.json").read_text())
    conf["quantization_config"] = {"quant_method": "mxfp4"}
    dirs["mxfp4"] = _write(tmp_path / "mx", conf, tensors)
    for d in dirs.values():
        spec, full = load_checkpoint(d)
        E = spec.experts.num_experts
        held = [[0, 2, E - 1] if l % 2 else [] for l in range(spec.num_layers)]
        _, shard = load_checkpoint(d, experts=held)
        _assert_shard_of(shard, full, held)


def test_gpt_oss_120b_l18_rank_bytes_match_the_plan():
    """The bytes a rank of GPT-OSS-120B cut to 18 layers holds on 2 GPUs (from shapes, no tensors):
    what the weights builders make equals the plan's memory pass, about half of the whole model."""
    spec = cut_layers(load_spec(f"{SPECS}/gpt-oss-120b.yaml"), 18)
    plan = compile_plan(spec, 2, "cuda", device_memory_gib=141)
    elem = torch.empty(0, dtype=torch_dtype(spec.dtype)).element_size()

    def nbytes(experts) -> int:  # correction biases would be fp32; GPT-OSS has none
        return sum(math.prod(s) * elem for s in expected_shapes(spec, experts).values())

    for r in range(2):
        assert nbytes(plan.placement.held_by(r)) == plan.memory[r].weight_bytes == 60_636_627_072
    assert nbytes(None) == 117_987_426_432


def test_multiprocess_ranks_hold_only_their_experts_and_match_the_reference(capsys):
    """3 processes, round-robin placement (uneven, non-contiguous: 3/3/2 of 8 experts per layer):
    each rank reports the experts it built, and the tokens are the reference decoder's."""
    name = "tiny-mixtral"
    spec, full, _ = model(name)
    plan = compile_plan(spec, 3, placement="round_robin", attn_cap=16, block_size=4)
    reqs = make_requests(spec.vocab_size, 6, seed=11, max_new=6, max_prompt=30)
    [res] = run_workloads_multiprocess(plan, [(reqs, RunOptions(policy="defrag", kv_blocks=128))], timeout=80,
                                       env={"DATAFLOW_OPTIONS": '{"verbose": true}'})
    assert assert_matches_reference(name, res.requests) > 15
    reported = {int(m[0]): (int(m[1]), json.loads(m[2])) for m in re.findall(
        r"rank (\d+): weights (\d+) bytes, experts held per MoE layer (\[[\d, ]*\])", capsys.readouterr().err)}
    assert sorted(reported) == [0, 1, 2]
    for r, (nbytes, held) in reported.items():
        want = [len(plan.placement.experts_on(l, r)) for l in spec.moe_layers]
        assert held == want and held == [3 if r < 2 else 2] * len(spec.moe_layers)
        assert nbytes < full.num_bytes()
    assert sum(n for n, _ in reported.values()) < 3 * full.num_bytes()
