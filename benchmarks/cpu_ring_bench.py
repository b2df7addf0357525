"""What one hop of a ring collective costs the barrier baselines' rank processes on this CPU (lab/barrier_mp.py). The
CPU cost profile took its hop from here until session 26; since session 27 lab/costs/cpu_tiny.yaml prices a hop as a
message of the same transport measured inside the real runs (benchmarks/sim_validation/inrun_costs.py):

    python benchmarks/cpu_ring_bench.py --ranks 4 --rows 23 --hidden 48 --collectives 300

Starts `--ranks` processes (runtime.drivers.launch, the same launcher, transport (ZeroMQ metadata + gloo p2p) and
thread setting as the bench's rank processes) and runs the barrier ranks' ring all-gather
(lab/barrier_rank.py `_allgather`, ring mode): R-1 steps, each a send of a [rows, hidden] fp32 tensor to rank+1 and a
wait for rank-1's, the wait polling the transport 1 ms at a time as lab/barrier_mp.py does. Every rank times its
collectives; the report is the median seconds per collective and per hop (collective / (R-1)) and the process CPU
per hop. Optionally `--compute-us` of busy math per rank between collectives (a barrier step's attention), to see
the hops as a step sees them.
"""
from __future__ import annotations

import json
import statistics
import sys
import time
from pathlib import Path

import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

RANK_TARGET = "benchmarks.cpu_ring_bench:ring_rank"


def ring_rank(env, rows: int, hidden: int, collectives: int, compute_us: float, pingpong: bool = False,
              busy_us: float = 0.0) -> dict:
    import torch

    from runtime.drivers.launch import set_rank_threads
    from runtime.transport.zmq_dist import ZmqDistTransport, init_distributed
    set_rank_threads(env, on_gpu=False)
    init_distributed(env.rank, env.world_size, "gloo")
    me, R = env.rank, env.world_size
    nxt = (me + 1) % R
    inbox: dict = {}
    x = torch.randn(rows, hidden)
    a = torch.randn(64, 64)

    with ZmqDistTransport(me, R, "cpu") as tr:
        def pump(timeout: float) -> None:
            for arr in tr.poll(timeout):
                inbox[arr.meta["tag"]] = arr

        def gather(tag) -> None:
            while tag not in inbox:
                pump(0.001)
            inbox.pop(tag)

        def ring(tag) -> None:
            t = x
            for i in range(R - 1):
                tr.send(nxt, {"tag": (tag, i)}, t)
                gather((tag, i))

        ring(-1)  # warm-up and a common start
        if busy_us:   # rank 0 sends to a busy rank 1 (compute blocks of busy_us, a poll between them): what it sees
            rec = []
            if me == 0:
                for c in range(collectives):
                    time.sleep(0.0007 + 0.0013 * ((c * 7919) % 100) / 100)   # spread over rank 1's blocks
                    tr.send(1, {"tag": ("b", c), "ts": time.perf_counter()}, x)
                    pump(0.0)
                tr.send(1, {"tag": "done"}, None)
            elif me == 1:
                block_end = time.perf_counter()
                while "done" not in inbox:
                    end = time.perf_counter() + busy_us * 1e-6
                    while time.perf_counter() < end:   # the engine thread's math: small torch ops, GIL held between
                        torch.relu(a @ a)
                    block_end = time.perf_counter()
                    got = list(tr.poll(0.0))
                    while not got and "done" not in inbox:
                        got = list(tr.poll(0.002))
                        if got or time.perf_counter() - block_end > 0.05:
                            break
                    now = time.perf_counter()
                    for arr in got:
                        inbox[arr.meta["tag"]] = arr
                        if "ts" in arr.meta:  # exposed: seen after the later of (sent, the receiver free)
                            rec.append((now - arr.meta["ts"], now - max(arr.meta["ts"], block_end),
                                        arr.meta["ts"] < block_end))
            ring(-2)
            pump(0.01)
            return {"rank": me, "busy": rec, "times": [], "cpu": [0.0]}
        if pingpong:   # ranks 0 and 1 ping-pong one message at a time; the others compute (hold a core) meanwhile
            rtt = []
            if me < 2:
                for c in range(collectives):
                    t0 = time.perf_counter()
                    if me == 0:
                        tr.send(1, {"tag": ("p", c)}, x)
                        gather(("q", c))
                    else:
                        gather(("p", c))
                        tr.send(0, {"tag": ("q", c)}, x)
                    rtt.append(time.perf_counter() - t0)
                tr.send(2 % R, {"tag": "done"}, None) if me == 0 and R > 2 else None
            else:
                while "done" not in inbox and not (me > 2 and "done2" in inbox):
                    end = time.perf_counter() + 0.002
                    while time.perf_counter() < end:
                        a @ a
                    pump(0.0)
                for p in range(me + 1, R):
                    tr.send(p, {"tag": "done2"}, None)
            ring(-2)
            pump(0.01)
            return {"rank": me, "times": rtt if me == 0 else [], "cpu": [0.0]}
        times, cpu = [], []
        for c in range(collectives):
            if compute_us:
                end = time.perf_counter() + compute_us * 1e-6
                while time.perf_counter() < end:
                    a @ a
            c0, t0 = time.process_time(), time.perf_counter()
            ring(c)
            times.append(time.perf_counter() - t0)
            cpu.append(time.process_time() - c0)
        ring(-2)
        pump(0.01)
    return {"rank": me, "times": times, "cpu": cpu}


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@app.command()
def main(ranks: int = typer.Option(4), rows: int = typer.Option(23), hidden: int = typer.Option(48),
         collectives: int = typer.Option(300), compute_us: float = typer.Option(0.0, "--compute-us"),
         pingpong: bool = typer.Option(False, "--pingpong", help="ranks 0 and 1 ping-pong while the others compute"),
         busy_us: float = typer.Option(0.0, "--busy-us", help="rank 0 sends to rank 1 computing in blocks of this"),
         out: Path = typer.Option(None, "--out", help="also write the raw per-rank times as JSON")) -> None:
    from runtime.drivers.launch import launch_local
    res = launch_local(ranks, RANK_TARGET, (rows, hidden, collectives, compute_us, pingpong, busy_us), timeout=600)
    if not res.ok:
        raise SystemExit(f"ring bench failed: {res.first_error}")
    if busy_us:
        rec = res.results[1]["busy"]
        during = sorted(e for _, e, d in rec if d)
        after = sorted(e for _, e, d in rec if not d)
        q = lambda v, f: v[min(len(v) - 1, int(f * len(v)))] * 1e6 if v else float("nan")
        print(f"rank 0 -> rank 1 computing in {busy_us:g} us blocks, [{rows}, {hidden}] fp32, {len(rec)} messages: "
              f"seen after the receiver's block ended (sent during a block, {len(during)}): median {q(during, 0.5):.0f} us, "
              f"p90 {q(during, 0.9):.0f}; after it was sent (sent while it polled, {len(after)}): median "
              f"{q(after, 0.5):.0f} us, p90 {q(after, 0.9):.0f}")
        return
    if pingpong:
        rtt = sorted(res.results[0]["times"])
        print(f"ping-pong 0 <-> 1, [{rows}, {hidden}] fp32, ranks 2..{ranks - 1} computing: one-way (RTT / 2) median "
              f"{statistics.median(rtt) / 2 * 1e6:.0f} us, p90 {rtt[int(0.9 * len(rtt))] / 2 * 1e6:.0f} us")
        return
    per = [statistics.median(r["times"]) for r in res.results]
    cpu = [statistics.median(r["cpu"]) for r in res.results]
    allt = sorted(t for r in res.results for t in r["times"])
    print(f"ring all-gather, {ranks} rank processes, [{rows}, {hidden}] fp32 per hop, {collectives} collectives, "
          f"{compute_us:g} us of math between them")
    print(f"  per collective: median {statistics.median(allt) * 1e6:.0f} us (per rank {[round(p * 1e6) for p in per]}),"
          f" p90 {allt[int(0.9 * len(allt))] * 1e6:.0f} us")
    print(f"  per hop: {statistics.median(allt) / (ranks - 1) * 1e6:.0f} us; process CPU per hop "
          f"{statistics.median(cpu) / (ranks - 1) * 1e6:.0f} us")
    if out is not None:
        out.write_text(json.dumps(res.results))


if __name__ == "__main__":
    app()
