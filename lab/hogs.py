"""Co-running interference processes for benchmarks: a compute hog and an NVLink bandwidth hog.

    hog = Hog("compute", device=1).start()      # bf16 8192^3 matmuls in a loop on cuda:1
    hog = Hog("nvlink", devices=(0, 1)).start() # continuous 256 MB peer copies cuda:0 <-> cuda:1
    info = hog.stop()                           # {"kind", "iters", "seconds", "rate", ...}

Each hog is a separate Python process (its own CUDA context, as a noisy neighbour would be). `start`
waits until the child reports "ready" (allocated and one iteration done). `stop` sends SIGTERM, the
child prints its iteration count and exits; SIGKILL after a grace period. The child also exits by
itself when its parent dies (it polls getppid), and every hog still running at interpreter exit is
stopped (atexit), so no orphan keeps a GPU busy. On a machine without CUDA (`device="cpu"`) the hogs
run the same loops on small CPU tensors (smoke tests).
"""
from __future__ import annotations

import atexit
import json
import os
import signal
import subprocess
import sys
import time
from typing import Optional

_CHILD = r"""
import json, os, signal, sys, time
import torch
kind, dev_a, dev_b, mb, n, seconds_cap = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5]), float(sys.argv[6])
parent = os.getppid()
stop = [False]
signal.signal(signal.SIGTERM, lambda *a: stop.__setitem__(0, True))
torch.set_num_threads(1)
cuda = dev_a.startswith("cuda")
def sync():
    if cuda:
        torch.cuda.synchronize(dev_a)
        if dev_b.startswith("cuda"):
            torch.cuda.synchronize(dev_b)
if kind == "compute":
    dt = torch.bfloat16 if cuda else torch.float32
    a = torch.randn(n, n, device=dev_a, dtype=dt)
    b = torch.randn(n, n, device=dev_a, dtype=dt)
    c = torch.empty(n, n, device=dev_a, dtype=dt)
    def step():
        for _ in range(8):
            torch.mm(a, b, out=c)
    per_iter = 8 * 2 * n ** 3
    unit = "TFLOP/s"
elif kind == "nvlink":
    numel = mb * (1 << 20) // 2
    dt = torch.bfloat16 if cuda else torch.float32
    x0 = torch.ones(numel, device=dev_a, dtype=dt)
    x1 = torch.ones(numel, device=dev_b, dtype=dt)
    y0 = torch.empty_like(x0)
    y1 = torch.empty_like(x1)
    s0 = torch.cuda.Stream(dev_a) if cuda else None
    s1 = torch.cuda.Stream(dev_b) if cuda else None
    def step():
        if cuda:
            with torch.cuda.stream(s0):
                y1.copy_(x0, non_blocking=True)   # 0 -> 1
            with torch.cuda.stream(s1):
                y0.copy_(x1, non_blocking=True)   # 1 -> 0
            s0.synchronize(); s1.synchronize()
        else:
            y1.copy_(x0); y0.copy_(x1)
    per_iter = 2 * numel * x0.element_size()
    unit = "GB/s"
else:
    raise SystemExit(f"unknown hog kind {kind!r}")
step(); sync()
print("ready", flush=True)
iters, t0 = 0, time.perf_counter()
while not stop[0]:
    step()
    iters += 1
    if iters % 4 == 0:
        sync()
        if os.getppid() != parent or time.perf_counter() - t0 > seconds_cap:
            break
sync()
dt_s = time.perf_counter() - t0
rate = per_iter * iters / dt_s / 1e12 if unit == "TFLOP/s" else per_iter * iters / dt_s / 1e9
print(json.dumps({"kind": kind, "iters": iters, "seconds": round(dt_s, 3), "rate": round(rate, 1), "unit": unit}), flush=True)
"""

_LIVE: set = set()


class Hog:
    def __init__(self, kind: str, device: int | str = 1, devices: tuple = (0, 1), mb: int = 256, n: int = 8192,
                 ready_timeout_s: float = 60.0, max_seconds: float = 900.0, env: Optional[dict] = None) -> None:
        if kind not in ("compute", "nvlink"):
            raise ValueError(f"hog kind {kind!r}; valid: compute, nvlink")
        self.kind = kind
        dev = (lambda d: d if isinstance(d, str) else f"cuda:{d}")
        if kind == "compute":
            self.dev_a, self.dev_b = dev(device), "none"
        else:
            self.dev_a, self.dev_b = dev(devices[0]), dev(devices[1])
        self.mb, self.n = mb, n
        self.ready_timeout_s, self.max_seconds = ready_timeout_s, max_seconds
        self.env = env
        self.proc: Optional[subprocess.Popen] = None
        self.t_start = 0.0

    def start(self) -> "Hog":
        env = dict(os.environ)
        env.update({"NCCL_NVLS_ENABLE": "0", "OMP_NUM_THREADS": "1"})
        env.update(self.env or {})
        self.proc = subprocess.Popen([sys.executable, "-c", _CHILD, self.kind, self.dev_a, self.dev_b, str(self.mb),
                                      str(self.n), str(self.max_seconds)],
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
        _LIVE.add(self)
        self.t_start = time.perf_counter()
        deadline = time.monotonic() + self.ready_timeout_s
        line = ""
        while time.monotonic() < deadline:
            line = self.proc.stdout.readline()
            if line.strip() == "ready" or line == "" and self.proc.poll() is not None:
                break
        if line.strip() != "ready":
            err = self.proc.stderr.read() if self.proc.poll() is not None else "(no ready line in time)"
            self.stop()
            raise RuntimeError(f"{self.kind} hog failed to start: {err[-800:]}")
        return self

    def stop(self, grace_s: float = 10.0) -> dict:
        p = self.proc
        if p is None:
            return {"kind": self.kind, "stopped": "never started"}
        info: dict = {"kind": self.kind, "pid": p.pid}
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
            try:
                out, err = p.communicate(timeout=grace_s)
            except subprocess.TimeoutExpired:
                p.kill()
                out, err = p.communicate()
                info["killed"] = True
        else:
            out, err = p.communicate()
        for ln in (out or "").splitlines():
            if ln.startswith("{"):
                try:
                    info.update(json.loads(ln))
                except ValueError:
                    pass
        if p.returncode not in (0, None) and "iters" not in info:
            info["error"] = (err or "")[-400:]
        info["returncode"] = p.returncode
        self.proc = None
        _LIVE.discard(self)
        return info

    def __enter__(self) -> "Hog":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()


@atexit.register
def _stop_all() -> None:
    for h in list(_LIVE):
        try:
            h.stop(grace_s=3.0)
        except Exception:  # noqa: BLE001
            pass
