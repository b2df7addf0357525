#!/usr/bin/env bash
# Device run 128 (nvidia-h200-x2, TWO GPUs, ~4 minutes): the short form of run117.sh for the device time left in
# session 15, on the final tree with the NCCL-only items brought back (`git cherry-pick 165d62f 45df8d4 e9d962f`,
# NOTES §32 items 3 and 5): (1) the transport tests on two GPUs (NCCL exchange, lib and c10d); (2) fp32 2-GPU tokens
# == CPU; (3) one A/B round against 3cdf379, 20B-L8, bf16, C=512, clean, streaming/defrag + 30 ms hold.
# Before the call: mkdir -p .df/ab && git archive 3cdf379 | gzip > .df/ab/old.tgz; carry [".whl", ".df/ab"].
# Output: env.txt, checks.txt, tokens.txt, ab.txt, phases.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_transport_dist.py 2>&1 | tail -3 | tee "$OUT/checks.txt"
bash benchmarks/device/fp32_tokens_vs_cpu.sh "$OUT" "defrag:hold_fill=1,hold_us=3000" | grep "2-GPU"
AB_TIMEOUT=70 bash benchmarks/device/ab_trees.sh "$OUT" .df/ab/old.tgz 1 --budget 55 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency 512 --new-tokens 64:128
cut -c1-150 "$OUT/ab.txt"
