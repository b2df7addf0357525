#!/usr/bin/env bash
# Device run 59 (nvidia-h200, ONE GPU, ~4 minutes): session 8's host-path changes together (the numba dispatch
# plan, c584b77; the staging upload in one .to(), NOTES §23) against session 7's final tree (a540828), in 4
# alternating rounds of gpu_bench's e2e section, run 57's shape (GPT-OSS-20B cut to 8 layers, bf16, decode-only,
# Zipf routing in the graph, 2 in-process ranks sharing GPU 0, streaming/defrag, C=256, 64 new tokens). First the
# kernel/executor tests and gpu_bench's correctness section on this tree (the upload change runs only on a GPU).
# Before the call: mkdir -p .df/ab && git archive a540828 | gzip > .df/ab/old.tgz; carry [".whl", ".df/ab"].
# Output: env.txt, checks.txt, gpu_bench.md (correctness), ab.txt, phases.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_executor_cuda.py 2>&1 | tail -3 | tee "$OUT/checks.txt"
timeout 150 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -2 "$OUT/gpu_bench.log"; rm -f "$OUT/gpu_bench.json" "$OUT/gpu_bench.log"
AB_BENCH=gpu_bench AB_TIMEOUT=80 bash benchmarks/device/ab_trees.sh "$OUT" .df/ab/old.tgz 4 --sections e2e \
  --systems streaming --policies defrag --layers 8 --concurrency 256 --max-new 64
