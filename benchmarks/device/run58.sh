#!/usr/bin/env bash
# Device run 58 (nvidia-h200, ONE GPU, ~3 minutes): session 8's dispatch plan in one numba call
# (runtime/core/dispatch_plan.py; NOTES §23) against the tree before it (a540828, session 7's final tree), in alternating
# launches of gpu_bench's e2e section, the shape of run 57: GPT-OSS-20B cut to 8 layers, bf16, decode-only, Zipf
# routing in the attention graph, 2 in-process ranks sharing GPU 0, streaming/defrag, C=256, 64 new tokens, 3 rounds.
# Before the call: mkdir -p .df/ab && git archive a540828 | gzip > .df/ab/old.tgz; carry [".whl", ".df/ab"].
# First gpu_bench's correctness section with this tree (fp32 GPU tokens == CPU, bf16 teacher-forced logits within
# the stated tolerance, every policy; run 56 found its teacher forcing broken, fixed in this session).
# Output: env.txt, gpu_bench.md (correctness), ab.txt (one table row per launch), phases.txt (dispatch and
# executor step wall clocks).
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
timeout 150 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -2 "$OUT/gpu_bench.log"; rm -f "$OUT/gpu_bench.json" "$OUT/gpu_bench.log"
AB_BENCH=gpu_bench AB_TIMEOUT=80 bash benchmarks/device/ab_trees.sh "$OUT" .df/ab/old.tgz 3 --sections e2e \
  --systems streaming --policies defrag --layers 8 --concurrency 256 --max-new 64
