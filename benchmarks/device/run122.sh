#!/usr/bin/env bash
# Device run 122 (nvidia-h200, ONE GPU, ~4 minutes): session 15's tree with every host cut so far (NOTES §32 items
# 1-9: the decision's policy in Python for a few candidates, no eligibility checks without chunked prompts, a decode
# group's shared per-segment arrays, the routed expert bucket's padding watermark, after run 121's). (1) the
# kernel/executor/runtime-unit/scheduler tests on the GPU and gpu_bench's correctness section; (2) gpu_bench e2e
# against 3cdf379 with ONE in-process rank (run 121 (a)'s setting), 20B-L8, C=256, defrag, 64 new tokens, 4 rounds,
# with the decision and embedding laps.
# Before the call: mkdir -p .df/ab && git archive 3cdf379 | gzip > .df/ab/old.tgz; carry [".whl", ".df/ab"].
# Output: env.txt, checks.txt, gpu_bench.md, ab.txt, phases.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_executor_cuda.py tests/test_runtime_units.py tests/test_scheduler.py 2>&1 | tail -3 | tee "$OUT/checks.txt"
timeout 120 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -1 "$OUT/gpu_bench.log"; rm -f "$OUT/gpu_bench.json" "$OUT/gpu_bench.log"
AB_BENCH=gpu_bench AB_TIMEOUT=80 bash benchmarks/device/ab_trees.sh "$OUT" .df/ab/old.tgz 4 --sections e2e \
  --systems streaming --policies defrag --layers 8 --ranks 1 --concurrency 256 --max-new 64
cut -c1-160 "$OUT/ab.txt"; python3 benchmarks/ab_summary.py "$OUT/ab.txt" 2>&1 | tail -3
grep -E "^===|decision|embed:|attention dispatch|executor experts" "$OUT/phases.txt" | cut -c1-330 | head -30
