"""runtime/cpu_bind.py: each GPU rank's serving thread on a physical core of its own near its GPU, the
process's other threads on the CPUs no serving thread uses."""
from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from runtime.cpu_bind import bind_enabled, parse_cpulist, plan_serving_cores


def test_parse_cpulist():
    assert parse_cpulist("0-3,8,10-11\n") == [0, 1, 2, 3, 8, 10, 11]
    assert parse_cpulist("5") == [5] and parse_cpulist("") == []


def _ht(c: int) -> frozenset:  # 8 CPUs, 4 physical cores: cpu i and i + 4 are siblings
    return frozenset({c % 4, c % 4 + 4})


def test_ranks_take_distinct_cores_near_their_gpus_siblings_left_out():
    near = {0: [0, 1, 4, 5], 1: [2, 3, 6, 7]}  # two NUMA nodes
    assert plan_serving_cores(2, list(range(8)), near.get, _ht) == [(0, frozenset({0, 4})), (2, frozenset({2, 6}))]
    same = {0: [0, 1, 4, 5], 1: [0, 1, 4, 5]}  # both GPUs on one node: the second rank takes the next core
    assert plan_serving_cores(2, list(range(8)), same.get, _ht) == [(0, frozenset({0, 4})), (1, frozenset({1, 5}))]
    # unknown locality, a restricted mask: only allowed CPUs, never a taken core's sibling
    assert plan_serving_cores(2, [4, 5, 6], lambda i: None, _ht) == [(4, frozenset({4})), (5, frozenset({5}))]
    with pytest.raises(ValueError, match="no free core for local rank 1"):
        plan_serving_cores(2, [0, 4], lambda i: None, _ht)


def test_bind_enabled_only_when_asked(monkeypatch):
    monkeypatch.delenv("DATAFLOW_CPU_BIND", raising=False)
    assert not bind_enabled()
    monkeypatch.setenv("DATAFLOW_CPU_BIND", "1")
    assert bind_enabled()
    monkeypatch.setenv("DATAFLOW_CPU_BIND", "0")
    assert not bind_enabled()
    monkeypatch.setenv("DATAFLOW_CPU_BIND", "yes")
    with pytest.raises(ValueError, match="DATAFLOW_CPU_BIND='yes'"):
        bind_enabled()


@pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(os.sched_getaffinity(0)) < 2,
                    reason="needs the Linux affinity API and 2 CPUs")
def test_bind_rank_threads_moves_the_serving_thread_and_the_others_in_a_real_process():
    # A fresh process (binding changes its affinity): one rank, a helper thread started before the binding
    # and one after (which inherits the serving thread's CPU until the next workload's binding moves it).
    code = textwrap.dedent("""
        import os, threading, time
        from runtime.cpu_bind import bind_rank_threads
        tids, stop = {}, threading.Event()
        def worker(name):
            tids[name] = threading.get_native_id()
            stop.wait()
        a = threading.Thread(target=worker, args=("before",)); a.start()
        allowed = sorted(os.sched_getaffinity(0))
        time.sleep(0.05)
        what = bind_rank_threads(0, 1, "cpu")
        b = threading.Thread(target=worker, args=("after",)); b.start(); time.sleep(0.05)
        main = sorted(os.sched_getaffinity(0))
        late = sorted(os.sched_getaffinity(tids["after"]))
        bind_rank_threads(0, 1, "cpu")  # the next workload's binding
        print(allowed, main, sorted(os.sched_getaffinity(tids["before"])), late,
              sorted(os.sched_getaffinity(tids["after"])), sorted(os.sched_getaffinity(0)), sep=";")
        stop.set(); a.join(); b.join()
    """)
    env = dict(os.environ, DATAFLOW_CPU_BIND="1", PYTHONPATH=os.getcwd())
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    allowed, main, before, late, after, main2 = (eval(p) for p in out.stdout.strip().split(";"))
    assert len(main) == 1 and main[0] in allowed and main2 == main
    assert before == after and main[0] not in before and set(before) <= set(allowed) and before
    assert late == main  # a thread started after the binding inherits it until the next binding
    assert "rank 0: serving thread on CPU" in out.stderr
