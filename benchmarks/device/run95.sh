#!/usr/bin/env bash
# Device run 95 (nvidia-h200-x2, TWO GPUs, ~6 minutes): session 12. Run 93 found the host, not the device, setting a
# layer's cycle (NOTES §29 item 3). This tree adds the first host cut: no K/V order is recorded or checked while no
# chunked prompt is live (Request.chunked; ~100 us per 256-row wave measured as the dispatch's bookkeeping lap in run
# 94). (1) gpu_bench correctness on GPU 0; (2) fp32 2-GPU tokens == CPU under the hold; (3) A/B against 1635c0a
# (session 11's last tree: so this measures run 93's attention fusions and the host cut together), 20B-L8, bf16,
# C=256, clean, streaming/defrag + 30 ms hold, 3 rounds, both trees' wave timelines and phases.
# Before the call: mkdir -p .df/ab && git archive 1635c0a | gzip > .df/ab/old.tgz; carry [".whl", ".df/ab"].
# Output: env.txt, gpu_bench.md, tokens.txt, ab.txt, phases.txt, timelines.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -1 "$OUT/gpu_bench.log"; rm -f "$OUT/gpu_bench.json"
bash benchmarks/device/fp32_tokens_vs_cpu.sh "$OUT" "defrag:hold_fill=1,hold_us=3000" | grep "2-GPU"
DATAFLOW_TIMELINE=1 AB_TIMEOUT=95 bash benchmarks/device/ab_trees.sh "$OUT" .df/ab/old.tgz 3 --budget 80 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency 256 --new-tokens 64:128
grep -E "^===|^  (attn host|cycle|home tail)|host us, median" "$OUT/timelines.txt"
grep -E "^===|complete:attn|execute:attn" "$OUT/phases.txt" | head -36
