#!/usr/bin/env bash
# Device run 60 (nvidia-h200, ONE GPU, ~2 minutes): an A/A check of the A/B method itself. Runs 57-59 alternated
# old/new launches with old always first, old from a tree extracted under /tmp and new from the working copy; in
# each of them "new" won the dispatch phase by about the same margin, whatever the change. Here both slots hold the
# same tree (.df/ab/old.tgz = git archive of this commit), both run from /tmp copies, the order swapped every round
# (ab_trees.sh as of session 8): any gap left is noise. gpu_bench e2e, run 57's shape, 4 rounds.
# Before the call: mkdir -p .df/ab && git archive HEAD | gzip > .df/ab/old.tgz; carry [".whl", ".df/ab"].
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
AB_BENCH=gpu_bench AB_TIMEOUT=80 bash benchmarks/device/ab_trees.sh "$OUT" .df/ab/old.tgz 4 --sections e2e \
  --systems streaming --policies defrag --layers 8 --concurrency 256 --max-new 64
