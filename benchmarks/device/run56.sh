#!/usr/bin/env bash
# Device run 56 (nvidia-h200, ONE GPU, ~4 minutes): session 8 had only single-GPU machines (run 55 needs two).
# Checks session 7's host-path changes on a GPU for the first time: the kernel tests, and the CUDA executor's
# correctness section (fp32 GPU tokens == fp32 CPU reference for every policy, bf16 within the stated tolerance;
# 2 in-process ranks on GPU 0) with the routing read as numpy arrays (route_arrays), the cached static views and the
# bounded device waits (host_staging.wait_event) on the hot path. Output: env.txt, kernels_tests.txt, gpu_bench.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"
{ date -u; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv; git log -1 --format=%H 2>/dev/null; } > "$OUT/env.txt" 2>&1
timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_keyed_router_graph.py 2>&1 | tail -5 | tee "$OUT/kernels_tests.txt"
timeout 300 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -4 "$OUT/gpu_bench.log"; rm -f "$OUT/gpu_bench.json"
