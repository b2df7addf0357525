#!/usr/bin/env bash
# Device run 96 (nvidia-h200-x2, TWO GPUs, ~6 minutes): session 12. Runs 93-95 found each rank's host busy ~85-89% of
# the loop, ~1.4 ms of it per layer-wave of 256 tokens, mostly per batch and per message, not per row (NOTES §29).
# So one wave of 512 tokens per home (attention cap 512: buckets up to 512, the device-routed expert cap 2 x 512 x 4
# = 4,096 slots) should cost little more host per layer than one of 256. 20B-L8, bf16, streaming/defrag + 30 ms hold
# against all-gather and all-to-all EP: (1) C=512 per rank, cap 512, clean and compute hog on GPU 1, one round;
# (2) C=256, cap 256 (the matrix setting), clean, one round, on the same instance for reference.
# Output: env.txt, ep512.md, ep256.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
SYS="streaming-defrag:hold_fill=1;hold_us=30000,ag-ep,a2a-ep"
P=$(mktemp -d /tmp/run96.XXXX)
timeout 330 python3 benchmarks/gpu_ep_bench.py --out "$P/a" --budget 320 --rounds 1 --attn-cap 512 --systems "$SYS" \
  --scenarios clean,compute-hog --concurrency 512 --new-tokens 64:128 > "$P/a.log" 2>&1
echo "ep C=512 exit $?" | tee -a "$OUT/env.txt"; cp "$P/a/ep_bench.md" "$OUT/ep512.md"; grep "^| " "$OUT/ep512.md" | grep -v "^|---" | cut -c1-230
grep -i "error\|failed\|timed out\|skipped" "$P/a.log" | head -5 | tee -a "$OUT/env.txt"
timeout 150 python3 benchmarks/gpu_ep_bench.py --out "$P/b" --budget 140 --rounds 1 --systems "$SYS" \
  --scenarios clean --concurrency 256 --new-tokens 64:128 > "$P/b.log" 2>&1
echo "ep C=256 exit $?" | tee -a "$OUT/env.txt"; cp "$P/b/ep_bench.md" "$OUT/ep256.md"; grep "^| " "$OUT/ep256.md" | grep -v "^|---" | cut -c1-230
