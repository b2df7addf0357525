#!/usr/bin/env bash
# Device run 41 (nvidia-h200-x2, ~5 minutes), session 5: the clean ratio with busy-polling ranks, measured in
# alternating launches (run 40's matrix ran all barrier cells before all streaming cells, and the instance's speed
# drifted by ~45% within it). GPT-OSS-20B cut to 8 layers, bf16, C=256, round-robin homes: all-gather EP and
# streaming/defrag + 30 ms hold, clean, 3 rounds (barrier launch, streaming launch), with the medians table.
# Output: env.txt, ep.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
P=$(mktemp -d /tmp/run41.XXXX)
timeout 330 python3 benchmarks/gpu_ep_bench.py --out "$P" --budget 310 --rounds 3 --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" \
  --scenarios clean --concurrency 256 --new-tokens 64:128 > "$P/ep.log" 2>&1
echo "ep exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/ep.md"; grep "^| " "$OUT/ep.md" | cut -c1-200
