#!/usr/bin/env bash
# Device run 121 (nvidia-h200, ONE GPU, ~5 minutes): session 15's tree with the combine writing the next attention
# batch's input in place (NOTES §32 item 5). (1) the kernel/executor/runtime-unit tests on the GPU (topk_merge into
# given rows runs on CUDA) and gpu_bench's correctness section; (2) gpu_bench e2e against 3cdf379 with ONE in-process
# rank (one engine on its executor, as each process of a multi-GPU run: the combine claims every layer's input),
# 20B-L8, C=256, defrag, 64 new tokens, 4 rounds; (3) the same with two in-process ranks (they share one executor and
# take turns at a bucket: claims mostly back off), 3 rounds: no loss expected there.
# Before the call: mkdir -p .df/ab && git archive 3cdf379 | gzip > .df/ab/old.tgz; carry [".whl", ".df/ab"].
# Output: env.txt, checks.txt, gpu_bench.md, one/ab.txt, one/phases.txt, two/ab.txt, two/phases.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT/one" "$OUT/two"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_executor_cuda.py tests/test_runtime_units.py 2>&1 | tail -3 | tee "$OUT/checks.txt"
timeout 120 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -1 "$OUT/gpu_bench.log"; rm -f "$OUT/gpu_bench.json" "$OUT/gpu_bench.log"
for n in one two; do
  R=1; ROUNDS=4; [ $n = two ] && R=2 && ROUNDS=3
  AB_BENCH=gpu_bench AB_TIMEOUT=80 bash benchmarks/device/ab_trees.sh "$OUT/$n" .df/ab/old.tgz $ROUNDS --sections e2e \
    --systems streaming --policies defrag --layers 8 --ranks $R --concurrency 256 --max-new 64
  { echo "=== $n rank(s)"; cat "$OUT/$n/env.txt"; } >> "$OUT/env.txt"; rm -f "$OUT/$n/env.txt"
  echo "== $n rank(s)"; cut -c1-160 "$OUT/$n/ab.txt"; python3 benchmarks/ab_summary.py "$OUT/$n/ab.txt" 2>&1 | tail -3
done
grep -E "^===|executor attention|decision" "$OUT/one/phases.txt" | cut -c1-330 | head -16
