"""`dataflow run` with one process per rank, the launcher's side: the job every rank process gets (RankJob), the run
of several workloads on one launch (`run_workloads_multiprocess`), and what comes back (results, or RunFailed).

The rank processes (runtime/drivers/rank_process.py, rank_node.py) speak the control protocol of
runtime/drivers/control.py; rank 0 also coordinates (runtime/drivers/coordinator.py). Several workloads per launch
(tests run every policy in one launch: spawning ranks is the expensive part); each starts behind a barrier and ends
with a clean cut (`stop`), so the next workload's engine starts on the same transport.

Failures end the run, they never hang it: a rank that fails (its own error, a dead or wedged peer, the coordinator's
stall bound) broadcasts an abort, runtime.drivers.launch ends the others and exits non-zero, and
`run_workloads_multiprocess` raises RunFailed with every rank's one-line message and the requests that finished before.

Weights: every rank loads all of them (attention is needed everywhere; the executor indexes the
stacked expert tensors by global expert id, so keeping only the local experts would need an index
remap in the executor). On the tiny/CPU models this costs nothing worth the complexity.
"""
from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import Optional

from runtime import settings
from runtime.drivers.control import COORDINATOR
from runtime.drivers.coordinator import RESULT_FIELDS
from runtime.drivers.launch import _read_text, from_torchrun_env, launch_local, make_run_dir, remove_run_dir, run_rank
from runtime.drivers.rank_process import rank_main

DEFAULT_STARTUP_TIMEOUT_S = 300.0  # loading a real checkpoint can take minutes; liveness is the heartbeat's job


class RunFailed(RuntimeError):
    """A multi-process run ended with failed ranks. The message names each failed rank and why.
    `finished`: the requests that finished before it (the caller's Request objects, results filled in, in finish
    order, every workload's); `unfinished`: the others (submission order). Each finished one is also on its line of
    its workload's RunOptions.output_path, when set."""

    def __init__(self, message: str, finished: Optional[list] = None, unfinished: Optional[list] = None) -> None:
        super().__init__(message)
        self.finished = list(finished or [])
        self.unfinished = list(unfinished or [])


@dataclass
class RankJob:
    """Everything a rank process needs, pickled once by the launcher (or built locally under torchrun)."""
    plan: object  # lowering.plan.Plan
    workloads: list  # [(requests, RunOptions without callables)]; only the coordinator uses the requests
    peer_timeout_s: float
    chaos: object = None  # runtime.transport.base.LinkDelays: per-message delays (tests, the lab's link models)
    # the coordinator writes "w done total tokens" here for the launcher's display, rank 0 its start-up phase to
    # this + ".phase"
    progress_path: Optional[str] = None
    startup_timeout_s: float = DEFAULT_STARTUP_TIMEOUT_S
    finished_path: Optional[str] = None  # the coordinator appends a JSON line per finished request (_journal)
    # (commands, events) endpoints of a serving front (runtime/drivers/front.py, front_link.py): the one workload
    # is open, its requests come from the front while the ranks serve, and tokens stream back to it.
    front: Optional[tuple] = None


def _picklable(options):
    """RunOptions minus what cannot cross a process boundary (callbacks); checks what is unsupported."""
    if options.clock != "wall":
        raise ValueError("the multi-process runner runs on the wall clock; use the in-process driver for --clock virtual")
    if options.until is not None:
        raise ValueError("`until` (stopping mid-run) is supported by the in-process driver only")
    if options.delay is not None:
        raise ValueError("`delay` is the in-process transport's hook; pass chaos= (a LinkDelays) for real sockets")
    return dataclasses.replace(options, progress=None)


def _check_fits(plan, requests: list, options) -> None:
    """Refuse a request no rank could ever hold here, as a ValueError (a user mistake), not as a rank's
    failure after every process started."""
    from runtime.core.engine import config_from_plan
    from runtime.drivers.admission import Admission
    capacity = [config_from_plan(plan, r, options.kv_blocks).num_blocks for r in range(plan.cluster.ranks)]
    adm = Admission(plan.kv.block_size, capacity, options.home_policy or plan.placement.home_policy,
                    plan.placement.homes(plan.cluster.ranks))
    for req in requests:
        adm.submit(req)  # raises ValueError naming the request when it cannot fit anywhere


def _to_result(raw: dict, original: list, world: int):
    from runtime.drivers.cluster import RunResult
    from runtime.observability.trace import TraceRecorder
    # Results go back into the caller's Request objects, as with the in-process driver.
    for mine, theirs in zip(original, raw["requests"]):
        for f in RESULT_FIELDS:
            setattr(mine, f, getattr(theirs, f))
    trace = None
    if raw["trace"] is not None:
        trace = TraceRecorder()
        trace.events, trace.decisions = raw["trace"]
    return RunResult(list(original), raw["metrics"], trace, world)


def _failure_message(res) -> str:
    """One line per failed rank, the first failure first; each error said once (a survivor's message that quotes
    the first failed rank's error, passed on by its abort notice, points to it instead of repeating it)."""
    lines = [res.first_error or "failed"]
    first = res.errors.get(res.first_failed_rank) if res.first_failed_rank is not None else None
    for rank, msg in sorted(res.errors.items()):
        # "terminated (SIGTERM)" is the launcher ending a rank that had not failed: not a cause.
        if rank != res.first_failed_rank and msg != "terminated (SIGTERM)":
            if first and len(first) > 20 and first in msg:
                msg = msg.replace(first, f"(rank {res.first_failed_rank}'s error above)")
            lines.append(f"rank {rank}: {msg}")
    return "\n".join(lines)


def run_workloads_multiprocess(plan, workloads: list, *, peer_timeout_s: float = 10.0, chaos=None,
                               timeout: Optional[float] = None, env: Optional[dict] = None,
                               progress=None) -> Optional[list]:
    """Serve several workloads [(requests, RunOptions)] one after the other on one launch of
    `plan.cluster.ranks` processes (or, under torchrun, as this process's rank). Returns one
    runtime.drivers.cluster.RunResult per workload (None on ranks other than 0 under torchrun).
    `timeout`: seconds for the whole launch. Raises RunFailed naming the failed ranks, with the requests that
    finished before (`finished`, their results filled in) and the others (`unfinished`). A workload's
    RunOptions.output_path is created empty here, and rank 0 appends each request's line as it finishes."""
    clean = [(list(reqs), _picklable(opts)) for reqs, opts in workloads]
    for reqs, opts in clean:
        _check_fits(plan, reqs, opts)
        if not opts.keep_outputs and not opts.output_path:
            raise ValueError("keep_outputs=False needs an output_path (the outputs would be nowhere)")
    progress = progress or (workloads[0][1].progress if len(workloads) == 1 else None)
    job = RankJob(plan, clean, peer_timeout_s, chaos)
    world = plan.cluster.ranks

    renv = from_torchrun_env()
    torchrun = renv is not None and settings.launch_environment().launch_dir is None  # (our launcher's ranks: not)
    if torchrun and renv.rank != COORDINATOR:
        # Started by torchrun, one of the serving ranks: no files here (rank 0 writes them).
        from runtime.transport.health import PeerFailure
        try:
            run_rank(rank_main, renv, (job,))
        except PeerFailure as err:
            raise RunFailed(f"rank {renv.rank}: {err}") from None
        return None
    for path in dict.fromkeys(opts.output_path for _, opts in clean if opts.output_path):
        open(path, "w").close()  # empty before any rank starts: lines of an earlier run never mix in
    tmpdir = make_run_dir("dataflow-progress-")
    job.finished_path = os.path.join(tmpdir, "finished.jsonl")
    try:
        if torchrun:
            # Started by torchrun: this process is rank 0. run_rank broadcasts an abort if we fail.
            if progress is not None:
                for _, opts in clean:
                    opts.progress = progress
            try:
                raws = run_rank(rank_main, renv, (job,))
            except Exception as err:
                from runtime.transport.health import PeerFailure
                finished, unfinished = _finished_so_far(job.finished_path, workloads)
                if isinstance(err, PeerFailure):
                    raise RunFailed(f"rank {renv.rank}: {err}", finished, unfinished) from None
                err.finished, err.unfinished = finished, unfinished  # what it did before, as with RunFailed
                raise
        else:
            res = _launch(plan, job, tmpdir, progress, timeout, peer_timeout_s, env)
            raws = res.results[COORDINATOR]
            if not res.ok or raws is None:
                raise RunFailed(_failure_message(res) if not res.ok else "rank 0 exited 0 but returned no results",
                                *_finished_so_far(job.finished_path, workloads))
        return [_to_result(raw, reqs, world) for raw, (reqs, _) in zip(raws, workloads)]
    finally:
        remove_run_dir(tmpdir)


def _launch(plan, job: RankJob, tmpdir: str, progress, timeout: Optional[float], peer_timeout_s: float,
            env: Optional[dict]):
    job.progress_path = os.path.join(tmpdir, "progress")
    last = {}

    def on_tick() -> None:
        # rank 0's start-up phase (StartupTimes.NEXT: the display's label, when the progress callable has one, as
        # dataflow run's does), and the coordinator's counts
        for path in (job.progress_path + ".phase", job.progress_path) if progress is not None else ():
            text = _read_text(path)
            if text and text != last.get(path):
                last[path] = text
                if path != job.progress_path:
                    if getattr(progress, "phase", None) is not None:
                        progress.phase(text)
                else:
                    _w, done, total, tokens = (int(x) for x in text.split())
                    progress(done, total, tokens)

    # (NCCL's environment is the rank's to set: settings.configure_nccl)
    # grace_s > the peer timeout: survivors get to notice a dead rank themselves and say what
    # they were waiting for, instead of being SIGTERMed with nothing to say.
    return launch_local(plan.cluster.ranks, rank_main, (job,), timeout=timeout, grace_s=peer_timeout_s + 5.0,
                        env=env, on_tick=on_tick)


def _finished_so_far(path: str, workloads: list) -> tuple[list, list]:
    """The requests rank 0's coordinator reported finished (its journal, Coordinator._keep), results copied into
    the caller's Request objects, in finish order; and the caller's others, in submission order."""
    by_key = {(w, r.rid): r for w, (reqs, _) in enumerate(workloads) for r in reqs}
    finished = []
    for line in (_read_text(path) or "").splitlines():  # (none when the coordinator never started it)
        try:
            rec = json.loads(line)
        except ValueError:  # a line cut by the coordinator's death mid-write
            continue
        req = by_key.pop((rec["w"], rec["rid"]), None)
        if req is None:
            continue
        for f in RESULT_FIELDS:
            if f in rec:
                setattr(req, f, rec[f])
        finished.append(req)
    return finished, list(by_key.values())


def run_workload_multiprocess(plan, requests: list, options=None, **kwargs):
    """Same contract as runtime.drivers.cluster.run_workload, with one process per rank (see the module doc)."""
    from runtime.drivers.cluster import RunOptions
    options = options or RunOptions()
    out = run_workloads_multiprocess(plan, [(requests, options)], progress=options.progress, **kwargs)
    return None if out is None else out[0]
