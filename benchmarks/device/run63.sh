#!/usr/bin/env bash
# Device run 63 (nvidia-h200, ONE GPU, ~5 minutes): two more host-path cuts (NOTES §24) against 7993511 (the tree
# before them): staging slots known free by stream order (no event query per slot reuse once a later copy on the
# stream was seen complete) and the bench probe's timing events made before the run. First the kernel/executor tests
# and gpu_bench's correctness section on this tree (both changes run only on a GPU). Then gpu_bench e2e, run 57's
# shape, 6 rounds, both trees from /tmp copies, order swapped every round.
# Before the call: mkdir -p .df/ab && git archive 7993511 | gzip > .df/ab/old.tgz; carry [".whl", ".df/ab"].
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
timeout 100 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_executor_cuda.py tests/test_runtime_units.py 2>&1 | tail -3 | tee "$OUT/checks.txt"
timeout 120 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -2 "$OUT/gpu_bench.log"; rm -f "$OUT/gpu_bench.json" "$OUT/gpu_bench.log"
AB_BENCH=gpu_bench AB_TIMEOUT=80 bash benchmarks/device/ab_trees.sh "$OUT" .df/ab/old.tgz 6 --sections e2e \
  --systems streaming --policies defrag --layers 8 --concurrency 256 --max-new 64
