#!/usr/bin/env bash
# Device run 24 (nvidia-h200-x2, ~5 minutes): does run 23's compute-hog result (streaming 1.77x of ag-ep)
# repeat, and hold at lower concurrency? GPT-OSS-20B cut to 8 layers, bf16, 64-128 new tokens,
# streaming/defrag + 30 ms wave hold vs ag-ep, C=64 and 256, clean / compute hog on GPU 1, twice each.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
P=$(mktemp -d /tmp/run24.XXXX)
timeout 400 python3 benchmarks/gpu_ep_bench.py --out "$P" --budget 390 --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" \
  --scenarios clean,compute-hog,clean,compute-hog --concurrency 64,256 --new-tokens 64:128 > "$OUT/ep.log" 2>&1
echo "ep exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/ep.md"; cp "$P/ep_bench.json" "$OUT/ep.json"; grep -A 40 "^| system" "$OUT/ep.md"
