"""The CPU-runnable measurement scripts under benchmarks/ still run (they are how host-path changes are priced:
benchmarks/NOTES.md §19-20), with their outputs' shape checked, not their timings."""
from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def test_engine_overhead_times_and_counts_every_batch_kind():
    import engine_overhead as eo
    timed = eo.run(16, 16, 2)
    counted = eo.run(16, 16, 2, count_calls=True)
    kinds = {k.split(":")[0].split("@")[0] for k in timed}
    assert kinds == {"attn", "expert", "recv", "sample"}
    assert set(counted) == set(timed)
    assert all(host >= eng >= 0 for host, eng, _ in timed.values())
    assert counted["attn:16@r0"][1] > 0  # the engine makes torch calls per attention batch; the count sees them
    assert eo.CALLS is not None and eo.CALLS.paused == 0  # every executor call un-paused the counter


def test_engine_overhead_runs_the_device_routed_dispatch():
    """--dispatch device: whole batches to both ranks, expert batches in slots (T*k per home batch)."""
    import engine_overhead as eo
    timed = eo.run(16, 16, 2, device_routed=True)
    assert {k.split(":")[0].split("@")[0] for k in timed} == {"attn", "expert", "recv", "sample"}
    assert "expert:64@r1" in timed  # rank 0's 16 tokens x 4 slots, all of them at the other owner too


def test_host_speed_prices_the_cpu_building_blocks():
    import host_speed
    rows = host_speed.cpu_rows(3)
    assert len(rows) >= 6 and all(us > 0 for _, us in rows)


def test_sampling_bench_checks_and_times_both_samplers(capsys):
    import sampling_bench
    assert sampling_bench.main(["--vocab", "512", "--rows", "1,4", "--reps", "1", "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert out.count("| 4 |") == 3 and "0 failed checks" in out


def test_mixed_batch_bench_compares_every_path(capsys):
    import mixed_batch_bench
    assert mixed_batch_bench.main(["--decode", "8", "--chunk", "5", "--context", "9", "--reps", "1",
                                   "--device", "cpu"]) == 0
    out = capsys.readouterr().out
    assert "one segment at a time" in out and out.rstrip().endswith("ok")
    assert all(f"| mixed (8 + 5 rows) | {p} |" in out for p in ("paged", "eager"))


def test_arrivals_bench_runs_every_variant_on_the_cpu(capsys):
    import arrivals_bench
    assert arrivals_bench.main(["--smoke", "--rounds", "1", "--requests", "10", "--initial", "4"]) == 0
    out = capsys.readouterr().out
    assert all(f"| {v} |" in out for v in arrivals_bench.VARIANTS) and "10/10 |" in out


def test_gpu_bench_correctness_section_passes_on_the_cpu_twin(tmp_path):
    """gpu_bench's correctness section on CPU shapes: fp32 tokens == the reference and the bf16 teacher-forced logits
    within the stated tolerance, for every policy. Its teacher forcing had silently recorded nothing since sampling
    became asynchronous (session 5) and failed every bf16 row on the GPU (run 56): this keeps it honest."""
    import json
    import subprocess

    # a process of its own: importing gpu_bench sets TRITON_INTERPRET=1 and torch's thread count for the process
    script = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_bench.py"
    run = subprocess.run([sys.executable, str(script), "--out", str(tmp_path), "--smoke", "--sections", "correctness"],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = json.loads((tmp_path / "gpu_bench.json").read_text())["results"]["correctness"]
    assert {r["dtype"] for r in rows} == {"float32", "bfloat16"} and all(r["ok"] for r in rows)
    assert all(r["tf_ratio"] <= r["tf_tol"] and r["tf_steps"] > r["tf_left_out"] for r in rows if r["dtype"] == "bfloat16")


def test_router_near_ties_are_steps_whose_expert_choice_is_within_bf16_noise():
    """gpu_bench leaves a step out of the teacher-forced logit comparison when the fp32 reference's k-th and (k+1)-th
    router logits (at any MoE layer) are closer than twice the bf16 run's router-logit error at that token; steps are
    the positions from the prompt's last on."""
    import gpu_bench_correctness as gb
    spec = SimpleNamespace(experts=SimpleNamespace(top_k=2))
    # 4 positions (a 2-token prompt: steps are positions 1..3), 4 experts; top-2 margin per position: 1.0, 0.1, 1.0, 0.1
    a = torch.tensor([[3.0, 2.0, 1.0, 0.0], [3.0, 2.0, 1.9, 0.0], [0.0, 5.0, 4.0, 3.0], [2.0, 0.0, 1.95, 1.85]])
    noise = torch.zeros_like(a)
    noise[:, 0] = 0.04  # 2 x 0.04 = 0.08: only a margin below that is a near-tie
    noise[3, 0] = 0.06  # 0.12 > 0.1 at position 3
    assert gb._router_near_ties(spec, [a], [a + noise], 2) == [False, False, True]
    # two layers: a near-tie at either counts
    assert gb._router_near_ties(spec, [a, a], [a + noise, a + 10 * noise], 2) == [True, False, True]
    assert gb._router_near_ties(spec, [], [], 2) == []


def test_gpu_bench_kernel_table_groups_a_traces_device_events_per_replay(tmp_path):
    """--profile-graphs reads the profiler's chrome trace (on the CPU no graph is captured, so this feeds it one):
    device events grouped by name per replay, largest first, the tail summed, host events ignored."""
    import json

    import gpu_bench_executor as gb

    class Prof:
        def export_chrome_trace(self, path):
            ev = [{"ph": "X", "cat": "kernel", "name": "rms", "dur": 2.0}] * 20 + \
                 [{"ph": "X", "cat": "kernel", "name": "gemm", "dur": 30.0}] * 10 + \
                 [{"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "dur": 1.0}] * 10 + \
                 [{"ph": "X", "cat": "cuda_runtime", "name": "cudaGraphLaunch", "dur": 9.0}] * 10
            Path(path).write_text(json.dumps({"traceEvents": ev}))
    rows = gb.kernel_table(Prof(), replays=10, top=2)
    assert rows == [["(all)", 4.0, 35.0], ["gemm", 1.0, 30.0], ["rms", 2.0, 4.0], ["(other)", 1.0, 1.0]]


def test_ab_summary_reads_both_benches_rows_and_pairs_rounds():
    from ab_summary import summary
    ep = ("old 1 | streaming-defrag | clean | 512 | 100.0 | 1.00 |\nnew 1 | streaming-defrag | clean | 512 | 90.0 | 1.00 |\n"
          "new 2 | streaming-defrag | clean | 512 | 130.0 | 1.00 |\nold 2 | streaming-defrag | clean | 512 | 110.0 | 1.00 |\n"
          "old 3 | streaming-defrag | clean | 512 | 120.0 | 1.00 |\nnew 3 | streaming-defrag | clean | 512 | 132.0 | 1.00 |\n")
    out = summary(ep)
    assert "old: median 110 tok/s over 3 launches (100, 110, 120)" in out
    assert "new/old per round: 0.90x, 1.18x, 1.10x; new ahead in 2 of 3 rounds; medians 1.182x" in out
    bench = "old 1 | streaming | defrag | 256 | 200.0 | 210.0 | - |\nnew 1 | streaming | defrag | 256 | 250.0 | 260.0 | - |\n"
    assert "new ahead in 1 of 1 rounds; medians 1.250x" in summary(bench)
    assert summary("old 1 | s | c | 1 | 5.0 |\n").startswith("expected two trees")


def test_transport_bench_prints_a_table():
    from typer.testing import CliRunner

    import transport_bench
    out = CliRunner().invoke(transport_bench.app, ["--ranks", "2", "--sizes", "0,4K", "--messages", "50"])
    assert out.exit_code == 0, out.output
    assert "msg/s" in out.output and "4K" in out.output and "meta-only" in out.output


# ------------------------------------------------------------------------------ the device runner (benchmarks/device)
DEVICE = Path(__file__).resolve().parent.parent / "benchmarks" / "device"
KINDS = {"nvidia-h200", "nvidia-h200-x2", "nvidia-h200-x4", "nvidia-h200-x8"}


def _device_runner():
    import importlib.util
    spec = importlib.util.spec_from_file_location("device_run", DEVICE / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_every_matrix_entry_names_a_machine_and_only_scripts_that_exist(tmp_path):
    """Each entry's steps, placeholders filled, name files of this tree and leave no placeholder unfilled (a
    brace that stays is a Python format the step passes on: profile_out's {rank})."""
    import re
    run = _device_runner()
    entries = run.load_matrix()
    assert {"checks-1gpu", "checks-2gpu", "ep", "ep-phases", "ab", "gpu-bench"} <= set(entries)
    root = DEVICE.parents[1]
    for name, entry in entries.items():
        assert entry["machine"] in KINDS, name
        for step in run.plan_entry(name, entry, tmp_path, tmp_path / "tmp", {}, {}):
            text = step["run"] + " " + " ".join(step["env"].values())
            assert set(re.findall(r"\{([a-z_]+)\}", text)) <= {"rank"}, (name, text)
            for path in re.findall(r"benchmarks/[\w/.-]+\.(?:py|sh)", step["run"]):
                assert (root / path).is_file(), (name, path)
            if "DATAFLOW_OPTIONS" in step["env"]:  # valid RuntimeOptions, as the ranks will read them
                from runtime import settings
                import json
                settings.options_from(json.loads(step["env"]["DATAFLOW_OPTIONS"]), name)


def test_the_device_helpers_are_valid_bash():
    import subprocess
    for script in sorted(DEVICE.glob("*.sh")):
        assert subprocess.run(["bash", "-n", str(script)]).returncode == 0, script


def test_the_runner_runs_an_entry_with_its_vars_options_and_kept_files(tmp_path, capsys):
    run = _device_runner()
    matrix = tmp_path / "matrix.yaml"
    matrix.write_text(
        "entries:\n"
        "  demo:\n"
        "    machine: nvidia-h200\n"
        "    vars: {word: hello}\n"
        "    options: {decode_wait_ms: 5}\n"
        "    steps:\n"
        "      - run: mkdir -p {tmp}/x && echo {word} > {tmp}/x/f.txt && echo \"$DATAFLOW_OPTIONS\" && echo {word}\n"
        "        log: a.log\n"
        "        show: world\n"
        "        keep: {\"{tmp}/x/f.txt\": kept.txt}\n"
        "      - run: exit 3\n")
    out = tmp_path / "out"
    rc = run.main([str(out), "demo", "--matrix", str(matrix), "--var", "word=world", "--set", "verbose=true"])
    assert rc == 1  # the second step failed; the first still ran and kept its file
    assert (out / "demo" / "a.log").read_text().splitlines() == ['{"decode_wait_ms":5,"verbose":true}', "world"]
    assert (out / "demo" / "kept.txt").read_text() == "world\n"
    assert (out / "env.txt").read_text() == "demo a.log exit 0\ndemo step2.log exit 3\n"
    assert "world" in capsys.readouterr().out
    for bad in (["--list", "--matrix", str(tmp_path / "none.yaml")], [str(out), "nope", "--matrix", str(matrix)]):
        with pytest.raises((SystemExit, FileNotFoundError)):
            run.main(bad)


def test_calibrate_costs_fits_the_cost_models_form_and_writes_a_profile_simulate_takes(tmp_path, monkeypatch):
    import yaml

    import calibrate_costs as cc
    fixed, per_row, worst = cc.fit_affine([(1, 11e-6), (10, 20e-6), (100, 110e-6)])
    assert fixed == pytest.approx(10e-6) and per_row == pytest.approx(1e-6) and worst < 1e-9
    assert cc.fit_affine([(1, 5.0), (8, 4.0)])[1] == 0.0          # never a negative slope
    out = tmp_path / "cpu.yaml"
    monkeypatch.setattr(sys, "argv", ["calibrate_costs.py", "--model", "tiny", "--ranks", "4", "--device", "cpu",
                                      "--iters", "1", "--context", "32", "--out", str(out),
                                      "--threads", str(torch.get_num_threads())])   # the test process's own
    cc.main()
    profile = yaml.safe_load(out.read_text())
    from lab.bench_config import CostConfig
    cost = CostConfig.model_validate(profile)                     # what a bench config / simulate --costs takes
    assert cost.expert_fixed_us + cost.expert_per_row_us > 0 and cost.send_cpu_us == 30   # copied from the base
    assert "# expert: rows -> us 1:" in out.read_text()
