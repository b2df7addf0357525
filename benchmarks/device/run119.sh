#!/usr/bin/env bash
# Device run 119 (nvidia-h200-x2, TWO GPUs, ~6 minutes; not run in session 15: no two-GPU machine was lent): the issue-7 matrix at C=512 on session 15's tree (NOTES §32),
# run 114's setting: 20B-L8, bf16, 2 rounds, streaming/defrag + 30 ms wave hold against all-gather EP,
# clean, compute hog on GPU 1, +5 ms link bursts, NVLink hog. Output: env.txt, ep512.md, logs.tgz.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
P=$(mktemp -d /tmp/run119.XXXX)
timeout 340 python3 benchmarks/gpu_ep_bench.py --out "$P/m" --budget 330 --rounds 2 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" \
  --scenarios clean,compute-hog,delay-5ms,nvlink-hog --concurrency 512 --new-tokens 64:128 > "$P/m.log" 2>&1
echo "matrix exit $?" | tee -a "$OUT/env.txt"; cp "$P/m/ep_bench.md" "$OUT/ep512.md"
grep "^| " "$OUT/ep512.md" | grep -v "^|---" | cut -c1-170
grep -i "error\|failed\|timed out\|skipped\|out of memory" "$P/m.log" | grep -v "TCPStore\|should dump\|frame #" | head -5 | tee -a "$OUT/env.txt"
tar czf "$OUT/logs.tgz" -C "$P" .
