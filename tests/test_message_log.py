"""lab/message_log.py in real rank processes: every message a rank sends to another is handed over once at the other
end, in order per link, never before it was sent (one CLOCK_MONOTONIC for the host's processes), and every batch's end
is logged: what benchmarks/sim_validation/inrun_costs.py's latencies rest on."""
from __future__ import annotations

import math
import sys
from pathlib import Path

from lab.message_log import MessageLog
from lowering.plan import compile_plan
from runtime.drivers.cluster import RunOptions
from runtime.drivers.multiproc import run_workloads_multiprocess
from test_runtime import make_requests, model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "sim_validation"))
from inrun_costs import affine_costs, batch_spread, latencies, logged_batches, read_logs  # noqa: E402


def test_every_message_is_logged_sent_and_handed_over_in_order(tmp_path):
    spec, _, _ = model("tiny-mixtral")
    plan = compile_plan(spec, 2, attn_cap=16, block_size=4)
    reqs = make_requests(spec.vocab_size, 6, seed=3)
    [res] = run_workloads_multiprocess(plan, [(reqs, RunOptions(kv_blocks=128, engine_setup=MessageLog(str(tmp_path))))],
                                       timeout=80)
    assert all(r.done for r in res.requests)
    sends, recvs, ends = read_logs(tmp_path)
    assert set(sends) == set(recvs) == {(0, 1), (1, 0)}
    for link in sends:  # (the run's end is agreed: every message is read before a transport closes)
        assert len(recvs[link]) == len(sends[link]) > 20
        assert all(t_recv >= t_send for t_send, (t_recv, _) in zip(sends[link], recvs[link]))
    assert sum(len(e) for e in ends.values()) >= sum(len(r.output) for r in reqs)  # (a sample batch per token at least)
    every, idle = latencies(tmp_path)
    assert len(every) == sum(len(r) for r in recvs.values()) and 0 < len(idle) <= len(every)
    batches = logged_batches(tmp_path)  # each batch's start, math end and end: one per logged end
    assert len(batches) == sum(len(e) for e in ends.values())
    assert {b[0] for b in batches} <= {"attn", "expert", "sample"} and all(b[1] > 0 for b in batches)
    assert all(0 < execute <= whole for _, _, execute, whole in batches)


def test_affine_costs_and_batch_spread_recover_what_the_batches_hold():
    """inrun_costs.py's fits on made-up batches: a line through every row group where one with both parts >= 0
    fits them (else through the groups of up to max_rows), and a spread whose median is the lognormal's."""
    line = [("attn", r, 1e-3 + 2e-6 * r, 1e-3 + 2e-6 * r) for r in (1, 3, 7, 20, 20, 20, 300) for _ in range(30)]
    fit = affine_costs(line)["attn"]
    assert abs(fit["fixed_us"] - 1000) < 0.5 and abs(fit["per_row_us"] - 2) < 1e-3 and fit["fitted_rows"] == "1-300"
    cold = line + [("attn", 320, 0.5, 0.5)] * 30  # prompt batches far above any line with a fixed part >= 0
    assert affine_costs(cold)["attn"]["fitted_rows"] == "1-20"
    flat = batch_spread(line)
    assert flat["batch_sigma"] == 0.0 and flat["ratio_p10_p50_p90_p99"] == [1.0] * 4
    spread = [("expert", 8, 0.0, t) for t in (0.5, 0.5, 0.5, 2.5)] * 10  # median 0.5 of a mean 1.0
    got = batch_spread(spread)
    assert got["ratio_p10_p50_p90_p99"][1] == 0.5 and abs(got["batch_sigma"] - (-2 * math.log(0.5)) ** 0.5) < 1e-3
