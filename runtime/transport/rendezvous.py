"""Rendezvous through torch.distributed's TCPStore: process group init and ZeroMQ endpoint exchange.

Like torchrun: rank 0 hosts a TCPStore at MASTER_ADDR:MASTER_PORT, every rank connects to it. We use
the store for three things only: (1) an arrival check before `init_process_group`, so a missing rank is
reported by number instead of as an anonymous timeout, (2) publishing each rank's ZeroMQ PULL
endpoint so peers can connect to it, and (3) under torchrun without DATAFLOW_RUN_SECRET, handing out
the run's frame-signing secret (runtime/transport/wire.py). No hand-made registry.

Listening addresses. The store listens on MASTER_ADDR only (a socket bound there is handed to
TCPStore, whose own default is every interface), so the single-host default (MASTER_ADDR=127.0.0.1,
as `dataflow run` sets it) is reachable from this host alone; ZeroMQ endpoints bind to the address of
the route towards the master (loopback on one host). `listening()` lists both for the run summary.

Every wait has a deadline and names the ranks it is still missing.
"""
from __future__ import annotations

import ipaddress
import socket
import time
from datetime import timedelta
from typing import Optional

import torch.distributed as dist

from runtime import settings

DEFAULT_TIMEOUT_S = 60.0
# Group timeout for torch.distributed work: liveness is the heartbeat's job (runtime/transport/health.py), and
# an expired gloo wait poisons the group, so this only bounds truly lost operations.
WORK_TIMEOUT = timedelta(minutes=30)

_store: Optional[dist.Store] = None


def is_loopback(addr: str) -> bool:
    try:
        return ipaddress.ip_address(socket.gethostbyname(addr)).is_loopback
    except (OSError, ValueError):
        return addr == "localhost"


def host_address(master_addr: str, master_port: int) -> str:
    """The address peers can reach this host on: loopback for single-host runs, otherwise the local
    address of the route towards the master (a UDP connect sends nothing, it only picks the route)."""
    if is_loopback(master_addr):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((master_addr, master_port))
        return s.getsockname()[0]


def _listen_socket(addr: str, port: int) -> Optional[socket.socket]:
    """A TCP socket listening on `addr`:`port` only, for rank 0's store; None when `addr` is not an address of
    this host (then TCPStore binds as it does by default)."""
    try:
        ip = socket.gethostbyname(addr)
        sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    except OSError:
        return None
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((ip, port))
        sock.listen(1024)
        return sock
    except OSError:
        sock.close()
        return None


_listening: list[str] = []
_store_sockets: list[socket.socket] = []


def listening() -> list[str]:
    """Addresses this process listens on for the run (store, ZeroMQ), for the run summary."""
    return list(_listening)


def make_store(rank: int, world_size: int, timeout_s: float) -> dist.TCPStore:
    """Rank 0 hosts the store, the others connect (MASTER_ADDR/MASTER_PORT of the launch environment)."""
    launch = settings.launch_environment()
    addr, port = launch.master_addr, int(launch.master_port)
    sock = _listen_socket(addr, port) if rank == 0 else None
    try:
        kwargs = {"master_listen_fd": sock.fileno()} if sock is not None else {}
        store = dist.TCPStore(addr, port, world_size, is_master=(rank == 0),
                              timeout=timedelta(seconds=timeout_s), wait_for_workers=False, **kwargs)
        if rank == 0:
            bound = sock.getsockname()[0] if sock is not None else "*"
            _listening.append(f"store tcp://{bound}:{port}")
            _store_sockets.append(sock)  # the store uses its fd: the socket object must outlive it
        return store
    except Exception as err:
        if sock is not None:
            sock.close()
        who = "host the store on" if rank == 0 else "reach rank 0's store at"
        raise RuntimeError(f"rendezvous: rank {rank} could not {who} {addr}:{port} within {timeout_s:g} s: {err}") from err


def wait_keys(store: dist.Store, keys: dict[int, str], timeout_s: float, what: str) -> None:
    """Wait until every key exists; on timeout name the ranks whose key is missing."""
    deadline = time.monotonic() + timeout_s
    missing = dict(keys)
    delay = 0.001
    while missing:
        missing = {r: k for r, k in missing.items() if not store.check([k])}
        if not missing:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"rendezvous: waited {timeout_s:g} s for {what} of rank(s) {sorted(missing)}; "
                               f"they never arrived (crashed before starting, or wrong MASTER_ADDR/PORT?)")
        time.sleep(delay)
        delay = min(delay * 2, 0.05)


def init_distributed(rank: int, world_size: int, backend: str = "gloo") -> dist.Store:
    """Join the run: check every rank arrived (naming the missing ones), then init the default process
    group on the same store. Returns the store; transports built later in this process reuse it."""
    global _store
    store = make_store(rank, world_size, DEFAULT_TIMEOUT_S)
    store.set(f"dataflow/arrived/{rank}", "1")
    wait_keys(store, {r: f"dataflow/arrived/{r}" for r in range(world_size)}, DEFAULT_TIMEOUT_S, "arrival")
    if not dist.is_initialized():
        dist.init_process_group(backend, store=store, rank=rank, world_size=world_size, timeout=WORK_TIMEOUT)
    _store = store
    return store


def current_store() -> dist.Store:
    if _store is None:
        raise RuntimeError("init_distributed() must run before a distributed transport is created")
    return _store


def run_secret(store: dist.Store, rank: int, timeout_s: float = DEFAULT_TIMEOUT_S) -> bytes:
    """The run's frame-signing secret: DATAFLOW_RUN_SECRET (hex; `dataflow run`'s launcher creates one per run
    and hands it to its ranks in their environment), else one rank 0 makes and hands out through the store
    (under torchrun: whoever can reach the store can read it, so set DATAFLOW_RUN_SECRET on every node of a
    multi-host run, e.g. `export DATAFLOW_RUN_SECRET=$(openssl rand -hex 32)`)."""
    from runtime.transport.wire import new_secret
    env = settings.run_secret_hex()
    if env:
        try:
            secret = bytes.fromhex(env)
        except ValueError:
            raise ValueError("DATAFLOW_RUN_SECRET must be hex digits (e.g. `openssl rand -hex 32`)") from None
        if len(secret) < 16:
            raise ValueError(f"DATAFLOW_RUN_SECRET has {len(secret)} bytes; at least 16 are needed")
        return secret
    key = "dataflow/run-secret"
    if rank == 0 and not store.check([key]):
        store.set(key, new_secret().hex())
    wait_keys(store, {0: key}, timeout_s, "the run secret")
    return bytes.fromhex(store.get(key).decode())


def exchange_endpoints(store: dist.Store, namespace: str, rank: int, world_size: int, endpoint: str,
                       timeout_s: float = DEFAULT_TIMEOUT_S) -> list[str]:
    """Publish this rank's endpoint under `namespace` and return every rank's, in rank order."""
    keys = {r: f"dataflow/{namespace}/endpoint/{r}" for r in range(world_size)}
    store.set(keys[rank], endpoint)
    _listening.append(f"zmq {endpoint}")
    wait_keys(store, keys, timeout_s, f"the {namespace} endpoint")
    return [store.get(keys[r]).decode() for r in range(world_size)]
