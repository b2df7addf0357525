#!/usr/bin/env bash
# Device run 116 (nvidia-h200, ONE GPU, ~6 minutes): session 15's host cuts (NOTES §32: merge groups reuse a closed
# group's y and event, a decision that found nothing runnable is not repeated on an unchanged state, transfers' events
# recorded again, zmq flags as ints) on one GPU, no 2-GPU machine being lent. (1) the kernel/executor/runtime-unit
# tests and gpu_bench's correctness section; (2) gpu_bench e2e (both ranks in one process on one GPU: no NCCL, so the
# transport's event reuse does nothing here), 20B shapes cut to 8 layers, C=256, defrag, 64 new tokens, against
# 3cdf379 (session 14's last tree), 6 rounds, order swapped every round, with the engine's and executor's step timers
# (run 112's setting).
# Before the call: mkdir -p .df/ab && git archive 3cdf379 | gzip > .df/ab/old.tgz; carry [".whl", ".df/ab"].
# Output: env.txt, checks.txt, gpu_bench.md, ab.txt, phases.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_executor_cuda.py tests/test_runtime_units.py 2>&1 | tail -3 | tee "$OUT/checks.txt"
timeout 120 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -1 "$OUT/gpu_bench.log"; rm -f "$OUT/gpu_bench.json" "$OUT/gpu_bench.log"
AB_BENCH=gpu_bench AB_TIMEOUT=80 bash benchmarks/device/ab_trees.sh "$OUT" .df/ab/old.tgz 6 --sections e2e \
  --systems streaming --policies defrag --layers 8 --concurrency 256 --max-new 64
cut -c1-160 "$OUT/ab.txt"
python3 benchmarks/ab_summary.py "$OUT/ab.txt" 2>&1 | tail -8
grep -E "^===|executor attention|attention execute|attention dispatch" "$OUT/phases.txt" | cut -c1-300 | head -30
