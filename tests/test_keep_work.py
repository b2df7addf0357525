"""Issue 29: a run keeps its finished work (each request's line is written as it finishes, a failed run says
what finished), bad output paths fail before the run, and a rank's records stay bounded however long it serves.

No assertion here depends on wall-clock timing: a rank is killed once a third of the requests finished (as the
coordinator reports them), and every check is on what was written, not when.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time

import pytest

from lowering.plan import compile_plan
from runtime.drivers.cluster import Cluster, RunOptions, build_executor
from runtime.observability.metrics import BatchRecord, RankMetrics, RequestStats, summarize
from runtime.observability.trace import TraceRecorder
from test_runtime import make_requests, model

NAME = "tiny-mixtral"
DATAFLOW = [sys.executable, "-c", "from dataflow.cli import main; main()"]


# ------------------------------------------------------------------------------ bounded records
def test_batch_records_and_trace_stay_bounded_and_totals_stay_exact():
    m = RankMetrics(0, batch_log=100)
    tr = TraceRecorder(keep_batches=50)
    for i in range(10_000):
        kind = ("attn", "expert", "sample")[i % 3]
        m.on_batch(BatchRecord(0, i % 7, kind, 0, 1 + i % 5, i * 1e-3, i * 1e-3 + 5e-4, 0.0), [1e-4], [2])
        tr.decision(0, i * 1e-3, "defrag", i % 7, kind, {1: 0.5, 2: 0.25}, 1 + i % 5)
        tr.batch(0, kind, i * 1e-3, i * 1e-3 + 5e-4, {"rows": 1 + i % 5})
        assert len(m.batches) <= 200 and len(tr.decisions) <= 100 and len(tr.events) <= 200
    assert m.batches[-1].t_start == pytest.approx(9.999)  # the latest are the ones kept
    assert m.batch_count == 10_000 and m.queued_items == 20_000
    s = summarize([], [m], 10.0)
    assert s["batches"] == 10_000 and s["attn_batches"] == 3334 and s["expert_batches"] == 3333
    rows = [1 + i % 5 for i in range(10_000)]
    assert s["attn_mean_batch"] == pytest.approx(sum(rows[0::3]) / 3334)
    assert s["busy_fraction"] == [pytest.approx(10_000 * 5e-4 / 10.0)]
    assert tr.dropped_events == 20_000 - len(tr.events)
    assert "dropped_events" in tr.to_chrome(1)["otherData"]


def test_engine_records_are_a_ring_with_the_same_summary():
    """Two identical virtual-clock runs, every record kept against a ring of 8: the same summary, and no engine
    holds more than 16 records."""
    spec, w, _ = model(NAME)
    plan = compile_plan(spec, 2, attn_cap=16, block_size=4)
    out = {}
    for keep in (None, 8):
        reqs = make_requests(spec.vocab_size, 12, seed=3, max_new=6, spread=2e-3)
        opts = RunOptions(clock="virtual", kv_blocks=128, batch_log=keep, trace=True)
        cl = Cluster(plan, build_executor(plan, opts, w), opts)
        res = cl.run(reqs)
        if keep is not None:
            assert all(len(e.metrics.batches) <= 2 * keep for e in cl.engines)
            assert res.metrics["batches"] > 4 * keep
        out[keep] = res.metrics
    assert out[8] == out[None]


def test_request_stats_histogram_is_bounded_and_close():
    from runtime.core.requests import Request
    exact, approx = RequestStats(), RequestStats(exact=False)
    for i in range(2000):
        r = Request(i, f"r{i}", [1], 8)
        r.output, r.finish_reason = list(range(8)), "length"
        r.token_times = [0.001 * k * (1 + (i % 97) / 10) for k in range(8)]
        exact.add(r)
        approx.add(r)
    assert approx.finished == exact.finished == 2000 and approx.tokens == exact.tokens
    for name in ("itl", "ttft", "tpot"):
        a, e = getattr(approx, name), getattr(exact, name)
        assert a.n == e.n > 0 and a.max == e.max and a.sum == pytest.approx(e.sum)
        for p in (50, 99):
            assert a.pct(p) == pytest.approx(e.pct(p), rel=0.011), (name, p)
        assert len(a._hist) < 400


def test_step_timer_keeps_totals_and_a_bounded_sample():
    from runtime.observability import step_timer
    t = step_timer.StepTimer("t", True)
    for _ in range(step_timer.SAMPLES + 500):
        t.start()
        t.lap("a")
    assert len(t.steps["a"]) == step_timer.SAMPLES and t.totals["a"][0] == step_timer.SAMPLES + 500
    assert f"n {step_timer.SAMPLES + 500} " in t.report()


# ------------------------------------------------------------------------------ launch files
def test_run_dirs_of_dead_launchers_are_swept():
    from runtime.drivers.launch import make_run_dir, remove_run_dir
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    tmp = tempfile.gettempdir()
    stale = os.path.join(tmp, f"dataflow-sweeptest-{dead.pid}-x")
    alive = os.path.join(tmp, f"dataflow-sweeptest-{os.getppid()}-y")
    os.makedirs(stale, exist_ok=True)
    os.makedirs(alive, exist_ok=True)
    try:
        mine = make_run_dir("dataflow-sweeptest-")
        assert not os.path.exists(stale) and os.path.isdir(alive) and os.path.isdir(mine)
        remove_run_dir(mine)
        assert not os.path.exists(mine)
    finally:
        os.rmdir(alive)


# ------------------------------------------------------------------------------ in-process driver
def test_in_process_failure_keeps_the_finished_lines(tmp_path, monkeypatch):
    from runtime.core.engine import Engine
    spec, w, _ = model(NAME)
    plan = compile_plan(spec, 2, attn_cap=16, block_size=4)
    reqs = make_requests(spec.vocab_size, 12, seed=5, max_new=6, spread=0.05)
    seen = [0]
    take = Engine.take_finished

    def failing(self):
        got = take(self)
        seen[0] += len(got)
        if seen[0] >= 4:
            raise RuntimeError("injected failure")
        return got
    monkeypatch.setattr(Engine, "take_finished", failing)
    out = tmp_path / "out.jsonl"
    opts = RunOptions(clock="virtual", kv_blocks=128, output_path=str(out))
    with pytest.raises(RuntimeError, match="injected") as info:
        Cluster(plan, build_executor(plan, opts, w), opts).run(reqs)
    finished = info.value.finished
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert 0 < len(finished) < 12 and [x["id"] for x in lines] == [r.name for r in finished]
    assert all(len(x["output_token_ids"]) == 6 for x in lines)


# ------------------------------------------------------------------------------ multi-process: kill a rank
def _rank_pid(rank: int) -> int:
    """The pid of this process's rank child (runtime.drivers.launch children carry RANK in their environment)."""
    me = str(os.getpid())
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/stat") as f:
                ppid = f.read().rsplit(")", 1)[1].split()[1]
            if ppid != me:
                continue
            with open(f"/proc/{pid}/environ", "rb") as f:
                env = f.read().split(b"\0")
        except OSError:
            continue
        if f"RANK={rank}".encode() in env and b"DATAFLOW_LAUNCH_DIR" in b" ".join(env):
            return int(pid)
    raise AssertionError(f"no rank {rank} child of {me}")


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="finds the rank's pid in /proc")
def test_killed_rank_keeps_every_finished_request(tmp_path):
    from runtime.drivers.multiproc import RunFailed, run_workloads_multiprocess
    spec, _, _ = model(NAME)
    plan = compile_plan(spec, 2, attn_cap=16, block_size=4)
    n = 60
    reqs = make_requests(spec.vocab_size, n, seed=11, max_new=8, max_prompt=12, spread=0.0)
    for i, r in enumerate(reqs):
        r.arrival = 0.08 * i  # arriving over ~5 s: a third of them finish well before the last arrives
    out = tmp_path / "out.jsonl"
    out.write_text("a line of an earlier run\n")
    killed = []

    def progress(done: int, total: int, _tokens: int) -> None:
        if done >= total // 3 and not killed:
            killed.append(done)
            os.kill(_rank_pid(1), signal.SIGKILL)
    opts = RunOptions(kv_blocks=256, output_path=str(out), progress=progress)
    with pytest.raises(RunFailed, match="rank 1: killed by signal SIGKILL") as info:
        run_workloads_multiprocess(plan, [(reqs, opts)], peer_timeout_s=5.0, timeout=120)
    err = info.value
    assert killed and n // 3 <= len(err.finished) < n, (killed, len(err.finished))
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert [x["id"] for x in lines] == [r.name for r in err.finished]  # every finished one, once, in finish order
    for x, r in zip(lines, err.finished):
        assert x["output_token_ids"] == r.output and len(r.output) == 8 and r.done
    assert {r.name for r in err.unfinished} == {r.name for r in reqs} - {x["id"] for x in lines}


def _line_count(path) -> int:
    """Lines written so far; 0 while the file is absent (the output check before the run creates and removes it, so
    exists() then read_text() can race)."""
    try:
        return path.read_text().count("\n")
    except FileNotFoundError:
        return 0


def test_cli_killed_rank_exits_1_and_keeps_the_lines(tmp_path):
    res = subprocess.run(DATAFLOW + ["compile", "tiny", "--ranks", "2"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    env = dict(os.environ, DATAFLOW_OPTIONS='{"verbose": true}')
    p = subprocess.Popen(DATAFLOW + ["run", "-q", "--num-requests", "3000", "--max-new-tokens", "48", "--ignore-eos",
                                     "--peer-timeout", "5", "-o", "out.jsonl"], cwd=tmp_path, env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    err: list[str] = []
    pids: dict[int, int] = {}

    def read() -> None:
        for line in p.stderr:
            err.append(line)
            if "): serving workload" in line:
                pids[int(line.split("] rank ")[1].split()[0])] = int(line.split("(pid ")[1].split(")")[0])
    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    out = tmp_path / "out.jsonl"
    try:
        deadline = time.monotonic() + 120
        while _line_count(out) < 10:  # some finished: kill rank 1 now
            assert p.poll() is None, "".join(err)
            assert time.monotonic() < deadline, "".join(err)
            time.sleep(0.05)
        os.kill(pids[1], signal.SIGKILL)
        rc = p.wait(90)
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    reader.join(5)
    text = "".join(err)
    assert rc == 1, text
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    assert len(lines) >= 10 and len({x["id"] for x in lines}) == len(lines)
    assert all(len(x["output_token_ids"]) == 48 for x in lines)
    assert f"{len(lines)} of 3000 requests finished before the failure; their lines are in out.jsonl" in text, text
    assert "did not finish: " in text and f"and {3000 - len(lines) - 20} more" in text
    assert text.count("killed by signal SIGKILL") == 1, text  # each rank's error once


# ------------------------------------------------------------------------------ paths checked before the run
@pytest.mark.parametrize("flag", ["-o", "--trace"])
def test_unwritable_output_paths_fail_before_the_run(tmp_path, flag):
    res = subprocess.run(DATAFLOW + ["compile", "tiny", "--ranks", "2"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    (tmp_path / "afile").write_text("")
    env = dict(os.environ, DATAFLOW_OPTIONS='{"verbose": true}')
    for bad, why in (("nodir/x.json", "nodir is not an existing directory"), ("afile/x.json", "afile is not an"),
                     (".", "is a directory")):
        res = subprocess.run(DATAFLOW + ["run", "-q", flag, bad], cwd=tmp_path, capture_output=True, text=True,
                             timeout=60, env=env)
        assert res.returncode == 2, res.stderr
        option = "--output" if flag == "-o" else "--trace"
        assert f"error: {option} {bad}: " in res.stderr and why in res.stderr, res.stderr
        assert "serving workload" not in res.stderr and "Traceback" not in res.stderr


def test_a_failed_ranks_error_is_said_once():
    from runtime.drivers.launch import LaunchResult
    from runtime.drivers.multiproc import _failure_message
    first = "ValueError: the plan is compiled for 2 ranks but 3 processes were started (WORLD_SIZE)"
    res = LaunchResult([1, 1, -15], f"rank 1: {first}", 1,
                       {1: first, 0: f"PeerFailure: rank 1 failed: rank 1 aborted: {first}; this rank was waiting for: "
                                     f"workload 0", 2: "terminated (SIGTERM)"})
    msg = _failure_message(res)
    assert msg.count(first) == 1 and "rank 0: PeerFailure: rank 1 failed: rank 1 aborted: (rank 1's error above)" in msg
    assert "rank 2" not in msg
