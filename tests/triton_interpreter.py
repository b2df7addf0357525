"""The kernels' Triton tests (tests/test_kernels*.py) without a GPU: Triton's CPU interpreter.

Triton fixes interpret mode when it is imported, and `dataflow_kernels` only imports it at the first launch, so the
`triton_device` fixture sets TRITON_INTERPRET=1 before that. If some earlier test already imported triton in
compiled mode, the fixture skips and each kernels test file re-runs its Triton tests in a subprocess
(`run_triton_tests_in_subprocess`, the last test of the file)."""
from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

HAS_TRITON = importlib.util.find_spec("triton") is not None
DTYPES = [torch.float32, torch.bfloat16]


def interpreter_blocked() -> bool:
    """True when triton was imported in compiled mode before we could ask for the interpreter."""
    return not torch.cuda.is_available() and "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1"


@pytest.fixture(scope="module")
def triton_device() -> str:
    if not HAS_TRITON:
        pytest.skip("triton is not importable: only the torch references are tested")
    if torch.cuda.is_available():
        return "cuda"
    if interpreter_blocked():
        pytest.skip("triton was imported without TRITON_INTERPRET=1 earlier in this process; "
                    "test_triton_kernels_in_subprocess runs these tests instead")
    os.environ["TRITON_INTERPRET"] = "1"  # before triton's first import (it happens at first launch)
    return "cpu"


def gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def run_triton_tests_in_subprocess(test_file: str) -> None:
    """Fallback when triton was imported in compiled mode before `test_file` could ask for the interpreter (see
    above): run that file's Triton tests in a fresh interpreter."""
    if not HAS_TRITON or not interpreter_blocked():
        pytest.skip("not needed: the Triton tests ran in this process")
    env = dict(os.environ, TRITON_INTERPRET="1")
    result = subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", test_file, "-k", "triton and not subprocess"],
        env=env, capture_output=True, text=True, timeout=240,
    )
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-2000:]
