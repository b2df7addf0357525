"""Launching a compiled Triton kernel again without the JIT's per-call argument binding.

Each `kernel[grid](*args)` has Triton bind the arguments, derive their specialization (dtypes, 16-byte alignment,
integer ranges), build a cache key from it and the options, and only then launch: 16.5-18.3 us of host on the H200
machines, where calling the CompiledKernel's `run` directly takes 6.9-7.3 (benchmarks/triton_launch_bench.py, runs
102-103). Outside a CUDA graph that is paid per launch: the merge of a device-routed layer's partial sums
(kernels/topk_merge.py) runs twice per layer and rank on the streaming hot path. Measured through this file (run
103): 14.7 us per launch, the key of the arguments being 3.2 of it (benchmarks/NOTES.md §30 item 2).

`FastLauncher` keeps, per (grid-independent) key of the arguments, the CompiledKernel the JIT returned the first
time, and launches it directly after that. The key holds everything Triton specializes on, at least as finely:
a tensor's dtype and whether its address is 16-byte aligned; an integer's range (i32 / i64 / u64), whether it is 1
and whether it is a multiple of 16; a bool, None or constexpr value itself; the keyword arguments (constexprs and
options such as num_warps) as given. Two calls with the same key therefore get the same compiled kernel from the JIT
too. Anything else (an argument type the key does not know, Triton's launch hooks being set, the CPU interpreter)
goes through the JIT as before, and so does every launch with DATAFLOW_TRITON_LAUNCH=jit (the A/B switch; the
default is "direct").
"""
from __future__ import annotations

import os
from typing import Any, Optional

import torch

_I32 = (-2 ** 31, 2 ** 31)
_U64 = 2 ** 63


def arg_key(a: Any) -> Any:
    """The part of Triton's specialization that one argument can change (None: not keyable here)."""
    t = type(a)
    if t is torch.Tensor or isinstance(a, torch.Tensor):
        return (a.dtype, a.data_ptr() % 16 == 0)
    if a is None or t is bool or t is float:
        return (t, a) if t is not float else float
    if t is int:
        return (int, a == 1, a % 16 == 0, _I32[0] <= a < _I32[1], a < _U64)
    return None


class FastLauncher:
    """Direct launches of one jitted kernel's compiled variants (see the module doc). One per LazyJit."""

    def __init__(self, jit: Any) -> None:
        self.jit = jit
        self._compiled: dict = {}  # key -> (CompiledKernel, constexpr tail) or None (this key goes through the JIT)
        self._runtime = _runtime_api()

    def __call__(self, grid: tuple, args: tuple, meta: dict) -> None:
        rt = self._runtime
        keys = tuple(map(arg_key, args))
        hit = None
        if rt is not None and None not in keys and type(grid) is tuple:
            key = (keys, tuple(meta.items()))
            hit = self._compiled.get(key, False)
            if hit is False:  # first time: the JIT compiles (or finds) the variant and launches it
                compiled = self.jit[grid](*args, **meta)
                self._compiled[key] = self._entry(compiled, len(args), meta)
                return
        if hit is None or rt.hooked():
            self.jit[grid](*args, **meta)
            return
        compiled, tail = hit
        bound = args + tail
        stream = rt.stream()
        compiled.run(grid[0], grid[1] if len(grid) > 1 else 1, grid[2] if len(grid) > 2 else 1, stream,
                     compiled.function, compiled.packed_metadata, compiled.launch_metadata(grid, stream, *bound),
                     rt.enter_hook(), rt.exit_hook(), *bound)

    def _entry(self, compiled: Any, npos: int, meta: dict) -> Optional[tuple]:
        """(compiled, the keyword parameters' values in signature order) when the signature is the positional
        arguments followed by exactly the keyword parameters given (then the launcher's argument list is
        args + tail, as the JIT passes it); None otherwise."""
        names = list(self.jit.arg_names)
        rest = names[npos:]
        if compiled is None or not set(rest) <= set(meta) or any(n in meta for n in names[:npos]):
            return None
        return compiled, tuple(meta[n] for n in rest)


class _RuntimeApi:
    """The few Triton runtime entry points a direct launch needs (they moved between Triton versions)."""

    def __init__(self, driver: Any, knobs: Any) -> None:
        self._driver, self._knobs = driver, knobs

    def stream(self) -> Any:
        d = self._driver.active
        return d.get_current_stream(d.get_current_device())

    def enter_hook(self) -> Any:
        return self._knobs.runtime.launch_enter_hook

    def exit_hook(self) -> Any:
        return self._knobs.runtime.launch_exit_hook

    def hooked(self) -> bool:
        """A profiler's launch hooks are set: leave launches to the JIT, which also feeds them metadata."""
        hook = self._knobs.runtime.launch_enter_hook
        return hook is not None and bool(getattr(hook, "calls", True))


def _runtime_api() -> Optional[_RuntimeApi]:
    """None with DATAFLOW_TRITON_LAUNCH=jit, under the CPU interpreter, or where the entry points are not where this
    file expects them."""
    from kernels.dispatch import interpreting
    mode = os.environ.get("DATAFLOW_TRITON_LAUNCH", "direct").strip().lower() or "direct"
    if mode not in ("direct", "jit"):
        raise ValueError(f"DATAFLOW_TRITON_LAUNCH={mode!r}: expected direct or jit")
    if mode == "jit" or interpreting():
        return None
    try:
        from triton import knobs
        from triton.runtime.driver import driver
    except Exception:  # an older Triton: the JIT path only
        return None
    return _RuntimeApi(driver, knobs)
