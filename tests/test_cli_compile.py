"""`dataflow compile` / `dataflow inspect` end to end: exit codes, one-line errors without tracebacks,
the default plan directory, and the inspect views."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from dataflow import cli

SPECS = Path(__file__).resolve().parents[1] / "models" / "specs"


def run(monkeypatch, capsys, *args: str) -> tuple[int, str, str]:
    """Call the console entry point in-process (same code path as the `dataflow` command)."""
    monkeypatch.setattr(sys, "argv", ["dataflow", *args])
    monkeypatch.setenv("COLUMNS", "200")
    code = 0
    try:
        cli.main()
    except SystemExit as exit_:
        code = exit_.code if isinstance(exit_.code, int) else 1
    out, err = capsys.readouterr()
    return code, out, err


@pytest.fixture
def workdir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    return tmp_path


def test_compile_shipped_name_to_default_dir_then_inspect(workdir, monkeypatch, capsys):
    code, out, err = run(monkeypatch, capsys, "compile", "tiny", "--ranks", "3")
    assert code == 0, err
    plan_dir = workdir / cli.DEFAULT_PLAN_DIR
    assert (plan_dir / "plan.json").is_file() and (plan_dir / "plan.txt").is_file()
    assert "tiny" in out and "wrote" in out
    code, out, err = run(monkeypatch, capsys, "inspect")  # finds the default plan without arguments
    assert code == 0, err
    for text in ("placement", "stage chain", "mu-queues of rank 0", "dispatch", "combine", "buckets",
                 "memory pools", "KV blocks"):
        assert text in out
    code, out, _ = run(monkeypatch, capsys, "inspect", "--section", "queues", "--rank", "2")
    assert "mu-queues of rank 2" in out and "expert(1)" in out and "6-7" in out  # rank 2 holds experts 6-7


def test_compile_records_the_dispatch_and_inspect_shows_its_routes(workdir, monkeypatch, capsys):
    code, out, err = run(monkeypatch, capsys, "compile", "tiny", "--device", "cuda", "-o", "g")
    assert code == 0, err
    assert "device-routed dispatch" in " ".join(out.split())
    code, out, err = run(monkeypatch, capsys, "inspect", "g", "--section", "routes")
    assert code == 0 and "device-routed dispatch" in " ".join(out.split()), err
    code, _, err = run(monkeypatch, capsys, "compile", "tiny", "--device", "cuda", "--dispatch", "host", "-o", "h")
    code, out, _ = run(monkeypatch, capsys, "inspect", "h", "--section", "routes", "--json")
    assert code == 0 and all("whole" not in r["carries"] for r in json.loads(out))
    code, _, err = run(monkeypatch, capsys, "compile", "tiny", "--dispatch", "gpu")
    assert code == 2 and "option 'dispatch': got 'gpu'; valid: auto" in err


def test_compile_yaml_with_options_and_json_sections(workdir, monkeypatch, capsys):
    profile = workdir / "load.yaml"
    profile.write_text(yaml.safe_dump([5, 1, 1, 1, 1, 1, 1, 5, 1, 1]))
    code, _, err = run(monkeypatch, capsys, "compile", str(SPECS / "tiny-qwen2-moe.yaml"), "-o", "p", "--ranks", "4",
                       "--placement", "profile", "--load-profile", str(profile), "--attn-cap", "64",
                       "--expert-cap", "200", "--block-size", "8", "--home-policy", "round_robin")
    assert code == 0, err
    for section in ("placement", "queues", "graphs", "routes", "memory"):
        code, out, err = run(monkeypatch, capsys, "inspect", "p", "--section", section, "--json")
        assert code == 0, err
        data = json.loads(out)
        assert data
    code, out, _ = run(monkeypatch, capsys, "inspect", "p", "--section", "placement", "--json")
    placement = json.loads(out)
    assert placement["policy"] == "profile" and placement["home_policy"] == "round_robin"
    assert placement["expert_rank"][0][0] != placement["expert_rank"][0][7]
    code, out, _ = run(monkeypatch, capsys, "inspect", "p", "--section", "graphs", "--json")
    assert json.loads(out)["buckets"]["attn"] == [1, 8, 40, 64]
    code, out, _ = run(monkeypatch, capsys, "inspect", "p", "--json")
    assert json.loads(out)["kv"]["block_size"] == 8


def test_inspect_dot(workdir, monkeypatch, capsys):
    assert run(monkeypatch, capsys, "compile", "tiny-deepseek-v2", "--ranks", "2")[0] == 0
    code, _, err = run(monkeypatch, capsys, "inspect", "--dot", "g.dot")
    assert code == 0, err
    dot = (workdir / "g.dot").read_text()
    assert dot.startswith("digraph") and "cluster_home1" in dot and "E9 L2 h1" in dot


@pytest.mark.parametrize("args, needle", [
    (["compile", "no-such-model"], "MODEL 'no-such-model': no such file, directory or shipped model; valid"),
    (["compile", "tiny", "--ranks", "0"], "option 'ranks': got 0"),
    (["compile", "tiny", "--ranks", "100000"], "valid: an integer 1..1024"),
    (["compile", "tiny", "--device", "tpu"], "option 'device': got 'tpu'"),
    (["compile", "tiny", "--placement", "profile"], "needs a per-expert load file"),
    (["compile", "mixtral-8x7b", "--ranks", "2"], "does not fit 2 x cpu"),
    (["inspect", "nowhere"], "no plan here"),
])
def test_user_errors_exit_2_with_one_line(workdir, monkeypatch, capsys, args, needle):
    code, out, err = run(monkeypatch, capsys, *args)
    assert code == 2
    assert needle in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("mutate, needle", [
    (lambda d: d.update(hiden_size=48), "field 'hiden_size': unknown field (got 48)"),
    (lambda d: d["experts"].update(top_k="two"), "field 'experts.top_k': Input should be a valid integer"),
    (lambda d: d["experts"].update(top_k=9), "top_k (9) must be <= num_experts (8)"),
    (lambda d: d["attention"].update(num_kv_heads=3), "num_kv_heads (3) must divide num_heads (4)"),
])
def test_bad_yaml_exit_2_names_file_field_value(workdir, monkeypatch, capsys, mutate, needle):
    data = yaml.safe_load((SPECS / "tiny.yaml").read_text())
    mutate(data)
    (workdir / "bad.yaml").write_text(yaml.safe_dump(data))
    code, _, err = run(monkeypatch, capsys, "compile", "bad.yaml")
    assert code == 2 and "bad.yaml" in err and needle in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1


def test_inspect_bad_rank_and_section(workdir, monkeypatch, capsys):
    assert run(monkeypatch, capsys, "compile", "tiny", "--ranks", "2")[0] == 0
    code, _, err = run(monkeypatch, capsys, "inspect", "--rank", "5")
    assert code == 2 and "valid: 0..1" in err
    code, _, err = run(monkeypatch, capsys, "inspect", "--section", "bogus")
    assert code == 2 and "valid: placement, queues, graphs, routes, memory" in err


def test_an_unknown_option_is_a_usage_error_without_traceback(workdir, monkeypatch, capsys):
    for args in (("inspect", "--plan", "x"), ("compile", "tiny", "--bogus"), ("run", "--max-new-tokens", "many")):
        code, _, err = run(monkeypatch, capsys, *args)
        assert code == 2, (args, err)
        assert "Traceback" not in err and ("No such option" in err or "Invalid value" in err), (args, err)


def test_directory_without_config_json(workdir, monkeypatch, capsys):
    (workdir / "ckpt").mkdir()
    code, _, err = run(monkeypatch, capsys, "compile", "ckpt")
    assert code == 2 and "without config.json" in err


def test_real_console_command(tmp_path):
    """The installed `dataflow` script itself: exit 2, message on stderr, no traceback."""
    exe = Path(sys.executable).parent / "dataflow"
    if not exe.exists():
        pytest.skip("dataflow console script not installed in this environment")
    bad = tmp_path / "m.yaml"
    bad.write_text("name: x\nnum_layers: 2\n")
    res = subprocess.run([str(exe), "compile", str(bad)], capture_output=True, text=True, timeout=120)
    assert res.returncode == 2
    assert "field 'hidden_size': Field required" in res.stderr and "Traceback" not in res.stderr


def test_compile_hugging_face_checkpoint_dir(workdir, monkeypatch, capsys):
    """A directory with config.json is imported through models.checkpoint.import_spec."""
    pytest.importorskip("models.checkpoint")
    ckpt = workdir / "hf"
    ckpt.mkdir()
    (ckpt / "config.json").write_text(json.dumps(dict(
        architectures=["MixtralForCausalLM"], model_type="mixtral", hidden_size=48, intermediate_size=64,
        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, num_local_experts=6,
        num_experts_per_tok=2, vocab_size=300, rms_norm_eps=1e-5, rope_theta=10000.0,
        max_position_embeddings=512, tie_word_embeddings=False, eos_token_id=2, torch_dtype="float32")))
    code, _, err = run(monkeypatch, capsys, "compile", str(ckpt), "--ranks", "4", "-o", "p")
    assert code == 0, err
    plan = json.loads((workdir / "p" / "plan.json").read_text())
    assert plan["source"] == f"checkpoint {ckpt}"
    assert plan["spec"]["experts"]["num_experts"] == 6 and len(plan["placement"]["expert_rank"]) == 2


def test_compile_layers_cuts_the_model(tmp_path):
    from typer.testing import CliRunner
    from dataflow.cli import app
    from lowering.plan import load_plan
    res = CliRunner().invoke(app, ["compile", "gpt-oss-120b", "--ranks", "2", "--device", "cuda", "--layers", "18",
                                   "-o", str(tmp_path / "p")])
    assert res.exit_code == 0, res.output
    plan = load_plan(tmp_path / "p")
    assert plan.spec.num_layers == 18 and len(plan.stages) == 2 * 18 + 1
