"""runtime.drivers.launch with real processes and real signals. The rank functions here import no torch, so a
launch costs ~0.1 s per rank instead of ~1 s."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from runtime.drivers.launch import from_torchrun_env, launch_local

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
CHILD_ENV = {"PYTHONPATH": HERE}


# ------------------------------------------------------------------------------ rank functions
def _report(env, tag):
    return {"tag": tag, "env": env, "vars": {k: os.environ[k] for k in
                                             ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")}}


def _one_fails(env, bad_rank):
    if env.rank == bad_rank:
        raise ValueError("boom from the bad rank")
    signal.signal(signal.SIGTERM, signal.SIG_IGN)  # a wedged rank: only SIGKILL ends it
    time.sleep(60)


def _sleep_forever(env, pid_dir):
    with open(os.path.join(pid_dir, str(env.rank)), "w") as f:
        f.write(str(os.getpid()))
    time.sleep(120)


# ------------------------------------------------------------------------------ tests
def test_ranks_get_torchrun_variables_and_results_come_back():
    res = launch_local(3, "test_launch:_report", ("hello",), timeout=30, env=CHILD_ENV)
    assert res.ok and res.exit_codes == [0, 0, 0], res.first_error
    ports = set()
    for rank, r in enumerate(res.results):
        assert r["tag"] == "hello"
        assert (r["env"].rank, r["env"].world_size, r["env"].local_rank) == (rank, 3, rank)
        assert r["vars"]["MASTER_ADDR"] == "127.0.0.1" and r["env"] == from_torchrun_env(r["vars"])
        ports.add(r["vars"]["MASTER_PORT"])
    assert len(ports) == 1


def test_failing_rank_is_reported_first_and_wedged_ranks_are_killed():
    t0 = time.monotonic()
    res = launch_local(3, "test_launch:_one_fails", (1,), timeout=30, grace_s=0.5, env=CHILD_ENV)
    elapsed = time.monotonic() - t0
    assert res.exit_codes[1] == 1
    assert res.first_failed_rank == 1
    assert res.first_error == "rank 1: ValueError: boom from the bad rank"
    # ranks 0 and 2 ignore SIGTERM: grace, SIGTERM, then SIGKILL 2 s later
    assert res.exit_codes[0] == res.exit_codes[2] == -signal.SIGKILL
    assert elapsed < 10


def test_timeout_terminates_the_run_and_says_so(tmp_path):
    res = launch_local(2, "test_launch:_sleep_forever", (str(tmp_path),), timeout=1.0, env=CHILD_ENV)
    assert not res.ok
    assert res.first_error.startswith("timed out after 1 s; rank(s) [0, 1] still running")
    # Terminated: SIGTERM becomes SystemExit(143) inside a rank that got as far as its handler; on a loaded machine a
    # rank may still be starting (the default action: -15) or slower to exit than the 2 s before SIGKILL (-9).
    assert all(code in (143, -signal.SIGTERM, -signal.SIGKILL) for code in res.exit_codes), res.exit_codes
    pids = [int(p.read_text()) for p in tmp_path.iterdir() if p.read_text()]
    assert not any(_alive(pid) for pid in pids)   # none outlives the run


def test_from_torchrun_env():
    assert from_torchrun_env({}) is None
    env = from_torchrun_env({"RANK": "3", "WORLD_SIZE": "8", "LOCAL_RANK": "1", "MASTER_ADDR": "10.0.0.2",
                             "MASTER_PORT": "1234"})
    assert (env.rank, env.world_size, env.local_rank, env.master_addr, env.master_port) == (3, 8, 1, "10.0.0.2", 1234)
    with pytest.raises(ValueError, match="outside WORLD_SIZE"):
        from_torchrun_env({"RANK": "2", "WORLD_SIZE": "2"})


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie still answers kill(0); it is dead for our purposes
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[-1].split()[0] != "Z"
    except OSError:
        return False


def _start_launcher(pid_dir) -> subprocess.Popen:
    script = textwrap.dedent(f"""
        import sys
        from runtime.drivers.launch import launch_local
        try:
            launch_local(3, "test_launch:_sleep_forever", ({str(pid_dir)!r},), env={{"PYTHONPATH": {HERE!r}}},
                         grace_s=2.0)
        except KeyboardInterrupt:
            print("INTERRUPTED", flush=True)
            sys.exit(130)
    """)
    return subprocess.Popen([sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=ROOT))


def _child_pids(pid_dir, n=3, timeout_s=20.0) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while len(os.listdir(pid_dir)) < n:
        assert time.monotonic() < deadline, f"ranks did not start within {timeout_s} s"
        time.sleep(0.05)
    time.sleep(0.1)  # files are written before the ranks sleep; let the writes finish
    return [int(open(os.path.join(pid_dir, f)).read()) for f in sorted(os.listdir(pid_dir))]


def _wait_gone(pids, timeout_s) -> list[int]:
    deadline = time.monotonic() + timeout_s
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return [p for p in pids if _alive(p)]


@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGKILL], ids=["ctrl-c", "launcher-killed"])
def test_no_orphans(tmp_path, sig):
    launcher = _start_launcher(tmp_path)
    try:
        pids = _child_pids(tmp_path)
        launcher.send_signal(sig)
        out, _ = launcher.communicate(timeout=15)
        if sig == signal.SIGINT:
            assert launcher.returncode == 130 and "INTERRUPTED" in out
        # Ctrl-C: forwarded SIGINT; SIGKILL of the launcher: PR_SET_PDEATHSIG in every rank
        assert _wait_gone(pids, 10) == [], "rank processes outlived the launcher"
    finally:
        if launcher.poll() is None:
            launcher.kill()
