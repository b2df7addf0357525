"""lab/message_log.py in real rank processes: every message a rank sends to another is handed over once at the other
end, in order per link, never before it was sent (one CLOCK_MONOTONIC for the host's processes), and every batch's end
is logged: what benchmarks/sim_validation/inrun_costs.py's latencies rest on."""
from __future__ import annotations

import sys
from pathlib import Path

from lab.message_log import MessageLog
from lowering.plan import compile_plan
from runtime.drivers.cluster import RunOptions
from runtime.drivers.multiproc import run_workloads_multiprocess
from test_runtime import make_requests, model

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks" / "sim_validation"))
from inrun_costs import latencies, read_logs  # noqa: E402


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
