"""`python -m lab simulate` (lab/cmd_simulate.py): a model on a virtual cluster of N GPUs behind shared NICs,
streaming against barrier EP, clean and with a slow NIC, in the bench's report format."""
import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from graph_ir.errors import UserError
from graph_ir.spec import load_spec
from lab.cmd_simulate import COSTS, named_scenario, simulate_config


def test_named_scenarios_place_the_disturbance_on_the_last_node_or_gpu():
    assert named_scenario("clean", 16, 8) == {}
    nic = named_scenario("slow-nic", 6, 4)     # nodes {0..3}, {4, 5}: the last node's GPUs, both ways
    assert nic["bursts"][0]["links"] == [[4, -1], [-1, 4], [5, -1], [-1, 5]]
    assert named_scenario("slow-rank", 6, 4) == {"slow_ranks": [{"rank": 5, "factor": 1.5}]}
    with pytest.raises(UserError, match="not a named scenario"):
        named_scenario("slow-disk", 6, 4)


def test_the_config_carries_the_models_rows_the_cost_profile_and_the_network(tmp_path):
    spec = load_spec("models/specs/gpt-oss-120b.yaml")
    cfg = simulate_config("gpt-oss-120b", spec, 64, 8, ["clean", "slow-nic"], COSTS, 32, 16, ["streaming", "ag-ep"])
    assert cfg.row_bytes == 2880 * 2 and cfg.network.gpus_per_node == 8 and cfg.ranks == 64
    assert cfg.workload.requests == 64 * 32 and cfg.workload.decode_only and cfg.cost.expert_fixed_us == 150
    assert list(cfg.scenarios) == ["clean", "slow-nic"] and cfg.clean_scenario == "clean"
    mine = tmp_path / "mine.yaml"
    mine.write_text("calm: {}\nstorm: {bursts: [{period_ms: 5, duty: 0.5, extra_delay_us: 100}]}\n")
    cfg = simulate_config("x", spec, 4, 2, [str(mine)], COSTS, 2, 2, ["streaming", "ag-ep"])
    assert list(cfg.scenarios) == ["calm", "storm"] and cfg.clean_scenario == "calm"
    with pytest.raises(UserError, match="no such file"):
        simulate_config("x", spec, 4, 2, ["clean"], tmp_path / "none.yaml", 2, 2, ["streaming"])
    bad = tmp_path / "bad.yaml"   # a user's profile with a typo: one line naming the file and the field
    bad.write_text("expert_fixed_us: fast\n")
    with pytest.raises(UserError, match=r"--costs .*bad.yaml: expert_fixed_us: Input should be a valid number"):
        simulate_config("x", spec, 4, 2, ["clean"], bad, 2, 2, ["streaming"])


def test_a_16_gpu_cluster_runs_through_simulate_and_reports(tmp_path):
    from lab.__main__ import app
    model = tmp_path / "tiny16.yaml"     # the tiny model with one expert per GPU at least
    model.write_text(Path("models/specs/tiny.yaml").read_text().replace("num_experts: 8", "num_experts: 16"))
    out = tmp_path / "out"
    res = CliRunner().invoke(app, ["simulate", str(model), "--ranks", "16", "-g", "2", "--requests-per-rank", "2",
                                   "--new-tokens", "4", "--systems", "streaming,ag-ep", "--trace", "-o", str(out)])
    assert res.exit_code == 0, res.output
    doc = json.loads((out / "report.json").read_text())
    cells = {(r["label"], r["scenario"]) for r in doc["results"]}
    assert cells == {(s, sc) for s in ("streaming/defrag", "ag-ep") for sc in ("clean", "slow-nic")}
    tokens = {r["output_tokens"] for r in doc["results"]}   # ShareGPT output lengths, capped at --new-tokens
    assert len(tokens) == 1 and 0 < tokens.pop() <= 16 * 2 * 4 and all(r["unfinished"] == 0 for r in doc["results"])
    assert doc["config"]["network"]["gpus_per_node"] == 2 and (out / "report.md").exists()
    slow = {r["label"]: r for r in doc["results"] if r["scenario"] == "slow-nic"}
    assert all(r["loss_vs_clean"] > 0 for r in slow.values())   # virtual clock: the slow NIC costs every system
    # issue 34's scale table reads these per cell: tokens/s, ITL p99, the ratio to all-gather EP
    for r in doc["results"]:
        assert r["tokens_per_s"] > 0 and r["itl_p99_ms"] > 0 and r["ratio_vs_baseline"] > 0, r
        assert r["itl_p50_ms"] <= r["itl_p99_ms"] and r["total_link_bytes"] > 0
    assert {r["ratio_vs_baseline"] for r in doc["results"] if r["label"] == "ag-ep"} == {1.0}
    for scenario in ("clean", "slow-nic"):   # --trace: streaming's predicted schedule, one Perfetto file per cell
        trace = json.loads((out / "traces" / f"trace-defrag-{scenario}-r0.json").read_text())
        batches = [e for e in trace["traceEvents"] if e.get("ph") == "X"]
        assert {e["pid"] for e in batches} == set(range(16)) and all(e["dur"] > 0 for e in batches)
