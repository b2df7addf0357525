"""Failure detection by progress (runtime/transport/health.py): a slow run that progresses is never cut off, and a rank whose
main thread is stuck while its heartbeat thread lives is named in bounded time.

Both run real rank processes. The bound is max(--stall-timeout, 10x the longest pause seen), so the tests set a
small floor; nothing here asserts on how long anything took.
"""
from __future__ import annotations

import pytest

from lowering.plan import compile_plan
from runtime.drivers.cluster import RunOptions
from runtime.transport.health import ProgressWatch
from runtime.drivers.multiproc import RunFailed, run_workloads_multiprocess
from lab.chaos import ChaosDelays, WedgeAfter
from test_runtime import assert_matches_reference, make_requests, model

NAME = "tiny-mixtral"


def test_the_bound_follows_the_longest_pause_and_ignores_startup():
    w = ProgressWatch(floor_s=2.0, now=0.0)
    w.update(0, 0.0)
    w.update(1, 30.0)  # 30 s of start-up (value 0: not serving) is not a pause
    assert w.bound() == 2.0 and w.stalled_for(31.0) is None and w.stalled_for(32.5) == 2.5
    w.update(2, 31.0)
    w.update(3, 31.5)  # pauses of 1 s and 0.5 s: the bound is 10 x 1 s
    assert w.bound() == 10.0 and w.stalled_for(41.0) is None and w.stalled_for(42.0) == 10.5


def test_a_slow_run_that_progresses_is_not_called_stalled():
    """Every message delayed: no request finishes for longer than the 2 s floor, but batches run all along. The
    old rule (no request finished for stall_timeout_s) aborted such runs; progress is what counts now."""
    spec, _, _ = model(NAME)
    plan = compile_plan(spec, 2, attn_cap=16, block_size=4)
    reqs = make_requests(spec.vocab_size, 2, seed=9, max_new=100, max_prompt=8, spread=0.0)
    chaos = ChaosDelays(seed=2, max_delay_s=0.03, probability=1.0)
    res = run_workloads_multiprocess(plan, [(reqs, RunOptions(kv_blocks=128, stall_timeout_s=2.0))], chaos=chaos,
                                     timeout=240)[0]
    assert res.metrics["finished"] == 2
    first_finish = min(r.t_finish for r in reqs)
    assert first_finish > 2.0, f"the run was too quick to show anything (first finish at {first_finish:.2f} s)"
    assert assert_matches_reference(NAME, reqs) > 15


def test_a_wedged_coordinator_is_named_by_its_peer():
    """Rank 0's serving loop stops for good after 5 tokens while its heartbeat thread goes on beating: rank 1 sees
    the loop counter in those heartbeats stand still and ends the run naming rank 0 (before this, the job hung)."""
    spec, _, _ = model(NAME)
    plan = compile_plan(spec, 2, attn_cap=16, block_size=4)
    reqs = make_requests(spec.vocab_size, 6, seed=4, max_new=40, max_prompt=8, spread=0.0)
    with pytest.raises(RunFailed) as err:
        run_workloads_multiprocess(plan, [(reqs, RunOptions(kv_blocks=128, stall_timeout_s=2.0,
                                                            engine_setup=WedgeAfter(0, 5)))],
                                   peer_timeout_s=3.0, timeout=240)
    msg = str(err.value)
    assert "rank 0 failed" in msg and "serving loop has not advanced" in msg and "wedged" in msg, msg
    assert "timed out" not in msg, msg
