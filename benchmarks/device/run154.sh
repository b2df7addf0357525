#!/usr/bin/env bash
# Device run 154 (nvidia-h200, ONE GPU, ~4 minutes): does the row-block attention show end to end where contexts are
# long? Runs 152-153's arrivals loads (prompts up to 2,048) measured paged and per-row within their rounds' spread;
# here prompts of 2,048-8,192 tokens, where a chunk's rows re-read 4x more keys each (NOTES §36 item 1).
# arrivals_bench paged against per-row, 3 rounds, GPT-OSS-20B cut to 4 layers. Output: env.txt, arrivals_8k.md.
. benchmarks/device/start.sh "$@"
timeout 400 python3 benchmarks/arrivals_bench.py --rounds 3 --variants paged,per-row --requests 96 --initial 32 \
  --rate 40 --prompt 2048:8192 --max-new 16:32 > "$OUT/arrivals_8k.md" 2>&1
echo "arrivals 8k exit $?" | tee -a "$OUT/env.txt"; cat "$OUT/arrivals_8k.md"
