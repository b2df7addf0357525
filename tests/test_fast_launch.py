"""kernels/fast_launch.py: which launches may skip the JIT's binding, and that a direct launch computes what the JIT's
does (on a GPU; the CPU checks drive the launcher's decisions with a recording stand-in for Triton's objects)."""
from __future__ import annotations

import pytest
import torch

from kernels import fast_launch
from kernels.fast_launch import FastLauncher, arg_key


def test_arg_key_separates_what_triton_specializes_on():
    x = torch.zeros(16, dtype=torch.float32)
    assert arg_key(x) == arg_key(torch.ones(16, dtype=torch.float32))  # same dtype, both aligned
    assert arg_key(x) != arg_key(x.to(torch.bfloat16))
    assert arg_key(x[1:]) != arg_key(x)  # 4 bytes off: not 16-byte aligned
    assert arg_key(x[4:]) == arg_key(x)  # 16 bytes off: aligned
    assert arg_key(1) != arg_key(2) and arg_key(16) != arg_key(17) and arg_key(17) == arg_key(33)
    assert arg_key(2 ** 31) != arg_key(2 ** 31 - 16)  # i64 against i32
    assert arg_key(True) != arg_key(1) and arg_key(True) != arg_key(False) and arg_key(None) == arg_key(None)
    assert arg_key(0.5) == arg_key(2.0)
    assert arg_key("a string") is None  # not keyable: the JIT decides


class _Compiled:
    function, packed_metadata = "fn", "meta"

    def __init__(self, log):
        self.log = log

    def launch_metadata(self, grid, stream, *args):
        return None

    def run(self, g0, g1, g2, stream, function, packed, launch_meta, enter, exit_, *args):
        self.log.append(("direct", (g0, g1, g2), args))


class _Jit:
    """Records launches; returns one compiled stand-in per distinct call, as the JIT returns its CompiledKernel."""
    arg_names = ["a", "n", "K", "BLOCK"]

    def __init__(self):
        self.log = []

    def __getitem__(self, grid):
        def launch(*args, **meta):
            self.log.append(("jit", grid, args))
            return _Compiled(self.log)
        return launch


class _Rt:
    def __init__(self):
        self.hook = None

    def stream(self):
        return 0

    def enter_hook(self):
        return None

    def exit_hook(self):
        return None

    def hooked(self):
        return self.hook is not None


def _launcher():
    jit = _Jit()
    f = FastLauncher(jit)
    f._runtime = _Rt()
    return f, jit.log


def test_second_launch_of_a_key_is_direct_with_the_constexprs_appended():
    f, log = _launcher()
    t = torch.zeros(8)
    f((4,), (t, 64), {"K": 2, "BLOCK": 128, "num_warps": 4})
    f((8, 2), (t, 96), {"K": 2, "BLOCK": 128, "num_warps": 4})  # same key (96 and 64: multiples of 16, i32)
    assert [e[0] for e in log] == ["jit", "direct"]
    assert log[1][1] == (8, 2, 1) and log[1][2] == (t, 96, 2, 128)


def test_a_new_specialization_or_option_goes_through_the_jit():
    f, log = _launcher()
    t = torch.zeros(8)
    meta = {"K": 2, "BLOCK": 128}
    f((1,), (t, 64), meta)
    f((1,), (t[1:], 64), meta)  # misaligned
    f((1,), (t, 65), meta)  # not a multiple of 16
    f((1,), (t, 64), {"K": 3, "BLOCK": 128})  # another constexpr
    f((1,), (t.double(), 64), meta)  # another dtype
    assert [e[0] for e in log] == ["jit"] * 5
    f((1,), (t, 64), meta)
    assert log[-1][0] == "direct"


def test_unkeyable_arguments_hooks_and_odd_signatures_stay_on_the_jit():
    f, log = _launcher()
    t = torch.zeros(8)
    f((1,), (t, "x"), {"K": 2, "BLOCK": 1})
    f((1,), (t, "x"), {"K": 2, "BLOCK": 1})
    f((1,), (t,), {"K": 2, "BLOCK": 1})  # `n` left to a default: args + the keywords are not the signature
    f((1,), (t,), {"K": 2, "BLOCK": 1})
    assert [e[0] for e in log] == ["jit"] * 4
    f((1,), (t, 16), {"K": 2, "BLOCK": 1})
    f._runtime.hook = object()  # a profiler's launch hook: the JIT feeds it
    f((1,), (t, 16), {"K": 2, "BLOCK": 1})
    assert [e[0] for e in log[4:]] == ["jit", "jit"]


def test_interpreter_and_the_jit_switch_disable_direct_launches(monkeypatch):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    assert fast_launch._runtime_api() is None
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    monkeypatch.setenv("DATAFLOW_TRITON_LAUNCH", "jit")
    assert fast_launch._runtime_api() is None
    monkeypatch.setenv("DATAFLOW_TRITON_LAUNCH", "fast")
    with pytest.raises(ValueError, match="DATAFLOW_TRITON_LAUNCH='fast': expected direct or jit"):
        fast_launch._runtime_api()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a direct launch needs a GPU")
def test_direct_launches_compute_what_the_jit_does_on_the_gpu():
    from kernels.topk_merge import _TOPK_MERGE, topk_merge, topk_merge_torch
    dev = torch.device("cuda")
    g = torch.Generator(device="cpu").manual_seed(0)
    for dtype in (torch.float32, torch.bfloat16):
        flat = torch.randn(3 * 64 * 96 + 1, generator=g).to(dev, dtype)
        for off in (0, 1, 0, 1):  # off 1: every operand one element off 16-byte alignment; the repeats launch directly
            h, sh, rows = (flat[off + i * 64 * 96:off + (i + 1) * 64 * 96].view(64, 96) for i in range(3))
            ri = torch.randint(0, 64, (64, 4), generator=g).to(dev)
            w = torch.rand(64, 4, generator=g).to(dev)
            assert torch.equal(topk_merge(h, sh, rows, ri, w), topk_merge_torch(h, sh, rows, ri, w))
    assert sum(v is not None for v in _TOPK_MERGE._fast._compiled.values()) >= 2
