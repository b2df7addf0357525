#!/usr/bin/env bash
# Device run 76 (nvidia-h200-x2, TWO GPUs, ~7 minutes): session 10. Run 75 had one round only and the NVLink-hog cell
# moved the wrong way (20,400 -> 16,833 tok/s with 4x fewer combine bytes): the same A/B (per-token partial sums
# against 39369fa), streaming/defrag + 30 ms hold only, clean and NVLink hog, 2 more rounds, order swapped per round.
# Before the call: mkdir -p .df/ab && git archive 39369fa | gzip > .df/ab/old.tgz; carry [".whl", ".df/ab"].
# Output: env.txt, ab.txt, phases.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
AB_TIMEOUT=125 bash benchmarks/device/ab_trees.sh "$OUT" .df/ab/old.tgz 2 --budget 120 --launch-timeout 115 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean,nvlink-hog --concurrency 256 \
  --new-tokens 64:128
