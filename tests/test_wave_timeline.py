"""benchmarks/wave_timeline.py: a home's layer round trip split from the probe's timeline (gpu_ep_bench --timeline).
A hand-made timeline with known legs, and the real path: the EP bench's CPU smoke (2 gloo rank processes) writing
timelines that the analysis follows."""
from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("wave_timeline", ROOT / "benchmarks/wave_timeline.py")
wt = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(wt)


def _leg(text: str, name: str) -> float:
    m = re.search(rf"^  {re.escape(name)}\s+(-?\d+)", text, re.M)
    assert m, f"{name!r} not in:\n{text}"
    return float(m.group(1))


def test_legs_of_a_hand_made_wave():
    """Home 0's attention at t=0 (1 ms host, device end at 0.8 ms); its payload handed to rank 1 at 1.5 ms; rank 1
    runs its own wave's expert batch first (1.6-2.0), then home 0's (2.0-3.0, device end 2.9); the partial sums
    handed to home 0 at 3.5; home 0's own expert 1.2-1.7; its next attention at 4.0 ms."""
    ms = 1e-3
    r0 = [["attn", 3, [0], 8, 0.0, 1 * ms, 0.1 * ms, 0.8 * ms, None],
          ["expert", 3, [0], 8, 1.2 * ms, 0.5 * ms, 1.3 * ms, 1.6 * ms, None],
          ["msg", 3, [-1], "y", 3.5 * ms, 0.1 * ms, None, None, 1],
          ["attn", 4, [0], 8, 4.0 * ms, 1 * ms, None, None, None]]
    r1 = [["msg", 3, [0], "r", 1.5 * ms, 0.05 * ms, None, None, 0],
          ["expert", 3, [1], 8, 1.6 * ms, 0.4 * ms, None, None, None],
          ["expert", 3, [0], 8, 2.0 * ms, 1 * ms, 2.1 * ms, 2.9 * ms, None]]
    text = wt.analyze([r0, r1])
    assert "waves followed: 1;" in text
    for name, us in (("attn host", 1000), ("attn device", 800), ("to holder", 500), ("holder queue", 500),
                     ("holder expert", 1000), ("holder expert device", 900), ("back", 500), ("home tail", 500),
                     ("cycle", 4000), ("home's own expert start", 200), ("home's own expert", 500)):
        assert _leg(text, name) == us, name
    assert "holder ran its own wave first 1" in text
    assert "host us, median per: attn 1000, expert 500, msg y 100" in text  # rank 0
    assert "host us, median per: expert 700, msg r 50" in text  # rank 1: its two expert batches, 400 and 1000
    assert "sum of the legs' medians       4000" in text


def test_ep_bench_smoke_writes_timelines_the_analysis_follows(tmp_path):
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu_ep_bench.py"), "--out", str(tmp_path), "--smoke",
                          "--systems", "streaming-defrag:hold_fill=1;hold_us=30000", "--scenarios", "clean", "--timeline"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    files = sorted(tmp_path.glob("timeline_*.json"))
    assert files, list(tmp_path.iterdir())
    d = json.loads(files[-1].read_text())
    assert len(d["ranks"]) == 2 and all(d["ranks"])
    kinds = {x[0] for r in d["ranks"] for x in r}
    assert {"attn", "expert", "msg"} <= kinds
    text = wt.analyze(d["ranks"])
    n = int(re.search(r"waves followed: (\d+)", text).group(1))
    assert n > 0, text
    assert _leg(text, "cycle") >= _leg(text, "attn host") > 0
    # without --timeline: no timeline files, the bench as before
    run = subprocess.run([sys.executable, str(ROOT / "benchmarks/gpu_ep_bench.py"), "--out", str(tmp_path / "off"),
                          "--smoke", "--systems", "streaming-defrag", "--scenarios", "clean", "--concurrency", "4"],
                         cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert not list((tmp_path / "off").glob("timeline_*.json"))
