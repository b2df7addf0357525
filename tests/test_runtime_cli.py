"""`dataflow run` end to end: compile then run with no arguments, prompts/outputs files, errors."""
from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from dataflow.cli import app
from graph_ir.errors import UserError


@pytest.fixture()
def in_tmp(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    res = runner.invoke(app, ["compile", "tiny", "--ranks", "2"])
    assert res.exit_code == 0, res.output
    return tmp_path, runner


def test_compile_then_run_with_no_arguments(in_tmp):
    _, runner = in_tmp
    res = runner.invoke(app, ["run", "--in-process", "-q", "--max-new-tokens", "4", "--num-requests", "3"])
    assert res.exit_code == 0, res.output
    assert "3 / 3" in res.output and "tokens/s" in res.output and "mean expert batch" in res.output


@pytest.mark.parametrize("mode,shown,unit", [(None, "host-routed", "routed rows"), ("device", "device-routed", "slots")])
def test_run_summary_names_the_dispatch(in_tmp, use_options, mode, shown, unit):
    """The summary says which dispatch ran (the dispatch option; the CPU default is host-routed) and counts expert
    batches in that dispatch's unit."""
    _, runner = in_tmp
    if mode is not None:
        use_options(dispatch=mode)
    res = runner.invoke(app, ["run", "--in-process", "--max-new-tokens", "3", "--num-requests", "2"])
    assert res.exit_code == 0, res.output
    line = next(l for l in res.output.splitlines() if l.strip("│ ").startswith("dispatch"))  # (not the options row)
    assert shown in line and unit in next(l for l in res.output.splitlines() if "mean expert batch" in l)


def test_prompts_outputs_and_trace_files_match_the_reference(in_tmp):
    tmp, runner = in_tmp
    prompts = [{"id": "a", "prompt_token_ids": [5, 6, 7, 8], "max_new_tokens": 5},
               {"id": "b", "prompt_token_ids": list(range(3, 60))}]
    (tmp / "p.jsonl").write_text("\n".join(json.dumps(p) for p in prompts) + "\n")
    res = runner.invoke(app, ["run", "--prompts", "p.jsonl", "--max-new-tokens", "3", "--ignore-eos", "--policy",
                              "aging", "--policy-param", "bound=0.5", "-o", "out.jsonl", "--trace", "t.json",
                              "--in-process", "-q"])
    assert res.exit_code == 0, res.output
    lines = [json.loads(l) for l in (tmp / "out.jsonl").read_text().splitlines()]
    lines.sort(key=lambda l: l["id"])  # written as they finish: finish order
    assert [l["id"] for l in lines] == ["a", "b"]
    assert [len(l["output_token_ids"]) for l in lines] == [5, 3]
    assert all(l["finish_reason"] == "length" for l in lines)
    from lowering.plan import load_plan
    from lab.reference import ReferenceDecoder
    from models.weights import load_weights
    spec = load_plan(tmp / "dataflow-plan").spec
    ref = ReferenceDecoder(spec, load_weights(spec))
    for l in lines:
        # greedy: near-ties aside (rare on this model), the tokens are the reference's
        assert l["output_token_ids"] == ref.generate(l["prompt_token_ids"], len(l["output_token_ids"]),
                                                     ignore_eos=True).tokens
    trace = json.loads((tmp / "t.json").read_text())
    assert any(e["ph"] == "X" for e in trace["traceEvents"]) and any(e["ph"] == "i" for e in trace["traceEvents"])


@pytest.mark.parametrize("args,needle", [
    (["--policy", "fifo"], "valid: flfs"),
    (["--policy-param", "delta"], "KEY=VALUE"),
    (["--prompts", "missing.jsonl"], "no such prompts file"),
    (["--top-p", "0"], "top_p"),
    (["--clock", "sundial"], "valid: wall, virtual"),
])
def test_user_mistakes_are_user_errors(in_tmp, args, needle):
    # (dataflow.cli.main turns a UserError into its message and exit code 2, no traceback)
    _, runner = in_tmp
    res = runner.invoke(app, ["run", "--in-process", "-q", *args])
    assert isinstance(res.exception, UserError), res.output
    assert needle in str(res.exception)


def test_bad_prompt_line_names_file_line_and_field(in_tmp):
    tmp, runner = in_tmp
    (tmp / "p.jsonl").write_text('{"id": "a", "prompt_token_ids": [1, 2]}\n{"id": "b", "prompt_token_ids": [99999]}\n')
    res = runner.invoke(app, ["run", "--prompts", "p.jsonl", "--in-process", "-q"])
    assert res.exit_code != 0
    assert "p.jsonl:2" in str(res.exception) and "prompt_token_ids" in str(res.exception)


@pytest.mark.parametrize("n,hinted", [(9, "small second wave"), (16, "several waves"), (8, None)])
def test_run_hints_when_the_attention_cap_splits_the_decodes_into_waves(tmp_path, monkeypatch, n, hinted):
    """One rank, attention cap 8: 9 decoding requests make every step a batch of 8 plus a wave of 1 through
    every layer (the 20% loss of benchmarks/NOTES.md §19 item 4), 16 make two full waves (§29 item 6); `dataflow
    run` says which and how to fix it. 8 requests fit one batch: no hint."""
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    res = runner.invoke(app, ["compile", "tiny", "--ranks", "1", "--attn-cap", "8"])
    assert res.exit_code == 0, res.output
    (tmp_path / "p.jsonl").write_text("".join(json.dumps({"id": f"r{i}", "prompt_token_ids": [5 + i],
                                                          "max_new_tokens": 8}) + "\n" for i in range(n)))
    res = runner.invoke(app, ["run", "--in-process", "--prompts", "p.jsonl", "--ignore-eos"])
    assert res.exit_code == 0, res.output
    said = "--attn-cap" in res.output and "hint" in res.output
    assert said == (hinted is not None) and (hinted is None or hinted in " ".join(res.output.split())), res.output


def test_a_cuda_plan_without_a_gpu_runs_the_twin_with_a_pool_for_its_requests(tmp_path, monkeypatch):
    """A plan compiled for cuda, run where no GPU is visible: the CUDA executor's CPU twin serves it with a KV pool
    sized to the requests (the plan's, sized for 132 GiB GPUs, would take the host's memory), and says so."""
    import torch
    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    runner = CliRunner()
    assert runner.invoke(app, ["compile", "tiny", "--device", "cuda", "-o", "g"]).exit_code == 0
    res = runner.invoke(app, ["run", "g", "--in-process", "--num-requests", "3", "--max-new-tokens", "3"])
    assert res.exit_code == 0, res.output
    out = " ".join(res.output.split())
    assert "no GPU is visible" in out and "KV pool of 64 pages per rank" in out and "3 / 3" in out
    assert "device-routed" in out  # the plan's dispatch


@pytest.mark.parametrize("command", ["run", "serve"])
def test_kv_blocks_below_one_is_refused_by_run_and_serve(in_tmp, command):
    """`--kv-blocks 0` is refused with the option named, before anything starts: a usage error (exit 2) or a
    UserError (which dataflow.cli.run_app prints as one line, exit 2)."""
    _, runner = in_tmp
    res = runner.invoke(app, [command, "--kv-blocks", "0"] + (["--in-process"] if command == "run" else []))
    said = str(res.exception) if isinstance(res.exception, UserError) else res.output
    assert (res.exit_code == 2 or isinstance(res.exception, UserError)) and "kv-blocks" in said, res.output
