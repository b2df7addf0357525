#!/usr/bin/env bash
# Device run 81 (nvidia-h200-x2, TWO GPUs, ~2.5 minutes; the last of session 10's device time): 20B cut to 8 layers
# at C=64 per rank with session 10's tree, streaming/defrag + 30 ms hold against all-gather EP, clean and compute hog
# on GPU 1, 1 round (run 71, session 9's tree: 0.97x clean, 2.98x hog). Output: env.txt, ep20_c64.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
P=$(mktemp -d /tmp/run81.XXXX)
timeout 145 python3 benchmarks/gpu_ep_bench.py --out "$P" --budget 140 --rounds 1 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" --scenarios clean,compute-hog --concurrency 64 \
  --new-tokens 64:128 > "$P/ep.log" 2>&1
echo "ep exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/ep20_c64.md" 2>/dev/null
grep "^| " "$OUT/ep20_c64.md" | grep -v "^|---" | cut -c1-230
grep -i "error\|failed\|timed out\|skipped" "$P/ep.log" | head -5 | tee -a "$OUT/env.txt"
