#!/usr/bin/env bash
# Device run 51 (nvidia-h200-x2, ~9 minutes; session 7): the router inside the attention graph (the default from
# this tree on; NOTES §22) across the whole matrix, with asynchronous dispatch now waiting for a deferred batch's
# routing when the rank is idle (instead of a 200 us poll). (1) keyed_router_check.py --timing: one 192-row draw's
# device time, torch ops vs the Triton kernel vs a learned router's linear + top-k + softmax; (2) GPT-OSS-20B cut
# to 8 layers, bf16, C=256: all-gather EP, streaming/defrag + 30 ms hold with asynchronous dispatch (`async`) and
# without (`sync`), clean, compute hog, +5 ms bursts, NVLink hog, 2 rounds, medians. Output: env.txt, timing.txt, ep.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
export DATAFLOW_KEYED_ROUTER=graph  # the default of this tree, pinned
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
timeout 60 python3 benchmarks/device/keyed_router_check.py --timing > "$OUT/timing.txt" 2>&1; echo "timing exit $?" >> "$OUT/env.txt"
grep "^timing" "$OUT/timing.txt"
P=$(mktemp -d /tmp/run51.XXXX)
timeout 450 python3 benchmarks/gpu_ep_bench.py --out "$P" --budget 440 --rounds 2 --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" \
  --variants "async:DATAFLOW_ASYNC_ROUTE=1;sync:DATAFLOW_ASYNC_ROUTE=0" --scenarios clean,compute-hog,delay-5ms,nvlink-hog \
  --concurrency 256 --new-tokens 64:128 > "$P/ep.log" 2>&1
echo "ep exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/ep.md"; grep "^| " "$OUT/ep.md" | grep -v "^|---" | cut -c1-230
grep -i "error\|failed\|timed out" "$P/ep.log" | head -5 >> "$OUT/env.txt"
