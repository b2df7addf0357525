#!/usr/bin/env bash
# Device run 28 (nvidia-h200-x2, ~8 minutes), session 4: (1) fp32 2-GPU tokens == CPU tokens after the merge by
# dispatch position (defrag, defrag + hold); (2) issue 7's matrix at GPT-OSS-20B cut to 8 layers, bf16, C=256,
# 64-128 new tokens: streaming/defrag + 30 ms wave hold vs all-gather EP vs all-to-all EP, clean, link delay
# bursts of +2 / +5 / +10 ms (30% of every 20 ms), compute hog on GPU 1, NVLink hog, clean again.
# Output (few files: the device tool returns at most ~8): env.txt, tokens.txt, ep.md, ep.json, ep.log.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
bash benchmarks/device/fp32_tokens_vs_cpu.sh "$OUT" defrag "defrag:hold_fill=1,hold_us=3000" | grep "2-GPU"
P=$(mktemp -d /tmp/run28.XXXX)
timeout 560 python3 benchmarks/gpu_ep_bench.py --out "$P" --budget 540 --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep,a2a-ep" \
  --scenarios clean,delay,delay-5ms,delay-10ms,compute-hog,nvlink-hog,clean --concurrency 256 --new-tokens 64:128 > "$OUT/ep.log" 2>&1
echo "ep exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/ep.md"; cp "$P/ep_bench.json" "$OUT/ep.json"; grep "^| " "$OUT/ep.md" | cut -c1-240
