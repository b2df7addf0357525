#!/usr/bin/env bash
# Device run 146 (nvidia-h200, ONE GPU, ~3 minutes): session 17's final tree (the mixed-batch split on by default,
# separate prefill batches removed, router near-ties left out of gpu_bench's bf16 check): one_gpu_checks.sh (the tests
# and gpu_bench's correctness section).
# Output: env.txt, checks.txt, gpu_bench.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
bash benchmarks/device/one_gpu_checks.sh "$OUT"
