#!/usr/bin/env bash
# Device run 135 (nvidia-h200, ONE GPU, ~4 minutes): session 16's final tree. (1) the kernel/executor/runtime-unit/
# scheduler/math/batched-attention tests and the benches' smoke tests on the GPU, and gpu_bench's correctness section;
# (2) benchmarks/mixed_batch_bench.py (NOTES §33 item 3): one attention layer of a mixed batch (decode rows beside a
# new prompt's chunk) with its decode rows batched against one segment at a time, GPT-OSS-20B shapes in bf16 (256
# decode rows at context 512 beside a 256-row chunk, and 64 beside 64) and tiny-gpt-oss.
# Output: env.txt, checks.txt, gpu_bench.md, mixed.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
timeout 170 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_executor_cuda.py tests/test_runtime_units.py tests/test_scheduler.py tests/test_math.py tests/test_bench_scripts.py tests/test_attention_batched.py 2>&1 | tail -3 | tee "$OUT/checks.txt"
timeout 120 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -1 "$OUT/gpu_bench.log"; rm -f "$OUT/gpu_bench.json" "$OUT/gpu_bench.log"
{ timeout 120 python3 benchmarks/mixed_batch_bench.py --spec gpt-oss-20b --layers 1 --decode 256 --chunk 256 --context 512
  timeout 90 python3 benchmarks/mixed_batch_bench.py --spec gpt-oss-20b --layers 1 --decode 64 --chunk 64 --context 512
  timeout 60 python3 benchmarks/mixed_batch_bench.py; } > "$OUT/mixed.md" 2>&1
echo "mixed_batch_bench exit $?" | tee -a "$OUT/env.txt"; cat "$OUT/mixed.md"
