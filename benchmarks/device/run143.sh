#!/usr/bin/env bash
# Device run 143 (nvidia-h200, ONE GPU, ~2 minutes): why the mixed-batch split lost tokens/s and TTFT where arrivals
# never stop (run 142: split 18.4k against mixed 20.9k tok/s). arrivals_bench's busy workload (512 requests, 64 at
# t=0 then 300/s, GPT-OSS-20B cut to 4 layers, bf16), split / mixed alternating, 2 rounds, with each variant's
# attention batches (count, rows, host ms) and executor paths, and the executor's laps (DATAFLOW_PROFILE_EXEC=1).
# Output: env.txt, arrivals_busy.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
DATAFLOW_PROFILE_EXEC=1 timeout 150 python3 benchmarks/arrivals_bench.py --rounds 2 --requests 512 --initial 64 --rate 300 \
  --prompt 16:128 --max-new 64:128 --variants split,mixed > "$OUT/arrivals_busy.md" 2>&1
echo "arrivals_bench (busy) exit $?" | tee -a "$OUT/env.txt"; cat "$OUT/arrivals_busy.md"
