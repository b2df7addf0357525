#!/usr/bin/env bash
# Device run 136 (nvidia-h200, ONE GPU, ~5 minutes): session 16's separate attention batches for prompts' chunks and
# decode rows (NOTES §33 item 4). (1) gpu_bench's correctness section (the engine's batches changed); (2)
# benchmarks/arrivals_bench.py: serving with real prompts arriving while others decode, one rank in-process,
# GPT-OSS-20B cut to 4 layers, bf16: separate against mixed (decode rows batched on the eager path) against before
# (every segment of a mixed batch on its own, session 15's path), 2 rounds alternating.
# Output: env.txt, gpu_bench.md, arrivals.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
timeout 120 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -1 "$OUT/gpu_bench.log"; rm -f "$OUT/gpu_bench.json" "$OUT/gpu_bench.log"
timeout 420 python3 benchmarks/arrivals_bench.py --rounds 2 > "$OUT/arrivals.md" 2>&1
echo "arrivals_bench exit $?" | tee -a "$OUT/env.txt"; cat "$OUT/arrivals.md"
