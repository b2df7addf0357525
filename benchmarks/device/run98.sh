#!/usr/bin/env bash
# Device run 98 (nvidia-h200-x2, TWO GPUs, ~8 minutes): session 12's tree, the 120B column at one 512-token wave per
# home (runs 96-97: at 20B a 512-token wave gave 1.8x the tokens/s of a 256-token one, and 1.38x all-gather EP clean).
# GPT-OSS-120B cut to 18 layers, bf16, C=512, attention cap 512, 48-96 new tokens, streaming/defrag + 30 ms hold
# against all-gather EP: clean, NVLink hog, compute hog on GPU 1, one round (run 86: C=128, 1.09x / 1.16x / 3.41x).
# Output: env.txt, ep120.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
P=$(mktemp -d /tmp/run98.XXXX)
timeout 520 python3 benchmarks/gpu_ep_bench.py --out "$P" --model gpt-oss-120b --budget 500 --rounds 1 --attn-cap 512 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" --scenarios clean,nvlink-hog,compute-hog \
  --concurrency 512 --new-tokens 48:96 > "$P/ep120.log" 2>&1
echo "ep120 exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/ep120.md"
grep "^| " "$OUT/ep120.md" | grep -v "^|---" | cut -c1-230
grep -i "error\|failed\|timed out\|skipped" "$P/ep120.log" | grep -v "TCPStore\|should dump" | head -5 | tee -a "$OUT/env.txt"
