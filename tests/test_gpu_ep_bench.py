"""benchmarks/gpu_ep_bench.py's A/B bookkeeping (pure functions; the bench itself runs on the GPU box and
in its --smoke mode): environment variants, round labels and the medians over rounds."""
from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

_spec = importlib.util.spec_from_file_location("gpu_ep_bench", Path(__file__).resolve().parents[1] / "benchmarks/gpu_ep_bench.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)


def test_variants_parse_and_fail_clearly():
    assert bench.parse_variants(None) == [(None, {})]
    assert bench.parse_variants("lib:DATAFLOW_NCCL_P2P=lib;c10d:DATAFLOW_NCCL_P2P=c10d,X=1") == [
        ("lib", {"DATAFLOW_NCCL_P2P": "lib"}), ("c10d", {"DATAFLOW_NCCL_P2P": "c10d", "X": "1"})]
    for bad in ("lib", "lib:X", "a/b:X=1", ":X=1"):
        with pytest.raises(ValueError, match="--variants"):
            bench.parse_variants(bad)


def test_medians_over_rounds_use_same_round_ratios():
    def run(system, label, tps, ratio=None):
        r = {"system": system, "name": f"{system}/{label}/C8", "tokens_per_s": tps}
        if ratio is not None:
            r["ratio_vs_ag-ep"] = ratio
        return r
    results = {"runs": [run("ag-ep", "clean.r1", 100.0), run("s@a", "clean.r1", 50.0, 0.5),
                        run("ag-ep", "clean.r2", 200.0), run("s@a", "clean.r2", 80.0, 0.4),
                        run("ag-ep", "clean.r3", 150.0), run("s@a", "clean.r3", 90.0, 0.6)]}
    rows = {(r["system"], r["scenario"]): r for r in bench.median_rows(results)}
    assert rows[("ag-ep", "clean")]["median"] == 150.0 and rows[("ag-ep", "clean")]["rounds"] == 3
    s = rows[("s@a", "clean")]
    assert (s["median"], s["lo"], s["hi"], s["ratio"]) == (80.0, 50.0, 90.0, 0.5)
    assert bench._round_of("delay#2.r12") == 12 and bench._round_of("clean") == 0
    assert any("rounds" in line for line in bench.median_lines(results))
    # one round: no medians table
    assert bench.median_lines({"runs": [run("ag-ep", "clean", 1.0)]}) == []
