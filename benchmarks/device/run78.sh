#!/usr/bin/env bash
# Device run 78 (nvidia-h200-x2, TWO GPUs, ~7 minutes): session 10, last. An attention bucket's meta buffer keeps
# the last upload (positions and table rows): a decode wave's next layer, the same rows under the wave hold, skips
# the upload (NOTES §27 item 5; on the twin 16 uploads for 128 attention batches under the hold). (1) fp32 2-GPU NCCL
# tokens == CPU with the hold policy, where the skip happens; (2) A/B against f265178 (before it), 20B-L8, bf16, C=256,
# clean, streaming/defrag + 30 ms hold, 2 rounds: execute:attn per call in phases.txt.
# Before the call: mkdir -p .df/ab && git archive f265178 | gzip > .df/ab/old.tgz; carry [".whl", ".df/ab"].
# Output: env.txt, tokens.txt, ab.txt, phases.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
bash benchmarks/device/fp32_tokens_vs_cpu.sh "$OUT" "defrag:hold_fill=1,hold_us=3000" | grep "2-GPU"
AB_TIMEOUT=95 bash benchmarks/device/ab_trees.sh "$OUT" .df/ab/old.tgz 2 --budget 80 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency 256 --new-tokens 64:128
