"""Choosing between the torch reference and the Triton version of a kernel.

Every op in `kernels/` exists twice with the same signature: a torch reference (readable, runs
anywhere, the thing tests trust) and a Triton kernel (fast on the GPU). `backend_for` decides
which one a call runs:

- `torch`  always the reference.
- `triton` always Triton, also on CPU tensors. That only works under `TRITON_INTERPRET=1`
  (Triton's CPU interpreter), which is how the tests exercise the kernels on a machine without a GPU.
- `auto` (default) Triton when every tensor is on CUDA and Triton imports, else torch.

The choice is the runtime's `kernels` option (runtime/settings.py), installed here by `use_backend`.

Triton decides between compiling and interpreting when it is imported (its standard library is
jitted at import) and when `triton.jit` runs, not when a kernel is launched. So nothing in
`kernels/` imports triton at module import: kernel bodies are plain functions (annotations stay
strings thanks to `from __future__ import annotations`) wrapped in `LazyJit`, which imports triton
and applies `triton.jit` at the first launch. Importing `kernels` (as the runtime does) therefore
never fixes the mode; a test only has to set `TRITON_INTERPRET=1` before its first launch.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

import torch

_CHOICES = ("auto", "torch", "triton")


@functools.cache
def triton_available() -> bool:
    """True when `import triton` works (it does not say a GPU exists)."""
    try:
        import triton  # noqa: F401
        import triton.language  # noqa: F401
    except Exception:  # a broken install raises more than ImportError
        return False
    return True


def interpreting() -> bool:
    """True when Triton kernels run in the CPU interpreter (TRITON_INTERPRET=1, read by Triton's own knobs).

    Kernels use this to upcast bf16/fp16 tiles to fp32 before `tl.dot`: the interpreter's
    low-precision dot gives wrong results, while fp32 is exact enough to compare to torch.
    """
    if not triton_available():
        return False
    import triton.knobs

    return bool(triton.knobs.runtime.interpret)


def kernel_store_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype a Triton kernel should store a result of `dtype` in.

    The interpreter's fp32 -> bf16/fp16 conversion truncates (even with
    fp_downcast_rounding="rtne" about half of random values come out one ulp off), whereas the
    GPU and torch round to nearest even. Under the interpreter, kernels therefore store fp32 and
    the wrapper rounds with torch (`tensor.to(dtype)`), which is what the GPU kernel does in its
    store. Upcasts bf16 -> fp32 in the interpreter are exact and need no workaround.
    """
    if interpreting() and dtype in (torch.bfloat16, torch.float16):
        return torch.float32
    return dtype


_backend = "auto"


def use_backend(choice: str) -> None:
    """Set which version every kernel call runs (the runtime's `kernels` option)."""
    global _backend
    if choice not in _CHOICES:
        raise ValueError(f"kernels={choice!r}: expected one of {', '.join(_CHOICES)}")
    _backend = choice


def backend_for(*tensors: torch.Tensor | None) -> str:
    """"triton" or "torch" for a call over these tensors (None entries are ignored)."""
    choice = _backend
    present = [t for t in tensors if t is not None]
    if choice == "torch":
        return "torch"
    if choice == "triton":
        if not triton_available():
            raise RuntimeError("kernels=triton but triton cannot be imported")
        if not all(t.is_cuda for t in present) and not interpreting():
            raise RuntimeError(
                "kernels=triton with CPU tensors needs TRITON_INTERPRET=1 "
                "(set before the first kernel launch)"
            )
        return "triton"
    if present and all(t.is_cuda for t in present) and triton_available():
        return "triton"
    return "torch"


class LazyJit:
    """A Triton kernel that is only `triton.jit`-ed at its first launch (see module docstring).

    Use exactly like a jitted kernel: `KERNEL[grid](*args, **meta)`. The wrapped function must be
    a module-level function whose body is Triton code referring to `tl` (triton.language); any
    device function it calls must be listed in `helpers`. Its module must not import triton itself: `tl` is
    bound into the module's globals here, at the first launch.
    """

    def __init__(self, fn: Callable[..., Any], helpers: tuple[Callable[..., Any], ...] = (), **jit_kwargs: Any):
        # helpers: module-level Triton device functions the kernel calls; they are jitted and
        # bound under their own names in their module before the kernel is jitted.
        # jit_kwargs: passed to triton.jit (e.g. do_not_specialize: one compile for every value of an int).
        self.fn = fn
        self.helpers = helpers
        self.jit_kwargs = jit_kwargs
        self._jitted: Any = None
        functools.update_wrapper(self, fn)

    def _get(self) -> Any:
        if self._jitted is None:
            import triton
            import triton.language as tl

            for helper in self.helpers:
                helper.__globals__["tl"] = tl
                if helper.__globals__.get(helper.__name__) is helper:  # not yet jitted
                    helper.__globals__[helper.__name__] = triton.jit(helper)
            self.fn.__globals__["tl"] = tl
            self._jitted = triton.jit(self.fn, **self.jit_kwargs)
        return self._jitted

    def __getitem__(self, grid: Any) -> Any:
        return self._get()[grid]


def cdiv(a: int, b: int) -> int:
    """ceil(a / b) for the host-side grid arithmetic (same as triton.cdiv, without importing it)."""
    return -(-a // b)


def next_power_of_2(n: int) -> int:
    """Smallest power of two >= n (>= 1): Triton block shapes must be powers of two."""
    return 1 if n <= 1 else 1 << (n - 1).bit_length()
