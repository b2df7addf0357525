#!/usr/bin/env bash
# Device run 79 (nvidia-h200-x2, TWO GPUs, ~8 minutes; the session's last device minutes): GPT-OSS-120B cut to 18
# layers with session 10's tree (the payload, per-token partial sums, the meta-upload skip), C=128 per rank, 48-96 new
# tokens, streaming/defrag + 30 ms hold against all-gather EP, clean, compute hog on GPU 1, +5 ms link bursts and
# NVLink hog, 1 round (run 70: 1.02x clean, 3.18x compute hog; the link cells never ran at 120B).
# Output: env.txt, ep120.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
P=$(mktemp -d /tmp/run79.XXXX)
timeout 450 python3 benchmarks/gpu_ep_bench.py --out "$P" --model gpt-oss-120b --budget 440 --rounds 1 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" --scenarios clean,compute-hog,delay-5ms,nvlink-hog \
  --concurrency 128 --new-tokens 48:96 > "$P/ep120.log" 2>&1
echo "ep120 exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/ep120.md"
grep "^| " "$OUT/ep120.md" | grep -v "^|---" | cut -c1-230
grep -i "error\|failed\|timed out\|skipped" "$P/ep120.log" | head -5 | tee -a "$OUT/env.txt"
