#!/usr/bin/env bash
# Device run 77 (nvidia-h200-x2, TWO GPUs, ~9 minutes): session 10's tree (device-routed by the plan: the payload as
# the unit, holders returning per-token partial sums). The issue-7 matrix, GPT-OSS-20B cut to 8 layers, bf16, C=256:
# streaming/defrag + 30 ms hold against all-gather and all-to-all EP, clean, compute hog on GPU 1, +5 ms link bursts,
# NVLink hog, 2 rounds (medians). Output: env.txt, ep.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
P=$(mktemp -d /tmp/run77.XXXX)
timeout 530 python3 benchmarks/gpu_ep_bench.py --out "$P" --budget 520 --rounds 2 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep,a2a-ep" --scenarios clean,compute-hog,delay-5ms,nvlink-hog \
  --concurrency 256 --new-tokens 64:128 > "$P/ep.log" 2>&1
echo "ep exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/ep.md"; grep "^| " "$OUT/ep.md" | grep -v "^|---" | cut -c1-230
grep -i "error\|failed\|timed out\|skipped" "$P/ep.log" | head -5 | tee -a "$OUT/env.txt"
