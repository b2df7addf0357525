#!/usr/bin/env bash
# Device run 145 (nvidia-h200, ONE GPU, ~3 minutes): the mixed-batch split against the whole mixed batch eagerly
# again, now with arrivals_bench's untimed first pass (run 144: in rounds where no batch was split, so both variants
# ran the same code, "split" still measured 17-23% below "mixed": the launch's first run was the slow one), 3 rounds:
# the never-ending arrivals (512 requests, 64 at t=0 then 300/s) and run 137's decode-heavy workload (256 requests,
# 128 at t=0 then 100/s), GPT-OSS-20B cut to 4 layers, bf16.
# Output: env.txt, arrivals_busy.md, arrivals.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
timeout 200 python3 benchmarks/arrivals_bench.py --rounds 3 --requests 512 --initial 64 --rate 300 --prompt 16:128 \
  --max-new 64:128 --variants split,mixed > "$OUT/arrivals_busy.md" 2>&1
echo "arrivals_bench (busy) exit $?" | tee -a "$OUT/env.txt"; grep -E "^\| |round|attention batches" "$OUT/arrivals_busy.md"
timeout 200 python3 benchmarks/arrivals_bench.py --rounds 3 --requests 256 --initial 128 --rate 100 --prompt 16:128 \
  --max-new 64:128 --variants split,mixed > "$OUT/arrivals.md" 2>&1
echo "arrivals_bench exit $?" | tee -a "$OUT/env.txt"; grep -E "^\| |round|attention batches" "$OUT/arrivals.md"
