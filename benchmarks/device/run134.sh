#!/usr/bin/env bash
# Device run 134 (nvidia-h200, ONE GPU, ~3 minutes): run 133 again with the sampled rows' probabilities in fp64 (NOTES §33 item 2:
# models.sampling.sample_tokens; a batch with rows that sample is drawn on the device, asynchronously, and stepped
# ahead like a greedy one). (1) the kernel/executor/runtime-unit/scheduler/math tests and the benches' smoke tests on
# the GPU, and gpu_bench's correctness section (now with an fp32 row of requests that sample, against the CPU reference); (2) benchmarks/sampling_bench.py at GPT-OSS's vocabulary: ms per
# sample batch batched on the GPU against the per-row host path it replaced, and the GPU's tokens against the CPU's.
# Output: env.txt, checks.txt, gpu_bench.md, sampling.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
timeout 170 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_executor_cuda.py tests/test_runtime_units.py tests/test_scheduler.py tests/test_math.py tests/test_bench_scripts.py 2>&1 | tail -3 | tee "$OUT/checks.txt"
timeout 120 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -1 "$OUT/gpu_bench.log"; rm -f "$OUT/gpu_bench.json" "$OUT/gpu_bench.log"
timeout 240 python3 benchmarks/sampling_bench.py --rows 1,64,256 --reps 5 --old-reps 1 > "$OUT/sampling.md" 2>&1
echo "sampling_bench exit $?" | tee -a "$OUT/env.txt"; cat "$OUT/sampling.md"
