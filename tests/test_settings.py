"""runtime/settings.py: the runtime's options, validated, from a file / --set / DATAFLOW_OPTIONS, echoed by a run."""
from __future__ import annotations

import json
import os

import pytest
from typer.testing import CliRunner

from dataflow.cli import app
from graph_ir.errors import UserError
from runtime import settings


def test_defaults_and_validation_name_the_source_field_value_and_what_is_valid():
    assert settings.options_from({}, "x") == settings.RuntimeOptions()
    assert settings.options_from({"decode_wait_ms": 0}, "x").decode_wait_ms == 0
    with pytest.raises(UserError, match=r"f\.yaml: decode_wait_ms=-1: .*greater than or equal to 0.*decode rows"):
        settings.options_from({"decode_wait_ms": -1}, "f.yaml")
    with pytest.raises(UserError, match=r"--set: dispatch='gpu': .*'auto', 'host' or 'device'"):
        settings.options_from({"dispatch": "gpu"}, "--set")
    with pytest.raises(UserError, match=r"--set: decode_wait=1: .*valid fields: kernels, dispatch, decode_wait_ms"):
        settings.options_from({"decode_wait": 1}, "--set")
    with pytest.raises(UserError, match=r"profile_torch='3'"):
        settings.options_from({"profile_torch": "3"}, "x")


def test_set_flags_parse_json_values_and_refuse_a_missing_equals():
    assert settings.parse_set(["decode_wait_ms=0.5", "verbose=true", "dispatch=host", "nccl_library=null"]) == \
        {"decode_wait_ms": 0.5, "verbose": True, "dispatch": "host", "nccl_library": None}
    with pytest.raises(UserError, match=r"--set 'verbose': expected FIELD=VALUE"):
        settings.parse_set(["verbose"])
    # a rank number reads as JSON's 0: still the rank list "0" (a number for a string field would be refused)
    assert settings.options_from(settings.parse_set(["profile_ranks=0"]), "--set").profile_ranks == "0"
    assert settings.options_from({"profile_ranks": 12}, "f.yaml").profile_ranks == "12"
    with pytest.raises(UserError, match=r"profile_ranks='-1': String should match"):
        settings.options_from({"profile_ranks": -1}, "x")


def test_environment_file_and_flags_stack_and_configure_exports_them(tmp_path, monkeypatch):
    monkeypatch.setenv(settings.ENV_OPTIONS, json.dumps({"decode_wait_ms": 5, "verbose": True}))
    assert settings.current().decode_wait_ms == 5
    f = tmp_path / "opts.yaml"
    f.write_text("decode_wait_ms: 7\ndevice_wait_s: 30\n")
    opts = settings.from_flags(str(f), ["device_wait_s=60"])
    assert (opts.decode_wait_ms, opts.device_wait_s, opts.verbose) == (7, 60, True)
    assert json.loads(os.environ[settings.ENV_OPTIONS]) == {"decode_wait_ms": 7.0, "device_wait_s": 60.0, "verbose": True}
    assert settings.current() is opts and settings.changed() == json.loads(os.environ[settings.ENV_OPTIONS])
    f.write_text("- a list\n")
    with pytest.raises(UserError, match="an options file is a mapping"):
        settings.from_flags(str(f), [])
    monkeypatch.setenv(settings.ENV_OPTIONS, "{not json")
    with pytest.raises(UserError, match="DATAFLOW_OPTIONS: not a JSON object"):
        settings.current()


def test_the_kernels_option_reaches_the_kernel_dispatch(use_options):
    from dataflow_kernels import dispatch
    import torch

    use_options(kernels="torch")
    assert dispatch._backend == "torch" and dispatch.backend_for(torch.zeros(1)) == "torch"


def test_a_run_echoes_its_options_and_refuses_a_bad_one_with_exit_2(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    runner = CliRunner()
    assert runner.invoke(app, ["compile", "tiny", "--ranks", "2"]).exit_code == 0
    res = runner.invoke(app, ["run", "--in-process", "--max-new-tokens", "2", "--num-requests", "2",
                              "--set", "dispatch=device", "--set", "decode_wait_ms=0"])
    assert res.exit_code == 0, res.output
    assert "device-routed" in res.output
    assert "dispatch=device" in res.output and "decode_wait_ms=0.0" in res.output
    bad = runner.invoke(app, ["run", "--in-process", "--set", "dispatch=gpu"])  # (`dataflow` prints it, exit 2)
    assert isinstance(bad.exception, UserError) and "--set: dispatch='gpu'" in str(bad.exception)


def test_dataflow_options_lists_every_option():
    res = CliRunner().invoke(app, ["options"])
    assert res.exit_code == 0, res.output
    for name in settings.RuntimeOptions.model_fields:
        assert name in res.output


def test_a_cpu_plan_without_dtype_runs_in_fp32_and_an_explicit_dtype_is_kept():
    import yaml

    from graph_ir.spec import spec_from_dict
    from lowering.plan import compile_plan

    data = yaml.safe_load(open(os.path.join(os.path.dirname(__file__), "..", "models", "specs", "tiny-gpt-oss.yaml")))
    data.pop("dtype", None)
    assert compile_plan(spec_from_dict(data), 2, "cpu").spec.dtype == "float32"
    assert compile_plan(spec_from_dict(data), 2, "cuda").spec.dtype == "bfloat16"
    assert compile_plan(spec_from_dict({**data, "dtype": "bfloat16"}), 2, "cpu").spec.dtype == "bfloat16"
