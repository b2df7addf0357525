"""Report metrics from hand-made timestamps, and the report files."""
import json

import numpy as np
import pytest

from lab.report import (BatchRecord, QueueSample, RequestRecord, RunRecord, compare, environment,
                            median_over_repeats, peak_window_rate, queue_depth_grid, summarize, write_report)


def _run(system, scenario, gap, policy="-", n_req=4, n_tok=10):
    reqs = [RequestRecord(f"r{i}", arrival=0.1 * i, token_times=[0.1 * i + 0.5 + gap * j for j in range(n_tok)])
            for i in range(n_req)]
    batches = [BatchRecord(0, 0, "attn", 0, 4, 0.0, 0.01, 0.0), BatchRecord(1, 0, "attn", 0, 2, 0.0, 0.01, 0.0),
               BatchRecord(0, 1, "expert", 0, 8, 0.01, 0.02, 0.0)]
    qs = [QueueSample(t=0.01 * i, rank=i % 2, stage=i % 4, depth=i % 5) for i in range(200)]
    return RunRecord(system, policy, scenario, reqs, batches, qs, {"0->1": 100, "1->0": 50}, max_queue_delay_s=0.003)


def test_summary_metrics_from_known_timestamps():
    s = summarize(_run("ep", "clean", gap=0.2), peak_window_s=60)
    assert s["output_tokens"] == 40 and s["finished_requests"] == 4
    # first arrival 0.0, last token 0.3 + 0.5 + 9 * 0.2 = 2.6
    assert s["duration_s"] == pytest.approx(2.6) and s["tokens_per_s"] == pytest.approx(40 / 2.6)
    assert s["itl_mean_ms"] == pytest.approx(200) and s["itl_p99_ms"] == pytest.approx(200)
    assert s["ttft_p50_ms"] == pytest.approx(500)
    assert s["latency_mean_s"] == pytest.approx(0.5 + 1.8)
    assert s["batches"]["attn"] == {"count": 2, "mean_size": 3.0, "max_size": 4}
    assert s["total_link_bytes"] == 150 and s["max_queue_delay_ms"] == pytest.approx(3.0)


def test_peak_window():
    times = list(np.arange(0, 10, 1.0)) + list(10 + np.arange(0, 1, 0.01))   # a 1 s burst of 100 tokens
    assert peak_window_rate(times, 1.0) == pytest.approx(100.0)
    assert peak_window_rate([0.0, 1.0], 60.0) == pytest.approx(2.0)          # shorter than a window


def test_ratios_vs_baseline_and_clean():
    runs = [_run("ag-ep", "clean", 0.2), _run("ag-ep", "bursts", 0.4),
            _run("streaming", "clean", 0.1, "defrag"), _run("streaming", "bursts", 0.1, "defrag")]
    sums = compare([summarize(r) for r in runs], baseline="ag-ep")
    by = {(s["label"], s["scenario"]): s for s in sums}
    assert by["ag-ep", "clean"]["ratio_vs_baseline"] == pytest.approx(1.0)
    # durations: ag-ep bursts 0.3 + 0.5 + 9 * 0.4 = 4.4 s, streaming 0.3 + 0.5 + 9 * 0.1 = 1.7 s
    assert by["streaming/defrag", "bursts"]["ratio_vs_baseline"] == pytest.approx(4.4 / 1.7)
    assert by["ag-ep", "bursts"]["loss_vs_clean"] == pytest.approx(1 - 2.6 / 4.4)
    assert by["streaming/defrag", "bursts"]["loss_vs_clean"] == pytest.approx(0.0)


def test_repeats_take_medians_and_ratios_between_medians(tmp_path):
    """Three rounds per cell: every metric is the cell's median, each run's tok/s is kept, and the ratio
    and the loss compare medians (not one round's samples)."""
    gaps = {("ag-ep", "clean"): [0.2, 0.25, 0.1], ("ag-ep", "bursts"): [0.4, 0.5, 0.3],
            ("streaming", "clean"): [0.1, 0.3, 0.2], ("streaming", "bursts"): [0.1, 0.15, 0.3]}
    runs = []
    for rnd in range(3):   # round by round, as the bench runs them
        for (system, sc), g in gaps.items():
            run = _run(system, sc, g[rnd], "defrag" if system == "streaming" else "-")
            run.repeat = rnd
            runs.append(run)
    sums = median_over_repeats([summarize(r) for r in runs])
    assert [(s["label"], s["scenario"]) for s in sums] == [("ag-ep", "clean"), ("ag-ep", "bursts"),
                                                             ("streaming/defrag", "clean"),
                                                             ("streaming/defrag", "bursts")]
    tps = lambda g: 40 / (0.3 + 0.5 + 9 * g)   # noqa: E731 (4 requests x 10 tokens, last arrival 0.3)
    by = {(s["label"], s["scenario"]): s for s in compare(sums, baseline="ag-ep")}
    ep_c, ep_b = by["ag-ep", "clean"], by["ag-ep", "bursts"]
    st_c, st_b = by["streaming/defrag", "clean"], by["streaming/defrag", "bursts"]
    assert ep_c["repeats"] == 3 and ep_c["tokens_per_s_repeats"] == pytest.approx([tps(0.2), tps(0.25), tps(0.1)])
    assert ep_c["tokens_per_s"] == pytest.approx(tps(0.2)) and ep_b["tokens_per_s"] == pytest.approx(tps(0.4))
    assert st_b["itl_mean_ms"] == pytest.approx(150) and st_b["duration_s"] == pytest.approx(0.8 + 9 * 0.15)
    assert st_b["batches"]["attn"] == {"count": 2, "mean_size": 3.0, "max_size": 4}
    assert st_b["ratio_vs_baseline"] == pytest.approx(tps(0.15) / tps(0.4))
    assert ep_b["loss_vs_clean"] == pytest.approx(1 - tps(0.4) / tps(0.2))
    assert st_b["loss_vs_clean"] == pytest.approx(1 - tps(0.15) / tps(0.2))
    # a cell measured once passes through as it was (repeats = 1: the report is today's)
    one = [summarize(_run("ag-ep", "clean", 0.2))]
    assert median_over_repeats(one)[0] is one[0] and "repeats" not in one[0]
    write_report(tmp_path, runs, baseline="ag-ep", env={"host": "test"})
    md = (tmp_path / "report.md").read_text()
    assert "tok/s median of 3 (min-max)" in md and f"{tps(0.2):.1f} ({tps(0.25):.1f}-{tps(0.1):.1f})" in md


def test_queue_grid_sums_ranks():
    run = RunRecord("s", "p", "c", [], queue_samples=[QueueSample(0.0, 0, 1, 3), QueueSample(0.0, 1, 1, 4),
                                                        QueueSample(1.0, 0, 0, 2)])
    grid, edges = queue_depth_grid(run, bins=2)
    assert grid.shape == (2, 2) and grid[1, 0] == 7 and grid[0, 1] == 2


def test_write_report_files(tmp_path):
    runs = [_run("ag-ep", "clean", 0.2), _run("streaming", "clean", 0.1, "defrag")]
    doc = write_report(tmp_path, runs, baseline="ag-ep", env=environment(), config={"x": 1})
    for name in ("report.json", "report.md", "throughput.png", "itl_cdf.png", "queue_heatmap.png"):
        assert (tmp_path / name).stat().st_size > 0
    assert json.loads((tmp_path / "report.json").read_text())["results"][1]["ratio_vs_baseline"] == pytest.approx(
        doc["results"][1]["ratio_vs_baseline"])
    md = (tmp_path / "report.md").read_text()
    assert "streaming/defrag" in md and "cores" in md and "1.53" in md   # 2.6 s / 1.7 s


def test_run_bench_small_matrix_is_deterministic(tmp_path):
    from graph_ir.spec import load_spec
    from lab.bench import run_bench
    from lab.bench_config import BenchConfig
    cfg = BenchConfig.model_validate({
        "ranks": 2, "clock": "virtual", "executor": "sim", "peak_window_s": 0.05,
        "workload": {"lengths": "fixed:8:6", "requests": 12, "rate": 2000},
        "routing": {"kind": "zipf", "s": 1.0},
        "policies": ["defrag", "mtfs"],
        "scenarios": {"clean": {"latency_us": 40},
                      "bursts": {"latency_us": 40, "bursts": [{"period_ms": 2, "duty": 0.5, "extra_delay_us": 500,
                                                                "links": [[0, 1]]}]}},
    })
    spec = load_spec("models/specs/tiny.yaml")
    a = run_bench(cfg, spec, tmp_path / "a")
    b = run_bench(cfg, spec, tmp_path / "b")
    assert len(a["results"]) == 2 * 4   # scenarios x (streaming x 2 policies + ag-ep + a2a-ep)
    assert [r["tokens_per_s"] for r in a["results"]] == [r["tokens_per_s"] for r in b["results"]]
    assert all(r["output_tokens"] == 12 * 6 and r["unfinished"] == 0 for r in a["results"])
    assert a["targets"] and (tmp_path / "a" / "queue_heatmap.png").exists()
    bursts = {r["label"]: r for r in a["results"] if r["scenario"] == "bursts"}
    assert bursts["ag-ep"]["loss_vs_clean"] > 0          # the slow link costs the barrier something


def test_bench_repeats_run_round_by_round_and_one_repeat_is_unchanged(tmp_path):
    """repeats = 2 on the virtual clock (deterministic): the matrix runs twice, round 0 of every cell
    before round 1, and every median equals the single run's number; repeats = 1 adds nothing."""
    from graph_ir.spec import load_spec
    from lab.bench import cells, run_bench
    from lab.bench_config import BenchConfig
    base = {"ranks": 2, "clock": "virtual", "executor": "sim", "peak_window_s": 0.05,
            "workload": {"lengths": "fixed:8:6", "requests": 12, "rate": 2000},
            "routing": {"kind": "zipf", "s": 1.0}, "systems": ["streaming", "ag-ep"], "policies": ["defrag", "mtfs"],
            "scenarios": {"clean": {"latency_us": 40},
                          "bursts": {"latency_us": 40, "bursts": [{"period_ms": 2, "duty": 0.5, "extra_delay_us": 500,
                                                                    "links": [[0, 1]]}]}}}
    spec = load_spec("models/specs/tiny.yaml")
    once = run_bench(BenchConfig.model_validate(base), spec, tmp_path / "one")
    seen = []
    cfg2 = BenchConfig.model_validate({**base, "repeats": 2})
    twice = run_bench(cfg2, spec, tmp_path / "two",
                      progress=lambda i, n, cell, summ: seen.append((cell, n)) if summ is not None else None)
    one_round = [(c.system, c.policy, c.scenario) for c in cells(cfg2)]
    assert [(c.system, c.policy, c.scenario) for c, _ in seen] == one_round * 2
    assert [c.repeat for c, _ in seen] == [0] * len(one_round) + [1] * len(one_round)
    assert {n for _, n in seen} == {2 * len(one_round)}
    assert len(twice["results"]) == len(once["results"]) == len(one_round)
    for a, b in zip(once["results"], twice["results"]):
        assert "repeats" not in a and "tokens_per_s_repeats" not in a
        assert b["repeats"] == 2 and b["tokens_per_s_repeats"] == [a["tokens_per_s"]] * 2
        for k in ("tokens_per_s", "itl_p99_ms", "ratio_vs_baseline", "loss_vs_clean", "batches", "output_tokens"):
            assert b[k] == pytest.approx(a[k]) if isinstance(a[k], float) else b[k] == a[k], k
    assert [t["value"] for t in twice["targets"]] == [t["value"] for t in once["targets"]]


def test_bench_runs_the_wave_hold_it_is_given(tmp_path):
    """A policy string with the wave hold reaches the engines through the bench (its depth recorder once
    hid hold_fill, so the held variant ran exactly like plain defrag): the hold changes the batches."""
    from graph_ir.spec import load_spec
    from lab.bench import run_bench
    from lab.bench_config import BenchConfig
    cfg = BenchConfig.model_validate({
        "ranks": 2, "clock": "virtual", "executor": "sim", "peak_window_s": 0.05,
        "workload": {"lengths": "fixed:8:6", "requests": 24, "rate": 2000},
        "routing": {"kind": "zipf", "s": 1.0}, "systems": ["streaming", "ag-ep"],
        "policies": ["defrag", "defrag:hold_fill=1,hold_us=2000"],
        "scenarios": {"clean": {"latency_us": 40}},
    })
    doc = run_bench(cfg, load_spec("models/specs/tiny.yaml"), tmp_path)
    by = {r["label"]: r for r in doc["results"]}
    plain, held = by["streaming/defrag"], by["streaming/defrag:hold_fill=1,hold_us=2000"]
    assert held["output_tokens"] == plain["output_tokens"] == 24 * 6
    # Deterministic virtual clock: had the hold not reached the engines, both runs would be identical.
    # (Which batches grow depends on the merge mode: whole-group merges under the hold, NOTES §19 item 7.)
    assert held["batches"] != plain["batches"]


def test_bench_prompts_file_and_decode_only(tmp_path):
    from graph_ir.spec import load_spec
    from lab.bench import run_bench
    from lab.bench_config import BenchConfig
    spec = load_spec("models/specs/tiny.yaml")
    prompts = tmp_path / "p.jsonl"
    prompts.write_text("".join(json.dumps({"id": f"q{i}", "prompt_token_ids": [5 + i] * (3 + 2 * i),
                                           "max_new_tokens": 4}) + "\n" for i in range(6)))
    cfg = BenchConfig.model_validate({
        "ranks": 2, "clock": "virtual", "executor": "sim", "peak_window_s": 0.05, "row_bytes": 5760,
        "workload": {"prompts": str(prompts), "rate": 5000, "decode_only": True},
        "routing": {"kind": "zipf", "s": 1.0}, "policies": ["defrag"],
        "cost": {"send_cpu_us": 30, "collective_algo": "ring", "collective_fixed_us": {"ag": 100, "ar": 25, "a2a": 100}},
        "scenarios": {"clean": {"latency_us": 10, "bandwidth_gbps": 100}},
    })
    doc = run_bench(cfg, spec, tmp_path / "out")
    assert all(r["output_tokens"] == 6 * 4 and r["unfinished"] == 0 for r in doc["results"])
    for r in doc["results"]:   # decode-only: no attention batch holds more rows than there are requests
        assert r["batches"]["attn"]["max_size"] <= 6
        assert r["mean_live_requests"] > 0 and 0 < r["busy_fraction"] <= 1
    # row_bytes: every link byte is a whole number of 5760-byte rows
    assert all(v % 5760 == 0 for r in doc["results"] for v in r["link_bytes"].values())



def test_row_bytes_prices_every_row_a_message_carries(tmp_path):
    """row_bytes stands in for the real rows' size: with the simulated executor's own size (one float64 per row) every
    link carries exactly the bytes of the run without it. (A message's merge tags travel as (first, count): pricing
    it by len() of that pair made every message 2 rows, whatever it carried.)"""
    from graph_ir.spec import load_spec
    from lab.bench import run_bench
    from lab.bench_config import BenchConfig
    spec = load_spec("models/specs/tiny.yaml")
    docs = []
    for row_bytes in (None, 8):
        cfg = BenchConfig.model_validate({
            "ranks": 3, "clock": "virtual", "executor": "sim", "peak_window_s": 0.05, "row_bytes": row_bytes,
            "workload": {"lengths": "fixed:6:5", "requests": 24, "rate": 1e6, "decode_only": True},
            "routing": {"kind": "zipf", "s": 1.0}, "policies": ["defrag"], "systems": ["streaming"], "baseline": "streaming",
            "scenarios": {"clean": {"latency_us": 10, "bandwidth_gbps": 1}}})
        docs.append(run_bench(cfg, spec, tmp_path / f"out{row_bytes}"))
    real, priced = (d["results"][0] for d in docs)
    assert real["link_bytes"] == priced["link_bytes"] and sum(real["link_bytes"].values()) > 24 * 5 * 8
    assert real["tokens_per_s"] == priced["tokens_per_s"]

def _tiny_cell_runs(tmp_path):
    """run(latency_us, cost, name, **extra) -> {system: result} of a 3-rank decode-only tiny bench on the virtual
    clock, streaming and ag-ep."""
    from graph_ir.spec import load_spec
    from lab.bench import run_bench
    from lab.bench_config import BenchConfig
    spec = load_spec("models/specs/tiny.yaml")

    def run(latency_us, cost, name, **extra):
        cfg = BenchConfig.model_validate({
            "ranks": 3, "clock": "virtual", "executor": "sim", "peak_window_s": 0.05,
            "workload": {"lengths": "fixed:6:5", "requests": 24, "rate": 1e6, "decode_only": True},
            "routing": {"kind": "zipf", "s": 1.0}, "policies": ["defrag"], "systems": ["streaming", "ag-ep"],
            "baseline": "ag-ep", "cost": cost or {}, "scenarios": {"clean": {"latency_us": latency_us}}, **extra})
        return {r["system"]: r for r in run_bench(cfg, spec, tmp_path / name)["results"]}
    return run


def test_message_latency_takes_the_place_of_the_links_latency_for_every_message(tmp_path):
    """cost.message_latency (a measured delivery time of the rank processes' transport, lab/message_log.py): a fixed
    one (sigma 0) in place of the scenario's latency_us gives both systems the run where the scenario says that
    latency (to rounding); drawn (sigma > 0) it is seeded. With a `network` (a topology pricing its own links) it is
    refused."""
    from graph_ir.errors import UserError
    run = _tiny_cell_runs(tmp_path)
    near, far = run(50, None, "near"), run(3000, None, "far")
    measured = run(3000, {"message_latency": {"floor_us": 30, "median_us": 20}}, "measured")
    for system in ("streaming", "ag-ep"):
        assert measured[system]["tokens_per_s"] == pytest.approx(near[system]["tokens_per_s"], rel=1e-9)
        assert far[system]["tokens_per_s"] < near[system]["tokens_per_s"]
    noisy = run(3000, {"message_latency": {"floor_us": 30, "median_us": 20, "sigma": 1.0}}, "noisy")
    again = run(3000, {"message_latency": {"floor_us": 30, "median_us": 20, "sigma": 1.0}}, "again")
    for system in ("streaming", "ag-ep"):  # seeded: a rerun is equal
        assert noisy[system]["tokens_per_s"] == again[system]["tokens_per_s"] != near[system]["tokens_per_s"]
    with pytest.raises(UserError, match="message_latency .* without `network`"):
        run(3000, {"message_latency": {"floor_us": 30}}, "net", network={"gpus_per_node": 1})


def test_receive_after_batch_and_batch_sigma_slow_a_cell_seeded_per_round(tmp_path):
    """cost.receive_after_batch (a message landing while its rank runs a batch is received after it, a
    message_latency later) costs streaming throughput and leaves the barrier's alone; cost.batch_sigma (a mean-1
    lognormal spread per batch) costs both systems throughput (a layer waits for its slowest path); each round of
    the matrix draws its own (round 0 reruns equal)."""
    from graph_ir.errors import UserError
    run = _tiny_cell_runs(tmp_path)
    lat = {"floor_us": 300, "median_us": 200}
    base = run(50, {"message_latency": lat, "attn_fixed_us": 400, "expert_fixed_us": 400}, "base")
    deferred = run(50, {"message_latency": lat, "attn_fixed_us": 400, "expert_fixed_us": 400,
                        "receive_after_batch": True}, "deferred")
    assert deferred["streaming"]["tokens_per_s"] < base["streaming"]["tokens_per_s"]
    assert deferred["ag-ep"]["tokens_per_s"] == base["ag-ep"]["tokens_per_s"]
    spread = run(50, {"message_latency": lat, "attn_fixed_us": 400, "expert_fixed_us": 400, "batch_sigma": 1.0},
                 "spread", repeats=2)
    for system in ("streaming", "ag-ep"):
        assert spread[system]["tokens_per_s"] < base[system]["tokens_per_s"]
        rounds = spread[system]["tokens_per_s_repeats"]
        assert len(rounds) == 2 and rounds[0] != rounds[1]
    with pytest.raises(UserError, match="receive_after_batch"):
        run(50, {"receive_after_batch": True}, "no-latency")


def test_barrier_math_prices_the_barrier_ranks_batches_only(tmp_path):
    """cost.barrier_math (each system's math from its own ranks' timers): a dearer barrier attention slows all-gather
    EP and leaves streaming's run as it was; an unknown kind is refused by name."""
    from graph_ir.errors import UserError
    run = _tiny_cell_runs(tmp_path)
    same = run(50, {"attn_fixed_us": 400}, "same")
    dear = run(50, {"attn_fixed_us": 400, "barrier_math": {"attn": {"fixed_us": 900}}}, "dear")
    assert dear["streaming"]["tokens_per_s"] == same["streaming"]["tokens_per_s"]
    assert dear["ag-ep"]["tokens_per_s"] < same["ag-ep"]["tokens_per_s"]
    with pytest.raises(UserError, match="barrier_math: unknown kind.*'atn'"):
        run(50, {"barrier_math": {"atn": {"fixed_us": 900}}}, "typo")


def test_defrag_history_weight_stage_in_front_of_a_steady_queue():
    """H6's case (benchmarks/results/cpu_bench.md): with H(e0) ~ Q(e0) the paper's score runs a 1-token
    attn(0) before a 10-token expert(0); history_weight=0 (H dropped) runs the big queue."""
    from runtime.core.scheduler import StageView, make_policy
    nxt = [1, 2, 3, 4, 5, 6, 0]

    def views(a0):
        return [StageView(a0, a0 > 0, 0.0), StageView(10.0, True, 0.0)] + [StageView(0.0, False, 0.0)] * 5
    paper, no_h = make_policy("defrag"), make_policy("defrag", history_weight=0.0)
    for p in (paper, no_h):
        assert p.choose(views(0.0), nxt).stage == 1      # builds the history: H(e0) = 10
    d = paper.choose(views(1.0), nxt)
    assert d.stage == 0 and d.scores[0] == pytest.approx(1 + 0.8 * 20) and d.scores[1] == pytest.approx(10)
    assert no_h.choose(views(1.0), nxt).stage == 1
    assert make_policy("defrag").params() == {"delta": 0.8, "lookahead": 4, "history": 4}
    assert no_h.params()["history_weight"] == 0.0
    with pytest.raises(ValueError):
        make_policy("defrag", history_weight=-1)


def test_wall_link_delays_inject_only_the_bursts_and_pickle():
    import pickle

    from lab.bench import WallLinkDelays
    from lab.interference import from_config
    inter = from_config({"latency_us": 40, "bandwidth_gbps": 1,
                         "bursts": [{"period_ms": 20, "duty": 0.5, "extra_delay_us": 2000, "links": [[0, 1]]}]})
    w = pickle.loads(pickle.dumps(WallLinkDelays(inter, epoch=0.0)))
    import time as _t
    w.epoch = _t.time() - 0.001            # 1 ms into a period: the burst is on
    # Delivery is delayed: rank 1 draws the delay of link 0 -> 1 for what it receives from rank 0.
    assert w.lane("recv", 1, 0)() == pytest.approx(2e-3)   # extra only: no healthy latency, no bytes
    assert w.lane("recv", 0, 1)() == 0.0 and w.lane("send", 0, 1)() == 0.0
    w.epoch = _t.time() - 0.015            # 15 ms in: off
    assert w.lane("recv", 1, 0)() == 0.0
    assert WallLinkDelays(from_config({"latency_us": 40})).lane("recv", 1, 0)() == 0.0


def test_wall_slow_ranks_stall_by_the_ranks_own_batch_time_and_pickle(monkeypatch):
    """The wall-clock slow rank: after each batch, (factor - 1) x the time the batch's math took, only on the slow
    rank and only while its schedule is on; the same object reaches the rank processes (pickled)."""
    import pickle
    import types

    import lab.bench as bench
    from lab.interference import from_config
    inter = from_config({"slow_ranks": [{"rank": 1, "factor": 3.0, "period_ms": 10, "duty": 0.5}]})
    slow = pickle.loads(pickle.dumps(bench.WallSlowRanks(inter)))
    stalls = []
    stall = slow.stall
    monkeypatch.setattr(slow, "stall", lambda *a: stalls.append(stall(*a)))
    assert stall(1, 0.002, 0.0004) == pytest.approx(0.0008)   # (3 - 1) x the batch's 0.4 ms, spun
    assert stall(1, 0.007, 0.004) == 0.0         # 7 ms into a 10 ms period at duty 0.5: not slow now
    assert stall(0, 0.002, 0.004) == 0.0         # not the slow rank
    ran = []
    engine = types.SimpleNamespace(rank=1, clock=types.SimpleNamespace(now=lambda: 0.001), execute=ran.append)
    slow(engine)                                      # an engine_setup hook: wraps the engine's execute
    engine.execute("batch")
    assert ran == ["batch"] and len(stalls) == 1 and stalls[0] >= 0


def test_process_bench_injects_a_slow_rank_into_every_system(tmp_path):
    """clock: process with a slow-rank scenario (once refused: "slow ranks are not injectable into rank processes"):
    the streaming ranks (engine_setup in each rank process) and the barrier ranks both run it to the end."""
    from graph_ir.spec import load_spec
    from lab.bench import run_bench
    from lab.bench_config import BenchConfig
    cfg = BenchConfig.model_validate({
        "ranks": 2, "clock": "process", "executor": "torch", "peak_window_s": 0.05,
        "workload": {"lengths": "fixed:4:3", "requests": 4, "rate": 1000},
        "routing": {"kind": "model"}, "systems": ["streaming", "ag-ep"], "policies": ["defrag"],
        "scenarios": {"slow": {"slow_ranks": [{"rank": 1, "factor": 2.0}]}}, "clean_scenario": "slow",
    })
    doc = run_bench(cfg, load_spec("models/specs/tiny.yaml"), tmp_path / "out")
    assert {r["label"] for r in doc["results"]} == {"streaming/defrag", "ag-ep"}
    assert all(r["output_tokens"] == 4 * 3 and r["unfinished"] == 0 for r in doc["results"])


def test_cost_profiles_load_and_host_time_per_batch_combines_by_the_overlap_rule(tmp_path):
    """Every shipped cost profile validates; `host` per batch adds to the compute (CPU: no overlap) or hides under it
    (GPU: max), the barrier ranks take `barrier_host`; a bench config may name a profile file. No timing asserted."""
    from pathlib import Path

    import yaml

    from graph_ir.errors import UserError
    from lab.bench_config import CostConfig, load_config, validated
    for path in sorted(Path("lab/costs").glob("*.yaml")):
        cost = validated(CostConfig, yaml.safe_load(path.read_text()), str(path))
        assert cost.model().duration("attn", 8) > 0 and cost.model(barrier=True).duration("expert", 8) > 0
    cpu = CostConfig(attn_fixed_us=100, overlap_host=False, host={"attn": {"fixed_us": 50, "per_row_us": 1}},
                     barrier_host={})
    assert cpu.model().duration("attn", 10) == pytest.approx((100 + 10 * 1.0 + 50 + 10) * 1e-6)
    assert cpu.model(barrier=True).duration("attn", 10) == pytest.approx((100 + 10 * 1.0) * 1e-6)
    gpu = CostConfig(attn_fixed_us=100, attn_per_row_us=0, overlap_host=True, host={"attn": {"fixed_us": 300}})
    assert gpu.model().duration("attn", 10) == pytest.approx(300e-6)          # host-bound: max(device, host)
    assert gpu.model(barrier=True).duration("attn", 10) == pytest.approx(300e-6)   # no barrier_host: the same host
    assert gpu.model().duration("expert", 10) == pytest.approx((150 + 3) * 1e-6)   # no host for the kind: compute
    with pytest.raises(UserError, match="cost.host: unknown kind"):
        CostConfig(host={"attention": {"fixed_us": 1}}).model()
    cfg = tmp_path / "b.yaml"
    cfg.write_text("cost: lab/costs/cpu_tiny.yaml\n")
    assert load_config(cfg).cost.send_cpu_us > 0 and not load_config(cfg).cost.overlap_host
    cfg.write_text("cost: lab/costs/none.yaml\n")
    with pytest.raises(UserError, match="cost profile lab/costs/none.yaml does not exist"):
        load_config(cfg)
