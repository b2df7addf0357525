#!/usr/bin/env bash
# Device run 54 (nvidia-h200-x2, ~2.5 minutes; session 7): host time per batch measured again after the fix that
# subtracts a routing wait once (it was subtracted twice: every in-graph-router run understated the attention host
# time by its routing wait; NOTES §22 item 10). GPT-OSS-20B cut to 8 layers, bf16, C=256, clean, router in the
# graph, synchronous dispatch: all-gather EP and streaming/defrag + 30 ms hold, one round. Output: env.txt, ep.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
export DATAFLOW_KEYED_ROUTER=graph DATAFLOW_ASYNC_ROUTE=0
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
P=$(mktemp -d /tmp/run54.XXXX)
timeout 120 python3 benchmarks/gpu_ep_bench.py --out "$P" --budget 110 --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" \
  --scenarios clean --concurrency 256 --new-tokens 64:128 > "$P/ep.log" 2>&1
echo "ep exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/ep.md"; grep "^| " "$OUT/ep.md" | grep -v "^|---" | cut -c1-230
