"""`dataflow run` with one process per rank (runtime/drivers/multiproc.py, rank_node.py): real processes, real sockets.

Spawning a rank costs ~1 s on 2 cores, so each launch serves several workloads (every policy) and
checks them all. Exactness is checked as in tests/test_runtime.py: token for token against the
ReferenceDecoder up to the first near-tie (batch composition changes fp32 rounding).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

from lowering.plan import compile_plan
from models.sampling import SamplingParams
from runtime.drivers.cluster import RunOptions
from runtime.drivers.multiproc import run_workloads_multiprocess
from runtime.core.scheduler import POLICIES
from lab.chaos import ChaosDelays
from test_runtime import assert_matches_reference, make_requests, model

NAME = "tiny-mixtral"
ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DATAFLOW = [sys.executable, "-c", "from dataflow.cli import main; main()"]


def _workloads(ranks: int, seed: int, trace_policy: str = "defrag"):
    spec, _, _ = model(NAME)
    out = []
    for i, policy in enumerate(sorted(POLICIES)):
        reqs = make_requests(spec.vocab_size, 6, seed=seed + i, max_new=6, max_prompt=40, spread=2e-3)
        if policy == "aging":  # seeded sampling crosses processes too (per-request seed, step index)
            for j, r in enumerate(reqs):
                r.params = SamplingParams(temperature=0.8, seed=j) if j % 2 else None
        home = "round_robin" if ranks == 4 and policy == "mtfs" else None
        out.append((reqs, RunOptions(policy=policy, kv_blocks=128, trace=policy == trace_policy, home_policy=home)))
    return out


def _check(results, workloads, ranks: int) -> None:
    assert [r.metrics["policy"] for r in results] == sorted(POLICIES)
    for res, (reqs, _) in zip(results, workloads):
        assert res.requests == reqs and res.world_size == ranks
        assert all(r.done and r.home in range(ranks) for r in reqs)
        assert assert_matches_reference(NAME, res.requests) > 15, res.metrics["policy"]
        m = res.metrics
        assert m["finished"] == len(reqs) and m["tokens"] == sum(len(r.output) for r in reqs)
        assert m["processes"] == ranks and m["messages"] > 0 and m["elapsed_s"] > 0
        if res.trace is not None:
            assert {e["pid"] for e in res.trace.events if e["ph"] == "X"} == set(range(ranks))
            assert len(res.trace.decisions) == m["batches"]


@pytest.mark.parametrize("ranks", [2, 4])
def test_every_policy_matches_the_reference(ranks):
    spec, _, _ = model(NAME)
    plan = compile_plan(spec, ranks, attn_cap=16, block_size=4)
    wl = _workloads(ranks, seed=100 * ranks)
    _check(run_workloads_multiprocess(plan, wl, timeout=80), wl, ranks)
    if ranks == 4:  # round robin placed requests on every rank
        assert {r.home for r in wl[sorted(POLICIES).index("mtfs")][0]} == set(range(4))


def test_device_routed_dispatch_in_rank_processes_matches_the_reference(use_options):
    """dispatch=device over the real transport (ZeroMQ metadata + gloo tensors, 3 rank processes): the
    packed rows-and-ids messages cross processes and every policy keeps the reference tokens."""
    use_options(dispatch="device")  # the rank processes inherit it (DATAFLOW_OPTIONS)
    spec, _, _ = model(NAME)
    plan = compile_plan(spec, 3, attn_cap=16, block_size=4)
    wl = _workloads(3, seed=500)
    _check(run_workloads_multiprocess(plan, wl, timeout=80), wl, 3)


def test_chaos_delays_change_timings_not_tokens():
    """3 ranks, every lane of the real transport delayed at random (seeded): same tokens as the
    reference for every policy; the runs are measurably slower than without the delays."""
    spec, _, _ = model(NAME)
    plan = compile_plan(spec, 3, attn_cap=16, block_size=4)
    wl = _workloads(3, seed=300)
    chaos = ChaosDelays(seed=3, max_delay_s=0.004, probability=0.5)
    results = run_workloads_multiprocess(plan, wl, chaos=chaos, timeout=80)
    _check(results, wl, 3)
    # Hundreds of messages, about half delayed by 0-4 ms each, in sequence per lane: well over 50 ms.
    # (Un-delayed, these workloads take ~0.1-0.2 s on 2 shared cores: see the 2/4-rank test.)
    assert max(r.metrics["max_itl_s"] for r in results) > 0.004
    assert all(r.metrics["elapsed_s"] > 0.05 for r in results)


def test_keyed_router_and_wave_hold_in_rank_processes_equal_the_in_process_run():
    """A Zipf router in RunOptions (executor_wrapper) travels to the rank processes (the bench's skewed routing in
    process mode) and the wave hold only changes timing: 2 processes give the in-process run's tokens."""
    from runtime.drivers.cluster import run_workload
    from lab.routing_override import RoutedBy, ZipfRouting
    spec, w, _ = model(NAME)
    plan = compile_plan(spec, 2, attn_cap=16, block_size=4)
    zipf = ZipfRouting(spec.experts.num_experts, spec.experts.top_k, s=1.2, seed=5)
    policies = ["defrag", "defrag:hold_fill=1,hold_us=20000"]

    def work():
        return [(make_requests(spec.vocab_size, 6, seed=77, max_new=6, max_prompt=40, spread=2e-3),
                 RunOptions(policy=p, kv_blocks=128, executor_wrapper=RoutedBy(zipf))) for p in policies]
    got = run_workloads_multiprocess(plan, work(), timeout=80)
    for res, (reqs, opts) in zip(got, work()):
        want = run_workload(plan, reqs, opts, weights=w)
        assert [r.output for r in res.requests] == [r.output for r in want.requests], opts.policy
    # the router is in effect: the model's own router gives other tokens
    plain = run_workload(plan, work()[0][0], RunOptions(kv_blocks=128), weights=w)
    assert [r.output for r in plain.requests] != [r.output for r in got[0].requests]


# ------------------------------------------------------------------------------ the real CLI
@pytest.fixture(scope="module")
def plan_dirs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mp-cli")
    out = {}
    for ranks in (2, 3):
        d = root / f"r{ranks}"
        d.mkdir()
        res = subprocess.run(DATAFLOW + ["compile", "tiny", "--ranks", str(ranks)], cwd=d, capture_output=True,
                             text=True, timeout=60)
        assert res.returncode == 0, res.stderr
        out[ranks] = d
    return out


def test_cli_default_runs_one_process_per_rank_and_matches_the_reference(plan_dirs):
    d = plan_dirs[2]
    res = subprocess.run(DATAFLOW + ["run", "-o", "out.jsonl", "--ignore-eos"], cwd=d, capture_output=True, text=True,
                         timeout=60)
    assert res.returncode == 0, res.stderr
    assert "8 / 8" in res.stdout and "2 (one per rank)" in res.stdout, res.stdout
    from lowering.plan import load_plan
    from lab.reference import ReferenceDecoder
    from models.weights import load_weights
    spec = load_plan(d / "dataflow-plan").spec
    ref = ReferenceDecoder(spec, load_weights(spec))
    lines = [json.loads(x) for x in (d / "out.jsonl").read_text().splitlines()]
    assert len(lines) == 8
    for line in lines:  # greedy; near-ties are rare on this model (the in-process CLI test relies on it too)
        assert line["output_token_ids"] == ref.generate(line["prompt_token_ids"], 16, ignore_eos=True).tokens


class _LongRun:
    """`dataflow run` on a workload that takes a minute, with rank processes announcing their pids."""

    def __init__(self, cwd, extra=()):
        env = dict(os.environ, DATAFLOW_OPTIONS='{"verbose": true}')
        self.p = subprocess.Popen(DATAFLOW + ["run", "-q", "--num-requests", "400", "--max-new-tokens", "64",
                                              "--ignore-eos", *extra], cwd=cwd, env=env, stdout=subprocess.PIPE,
                                  stderr=subprocess.PIPE, text=True, start_new_session=True)
        self.err: list[str] = []
        self.pids: dict[int, int] = {}
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        for line in self.p.stderr:
            self.err.append(line)
            if "): serving workload" in line:  # "[rank 1] rank 1 (pid 123): serving workload 0"
                rank = int(line.split("] rank ")[1].split()[0])
                self.pids[rank] = int(line.split("(pid ")[1].split(")")[0])

    def wait_serving(self, ranks: int, timeout: float = 40.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.pids) < ranks:
            assert self.p.poll() is None, "".join(self.err)
            assert time.monotonic() < deadline, f"ranks never started serving: {''.join(self.err)}"
            time.sleep(0.05)
        time.sleep(1.0)  # mid-run

    def finish(self, timeout: float):
        try:
            rc = self.p.wait(timeout)
        finally:
            if self.p.poll() is None:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait()
        self._reader.join(5)
        return rc, "".join(self.err)

    def orphans(self) -> list[int]:
        alive = []
        for pid in self.pids.values():
            try:
                os.kill(pid, 0)
                alive.append(pid)
            except ProcessLookupError:
                pass
        return alive


def test_killed_rank_ends_the_run_with_a_clear_message(plan_dirs):
    run = _LongRun(plan_dirs[3], ["--peer-timeout", "5"])
    run.wait_serving(3)
    os.kill(run.pids[1], signal.SIGKILL)
    t0 = time.monotonic()
    rc, err = run.finish(timeout=40)
    elapsed = time.monotonic() - t0
    assert rc == 1, err
    assert elapsed < 30, f"took {elapsed:.1f} s"
    tail = err[err.rindex("error: run failed"):]
    assert "rank 1: killed by signal SIGKILL" in tail, tail
    for survivor in (0, 2):  # each names the dead rank and what it was waiting for
        line = next(x for x in tail.splitlines() if x.startswith(f"rank {survivor}: "))
        assert "rank 1 failed" in line and "waiting for" in line, tail
    assert "Traceback" not in err, err
    assert run.orphans() == []


def test_ctrl_c_takes_every_rank_down(plan_dirs):
    run = _LongRun(plan_dirs[2])
    run.wait_serving(2)
    run.p.send_signal(signal.SIGINT)
    rc, err = run.finish(timeout=20)
    assert rc == 130, err
    assert "interrupted" in err
    assert run.orphans() == []


def test_the_phase_profile_counts_only_the_loops_collections():
    """Start-up's collections (and settle_heap's own) are not the serving loop's: the report counts those made while
    the loop runs."""
    import gc

    from runtime.observability.rank_profile import PhaseTimes as _PhaseTimes
    ph = _PhaseTimes()
    try:
        gc.collect()
        assert not ph.gc
        ph.in_loop = True
        gc.collect()
        assert len(ph.gc[2]) == 1 and "gc gen2: 1 collections" in ph.report(0)
    finally:
        gc.callbacks.remove(ph.on_gc)


def test_eos_requests_drain_in_rank_processes_with_step_ahead():
    """Step-ahead across real rank processes (the CUDA executor's CPU twin, gloo + ZeroMQ, 2 ranks): with an EOS id
    that several requests sample mid-run, a request whose next row was already queued drains before its finish is
    reported (the coordinator's free-block mirror and the stop protocol count on that order); outputs end at the EOS
    like the reference's, and the run's token count is the outputs' (a drained row's token is not counted)."""
    from collections import Counter

    name = "tiny-gpt-oss"
    spec, _, ref = model(name)
    reqs = make_requests(spec.vocab_size, 10, seed=7, max_new=8, max_prompt=6, spread=0.0)
    free = [ref.generate(r.prompt, 8, ignore_eos=True).tokens for r in reqs]
    eos = Counter(t for toks in free for t in set(toks[1:5])).most_common(1)[0][0]
    for r in reqs:
        r.ignore_eos = False
    plan = compile_plan(spec.model_copy(update={"eos_token_ids": [eos]}), 2, attn_cap=16, block_size=4)
    wl = [(reqs, RunOptions(policy="defrag", executor="cuda", kv_blocks=128))]
    [res] = run_workloads_multiprocess(plan, wl, timeout=80)
    assert assert_matches_reference(name, res.requests, ignore_eos=False, eos=(eos,)) > 15
    stopped = [r for r in res.requests if r.finish_reason == "eos" and len(r.output) < r.max_new_tokens]
    assert len(stopped) >= 2 and res.metrics["tokens"] == sum(len(r.output) for r in res.requests)
