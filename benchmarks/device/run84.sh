#!/usr/bin/env bash
# Device run 84 (nvidia-h200-x2, TWO GPUs, ~8 minutes): session 11; run 83 again after its failure (a sample graph key
# of two fields broke GraphCache.drop where graphs are captured; keys are now checked on the CPU too). Three changes
# against 334df14 (session 10's tree): (a) sample graphs (the plan's sample buckets captured: final norm, LM head,
# greedy argmax; execute:sample per call in phases.txt, run 83's old tree 1,324-1,591 us); (b) the device-routed expert
# cap holds every home's whole batch (2 x 256 x 4 = 2,048 slots; run 82's timeline: the owner's own wave filled the
# 1,024-slot cap while the other home's payload waited in the queue, ~40% of layers); (c) the payload leaves before
# the attention batch's bookkeeping (Engine._send_routed). (1) gpu_bench correctness (new graph bodies); (2) fp32 2-GPU
# tokens == CPU under the hold; (3) A/B against 334df14, 20B-L8, bf16, C=256, clean, streaming/defrag + 30 ms hold,
# 2 rounds, with the wave timeline of the new tree's launches (timelines.txt: expert batches of several homes, legs).
# Before the call: mkdir -p .df/ab && git archive 334df14 | gzip > .df/ab/old.tgz; carry [".whl", ".df/ab"].
# Output: env.txt, gpu_bench.md, tokens.txt, ab.txt, phases.txt, timelines.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -1 "$OUT/gpu_bench.log"; rm -f "$OUT/gpu_bench.json"
bash benchmarks/device/fp32_tokens_vs_cpu.sh "$OUT" "defrag:hold_fill=1,hold_us=3000" | grep "2-GPU"
DATAFLOW_TIMELINE=1 AB_TIMEOUT=95 bash benchmarks/device/ab_trees.sh "$OUT" .df/ab/old.tgz 2 --budget 80 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency 256 --new-tokens 64:128
grep -E "^===|several homes|^  (cycle|holder queue|home tail)|^on the holder" "$OUT/timelines.txt"
grep -E "^===|execute:sample|execute:expert|loop" "$OUT/phases.txt" | head -40
