#!/usr/bin/env bash
# Device run 70 (nvidia-h200-x2, TWO GPUs, ~8 minutes): session 9's headline with the device-routed dispatch as the
# GPU default (tree c9fa6ed + docs), at the shapes and concurrency levels run 67 did not cover:
# (1) GPT-OSS-120B cut to 18 layers, C=128 per rank, 48-96 new tokens, clean and compute hog on GPU 1, streaming
#     (defrag + 30 ms hold) against all-gather EP, 2 alternating rounds (run 45's shape: 0.91x clean, 2.27x hog with the
#     host-routed dispatch);
# (2) GPT-OSS-20B cut to 8 layers, C=64 per rank, 64-128 new tokens, clean and compute hog, streaming against
#     all-gather and all-to-all EP, 2 rounds.
# Output: env.txt, ep120.md, ep20_c64.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
P=$(mktemp -d /tmp/run70.XXXX)
timeout 290 python3 benchmarks/gpu_ep_bench.py --out "$P/120" --model gpt-oss-120b --budget 280 --rounds 2 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" --scenarios clean,compute-hog --concurrency 128 \
  --new-tokens 48:96 > "$P/ep120.log" 2>&1
echo "ep120 exit $?" | tee -a "$OUT/env.txt"; cp "$P/120/ep_bench.md" "$OUT/ep120.md"
timeout 240 python3 benchmarks/gpu_ep_bench.py --out "$P/20" --budget 230 --rounds 2 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep,a2a-ep" --scenarios clean,compute-hog --concurrency 64 \
  --new-tokens 64:128 > "$P/ep20.log" 2>&1
echo "ep20 C=64 exit $?" | tee -a "$OUT/env.txt"; cp "$P/20/ep_bench.md" "$OUT/ep20_c64.md"
for f in "$OUT/ep120.md" "$OUT/ep20_c64.md"; do grep "^| " "$f" | grep -v "^|---" | cut -c1-210; done
for f in "$P/ep120.log" "$P/ep20.log"; do grep -i "error\|failed\|timed out" "$f" | head -3; done >> "$OUT/env.txt"
