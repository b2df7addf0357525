#!/usr/bin/env bash
# Device run 120 (nvidia-h200, ONE GPU, ~3 minutes): where a decision's host goes (the decision laps are new: deferred
# completions, views, policy, take, batch), on session 15's tree, in gpu_bench e2e (both ranks in one process on one
# GPU), 20B-L8, C=256, defrag, 64 new tokens, against 3cdf379, 2 rounds (run 116's setting, fewer rounds).
# Before the call: mkdir -p .df/ab && git archive 3cdf379 | gzip > .df/ab/old.tgz; carry [".whl", ".df/ab"].
# Output: env.txt, ab.txt, phases.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
AB_BENCH=gpu_bench AB_TIMEOUT=80 bash benchmarks/device/ab_trees.sh "$OUT" .df/ab/old.tgz 2 --sections e2e \
  --systems streaming --policies defrag --layers 8 --concurrency 256 --max-new 64
cut -c1-160 "$OUT/ab.txt"
grep -E "^===|decision" "$OUT/phases.txt" | cut -c1-400
