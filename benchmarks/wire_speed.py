"""Host cost of one metadata frame, encode + decode, side by side in one run: the authenticated msgpack frame
(runtime/transport/wire.py) against the pickled tuple the transport sent before it (which ran code from any
frame). The engine sends one frame per destination per batch, so this is per-message host time of the
metadata phase; the tensor phase is unchanged.

    python benchmarks/wire_speed.py [--n 200000]
"""
from __future__ import annotations

import argparse
import pickle
import time

import numpy as np

from runtime.transport.wire import DATA, Codec


def per_call_us(fn, n: int) -> float:
    for _ in range(min(n, 1000)):
        fn()
    t0 = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - t0) / n * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--n", type=int, default=200_000)
    n = ap.parse_args().n
    tx, rx = Codec(bytes(32), 1, 2), Codec(bytes(32), 0, 2)
    cases = {
        "expert-in (run tags, 40 ids)": ({"t": "x", "layer": 3, "home": 1, "rows": (1234, 40), "e": bytes(40),
                                          "more": 3.5, "d": 1}, (40, 2880), "bfloat16"),
        "expert-out (400 scattered tags)": ({"t": "y", "layer": 3, "rows": np.arange(0, 800, 2, dtype=np.int64)},
                                            (400, 2880), "bfloat16"),
        "heartbeat": ({"p": 123456, "w": 789, "k": 4567, "q": 12}, None, None),
    }
    print(f"{'message':<34}{'pickle us':>10}{'wire us':>10}{'ratio':>8}{'bytes (pickle / wire)':>24}")
    for name, (meta, shape, dtype) in cases.items():
        old = lambda: pickle.loads(pickle.dumps((DATA, 1, 7, meta, shape, dtype), protocol=5))  # noqa: E731
        new = lambda: rx.decode(tx.encode(DATA, 7, meta, shape, dtype))  # noqa: E731
        a, b = per_call_us(old, n), per_call_us(new, n)
        size_old = len(pickle.dumps((DATA, 1, 7, meta, shape, dtype), protocol=5))
        size_new = len(tx.encode(DATA, 7, meta, shape, dtype))
        print(f"{name:<34}{a:>10.2f}{b:>10.2f}{b / a:>8.2f}{f'{size_old} / {size_new}':>24}")


if __name__ == "__main__":
    main()
