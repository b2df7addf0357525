#!/usr/bin/env bash
# Device run 107 (nvidia-h200-x2, TWO GPUs, ~1.5 minutes): session 13's final tree, a diagnosis. The phase profiler
# now counts only the serving loop's garbage collections (until this session start-up's were counted too, so run 100's
# 60-70 ms of gen0/gen1 per 2.8 s could not be read as the loop's). One launch of streaming/defrag + 30 ms hold,
# 20B-L8, bf16, C=512 (default cap), clean, DATAFLOW_PROFILE_RANK=all (cProfile off): per rank the loop's phases and
# its collections by generation, with the startup heap frozen. Output: env.txt, phases.txt, ep.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
P=$(mktemp -d /tmp/run107.XXXX)
DATAFLOW_PROFILE_RANK=all DATAFLOW_PROFILE_CPROFILE=0 DATAFLOW_PROFILE_OUT="$P/rank{rank}.prof" \
  timeout 90 python3 benchmarks/gpu_ep_bench.py --out "$P/a" --budget 80 --rounds 1 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency 512 --new-tokens 64:128 \
  > "$P/a.log" 2>&1
echo "ep exit $?" | tee -a "$OUT/env.txt"; cp "$P/a/ep_bench.md" "$OUT/ep.md"
for k in 0 1; do echo "=== rank $k"; head -22 "$P/rank$k.prof.phases.txt"; done > "$OUT/phases.txt" 2>&1
grep "^| streaming" "$OUT/ep.md" | cut -c1-170
grep -E "===|loop iterations|gc gen" "$OUT/phases.txt"
