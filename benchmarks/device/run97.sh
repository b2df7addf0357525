#!/usr/bin/env bash
# Device run 97 (nvidia-h200-x2, TWO GPUs, ~9 minutes): session 12's tree. Run 96: one wave of 512 tokens per home
# (attention cap 512, C=512) gave streaming 55.6k tok/s against 30.8k at C=256 on the same instance (all-gather EP
# 43.5k against 24.8k): a rank's host cost is per batch and per message, so a bigger wave amortizes it. (1) The issue-7
# matrix at that setting: GPT-OSS-20B cut to 8 layers, bf16, C=512, attention cap 512, streaming/defrag + 30 ms hold
# against all-gather and all-to-all EP, clean, compute hog on GPU 1, +5 ms link bursts, NVLink hog, 2 rounds (medians);
# (2) C=1024, attention cap 1024 (expert cap 8,192 slots), clean, one round: does the trend go on.
# Output: env.txt, ep512.md, ep1024.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
SYS="streaming-defrag:hold_fill=1;hold_us=30000,ag-ep,a2a-ep"
P=$(mktemp -d /tmp/run97.XXXX)
timeout 450 python3 benchmarks/gpu_ep_bench.py --out "$P/a" --budget 440 --rounds 2 --attn-cap 512 --systems "$SYS" \
  --scenarios clean,compute-hog,delay-5ms,nvlink-hog --concurrency 512 --new-tokens 64:128 > "$P/a.log" 2>&1
echo "ep C=512 exit $?" | tee -a "$OUT/env.txt"; cp "$P/a/ep_bench.md" "$OUT/ep512.md"; grep "^| " "$OUT/ep512.md" | grep -v "^|---" | cut -c1-200
grep -i "error\|failed\|timed out\|skipped" "$P/a.log" | grep -v "TCPStore\|should dump" | head -5 | tee -a "$OUT/env.txt"
timeout 120 python3 benchmarks/gpu_ep_bench.py --out "$P/b" --budget 110 --rounds 1 --attn-cap 1024 --systems "$SYS" \
  --scenarios clean --concurrency 1024 --new-tokens 64:128 > "$P/b.log" 2>&1
echo "ep C=1024 exit $?" | tee -a "$OUT/env.txt"; cp "$P/b/ep_bench.md" "$OUT/ep1024.md"; grep "^| " "$OUT/ep1024.md" | grep -v "^|---" | cut -c1-200
