#!/usr/bin/env bash
# Device run 19 (nvidia-h200-x2, ~5 minutes): does a wave hold as long as a layer's wave (~10-30 ms at
# C=256; run 13 held 3 ms at most) give whole-wave batches and fewer, cheaper host steps per token?
# GPT-OSS-20B cut to 8 layers, bf16, C=256, clean and delay bursts; streaming/defrag with and without
# the hold, all-gather EP. Output: env.txt, ep.{log,md}.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
P=$(mktemp -d /tmp/run19.XXXX)
timeout 330 python3 benchmarks/gpu_ep_bench.py --out "$P" --budget 320 --systems "streaming-defrag,streaming-defrag:hold_fill=1;hold_us=10000,streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" --scenarios clean,delay,clean --concurrency 256 > "$OUT/ep.log" 2>&1
echo "exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/ep.md"; grep "^|" "$OUT/ep.md"
