#!/usr/bin/env bash
# Device run 16 (nvidia-h200-x2, ~3 minutes): the wave hold at low concurrency (C=64 per rank, where a
# streaming rank does go idle), GPT-OSS-20B cut to 8 layers, bf16: defrag, defrag + hold, all-gather EP;
# clean / delay / clean again. Output: env.txt, ep.{log,md}.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
P=$(mktemp -d /tmp/run16.XXXX)
timeout 230 python3 benchmarks/gpu_ep_bench.py --out "$P" --budget 220 --systems "streaming-defrag,streaming-defrag:hold_fill=1;hold_us=2000,ag-ep" --scenarios clean,delay,clean --concurrency 64 > "$OUT/ep.log" 2>&1
echo "exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/ep.md"; grep "^|" "$OUT/ep.md"
