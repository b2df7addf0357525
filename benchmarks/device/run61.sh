#!/usr/bin/env bash
# Device run 61 (nvidia-h200, ONE GPU, ~3 minutes): run 59's question again with the method run 60 checked (both trees
# from /tmp copies, the order swapped every round): session 8's host path (the numba dispatch plan, the staging upload
# in one .to()) against session 7's final tree a540828. gpu_bench e2e, run 57's shape, 6 rounds.
# Before the call: mkdir -p .df/ab && git archive a540828 | gzip > .df/ab/old.tgz; carry [".whl", ".df/ab"].
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
AB_BENCH=gpu_bench AB_TIMEOUT=80 bash benchmarks/device/ab_trees.sh "$OUT" .df/ab/old.tgz 6 --sections e2e \
  --systems streaming --policies defrag --layers 8 --concurrency 256 --max-new 64
