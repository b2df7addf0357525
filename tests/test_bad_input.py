"""Bad input everywhere (issue 29): every case builds one broken input in tmp_path, runs the `dataflow` entry point
in-process (`dataflow.cli.main`, the console script's code path) and expects exit code 2 and ONE line naming the
file/field, the value and what is valid; never a traceback, a hang or a silent success. No case starts a rank
process: run's checks all come before the ranks are spawned."""
from __future__ import annotations

import json
import shutil
import struct
import sys
from pathlib import Path

import pytest
import yaml

from dataflow import cli

SPECS = Path(__file__).resolve().parents[1] / "models" / "specs"
TINY = (SPECS / "tiny.yaml").read_text()


def _main(monkeypatch, capsys, args: list[str]) -> tuple[int, str, str]:
    from test_cli_compile import run
    return run(monkeypatch, capsys, *args)


@pytest.fixture(scope="module")
def tiny_plan(tmp_path_factory) -> Path:
    """`dataflow compile tiny --ranks 2`, once: the plan every run/inspect case starts from."""
    from lowering.plan import compile_plan, save_plan
    from graph_ir.spec import load_spec
    d = tmp_path_factory.mktemp("plan") / "dataflow-plan"
    save_plan(compile_plan(load_spec(SPECS / "tiny.yaml"), 2, source="shipped model 'tiny'"), d)
    return d


# ---- builders: build(d, plan, main) writes its bad input under `d` and returns the CLI arguments; `plan` is the
# tiny plan, `main(args)` runs the CLI (-> code, stdout, stderr) for builders that compile something first ----------

def _yaml(text: str | bytes, name: str = "bad.yaml"):
    def build(d: Path, plan: Path, main) -> list[str]:
        p = d / name
        p.write_bytes(text if isinstance(text, bytes) else text.encode())
        return ["compile", str(p), "-o", str(d / "out")]
    return build


def _tiny_with(old: str, new: str):
    assert old in TINY
    return _yaml(TINY.replace(old, new))


def _compile(*args: str):
    return lambda d, plan, main: ["compile", *args, "-o", str(d / "out")]


def _prompts(data: str | bytes, *extra: str, name: str = "p.jsonl"):
    def build(d: Path, plan: Path, main) -> list[str]:
        p = d / name
        p.write_bytes(data if isinstance(data, bytes) else data.encode())
        return ["run", str(plan), "--prompts", str(p), "--in-process", "-q", *extra]
    return build


def _run(*args: str):
    return lambda d, plan, main: ["run", str(plan), "-q", *args]


def _plan_edit(edit, raw: bytes | None = None):
    """A copy of the tiny plan with plan.json edited by hand (`edit(dict)`) or replaced by `raw` bytes."""
    def build(d: Path, plan: Path, main) -> list[str]:
        dst = d / "edited"
        shutil.copytree(plan, dst)
        if raw is not None:
            (dst / "plan.json").write_bytes(raw)
        else:
            data = json.loads((dst / "plan.json").read_text())
            edit(data)
            (dst / "plan.json").write_text(json.dumps(data))
        return ["run", str(dst), "--in-process", "-q"]
    return build


# A tiny Mixtral checkpoint written by hand (no transformers): config.json + one safetensors file.
HF_CONFIG = dict(architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=48, intermediate_size=64,
                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_local_experts=4,
                 num_experts_per_tok=2, vocab_size=300, rms_norm_eps=1e-5, rope_theta=10000.0,
                 max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=2, torch_dtype="float32")


def _hf_tensors() -> dict:
    import torch
    H, I, V, E, hd = 48, 64, 300, 4, 12
    t = {"model.embed_tokens.weight": (V, H), "model.norm.weight": (H,), "lm_head.weight": (V, H)}
    for l in range(2):
        p = f"model.layers.{l}."
        t.update({p + "input_layernorm.weight": (H,), p + "post_attention_layernorm.weight": (H,),
                  p + "self_attn.q_proj.weight": (4 * hd, H), p + "self_attn.k_proj.weight": (2 * hd, H),
                  p + "self_attn.v_proj.weight": (2 * hd, H), p + "self_attn.o_proj.weight": (H, 4 * hd),
                  p + "block_sparse_moe.gate.weight": (E, H)})
        for e in range(E):
            m = p + f"block_sparse_moe.experts.{e}."
            t.update({m + "w1.weight": (I, H), m + "w3.weight": (I, H), m + "w2.weight": (H, I)})
    return {k: torch.zeros(s) for k, s in t.items()}


def _write_hf(d: Path, edit=None, raw_edit=None) -> Path:
    from safetensors.torch import save_file
    ckpt = d / "hf"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(HF_CONFIG))
    tensors = _hf_tensors()
    if edit:
        edit(tensors)
    save_file(tensors, str(ckpt / "model.safetensors"))
    if raw_edit:
        f = ckpt / "model.safetensors"
        f.write_bytes(raw_edit(f.read_bytes()))
    return ckpt


def _hf(edit=None, raw_edit=None):
    return lambda d, plan, main: ["compile", str(_write_hf(d, edit, raw_edit)), "-o", str(d / "out")]


def _hf_then_run(damage):
    """Compile a good checkpoint, then damage it: run refuses before starting any rank."""
    def build(d: Path, plan: Path, main) -> list[str]:
        ckpt = _write_hf(d)
        code, _, err = main(["compile", str(ckpt), "-o", str(d / "out")])
        assert code == 0, err
        damage(ckpt)
        return ["run", str(d / "out"), "-q"]
    return build


def _bad_header(raw: bytes) -> bytes:
    return struct.pack("<Q", 10) + b"{not json!" + raw[18:]


def _set(path: list, value):
    def edit(data):
        node = data
        for k in path[:-1]:
            node = node[k]
        node[path[-1]] = value
    return edit


CASES = {
    # ---- model YAML (dataflow compile FILE) ----
    "yaml-binary": (_yaml(b"\x00\x01\xff\xfe binary"), ["bad.yaml:1", "binary", "UTF-8 text model file"]),
    "yaml-not-utf8": (_yaml(TINY.replace("name: tiny", "name: caf\xe9").encode("latin-1")),
                      ["bad.yaml:", "not UTF-8", "byte 0xe9"]),
    "yaml-duplicate-key": (_yaml(TINY + "num_layers: 4\n"), ["bad.yaml:", "duplicate key 'num_layers'", "first at line"]),
    "yaml-duplicate-nested-key": (_tiny_with("  top_k: 2\n", "  top_k: 2\n  top_k: 3\n"), ["duplicate key 'top_k'"]),
    "yaml-syntax": (_yaml("name: [unclosed\n"), ["bad.yaml:", "not valid YAML"]),
    "yaml-alias": (_yaml("a: &x [1, 2]\nname: *x\n"), ["bad.yaml:2", "alias '*x'"]),
    "yaml-empty": (_yaml(""), ["bad.yaml", "expected a mapping", "NoneType"]),
    "yaml-directory": (lambda d, p, main: (d / "dir.yaml").mkdir() or ["compile", str(d / "dir.yaml")],
                       ["dir.yaml", "a directory without config.json"]),
    "num_layers-1e26": (_tiny_with("num_layers: 3", "num_layers: 1e26"), ["field 'num_layers'", "'1e26'", "1..256"]),
    "num_layers-1.0e+26": (_tiny_with("num_layers: 3", "num_layers: 1.0e+26"), ["field 'num_layers'", "1e+26", "1..256"]),
    "num_layers-fraction": (_tiny_with("num_layers: 3", "num_layers: 2.5"), ["field 'num_layers'", "2.5", "1..256"]),
    "num_experts-1e7": (_tiny_with("num_experts: 8", "num_experts: 10000000"),
                        ["field 'experts.num_experts'", "10000000", "less than or equal to 1024"]),
    "hidden_size-negative": (_tiny_with("hidden_size: 48", "hidden_size: -48"), ["field 'hidden_size'", "-48", "greater than 0"]),
    "vocab-huge": (_tiny_with("vocab_size: 320", "vocab_size: 100000000000"), ["field 'vocab_size'", "100000000000"]),
    "head_dim-odd": (_tiny_with("head_dim: 12", "head_dim: 15"), ["field 'attention'", "head_dim 15", "even head_dim"]),
    "rope-theta-inf": (_tiny_with("theta: 10000", "theta: .inf"), ["field 'attention.rope.theta'", "finite", "inf"]),
    "seed-too-big": (_tiny_with("seed: 0", "seed: 100000000000000000000"), ["field 'weights.seed'", "100000000000000000000"]),
    "dense-layers-twice": (_tiny_with("dtype: float32", "dtype: float32\ndense_layers: [0, 0]\ndense_intermediate_size: 8"),
                           ["dense_layers", "[0] more than once"]),
    "weights-path-missing": (_tiny_with("weights: {source: random, seed: 0}", "weights: {source: checkpoint, path: nope}"),
                             ["bad.yaml: field 'weights.path'", "nope: no such checkpoint directory"]),
    # ---- compile options ----
    "ranks-1000-cpu": (_compile("tiny", "--ranks", "1000"), ["option 'ranks': got 1000", "1..64 for device cpu"]),
    "ranks-5000-cuda": (_compile("tiny", "--ranks", "5000", "--device", "cuda"), ["option 'ranks': got 5000", "1..1024"]),
    "device-memory-inf": (_compile("tiny", "--device-memory", "inf"), ["option 'device_memory_gib': got inf", "up to 16384"]),
    "layers-past-the-model": (_compile("tiny", "--layers", "100"), ["option 'layers': got 100", "valid: 1..3"]),
    "out-under-a-file": (lambda d, p, main: (d / "f").write_text("x") and ["compile", "tiny", "-o", str(d / "f" / "x")],
                         ["cannot write the plan", "Not a directory"]),
    "load-profile-binary": (lambda d, p, main: (d / "prof.json").write_bytes(b"\xff\x00\x01") and
                            ["compile", "tiny", "--placement", "profile", "--load-profile", str(d / "prof.json"),
                             "-o", str(d / "out")], ["prof.json:1", "binary", "load profile"]),
    "load-profile-nan": (lambda d, p, main: (d / "prof.json").write_text("[1, 2, NaN, 1, 1, 1, 1, 1]") and
                         ["compile", "tiny", "--placement", "profile", "--load-profile", str(d / "prof.json"),
                          "-o", str(d / "out")], ["prof.json", "NaN"]),
    # ---- Hugging Face checkpoint dir: header-only checks at compile ----
    "hf-truncated": (_hf(raw_edit=lambda raw: raw[:-1000]),
                     ["model.safetensors", "tensor '", "truncated", "1000 bytes missing"]),
    "hf-missing-tensor": (_hf(edit=lambda t: t.pop("model.layers.1.block_sparse_moe.experts.3.w3.weight")),
                          ["missing tensor 'model.layers.1.block_sparse_moe.experts.3.w3.weight'", "[64, 48]"]),
    "hf-wrong-shape": (_hf(edit=lambda t: t.__setitem__("model.layers.0.self_attn.k_proj.weight",
                                                        t["model.layers.0.self_attn.k_proj.weight"][:20])),
                       ["model.safetensors", "'model.layers.0.self_attn.k_proj.weight'", "[20, 48]", "[24, 48]"]),
    "hf-garbage-header": (_hf(raw_edit=_bad_header), ["model.safetensors", "not a safetensors file"]),
    "hf-missing-shard": (lambda d, p, main: (_write_hf(d) / "model.safetensors.index.json").write_text(
        json.dumps({"weight_map": {"x": "model-00002.safetensors"}})) and ["compile", str(d / "hf")],
        ["model.safetensors.index.json", "model-00002.safetensors"]),
    "hf-truncated-after-compile": (_hf_then_run(lambda c: (c / "model.safetensors").write_bytes(
        (c / "model.safetensors").read_bytes()[:5000])), ["model.safetensors", "truncated"]),
    "hf-no-weights-at-run": (_hf_then_run(lambda c: (c / "model.safetensors").unlink()),
                             ["no *.safetensors files", "needs its weights"]),
    # ---- prompts JSONL (dataflow run --prompts FILE) ----
    "prompts-binary": (_prompts(b'{"id": "a"}\x00\x01'), ["p.jsonl:1", "binary"]),
    "prompts-not-utf8": (_prompts(b'{"id": "a", "prompt_token_ids": [1]}\n{"id": "caf\xe9"}\n'),
                         ["p.jsonl:2", "not UTF-8", "byte 0xe9"]),
    "prompts-duplicate-key": (_prompts('{"id": "a", "prompt_token_ids": [1, 2], "id": "b"}\n'),
                              ["p.jsonl:1", "duplicate key 'id'"]),
    "prompts-missing-field": (_prompts('{"id": "a"}\n'), ["p.jsonl:1", "missing field 'prompt_token_ids'"]),
    "prompts-oov": (_prompts('{"id": "a", "prompt_token_ids": [1, 2, 99999]}\n'),
                    ["p.jsonl:1", "prompt_token_ids", "[99999]", "0..319"]),
    "prompts-negative-id": (_prompts('{"id": "a", "prompt_token_ids": [-1]}\n'), ["p.jsonl:1", "[-1]", "0..319"]),
    "prompts-negative-max-new": (_prompts('{"id": "a", "prompt_token_ids": [1], "max_new_tokens": -3}\n'),
                                 ["p.jsonl:1", "field 'max_new_tokens'", "-3", "positive integer"]),
    "prompts-nan": (_prompts('{"id": "a", "prompt_token_ids": [1, NaN]}\n'), ["p.jsonl:1", "NaN"]),
    "prompts-empty": (_prompts(""), ["p.jsonl", "no requests", "one JSON object per line"]),
    "prompts-directory": (lambda d, p, main: ["run", str(p), "--prompts", str(d), "--in-process"],
                          ["is a directory", "prompts file"]),
    "prompts-past-max-position": (_prompts('{"id": "a", "prompt_token_ids": [1, 2]}\n', "--max-new-tokens", "600"),
                                  ["p.jsonl:1", "--max-new-tokens (600)", "max_position 512", "1..511"]),
    # ---- run options ----
    "max-new-tokens-506": (_run("--max-new-tokens", "506", "--in-process"),
                           ["--max-new-tokens 506", "max_position 512", "valid: 1..505"]),
    "max-new-tokens-negative": (_run("--max-new-tokens", "-1"), ["--max-new-tokens -1", "valid: 1..512"]),
    "num-requests-1e8": (_run("--num-requests", "100000000"), ["--num-requests 100000000", "1..100000"]),
    "kv-blocks-zero": (_run("--kv-blocks", "0"), ["--kv-blocks 0", "positive"]),
    "top-p-2": (_run("--top-p", "2", "--in-process"), ["top_p", "--top-p 2.0", "less than or equal to 1"]),
    "no-plan-dir": (lambda d, p, main: ["run", str(d / "nowhere")], ["nowhere/plan.json", "no plan here"]),
    "1000-local-processes": (lambda d, p, main: main(["compile", "tiny", "--ranks", "1000", "--device", "cuda", "-o",
                                                      str(d / "big")])[0] == 0 and ["run", str(d / "big"), "-q"],
                             ["1000 ranks", "local rank processes", "--in-process"]),
    "inspect-dot-unwritable": (lambda d, p, main: ["inspect", str(p), "--dot", str(d / "no" / "g.dot")],
                               ["option '--dot'", "g.dot", "No such file"]),
    # ---- plan.json edited by hand ----
    "plan-binary": (_plan_edit(None, raw=b"\xff\xfe\x00"), ["plan.json", "binary", "compile it again"]),
    "plan-duplicate-key": (_plan_edit(None, raw=b'{"version": 1, "version": 1}'),
                           ["plan.json", "duplicate key 'version'"]),
    "plan-expert-on-rank-7": (_plan_edit(lambda p: p["placement"]["expert_rank"][0].__setitem__(0, 7)),
                              ["plan.json", "field 'placement.expert_rank[0][0]'", "got 7", "a rank 0..1"]),
    "plan-expert-missing": (_plan_edit(lambda p: p["placement"]["expert_rank"][1].pop()),
                            ["field 'placement.expert_rank[1]'", "7 experts", "8 entries"]),
    "plan-cluster-ranks": (_plan_edit(_set(["cluster", "ranks"], 3)), ["field 'ranks'", "2 entries", "3 entries"]),
    "plan-rank-dropped": (_plan_edit(lambda p: p["ranks"].pop()), ["field 'ranks'", "1 entries", "2 entries"]),
    "plan-stage-layer": (_plan_edit(lambda p: p["stages"][2].__setitem__("layer", 9)),
                         ["field 'stages[2].layer'", "got 9", "valid: 1"]),
    "plan-stage-next": (_plan_edit(lambda p: p["stages"][0].__setitem__("next", 99)),
                        ["field 'stages[0].next'", "got 99", "valid: 1"]),
    "plan-queue-layer": (_plan_edit(lambda p: p["ranks"][0]["queues"][0].__setitem__("layer", 9)),
                         ["field 'ranks[0].queues[0].layer'", "got 9"]),
    "plan-queue-experts": (_plan_edit(lambda p: p["ranks"][0]["queues"][1]["experts"].append(4)),
                           ["field 'ranks[0].queues[1].experts'", "[0, 1, 2, 3, 4]", "[0, 1, 2, 3]"]),
    "plan-num-blocks-negative": (_plan_edit(lambda p: p["kv"]["num_blocks"].__setitem__(0, -1)),
                                 ["field 'kv.num_blocks.0'", "greater than 0", "-1"]),
    "plan-num-blocks-short": (_plan_edit(lambda p: p["kv"]["num_blocks"].pop()),
                              ["field 'kv.num_blocks'", "1 entries", "2 entries"]),
    "plan-spec-layers": (_plan_edit(_set(["spec", "num_layers"], 2)), ["plan.json", "field '", "spec.num_layers"]),
    "plan-batch-cap-zero": (_plan_edit(lambda p: p["ranks"][1]["queues"][0].__setitem__("batch_cap", 0)),
                            ["batch_cap", "greater than 0"]),
    "plan-routes-dropped": (_plan_edit(lambda p: p["routes"].pop()), ["plan.json", "routes", "compile the model again"]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_input_exits_2_with_one_line(case, tiny_plan, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    build, needles = CASES[case]
    # `main` for the builders that compile first (a plan to break, or to run)
    args = build(tmp_path, tiny_plan, lambda a: _main(monkeypatch, capsys, a))
    assert args, f"{case}: the builder failed"
    code, out, err = _main(monkeypatch, capsys, args)
    assert "Traceback" not in err + out
    assert code == 2, f"{case}: exit {code}\n{out}\n{err}"
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    for needle in needles:
        assert needle in lines[0], f"{case}: {needle!r} not in {lines[0]!r}"


def test_config_only_checkpoint_compiles_with_a_note(tmp_path, monkeypatch, capsys):
    """A checkpoint dir with config.json and no weights still compiles (sizing a published model), with a note
    that `run` needs the weights (run then refuses: the hf-no-weights-at-run case)."""
    ckpt = tmp_path / "hf"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(HF_CONFIG))
    code, _, err = _main(monkeypatch, capsys, ["compile", str(ckpt), "-o", str(tmp_path / "p")])
    assert code == 0, err
    assert "note:" in err and "no *.safetensors files" in err


def test_good_checkpoint_and_yaml_still_compile(tmp_path, monkeypatch, capsys):
    """The header checks pass a valid checkpoint; the bounds pass every shipped spec."""
    code, _, err = _main(monkeypatch, capsys, ["compile", str(_write_hf(tmp_path)), "-o", str(tmp_path / "p")])
    assert code == 0, err
    from graph_ir.spec import load_spec
    for p in SPECS.glob("*.yaml"):
        load_spec(p)
    assert yaml.safe_load(TINY)["num_layers"] == 3
