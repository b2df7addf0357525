#!/usr/bin/env bash
# Device run 140 (nvidia-h200, ONE GPU, ~2 minutes): session 16's final tree: run 139's plus the sample graph replayed
# only when its argmax is wanted (a batch that samples runs its LM head once; NOTES §33 item 2). (1) the kernel/executor/runtime-unit/scheduler/math/batched-attention tests
# and the benches' smoke tests on the GPU, and gpu_bench's correctness section (its fp32 sampled rows: the eager LM
# head alone). No sampling_bench: sample_tokens did not change, and the session's device time was nearly spent.
# Output: env.txt, checks.txt, gpu_bench.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
timeout 170 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_executor_cuda.py tests/test_runtime_units.py tests/test_scheduler.py tests/test_math.py tests/test_bench_scripts.py tests/test_attention_batched.py 2>&1 | tail -3 | tee "$OUT/checks.txt"
timeout 100 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -1 "$OUT/gpu_bench.log"; rm -f "$OUT/gpu_bench.json" "$OUT/gpu_bench.log"
