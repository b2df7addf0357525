"""Decode rows behind a flood of long prompts (the engine's decode-wait bound, Engine.decode_wait_bound), on the
virtual clock with the simulated executor (benchmarks/prefill_flood_sim.py, smaller): with the bound a token waits at
most about the bound per stage behind prompt work; without it the default policy (defrag) runs the prompts queued
at a layer first and a decoding request waits for all of them."""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
from prefill_flood_sim import flood  # noqa: E402

torch.set_num_threads(1)
LOAD = dict(requests=40, initial=16, rate=40.0, prompt=(2048, 8192), new=(16, 32), layers=4)


@pytest.mark.parametrize("ranks", [1, 2])
def test_prompt_batches_yield_to_overdue_decode_rows(ranks):
    """On two ranks the expert rows of a batch with decode rows cross the wire flagged (meta "d"): without the flag
    the holder queues them behind prompt rows (ITL max 143 ms here instead of 20)."""
    bound_ms = 2.0
    on = flood("defrag", bound_ms, ranks=ranks, **LOAD)
    off = flood("defrag", 0, ranks=ranks, **LOAD)
    assert on["tokens"] == off["tokens"] == on["wanted"]  # every request got all its tokens
    stages = 2 * LOAD["layers"] + 1
    limit = stages * bound_ms * 1e-3 + 3e-3  # + a few batch times (the batch that runs when the bound is reached)
    assert on["yields"] > 0
    assert on["itl_max"] < limit, on
    assert off["yields"] == 0 and off["itl_max"] > 3 * limit, off  # the stall the bound removes is there without it
    # what it costs the prompts here: TTFT p50 within 2%, the last token within 5%
    assert on["ttft50"] <= off["ttft50"] * 1.02 and on["end"] <= off["end"] * 1.05


def test_the_bound_is_the_decode_wait_option(use_options):
    """The engine's bound is the decode_wait_ms option, in seconds; a negative one is refused naming the field."""
    from graph_ir.errors import UserError
    from runtime.core.clock import VirtualClock
    from runtime.core.engine import Engine, EngineConfig, StageInfo
    from runtime.executors.sim_executor import SimExecutor
    from runtime.transport.inproc import InprocHub

    stages = [StageInfo(0, "attn", 0, 1, 64), StageInfo(1, "expert", 0, 2, 256), StageInfo(2, "sample", -1, 0, 64)]
    cfg = EngineConfig(rank=0, world_size=1, num_layers=1, top_k=2, stages=stages, expert_rank=[[0] * 4],
                       block_size=16, num_blocks=64)

    def bound() -> float:
        clock = VirtualClock()
        return Engine(cfg, SimExecutor(4, 2, 32), InprocHub(1, clock).transports()[0], clock).decode_wait_bound

    assert bound() == pytest.approx(2e-3)
    use_options(decode_wait_ms=7.5)
    assert bound() == pytest.approx(7.5e-3)
    with pytest.raises(UserError, match="decode_wait_ms=-1"):
        use_options(decode_wait_ms=-1)
