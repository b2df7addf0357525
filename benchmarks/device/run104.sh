#!/usr/bin/env bash
# Device run 104 (nvidia-h200-x2, TWO GPUs, ~7 minutes): session 13. (1) Python's full garbage collections as the ITL
# stalls: runs 20 and 22's phase profiles recorded generation-2 collections of 208-292 ms, and streaming's ITL p99 sits
# at 116-234 ms in many launches (runs 97, 101-103) while p50 is 12-25 ms. runtime/drivers/gc_settle.py freezes the startup
# heap before serving. A/B DATAFLOW_GC_FREEZE=1 vs 0, streaming/defrag + 30 ms hold, 20B-L8, bf16, C=512 (default cap),
# clean, 4 rounds alternating: ITL p99 and the stall windows. (2) The default cap (1,024) at 120B: GPT-OSS-120B cut to
# 18 layers, C=256, streaming against all-gather EP, clean and compute hog, one round (run 99 at cap 256: 1.08x,
# 3.23x): does the larger expert cap (8,192 slots) fit and cost nothing. Output: env.txt, ab.md, ep120.md, logs.tgz.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
P=$(mktemp -d /tmp/run104.XXXX)
timeout 230 python3 benchmarks/gpu_ep_bench.py --out "$P/ab" --budget 220 --rounds 4 \
  --variants "freeze:DATAFLOW_GC_FREEZE=1;nofreeze:DATAFLOW_GC_FREEZE=0" \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency 512 --new-tokens 64:128 \
  > "$P/ab.log" 2>&1
echo "ab exit $?" | tee -a "$OUT/env.txt"; cp "$P/ab/ep_bench.md" "$OUT/ab.md"; grep "^| " "$OUT/ab.md" | grep -v "^|---" | cut -c1-180
timeout 230 python3 benchmarks/gpu_ep_bench.py --out "$P/e120" --model gpt-oss-120b --budget 220 --rounds 1 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" --scenarios clean,compute-hog \
  --concurrency 256 --new-tokens 48:96 > "$P/e120.log" 2>&1
echo "ep120 exit $?" | tee -a "$OUT/env.txt"; cp "$P/e120/ep_bench.md" "$OUT/ep120.md"
grep "^| " "$OUT/ep120.md" | grep -v "^|---" | cut -c1-200
grep -i "error\|failed\|timed out\|skipped\|out of memory" "$P/ab.log" "$P/e120.log" | grep -v "TCPStore\|should dump\|frame #" | head -5 | tee -a "$OUT/env.txt"
tar czf "$OUT/logs.tgz" -C "$P" .
