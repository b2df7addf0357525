#!/usr/bin/env bash
# Device run 110 (nvidia-h200-x2, TWO GPUs, ~9 minutes): session 14's tree (NOTES §31): run 109's host cuts, plus the
# decode wave's fit check memoized, layer 0's embedding in 3-4 torch calls, receives posted between a batch's launch
# and its bookkeeping (Transport.post_receives), an expert batch's remote partial sums sent before its local merge,
# the device page-table rows of admitted sequences written in one batched flush per attention batch.
# (1) gpu_bench correctness on GPU 0; (2) fp32 2-GPU tokens == CPU; (3) A/B against e335aa9 (session 13's runtime),
# 20B-L8, bf16, C=512, clean, streaming/defrag + 30 ms hold, 3 rounds, with both trees' wave timelines (the legs of a
# home's layer: to holder, holder queue, back, home tail; benchmarks/wave_timeline.py) and phases; (4) one launch of
# this tree with the laps (DATAFLOW_PROFILE_EXEC=1).
# Before the call: mkdir -p .df/ab && git archive e335aa9 | gzip > .df/ab/old.tgz; carry [".whl", ".df/ab"].
# Output: env.txt, gpu_bench.md, tokens.txt, ab.txt, phases.txt, timelines.txt, laps.log.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -1 "$OUT/gpu_bench.log"; rm -f "$OUT/gpu_bench.json" "$OUT/gpu_bench.log"
bash benchmarks/device/fp32_tokens_vs_cpu.sh "$OUT" "defrag:hold_fill=1,hold_us=3000" | grep "2-GPU"
DATAFLOW_TIMELINE=1 AB_TIMEOUT=75 bash benchmarks/device/ab_trees.sh "$OUT" .df/ab/old.tgz 3 --budget 60 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency 512 --new-tokens 64:128
P=$(mktemp -d /tmp/run110.XXXX)
DATAFLOW_PROFILE_EXEC=1 DATAFLOW_PROFILE_RANK=all DATAFLOW_PROFILE_CPROFILE=0 DATAFLOW_PROFILE_OUT="$P/rank{rank}.prof" \
  timeout 75 python3 benchmarks/gpu_ep_bench.py --out "$P/l" --budget 60 --rounds 1 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency 512 --new-tokens 64:128 \
  > "$P/laps.log" 2>&1
echo "laps exit $?" | tee -a "$OUT/env.txt"
{ grep -E "attention (execute|dispatch)|executor (attention|experts)|^\| streaming" "$P/laps.log" | cut -c1-700
  for k in 0 1; do echo "=== laps launch rank $k"; head -20 "$P/rank$k.prof.phases.txt"; done; } > "$OUT/laps.log"
cut -c1-150 "$OUT/ab.txt"
grep -E "^===|^  (attn host|cycle|home tail|back)|host us, median" "$OUT/timelines.txt" | head -40
