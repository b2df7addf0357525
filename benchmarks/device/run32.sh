#!/usr/bin/env bash
# Device run 32 (nvidia-h200-x2, ~6 minutes), session 4: does rank 0's second attention wave explain the pair's
# imbalance? The plan's most_free_kv homes put 265 / 247 requests on ranks 0 / 1 at C=256 (KV blocks balanced,
# ShareGPT prompts), and 265 exceed the 256-row attention cap. Same bench with --home-policy most_free_kv vs
# round_robin (256 / 256), streaming/defrag + 30 ms hold and all-gather EP, 20B-L8, bf16, C=256, clean, twice
# each, rank phase timers. Output: env.txt, ab.txt, phases.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
P=$(mktemp -d /tmp/run32.XXXX)
for r in 1 2; do
  for h in most_free_kv round_robin; do
    mkdir -p "$P/$h$r"
    DATAFLOW_PROFILE_RANK=all DATAFLOW_PROFILE_CPROFILE=0 DATAFLOW_PROFILE_OUT="$P/$h$r/rank{rank}.prof" \
      timeout 140 python3 benchmarks/gpu_ep_bench.py --out "$P/$h$r" --budget 130 --home-policy $h \
      --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" --scenarios clean --concurrency 256 --new-tokens 64:128 > "$P/$h$r.log" 2>&1
    echo "$h round $r exit $?" >> "$OUT/env.txt"
    grep '^| ' "$P/$h$r/ep_bench.md" | grep -v "^| system" | cut -c1-200 | sed "s/^/$h $r /" | tee -a "$OUT/ab.txt"
    for k in 0 1; do echo "=== $h round $r rank $k"; head -16 "$P/$h$r/rank$k.prof.phases.txt"; done >> "$OUT/phases.txt" 2>&1
    grep -h "loop iterations" "$P/$h$r"/rank*.prof.phases.txt
  done
done
