#!/usr/bin/env bash
# Device run 42 (nvidia-h200-x2, ~4 minutes), session 5: asynchronous sampling (DATAFLOW_ASYNC_SAMPLE=1: a sample
# batch completes when its argmax copy has landed, instead of the host waiting for it in execute; NOTES §20 item 8a).
# (1) fp32 2-GPU tokens == CPU with it on (defrag + hold); (2) streaming/defrag + 30 ms hold, 20B-L8, bf16, C=256,
# clean, sync vs async alternating, 2 rounds, medians. Output: env.txt, tokens.txt, ep.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
DATAFLOW_ASYNC_SAMPLE=1 bash benchmarks/device/fp32_tokens_vs_cpu.sh "$OUT" "defrag:hold_fill=1,hold_us=3000" | grep "2-GPU"
P=$(mktemp -d /tmp/run42.XXXX)
timeout 200 python3 benchmarks/gpu_ep_bench.py --out "$P" --budget 190 --rounds 2 --variants "sync:DATAFLOW_ASYNC_SAMPLE=0;async:DATAFLOW_ASYNC_SAMPLE=1" \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency 256 --new-tokens 64:128 > "$P/ep.log" 2>&1
echo "ep exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/ep.md"; grep "^| " "$OUT/ep.md" | cut -c1-200
