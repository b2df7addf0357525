#!/usr/bin/env bash
# Device run 14 (nvidia-h200-x2, ~6 minutes): after the vectorized synthetic routing (NOTES §14), streaming/defrag
# vs all-gather EP with a second clean run last (the barrier's first clean is sometimes slow, runs 8/13):
# (A) GPT-OSS-20B cut to 8 layers, C=256; (B) GPT-OSS-120B cut to 18 layers (sharded experts), C=128. bf16.
# Output: env.txt, ep20.{log,md}, ep120.{log,md}.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
P=$(mktemp -d /tmp/run14.XXXX)
timeout 200 python3 benchmarks/gpu_ep_bench.py --out "$P/a" --budget 190 --systems streaming-defrag,ag-ep --scenarios clean,delay,clean --concurrency 256 > "$OUT/ep20.log" 2>&1
echo "ep20 exit $?" | tee -a "$OUT/env.txt"; cp "$P/a/ep_bench.md" "$OUT/ep20.md"; grep "^|" "$OUT/ep20.md"
timeout 260 python3 benchmarks/gpu_ep_bench.py --out "$P/b" --model gpt-oss-120b --budget 250 --systems streaming-defrag,ag-ep --scenarios clean,delay,clean --concurrency 128 > "$OUT/ep120.log" 2>&1
echo "ep120 exit $?" | tee -a "$OUT/env.txt"; cp "$P/b/ep_bench.md" "$OUT/ep120.md"; grep "^|" "$OUT/ep120.md"
