#!/usr/bin/env bash
# Device run 40 (nvidia-h200-x2, ~9 minutes), session 5: the interference matrix with busy-polling ranks (now the
# default for NCCL ranks; run 39: +43% clean). fp32 2-GPU tokens == CPU with the hold; then GPT-OSS-20B cut to 8
# layers, bf16, C=256, round-robin homes: streaming/defrag + 30 ms hold, all-gather EP, all-to-all EP, clean,
# delay bursts +5 ms, compute hog on GPU 1, NVLink hog, clean again. Output: env.txt, tokens.txt, ep.md, ep.json.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
bash benchmarks/device/fp32_tokens_vs_cpu.sh "$OUT" "defrag:hold_fill=1,hold_us=3000" | grep "2-GPU"
P=$(mktemp -d /tmp/run40.XXXX)
timeout 450 python3 benchmarks/gpu_ep_bench.py --out "$P" --budget 430 --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep,a2a-ep" \
  --scenarios clean,delay-5ms,compute-hog,nvlink-hog,clean --concurrency 256 --new-tokens 64:128 > "$OUT/ep.log" 2>&1
echo "ep exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/ep.md"; cp "$P/ep_bench.json" "$OUT/ep.json"; grep "^| " "$OUT/ep.md" | cut -c1-240
