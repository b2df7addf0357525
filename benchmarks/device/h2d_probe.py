"""Does a host->device copy from pageable memory wait for the work already queued on the stream?
Host time of `torch.from_numpy(a).to("cuda")` right after queueing a ~3 ms GPU sleep, against the same
copy from pinned memory with non_blocking=True, for index-array sizes the engine ships per message.
If the pageable copy's host time is ~3 ms, every such copy on the hot path serializes host and GPU."""
import time

import numpy as np
import torch

dev = torch.device("cuda")
torch.cuda._sleep(1000)
torch.cuda.synchronize()
# calibrate: cycles for ~3 ms
t = time.perf_counter(); torch.cuda._sleep(10_000_000); torch.cuda.synchronize(); dt = time.perf_counter() - t
cycles = int(10_000_000 * 3e-3 / dt)
print(f"_sleep: {dt * 1e3:.2f} ms per 1e7 cycles -> {cycles} cycles for 3 ms")
for n in (64, 512, 8192, 131072):
    a = np.arange(n, dtype=np.int64)
    pin = torch.empty(n, dtype=torch.int64, pin_memory=True)
    for name, fn in (("pageable .to(cuda)", lambda: torch.from_numpy(a).to(dev)),
                     ("pinned non_blocking", lambda: (pin.numpy().__setitem__(slice(None), a), pin.to(dev, non_blocking=True))[1]),
                     ("torch.tensor(list, device)", lambda: torch.tensor(a[:64].tolist(), device=dev)),
                     ("idle stream: pageable", None)):
        ts = []
        for _ in range(20):
            torch.cuda.synchronize()
            if fn is None:
                t = time.perf_counter(); torch.from_numpy(a).to(dev); ts.append(time.perf_counter() - t)
                continue
            torch.cuda._sleep(cycles)
            t = time.perf_counter(); fn(); ts.append(time.perf_counter() - t)
        ts.sort()
        print(f"{n * 8:>8} B  {name:<28} host us median {ts[10] * 1e6:8.1f}  max {ts[-1] * 1e6:8.1f}")
torch.cuda.synchronize()
