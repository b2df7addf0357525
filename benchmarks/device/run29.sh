#!/usr/bin/env bash
# Device run 29 (nvidia-h200-x2, ~8 minutes), session 4: issue 7's matrix at GPT-OSS-120B cut to 18 layers
# (expert-sharded, 56.5 GiB of weights per rank), bf16, C=128, 48-96 new tokens: streaming/defrag + 30 ms wave
# hold vs all-gather EP vs all-to-all EP, clean, delay bursts +2 / +10 ms, compute hog on GPU 1, NVLink hog,
# clean again. Output: env.txt, ep.md, ep.json, ep.log.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
P=$(mktemp -d /tmp/run29.XXXX)
timeout 570 python3 benchmarks/gpu_ep_bench.py --out "$P" --model gpt-oss-120b --budget 550 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep,a2a-ep" \
  --scenarios clean,delay,delay-10ms,compute-hog,nvlink-hog,clean --concurrency 128 --new-tokens 48:96 > "$OUT/ep.log" 2>&1
echo "ep exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/ep.md"; cp "$P/ep_bench.json" "$OUT/ep.json"; grep "^| " "$OUT/ep.md" | cut -c1-240
