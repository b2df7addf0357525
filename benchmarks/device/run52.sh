#!/usr/bin/env bash
# Device run 52 (nvidia-h200-x2, ~6 minutes; session 7): GPT-OSS-120B cut to 18 layers (the paper's model) on this
# session's final defaults: the Zipf router inside the attention graph (one Triton kernel), synchronous dispatch.
# C=128 per rank, clean and compute hog on GPU 1, streaming/defrag + 30 ms hold vs all-gather EP, 2 alternating
# rounds (run 45's setting, whose router ran on the host). With the host time per batch hidden behind any device
# work (the paper's definition, a column since run 50). Output: env.txt, ep120.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
export DATAFLOW_KEYED_ROUTER=graph DATAFLOW_ASYNC_ROUTE=0  # this tree's defaults, pinned
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
P=$(mktemp -d /tmp/run52.XXXX)
timeout 330 python3 benchmarks/gpu_ep_bench.py --out "$P" --model gpt-oss-120b --budget 320 --rounds 2 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" --scenarios clean,compute-hog --concurrency 128 \
  --new-tokens 48:96 > "$P/ep120.log" 2>&1
echo "ep120 exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/ep120.md"; grep "^| " "$OUT/ep120.md" | grep -v "^|---" | cut -c1-230
grep -i "error\|failed\|timed out" "$P/ep120.log" | head -5 >> "$OUT/env.txt"
