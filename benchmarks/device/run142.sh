#!/usr/bin/env bash
# Device run 142 (nvidia-h200, ONE GPU, ~4 minutes): run 141's second half. (1) arrivals_bench where arrivals never
# stop (512 requests, 64 at t=0 then 300/s, prompts 16-128, 64-128 new tokens, GPT-OSS-20B cut to 4 layers, bf16),
# split / mixed / separate / before alternating, 2 rounds; (2) one rank process, 20B-L8, C=256, streaming/defrag +
# 30 ms hold, 2 rounds, with the phases and the executor's expert laps (session 17's local landing: complete:expert,
# execute:expert, y_clone).
# Output: env.txt, arrivals_busy.md, ep256.md, phases.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
timeout 150 python3 benchmarks/arrivals_bench.py --rounds 2 --requests 512 --initial 64 --rate 300 --prompt 16:128 \
  --max-new 64:128 > "$OUT/arrivals_busy.md" 2>&1
echo "arrivals_bench (busy) exit $?" | tee -a "$OUT/env.txt"; grep -E "^\| " "$OUT/arrivals_busy.md"
P=$(mktemp -d /tmp/run142.XXXX)
DATAFLOW_PROFILE_RANK=0 DATAFLOW_PROFILE_CPROFILE=0 DATAFLOW_PROFILE_OUT="$P/rank{rank}.prof" DATAFLOW_PROFILE_EXEC=1 \
  timeout 120 python3 benchmarks/gpu_ep_bench.py --out "$P/o" --budget 110 --ranks 1 --rounds 2 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency 256 --new-tokens 64:128 > "$P/run.log" 2>&1
echo "bench exit $?" | tee -a "$OUT/env.txt"
cp "$P/o/ep_bench.md" "$OUT/ep256.md" 2>/dev/null; grep -E "^\| streaming" "$OUT/ep256.md" | cut -c1-200
{ head -16 "$P/rank0.prof.phases.txt"; grep -E "executor experts" "$P/run.log" | tail -1; } > "$OUT/phases.txt" 2>&1; cat "$OUT/phases.txt"
