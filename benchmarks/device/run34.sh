#!/usr/bin/env bash
# Device run 34 (nvidia-h200-x2, ~2.5 minutes), session 4: whole-group merges under the wave hold (one combine per
# attention batch; DATAFLOW_MERGE=whole, the new default with a hold) vs per-segment merges (DATAFLOW_MERGE=segments,
# the old behaviour): fp32 2-GPU tokens == CPU with the hold, then streaming/defrag + 30 ms hold, 20B-L8, bf16,
# C=256, clean, one launch per variant.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
bash benchmarks/device/fp32_tokens_vs_cpu.sh "$OUT" "defrag:hold_fill=1,hold_us=3000" | grep "2-GPU"
P=$(mktemp -d /tmp/run34.XXXX)
timeout 150 python3 benchmarks/gpu_ep_bench.py --out "$P" --budget 140 --systems "streaming-defrag:hold_fill=1;hold_us=30000" \
  --scenarios clean --concurrency 256 --new-tokens 64:128 --variants "segments:DATAFLOW_MERGE=segments;whole:DATAFLOW_MERGE=whole" > "$OUT/ep.log" 2>&1
echo "ep exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/ep.md"; cp "$P/ep_bench.json" "$OUT/ep.json"
grep "^| streaming" "$OUT/ep.md" | cut -c1-220
