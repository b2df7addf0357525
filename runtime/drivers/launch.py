"""One process per rank: start them on this machine, or pick up torchrun's, and leave no orphans.

A run target is an importable function `target(env: RankEnv, *args) -> result` (named "pkg.mod:fn"
or passed as a module-level function). `launch_local` starts `python -m runtime.drivers.launch` once per rank
with the torchrun variables set (MASTER_ADDR=127.0.0.1, a free MASTER_PORT, RANK, WORLD_SIZE,
LOCAL_RANK, LOCAL_WORLD_SIZE), so the target cannot tell the two apart; under torchrun the entry
point calls `run_rank(target, from_torchrun_env(), args)` in its own process instead.

Failure handling, because a distributed run must end, not hang:
- a rank whose target raises prints the traceback, records a one-line message, broadcasts an abort
  to its peers (runtime/transport/health.py) and exits 1 (130 for Ctrl-C, 143 for SIGTERM);
- when any rank exits non-zero, the launcher gives the others `grace_s` to notice and exit on their
  own (so their own messages name the dead rank), then SIGTERMs and, 2 s later, SIGKILLs the rest;
- Ctrl-C / SIGTERM to the launcher are forwarded to every rank (a second one kills them outright), a hang-up
  (SIGHUP) as SIGTERM; the launch's temporary files go on every exit path (make_run_dir);
- children die with the launcher: PR_SET_PDEATHSIG (Linux) or a ppid watchdog thread elsewhere.
Children run in their own sessions so a terminal's Ctrl-C reaches only the launcher, which forwards it
once, in order, instead of every rank being interrupted at a random point.

This module imports no torch: children that do not need it start fast.
"""
from __future__ import annotations

import atexit
import ctypes
import os
import pickle
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import traceback
from dataclasses import dataclass, field
from importlib import import_module
from typing import Any, Callable, Optional, Union

from runtime import settings

KILL_AFTER_TERM_S = 2.0
_POLL_S = 0.02


@dataclass(frozen=True)
class RankEnv:
    rank: int
    world_size: int
    local_rank: int
    master_addr: str
    master_port: int


def set_rank_threads(env: RankEnv, on_gpu: bool) -> int:
    """Intra-op (OpenMP) threads of a rank process; call before its first torch op. Returns the count.

    CPU ranks split the host's cores between the ranks of this host: one pool per core per rank
    oversubscribes them, and tiny matmuls then cost 100x more (3 us -> 300+ us per linear, 2 cores).
    GPU ranks get 1: their host work is Python and small tensor ops, and a pool of workers spinning
    after every small CPU op takes cores (and hyperthread siblings) from the engine thread (2 x H200,
    32 vCPUs, 16 threads per rank: every host step of a send ran 5-20x slower than alone).
    The rank_threads option overrides both."""
    import torch
    local_world = settings.launch_environment().local_world_size or env.world_size
    n = settings.current().rank_threads or (1 if on_gpu else max(1, (os.cpu_count() or 1) // local_world))
    torch.set_num_threads(n)
    return n


def from_torchrun_env(environ: Optional[dict] = None) -> Optional[RankEnv]:
    """The rank's identity from torchrun-style variables (this process's environment, or `environ`), or None when
    not launched that way."""
    launch = settings.LaunchEnvironment.read(environ)
    rank, world = launch.rank, launch.world_size
    if rank is None or world is None:
        return None
    if not 0 <= rank < world:
        raise ValueError(f"RANK={rank} is outside WORLD_SIZE={world}")
    return RankEnv(rank=rank, world_size=world, local_rank=rank if launch.local_rank is None else launch.local_rank,
                   master_addr=launch.master_addr, master_port=launch.master_port)


@dataclass
class LaunchResult:
    exit_codes: list[int]            # per rank; negative = killed by that signal (subprocess convention)
    first_error: Optional[str]       # message of the first rank that failed, prefixed with its rank
    first_failed_rank: Optional[int]
    errors: dict[int, str] = field(default_factory=dict)  # every failed rank's one-line message
    results: list[Any] = field(default_factory=list)      # targets' return values (None if it failed)

    @property
    def ok(self) -> bool:
        return all(code == 0 for code in self.exit_codes)


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket() as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def target_name(target: Union[str, Callable]) -> str:
    if isinstance(target, str):
        if ":" not in target:
            raise ValueError(f"target {target!r} must be 'package.module:function'")
        return target
    module, qualname = getattr(target, "__module__", None), getattr(target, "__qualname__", "")
    if not module or module == "__main__" or "<" in qualname:
        raise ValueError(f"target {target!r} must be a module-level function importable by the rank processes")
    return f"{module}:{qualname}"


def resolve_target(name: str) -> Callable:
    module, _, attr = name.partition(":")
    obj: Any = import_module(module)
    for part in attr.split("."):
        obj = getattr(obj, part)
    return obj


def run_rank(target: Union[str, Callable], env: RankEnv, args: tuple = ()) -> Any:
    """Run one rank's target in this process. On failure, tell the peers before re-raising."""
    fn = resolve_target(target) if isinstance(target, str) else target
    try:
        return fn(env, *args)
    except BaseException as err:
        from runtime.transport.health import PeerFailure, abort_all
        if isinstance(err, PeerFailure):  # pass on the root cause; peers add what they wait for
            abort_all(f"{err.reason} (rank {env.rank} was waiting for: {err.waiting_for})", err.rank)
        else:
            abort_all(_one_line(err), env.rank)
        raise


def _one_line(err: BaseException) -> str:
    if isinstance(err, KeyboardInterrupt):
        return "interrupted (SIGINT)"
    text = str(err).strip().replace("\n", " | ")
    return f"{type(err).__name__}: {text}" if text else type(err).__name__


def _repo_root() -> str:
    return os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _forward_lines(stream, sink, prefix: bytes) -> None:
    """Copy a child's output line by line with a rank prefix (whole lines: ranks don't interleave mid-line)."""
    for line in iter(stream.readline, b""):
        try:
            sink.write((prefix + line).decode(errors="replace"))
            sink.flush()
        except (ValueError, OSError):  # the sink was closed (interpreter shutting down)
            break
    stream.close()


def launch_local(world_size: int, target: Union[str, Callable], args: tuple = (), timeout: Optional[float] = None, *,
                 grace_s: float = 5.0, env: Optional[dict] = None,
                 on_tick: Optional[Callable[[], None]] = None) -> LaunchResult:
    """Run `target(RankEnv, *args)` in `world_size` processes on this machine and wait for all.

    `timeout`: seconds for the whole run (None: no limit); on expiry every rank is terminated and
    the result's first_error says so. `grace_s`: how long the others may take to exit on their own
    after one rank failed. Ctrl-C/SIGTERM (main thread only) are forwarded to the ranks, and after
    cleanup re-raised as KeyboardInterrupt / SystemExit(143). Never returns with a child alive.
    `on_tick`: called from the wait loop every ~20 ms (e.g. to show progress the ranks write to a
    file); it must be quick and not raise. The run's files (the pickled job: prompts included) live in
    a private temporary directory that is gone when this returns or raises (see make_run_dir). Pickle is read
    only from that directory (mode 0700, this user's own processes on this host), never from a socket: what
    ranks exchange over the network is the signed msgpack of runtime/transport/wire.py.
    """
    run_dir = make_run_dir("dataflow-launch-")
    try:
        return _launch_local(run_dir, world_size, target, args, timeout, grace_s=grace_s, env=env, on_tick=on_tick)
    finally:
        remove_run_dir(run_dir)


_RUN_DIRS: set[str] = set()  # made by make_run_dir and not removed yet (removed at exit by _remove_all)


def _remove_all() -> None:
    for d in list(_RUN_DIRS):
        remove_run_dir(d)


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive as far as we can tell
        return True
    return True


def make_run_dir(prefix: str) -> str:
    """A private temporary directory for one launch's files, named after this process (prefix + pid + "-"),
    removed by remove_run_dir, at interpreter exit at the latest (atexit), and, when this process is SIGKILLed
    or dies on a signal it does not handle, by the next make_run_dir of the same prefix: it removes those of
    processes that are gone. (launch_local turns SIGINT/SIGTERM/SIGHUP into exceptions, so its `finally` runs.)"""
    tmp = tempfile.gettempdir()
    try:
        names = [n for n in os.listdir(tmp) if n.startswith(prefix)]
    except OSError:
        names = []
    for n in names:
        pid = n[len(prefix):].split("-", 1)[0]
        if pid.isdigit() and int(pid) != os.getpid() and not _pid_alive(int(pid)):
            shutil.rmtree(os.path.join(tmp, n), ignore_errors=True)
    if not _RUN_DIRS:
        atexit.unregister(_remove_all)
        atexit.register(_remove_all)
    d = tempfile.mkdtemp(prefix=f"{prefix}{os.getpid()}-")
    _RUN_DIRS.add(d)
    return d


def remove_run_dir(path: str) -> None:
    _RUN_DIRS.discard(path)
    shutil.rmtree(path, ignore_errors=True)


def _launch_local(run_dir: str, world_size: int, target: Union[str, Callable], args: tuple, timeout: Optional[float],
                  *, grace_s: float, env: Optional[dict], on_tick: Optional[Callable[[], None]]) -> LaunchResult:
    name = target_name(target)
    with open(os.path.join(run_dir, "args.pkl"), "wb") as f:
        pickle.dump((name, tuple(args)), f)
    # This process's environment carries the run's options (DATAFLOW_OPTIONS, exported by settings.configure): the
    # ranks serve with the same ones.
    inherited = settings.environment_copy()
    base = {**inherited, **(env or {})}
    # The repository first, then a PYTHONPATH the caller adds, then the inherited one (where installed
    # dependencies may live, e.g. wheels unpacked on a machine without pip access): adding a path for
    # the ranks must not hide the packages the parent imports.
    paths = [_repo_root()] + [p for p in ((env or {}).get("PYTHONPATH"), inherited.get("PYTHONPATH")) if p]
    base["PYTHONPATH"] = os.pathsep.join(dict.fromkeys(paths))
    # DATAFLOW_RUN_SECRET: the key every rank signs its frames with (runtime/transport/wire.py), new per launch
    # unless the caller passes one in `env` (a serving front shares it: runtime/drivers/front.py), handed over in the
    # environment (readable by this user only), never through a socket.
    import secrets
    base["DATAFLOW_RUN_SECRET"] = (env or {}).get("DATAFLOW_RUN_SECRET") or secrets.token_hex(32)
    base.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()), WORLD_SIZE=str(world_size),
                LOCAL_WORLD_SIZE=str(world_size), DATAFLOW_LAUNCH_DIR=run_dir,
                DATAFLOW_LAUNCH_PARENT=str(os.getpid()), PYTHONUNBUFFERED="1")
    # Like torchrun: without this every rank starts one intra-op thread per core and they thrash.
    base.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // world_size)))

    procs: list[subprocess.Popen] = []
    readers: list[threading.Thread] = []
    received: list[int] = []  # signals received by the launcher while running
    old_handlers = {}

    def on_signal(signum, _frame):
        received.append(signum)
        # A hang-up (terminal closed) ends the ranks like SIGTERM, so they broadcast an abort on their way out.
        _signal_all(procs, signal.SIGKILL if len(received) > 1 else
                    signal.SIGTERM if signum == getattr(signal, "SIGHUP", None) else signum)

    if threading.current_thread() is threading.main_thread():
        hup = getattr(signal, "SIGHUP", None)
        for sig in (signal.SIGINT, signal.SIGTERM, hup):
            # (a hang-up that nohup made this process ignore stays ignored)
            if sig is not None and not (sig == hup and signal.getsignal(sig) == signal.SIG_IGN):
                old_handlers[sig] = signal.signal(sig, on_signal)

    start = time.monotonic()
    codes: list[Optional[int]] = [None] * world_size
    first_failed: Optional[int] = None
    timed_out = False
    failed_before_timeout: Optional[int] = None
    running_at_timeout: list[int] = []
    try:
        for rank in range(world_size):
            # DATAFLOW_SPAWNED_AT: when this launcher started the rank (its start-up phases count the spawn from it)
            child_env = dict(base, RANK=str(rank), LOCAL_RANK=str(rank), DATAFLOW_SPAWNED_AT=f"{time.time():.6f}")
            p = subprocess.Popen([sys.executable, "-m", "runtime.drivers.launch"], env=child_env, cwd=os.getcwd(),
                                 stdout=subprocess.PIPE, stderr=subprocess.PIPE, start_new_session=True)
            procs.append(p)
            for stream, sink in ((p.stdout, sys.stdout), (p.stderr, sys.stderr)):
                t = threading.Thread(target=_forward_lines, args=(stream, sink, f"[rank {rank}] ".encode()),
                                     daemon=True)
                t.start()
                readers.append(t)

        fail_at: Optional[float] = None
        term_at: Optional[float] = None
        killed = False
        while any(c is None for c in codes):
            now = time.monotonic()
            for rank, p in enumerate(procs):
                if codes[rank] is None and (rc := p.poll()) is not None:
                    codes[rank] = rc
                    if rc != 0 and first_failed is None:
                        first_failed, fail_at = rank, now
            if received and fail_at is None:
                fail_at = now  # interrupted: the forwarded signal gets the same grace as a failure
            if timeout is not None and not timed_out and now - start > timeout:
                timed_out = True
                failed_before_timeout = first_failed  # ranks failing after our SIGTERM are not news
                running_at_timeout = [r for r, c in enumerate(codes) if c is None]
                term_at = now
                _signal_all(procs, signal.SIGTERM)
            if fail_at is not None and term_at is None and now - fail_at > grace_s:
                term_at = now
                _signal_all(procs, signal.SIGTERM)
            if term_at is not None and not killed and now - term_at > KILL_AFTER_TERM_S:
                killed = True
                _signal_all(procs, signal.SIGKILL)
            if on_tick is not None:
                on_tick()
            time.sleep(_POLL_S)
    finally:
        # Whatever happened above (an exception in this loop included), no child outlives us.
        _signal_all(procs, signal.SIGKILL)
        for p in procs:
            p.wait()
        for t in readers:
            t.join(1.0)
        for sig, handler in old_handlers.items():
            signal.signal(sig, handler)

    exit_codes = [p.returncode for p in procs]
    errors: dict[int, str] = {}
    results: list[Any] = []
    for rank, rc in enumerate(exit_codes):
        msg = _read_text(os.path.join(run_dir, f"error.{rank}"))
        if rc != 0:
            if msg is None:
                msg = (f"killed by signal {signal.Signals(-rc).name}" if rc < 0 else f"exited with code {rc}")
            errors[rank] = msg
        results.append(_read_pickle(os.path.join(run_dir, f"result.{rank}.pkl")))

    first_error = None
    if timed_out:
        first_error = f"timed out after {timeout:g} s; rank(s) {running_at_timeout} still running were terminated"
        if failed_before_timeout is not None:
            first_error += f"; earlier, rank {failed_before_timeout}: {errors.get(failed_before_timeout)}"
    elif first_failed is not None:
        first_error = f"rank {first_failed}: {errors[first_failed]}"
    result = LaunchResult(exit_codes, first_error, first_failed, errors, results)
    if received:
        if received[0] == signal.SIGINT:
            raise KeyboardInterrupt(f"interrupted; ranks exited with {exit_codes}")
        raise SystemExit(128 + received[0])
    return result


def _signal_all(procs: list, sig: int) -> None:
    for p in procs:
        if p.poll() is None:
            try:
                p.send_signal(sig)
            except ProcessLookupError:
                pass


def _read_text(path: str) -> Optional[str]:
    try:
        with open(path) as f:
            return f.read().strip() or None
    except OSError:
        return None


def _read_pickle(path: str) -> Any:
    try:
        with open(path, "rb") as f:
            return pickle.load(f)
    except (OSError, EOFError, pickle.UnpicklingError):
        return None


# ---------------------------------------------------------------------------------- child side
def _die_with_parent(parent_pid: int) -> None:
    """Make sure this rank cannot outlive the launcher (even a SIGKILLed one)."""
    if sys.platform.startswith("linux"):
        libc = ctypes.CDLL(None, use_errno=True)
        PR_SET_PDEATHSIG = 1
        libc.prctl(PR_SET_PDEATHSIG, signal.SIGKILL, 0, 0, 0)
        # The parent may have died between fork and prctl: then we were already re-parented.
        if os.getppid() != parent_pid:
            os._exit(1)
        return

    def watch() -> None:
        while os.getppid() == parent_pid:
            time.sleep(0.5)
        os._exit(1)
    threading.Thread(target=watch, name="ppid-watchdog", daemon=True).start()


def _sigterm_to_exit(_signum, _frame):
    raise SystemExit(143)  # unwinds the target, so it can broadcast an abort (see run_rank)


def _print_frames(err: BaseException, rank: int) -> None:
    """The traceback of a rank's error without its last line (the error itself: the launcher's caller prints it
    once, in the run's summary, from the error file)."""
    te = traceback.TracebackException.from_exception(err)
    lines = list(te.format())
    last = list(te.format_exception_only())
    if lines[-len(last):] == last:
        lines = lines[:-len(last)] + [f"(rank {rank}'s error: see the run's summary)\n"]
    sys.stderr.write("".join(lines))


_CHILD_STARTED: Optional[tuple[float, float]] = None  # (time.time(), time.perf_counter()) at a rank's first line


def child_started() -> Optional[tuple[float, float]]:
    """(wall clock, perf_counter) when this rank process ran its first line of Python (after the interpreter and
    this module's imports), or None when launch_local did not start it (torchrun, or not a rank)."""
    return _CHILD_STARTED


def _child_main(started: Optional[tuple[float, float]] = None) -> int:
    global _CHILD_STARTED
    _CHILD_STARTED = started
    launch = settings.launch_environment()
    assert launch.launch_dir is not None and launch.launch_parent is not None, \
        "DATAFLOW_LAUNCH_DIR/_PARENT missing: runtime.drivers.launch is started by launch_local"
    _die_with_parent(launch.launch_parent)
    signal.signal(signal.SIGTERM, _sigterm_to_exit)
    run_dir = launch.launch_dir
    env = from_torchrun_env()
    assert env is not None, "RANK/WORLD_SIZE missing: runtime.drivers.launch is started by launch_local"
    code, message = 0, None
    try:
        with open(os.path.join(run_dir, "args.pkl"), "rb") as f:
            name, args = pickle.load(f)
        result = run_rank(name, env, args)
        tmp = os.path.join(run_dir, f"result.{env.rank}.pkl.tmp")
        with open(tmp, "wb") as f:
            pickle.dump(result, f)
        os.replace(tmp, os.path.join(run_dir, f"result.{env.rank}.pkl"))
    except KeyboardInterrupt as err:
        code, message = 130, _one_line(err)
    except SystemExit as err:
        code = err.code if isinstance(err.code, int) else (0 if err.code is None else 1)
        if code:
            message = "terminated (SIGTERM)" if code == 143 else f"SystemExit({err.code})"
    except BaseException as err:
        from runtime.transport.health import PeerFailure
        if not isinstance(err, PeerFailure):  # a peer's failure is an expected ending: its message says it all
            _print_frames(err, env.rank)
        code, message = 1, _one_line(err)
    if message is not None:  # printed once, by whoever reports the run (launch_local's caller): not here as well
        with open(os.path.join(run_dir, f"error.{env.rank}"), "w") as f:
            f.write(message)
    # Exit without interpreter teardown: threads blocked in gloo waits or sockets to dead peers can
    # hang a normal exit. atexit handlers still run; output is flushed first.
    try:
        atexit._run_exitfuncs()
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


if __name__ == "__main__":
    _started = (time.time(), time.perf_counter())
    # Run through the imported module, not this __main__ copy, so RankEnv is one class everywhere.
    import runtime.drivers.launch as _launch
    _launch._child_main(_started)
