#!/usr/bin/env bash
# matrix.yaml checks-1gpu: `bash benchmarks/device/one_gpu_checks.sh OUT` (from the repository root,
# after start.sh). The tests that run on one GPU (kernels, the CUDA executor, runtime units, scheduler, math, the
# benches' smoke tests, batched attention: OUT/checks.txt) and gpu_bench's correctness section (CUDA-executor tokens
# against the reference, fp32 and bf16 teacher-forced: OUT/gpu_bench.md; its exit status appended to OUT/env.txt).
set -u
OUT=$(cd "${1:?out dir}" && pwd)
timeout 200 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_kernels_attention.py \
  tests/test_executor_cuda.py tests/test_executor_cuda_attention.py tests/test_executor_cuda_twin.py \
  tests/test_executor_cuda_in_place.py tests/test_runtime_units.py tests/test_scheduler.py tests/test_math.py \
  tests/test_bench_scripts.py tests/test_attention_batched.py 2>&1 | tail -3 | tee "$OUT/checks.txt"
timeout 120 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -1 "$OUT/gpu_bench.log"
grep -E "BAD|tf max" "$OUT/gpu_bench.log" | grep -E "BAD" | head -8
rm -f "$OUT/gpu_bench.json" "$OUT/gpu_bench.log"
