"""runtime/executors/kv_fit.py: the KV pool is clamped to the device's free memory (or refused) before any
engine exists; the engines, their device pools and the multi-process coordinator's free-block
mirror all use the clamped count. mem_get_info is faked, so this runs on the CPU twin."""
from __future__ import annotations

import pytest

from graph_ir.errors import UserError
from lowering.plan import compile_plan
from models.weights import load_weights
from runtime.drivers.cluster import Cluster, RunOptions
from runtime.executors.torch_executor import TorchExecutor
from runtime.executors.cuda_executor import CudaExecutor
import runtime.executors.kv_fit as kv_fit
from runtime.executors.kv_fit import RUNTIME_HEADROOM_BYTES, blocks_that_fit, executor_kv_fit, kv_bytes_per_block
from test_runtime import assert_matches_reference, make_requests, model

NAME = "tiny-mixtral"


def _setup(ranks=2, block_size=4):
    spec, _, _ = model(NAME)
    plan = compile_plan(spec, ranks, attn_cap=16, block_size=block_size)
    ex = CudaExecutor(spec, load_weights(spec), plan, device="cpu")
    k_row, v_row, dtype = ex.kv_rows()
    per_block = kv_bytes_per_block(spec.num_layers, block_size, k_row, v_row, dtype)
    return spec, plan, ex, per_block


def _free_for(plan, per_block: int, blocks: int, pools: int = 1) -> int:
    """Free bytes under which exactly `blocks` pages per pool fit."""
    m = plan.memory[0]
    return RUNTIME_HEADROOM_BYTES + (m.graph_bytes + m.workspace_bytes) * pools + pools * (blocks + 1) * per_block


def test_bytes_per_block_and_fit_arithmetic():
    assert kv_bytes_per_block(3, 16, (2, 12), (2, 12), __import__("torch").float32) == 3 * 16 * 48 * 4
    assert blocks_that_fit(10_000, 1_000, 100) == 89  # 90 pages, one is the trash page
    assert blocks_that_fit(10_000, 1_000, 100, pools=2) == 44
    assert blocks_that_fit(500, 1_000, 100) == 0


def test_clamp_keeps_plenty_clamps_short_and_refuses_hopeless(capsys):
    spec, plan, ex, per_block = _setup()
    wanted = plan.kv.num_blocks[0]
    assert wanted > 10_000  # a 16 GiB CPU plan of a tiny model
    huge = lambda dev: (10 ** 15, 10 ** 15)  # noqa: E731
    assert executor_kv_fit(ex, plan, 0, wanted, mem_get_info=huge) == wanted
    short = _free_for(plan, per_block, 300)
    assert executor_kv_fit(ex, plan, 0, wanted, mem_get_info=lambda d: (short, short)) == 300
    assert "clamped" in capsys.readouterr().err
    # Two pools (in-process ranks) on one device share it.
    two = _free_for(plan, per_block, 300, pools=2)
    assert executor_kv_fit(ex, plan, 0, wanted, pools=2, mem_get_info=lambda d: (two, two)) == 300
    # Fewer pages than one max_position (512 tokens = 128 pages of 4) -> a clear UserError.
    tiny = _free_for(plan, per_block, 100)
    with pytest.raises(UserError) as err:
        executor_kv_fit(ex, plan, 0, wanted, mem_get_info=lambda d: (tiny, tiny))
    msg = str(err.value)
    assert f"plan '{spec.name}'" in msg and f"wants {wanted} pages" in msg and "only 100 fit" in msg
    assert "--device-memory" in msg and "--max-kv-tokens" in msg
    # Asking for less than the floor is fine as long as it fits.
    assert executor_kv_fit(ex, plan, 0, 64, mem_get_info=lambda d: (tiny, tiny)) == 64
    # Executors without a device pool are never clamped.
    assert executor_kv_fit(TorchExecutor(spec, load_weights(spec)), plan, 0, wanted,
                           mem_get_info=lambda d: (tiny, tiny)) == wanted


def test_the_cpu_twin_is_clamped_to_the_hosts_available_memory(monkeypatch, capsys):
    """The CUDA executor's CPU twin preallocates its pool in host memory: a plan sized for big devices (here a
    16 GiB CPU plan of a tiny model, 2 ranks) is clamped to what the host has available, shared by the plan's
    ranks, with a note; plenty of host memory keeps the plan's pool."""
    import runtime.executors.kv_fit as kv_fit
    free, total = kv_fit.host_mem_get_info()  # the real host's
    assert 0 < free <= total
    spec, plan, ex, per_block = _setup()
    wanted = plan.kv.num_blocks[0]
    monkeypatch.setattr(kv_fit, "host_mem_get_info", lambda d=None: (10 ** 15, 10 ** 15))
    assert executor_kv_fit(ex, plan, 0, wanted) == wanted
    avail = RUNTIME_HEADROOM_BYTES + 2 * (300 + 1) * per_block  # 300 pages for each of the plan's 2 ranks
    monkeypatch.setattr(kv_fit, "host_mem_get_info", lambda d=None: (avail, avail))
    assert executor_kv_fit(ex, plan, 0, wanted) == 300
    assert "clamped" in capsys.readouterr().err


def test_in_process_cluster_uses_the_clamped_pool(monkeypatch):
    """The CPU twin's pool lives in host memory: with the host's available memory faked to 150 pages for each of
    the plan's 2 ranks, both engines get 150."""
    spec, plan, ex, per_block = _setup()
    avail = RUNTIME_HEADROOM_BYTES + 2 * (150 + 1) * per_block
    monkeypatch.setattr(kv_fit, "host_mem_get_info", lambda d=None: (avail, avail))
    cl = Cluster(plan, ex, RunOptions(executor="cuda"))
    assert [e.cfg.num_blocks for e in cl.engines] == [150, 150]
    assert [e.kv.allocator.num_blocks for e in cl.engines] == [150, 150]
    assert cl.admission is not None
    reqs = make_requests(spec.vocab_size, 8, seed=7, max_new=6, max_prompt=300)
    cl.run(reqs)
    assert all(r.done for r in reqs)
    assert assert_matches_reference(NAME, reqs) > 15


def test_multi_process_ranks_and_coordinator_use_the_clamped_pool():
    """300-token prompts (77 pages each) against 130 pages per rank: one at a time per rank, the
    others wait for KV. A coordinator mirror that still believed the plan's ~10^6 pages would
    over-admit (the home then refuses: 'its free-block mirror is off'). The rank processes cannot be handed a fake
    device (the environment is read by runtime/settings.py only), so the pool is the run's `kv_blocks`; the clamp
    itself is the in-process tests' above."""
    import random

    from runtime.drivers.multiproc import run_workloads_multiprocess
    from runtime.core.requests import Request
    spec, plan, _ex, per_block = _setup()
    rng = random.Random(5)
    reqs = [Request(i, f"req-{i}", [rng.randrange(3, spec.vocab_size) for _ in range(300 if i % 2 == 0 else 250)],
                    6, ignore_eos=True, arrival=i * 1e-4) for i in range(6)]
    opts = RunOptions(policy="defrag", executor="cuda", kv_blocks=130)
    res = run_workloads_multiprocess(plan, [(reqs, opts)], timeout=80)[0]
    assert res.metrics["finished"] == len(reqs)
    assert assert_matches_reference(NAME, res.requests) > 15
