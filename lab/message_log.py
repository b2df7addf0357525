"""Every message's send and receive time in real rank processes, for measuring the one-way latency a streaming
run's messages actually see (benchmarks/sim_validation/inrun_costs.py): the simulator's `latency_us` is an
input, and on an oversubscribed CPU host it is set by thread wake-ups under the run's own load, which no
ping-pong bench reproduces.

An engine_setup hook (RunOptions.engine_setup; picklable, it travels to the rank processes): it wraps the rank's
transport `send` and `poll` and appends one line per event to DIR/rank{rank}.tsv:
    S <dst> <t>                     a send to another rank, at its call
    R <src> <t> <poll_start>        a message from another rank handed to the engine by a poll that started at
                                    poll_start (a blocking idle poll starts before the message exists)
    B <kind> <rows> <t>             a batch's start (its execute called)
    X <t>                           its execute's return (the math: B to X)
    E <t>                           a batch's end (its complete returned): a message that reached a busy rank is
                                    handed over after it, at once or after more batches
Times are time.perf_counter() (CLOCK_MONOTONIC: one time base for every process on a Linux host). The transport
hands messages FIFO per source, so the k-th S from a to b is the k-th R from a at b."""
from __future__ import annotations

import atexit
import time
from pathlib import Path


class MessageLog:
    def __init__(self, out_dir: str) -> None:
        self.out_dir = out_dir

    def __call__(self, engine) -> None:
        tr, rank = engine.transport, engine.rank
        lines: list[str] = []
        f = open(Path(self.out_dir) / f"rank{rank}.tsv", "w")

        def flush() -> None:
            f.write("".join(lines))
            f.flush()
            lines.clear()
        atexit.register(flush)
        inner_send, inner_poll, clock = tr.send, tr.poll, time.perf_counter
        inner_execute, inner_complete = engine.execute, engine.complete

        def send(dst, meta, tensor=None):
            if dst != rank:
                lines.append(f"S {dst} {clock():.7f}\n")
            return inner_send(dst, meta, tensor)

        def poll(*args, **kwargs):
            t0 = clock()
            out = inner_poll(*args, **kwargs)
            if out:
                t1 = clock()
                lines.extend(f"R {a.src} {t1:.7f} {t0:.7f}\n" for a in out if a.src != rank)
                if len(lines) > 4096:
                    flush()
            return out

        def execute(batch):
            lines.append(f"B {batch.stage.kind} {batch.rows} {clock():.7f}\n")
            out = inner_execute(batch)
            lines.append(f"X {clock():.7f}\n")
            return out

        def complete(batch):
            out = inner_complete(batch)
            lines.append(f"E {clock():.7f}\n")
            return out
        tr.send, tr.poll, engine.execute, engine.complete = send, poll, execute, complete
