#!/usr/bin/env bash
# Device run 44 (nvidia-h200-x2, ~9 minutes): WRITTEN IN SESSION 5, NOT RUN YET. GPT-OSS-120B cut to 18 layers (the
# issue's second model) with the session's final tree, which session 4's 120B matrix (run 29) predates: busy-polling
# ranks, asynchronous sampling, fewer torch calls per batch. bf16, C=128, 48-96 new tokens, round-robin homes:
# streaming/defrag + 30 ms hold vs all-gather EP, clean and compute hog on GPU 1, 2 rounds in alternating launches,
# medians. Output: env.txt, ep.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
P=$(mktemp -d /tmp/run44.XXXX)
timeout 540 python3 benchmarks/gpu_ep_bench.py --out "$P" --model gpt-oss-120b --budget 520 --rounds 2 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" --scenarios clean,compute-hog --concurrency 128 \
  --new-tokens 48:96 > "$P/ep.log" 2>&1
echo "ep exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/ep.md"; grep "^| " "$OUT/ep.md" | cut -c1-200
