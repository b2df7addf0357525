#!/usr/bin/env bash
# Device run 68 (nvidia-h200-x2, TWO GPUs, ~8 minutes): written in session 8, to run after run 67. With the device-routed
# dispatch an expert batch's cap counts slots (T*k per token batch), of which about 1/owners are this rank's: at the
# default cap (1,024) a batch holds ~half the real rows of a host-routed one (NOTES §25 item 4). This doubles the
# cap and the largest captured expert bucket (gpu_ep_bench --expert-cap) and compares, GPT-OSS-20B cut to 8 layers,
# bf16, C=256, clean and compute hog, streaming/defrag + 30 ms hold with DATAFLOW_DISPATCH=device against all-gather
# EP, 2 rounds per cap. Output: env.txt, cap1024.md, cap2048.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
for cap in 1024 2048; do
  P=$(mktemp -d /tmp/run68.XXXX)
  DATAFLOW_DISPATCH=device timeout 230 python3 benchmarks/gpu_ep_bench.py --out "$P" --budget 220 --rounds 2 --expert-cap $cap \
    --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" --scenarios clean,compute-hog --concurrency 256 \
    --new-tokens 64:128 > "$P/ep.log" 2>&1
  echo "cap $cap exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/cap$cap.md"
  grep "^| " "$OUT/cap$cap.md" | grep -v "^|---" | cut -c1-200
done
