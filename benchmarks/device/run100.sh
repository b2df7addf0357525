#!/usr/bin/env bash
# Device run 100 (nvidia-h200-x2, TWO GPUs, ~2 minutes): session 12, a diagnosis (NOTES §29 item 4). execute:attn costs
# ~290-320 us per call in the phases while the executor's laps sum to ~128 us. One launch of streaming/defrag + 30 ms
# hold, 20B-L8, bf16, C=256, clean, with DATAFLOW_PROFILE_EXEC=1 (the executor's laps, the dispatch's, and now the
# engine's attention execute laps: embed / gather_h, segments, executor, payload) and the loop's phases
# (DATAFLOW_PROFILE_RANK=all, cProfile off), in the same run. Output: env.txt, laps.log, phases.txt, ep.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
P=$(mktemp -d /tmp/run100.XXXX)
DATAFLOW_PROFILE_EXEC=1 DATAFLOW_PROFILE_RANK=all DATAFLOW_PROFILE_CPROFILE=0 DATAFLOW_PROFILE_OUT="$P/rank{rank}.prof" \
  timeout 110 python3 benchmarks/gpu_ep_bench.py --out "$P/a" --budget 100 --rounds 1 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency 256 --new-tokens 64:128 \
  > "$OUT/laps.log" 2>&1
echo "laps exit $?" | tee -a "$OUT/env.txt"; cp "$P/a/ep_bench.md" "$OUT/ep.md"
for k in 0 1; do echo "=== rank $k"; head -16 "$P/rank$k.prof.phases.txt"; done > "$OUT/phases.txt" 2>&1
grep -E "attention execute|executor attention|attention dispatch" "$OUT/laps.log" | cut -c1-420
grep -E "===|execute:attn|complete:attn" "$OUT/phases.txt"
