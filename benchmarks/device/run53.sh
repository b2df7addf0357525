#!/usr/bin/env bash
# Device run 53 (nvidia-h200-x2, ~4.5 minutes; session 7): asynchronous dispatch again, now with a rank's expert(l)
# waiting while its own attn(l) batch waits for its routing (run 51: running it meanwhile made expert batches 13%
# smaller; NOTES §22 item 9). GPT-OSS-20B cut to 8 layers, bf16, C=256, clean and compute hog, router in the graph:
# all-gather EP, streaming/defrag + 30 ms hold with asynchronous (`async`) and synchronous (`sync`) dispatch,
# 2 rounds, medians. Output: env.txt, ep.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
export DATAFLOW_KEYED_ROUTER=graph
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
P=$(mktemp -d /tmp/run53.XXXX)
timeout 250 python3 benchmarks/gpu_ep_bench.py --out "$P" --budget 240 --rounds 2 --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" \
  --variants "async:DATAFLOW_ASYNC_ROUTE=1;sync:DATAFLOW_ASYNC_ROUTE=0" --scenarios clean,compute-hog \
  --concurrency 256 --new-tokens 64:128 > "$P/ep.log" 2>&1
echo "ep exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/ep.md"; grep "^| " "$OUT/ep.md" | grep -v "^|---" | cut -c1-230
grep -i "error\|failed\|timed out" "$P/ep.log" | head -5 >> "$OUT/env.txt"
