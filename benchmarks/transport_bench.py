"""What one message costs on the real transport (runtime/transport/zmq_dist.py), by size, for design notes.

    python benchmarks/transport_bench.py --ranks 2 --device cpu        # messages/s, p50/p99 latency, CPU per message
    python benchmarks/transport_bench.py --device cuda --ranks 2 --sizes 0,4K,64K,184K,1M --messages 2000

Starts `--ranks` processes on this machine (runtime.drivers.launch) and, for each size:
  latency:    rank 0 sends one message to rank 1 and waits for a meta-only ack before the next; the
              one-way latency is rank 1's arrival time minus the send stamp in the metadata (both
              CLOCK_MONOTONIC on one host, so comparable);
  throughput: every rank streams `--messages` messages to its ring neighbour while receiving from
              the other one, keeping the per-peer in-flight window full; messages/s is per stream,
              CPU per message is the process CPU time (all threads: engine, receptor, waiters,
              heartbeat) divided by the messages it sent, i.e. one send plus one receive.
Size 0 means a meta-only message (ZeroMQ only, no phase 2). `--device cuda` puts each rank on
cuda:LOCAL_RANK and moves the tensors with NCCL (on per-direction streams, see zmq_dist.py) instead
of gloo; latency then includes the device-side completion. (Formerly `dataflow transport-bench`.)
"""
from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path
from typing import Optional

import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from graph_ir.errors import UserError  # noqa: E402

# The ranks import this file as part of the repository (launch.py puts its root on their path), whatever name the
# launching process gave it (__main__ as a script).
RANK_TARGET = "benchmarks.transport_bench:bench_rank"


def _parse_size(text: str) -> int:
    text = text.strip().upper().removesuffix("B")
    scale = {"K": 1024, "M": 1024 ** 2, "G": 1024 ** 3}.get(text[-1:], 1)
    number = text[:-1] if text[-1:] in "KMG" else text
    try:
        value = int(float(number) * scale)
    except ValueError:
        raise UserError(f"--sizes: {text!r} is not a size like 4K, 184K or 1M") from None
    if value < 0:
        raise UserError(f"--sizes: {text!r} is negative")
    return value


def _label(size: int) -> str:
    if size == 0:
        return "meta-only"
    for unit, scale in (("M", 1024 ** 2), ("K", 1024)):
        if size >= scale and size % scale == 0:
            return f"{size // scale}{unit}"
    return f"{size}B"


def bench_rank(env, sizes: list[int], messages: int, latency_messages: int, device: str = "cpu") -> dict:
    """Runs inside each rank process (see runtime/drivers/launch.py). On CUDA the launch sets NCCL_NVLS_ENABLE=0:
    point-to-point needs no NVLink multicast buffers, and they fail on some machines."""
    import torch

    from runtime.transport.zmq_dist import ZmqDistTransport, init_distributed
    from runtime.drivers.launch import set_rank_threads
    set_rank_threads(env, on_gpu=device == "cuda")
    if device == "cuda":
        torch.cuda.set_device(env.local_rank)
        dev = torch.device("cuda", env.local_rank)
    else:
        dev = torch.device("cpu")
    init_distributed(env.rank, env.world_size, "nccl" if device == "cuda" else "gloo")
    rank, world = env.rank, env.world_size
    out: dict = {"rank": rank, "sizes": {}}
    with ZmqDistTransport(rank, world, dev) as tr:
        stash: list = []  # arrivals that belong to a later phase (a faster peer is already there)

        def take(kind: str, limit: int, timeout_s: float) -> list:
            mine = [a for a in stash if a.meta["kind"] == kind][:limit]
            for a in mine:
                stash.remove(a)
            # Always poll, even with nothing left to take: completions of our own sends are only
            # collected by poll(), and the send window waits for them.
            for a in tr.poll(timeout=timeout_s if len(mine) < limit else 0.0):
                (mine if a.meta["kind"] == kind and len(mine) < limit else stash).append(a)
            return mine

        def wait(n: int, kind: str, timeout_s: float = 120.0) -> list:
            got: list = []
            deadline = time.monotonic() + timeout_s
            while len(got) < n:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"rank {rank}: waited {timeout_s:g} s for {kind} messages, got {len(got)}/{n}")
                got += take(kind, n - len(got), 0.001)
            return got

        def barrier(tag: str) -> None:
            # meta-only all-to-all through the transport itself (no extra process group)
            for d in range(world):
                if d != rank:
                    tr.send(d, {"kind": tag}, None)
            wait(world - 1, tag)

        for size in sizes:
            payload = torch.randn(max(1, size // 4), device=dev) if size else None
            row: dict = {}
            barrier(f"lat{size}")
            # -- latency, rank 0 -> rank 1, one message at a time
            if rank == 0:
                for i in range(latency_messages):
                    tr.send(1, {"kind": "lat", "t": time.monotonic_ns()}, payload)
                    wait(1, "ack")
            elif rank == 1:
                lat = []
                for _ in range(latency_messages):
                    a = wait(1, "lat")[0]
                    lat.append((time.monotonic_ns() - a.meta["t"]) / 1000)
                    tr.send(0, {"kind": "ack"}, None)
                row["latency_us"] = lat
            barrier(f"tput{size}")
            # -- throughput: a ring, every rank sends to rank+1 and receives from rank-1
            nxt = (rank + 1) % world
            window = 2 * tr.inflight_limit
            sent = received = 0
            send_ns = 0
            cpu0, t0 = time.process_time(), time.monotonic()
            while sent < messages or received < messages:
                while sent < messages and tr.pending() < window:
                    s0 = time.perf_counter_ns()
                    tr.send(nxt, {"kind": "tput"}, payload)
                    send_ns += time.perf_counter_ns() - s0
                    sent += 1
                for _ in take("tput", messages - received, 0.0005 if received < messages else 0):
                    received += 1
            while tr.pending():
                stash.extend(tr.poll(timeout=0.001))  # a faster peer's next-phase messages: keep them
            wall = time.monotonic() - t0
            row.update(msgs_per_s=messages / wall, cpu_us_per_msg=(time.process_time() - cpu0) / messages * 1e6,
                       send_call_us=send_ns / messages / 1000)
            out["sizes"][size] = row
        barrier("end")
    return out


app = typer.Typer(add_completion=False, pretty_exceptions_enable=False)


@app.command()
def main(
    ranks: int = typer.Option(2, help="processes to start on this machine (>= 2)"),
    sizes: str = typer.Option("4K,64K,184K,1M", help="message sizes, comma separated (0 = meta-only)"),
    messages: int = typer.Option(1000, help="messages per rank per size in the throughput phase"),
    latency_messages: Optional[int] = typer.Option(None, help="ping-pong messages per size (default: min(messages, 300))"),
    timeout: float = typer.Option(600.0, help="seconds before the whole benchmark is terminated"),
    device: str = typer.Option("cpu", help="cpu (gloo) or cuda (NCCL, rank r on cuda:r)"),
) -> None:
    """Measure the ZeroMQ + torch.distributed transport: messages/s, one-way latency, CPU per message."""
    from rich.console import Console
    from rich.table import Table

    from runtime.drivers.launch import launch_local
    if ranks < 2:
        raise UserError("--ranks must be at least 2")
    if messages < 1:
        raise UserError("--messages must be at least 1")
    if device not in ("cpu", "cuda"):
        raise UserError(f"--device {device!r}; valid: cpu, cuda")
    if device == "cuda":
        import torch
        if torch.cuda.device_count() < ranks:
            raise UserError(f"--device cuda needs one GPU per rank: {ranks} ranks, "
                            f"{torch.cuda.device_count()} GPU(s) visible")
    size_list = [_parse_size(s) for s in sizes.split(",") if s.strip()]
    n_lat = latency_messages if latency_messages is not None else min(messages, 300)
    env = {"NCCL_NVLS_ENABLE": "0"} if device == "cuda" else None
    res = launch_local(ranks, RANK_TARGET, (size_list, messages, n_lat, device), timeout=timeout, env=env)
    if not res.ok:
        raise UserError(f"transport benchmark failed: {res.first_error}")
    backend = "NCCL p2p (GPU)" if device == "cuda" else "gloo p2p"
    table = Table(title=f"transport: ZeroMQ metadata + {backend}, {ranks} ranks on this host")
    for col in ("size", "msg/s", "MB/s", "p50 us", "p99 us", "send() us", "CPU us/msg"):
        table.add_column(col, justify="right")
    for size in size_list:
        rows = [r["sizes"][size] for r in res.results]
        lat = sorted(res.results[1]["sizes"][size]["latency_us"])
        rate = statistics.mean(r["msgs_per_s"] for r in rows)
        p = lambda q: lat[min(len(lat) - 1, int(q * len(lat)))] if lat else float("nan")
        table.add_row(_label(size), f"{rate:,.0f}", f"{rate * size / 1e6:,.1f}", f"{p(0.5):,.0f}", f"{p(0.99):,.0f}",
                      f"{statistics.mean(r['send_call_us'] for r in rows):.1f}",
                      f"{statistics.mean(r['cpu_us_per_msg'] for r in rows):,.0f}")
    Console().print(table)
    typer.echo("msg/s: per stream (each rank streams to one neighbour); p50/p99: one-way latency rank 0 -> 1, "
               "one message at a time; send(): host time of the call; CPU: all threads of a rank per message "
               "sent + one received")


if __name__ == "__main__":
    from dataflow.cli import run_app
    run_app(app)
