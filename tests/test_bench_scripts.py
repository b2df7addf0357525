"""The CPU-runnable measurement scripts under benchmarks/ still run (they are how host-path changes are priced:
benchmarks/NOTES.md §19-20), with their outputs' shape checked, not their timings."""
from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "benchmarks"))


def test_engine_overhead_times_and_counts_every_batch_kind():
    import engine_overhead as eo
    timed = eo.run(16, 16, 2)
    counted = eo.run(16, 16, 2, count_calls=True)
    kinds = {k.split(":")[0].split("@")[0] for k in timed}
    assert kinds == {"attn", "expert", "recv", "sample"}
    assert set(counted) == set(timed)
    assert all(host >= eng >= 0 for host, eng, _ in timed.values())
    assert counted["attn:16@r0"][1] > 0  # the engine makes torch calls per attention batch; the count sees them
    assert eo.CALLS is not None and eo.CALLS.paused == 0  # every executor call un-paused the counter


def test_host_speed_prices_the_cpu_building_blocks():
    import host_speed
    rows = host_speed.cpu_rows(3)
    assert len(rows) >= 6 and all(us > 0 for _, us in rows)
