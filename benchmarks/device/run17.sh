#!/usr/bin/env bash
# Device run 17 (nvidia-h200-x2, ~3 minutes): does a full-size warm-up remove the barrier's slow first clean run?
# all-gather EP and streaming/defrag, GPT-OSS-20B cut to 8 layers, bf16, C=256, clean / delay / clean again.
# Output: env.txt, ep.{log,md}.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
P=$(mktemp -d /tmp/run17.XXXX)
timeout 250 python3 benchmarks/gpu_ep_bench.py --out "$P" --budget 240 --systems streaming-defrag,ag-ep --scenarios clean,delay,clean --concurrency 256 > "$OUT/ep.log" 2>&1
echo "exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/ep.md"; grep "^|" "$OUT/ep.md"
