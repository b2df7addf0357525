#!/usr/bin/env bash
# Device run 62 (nvidia-h200, ONE GPU, ~3 minutes): run 57's question again, cleanly. Run 57 meant to measure session 7's
# host-path changes made after its last device run (bounded device waits, routing as numpy arrays, cached static views;
# NOTES §22 items 11, 14, 15) but its "new" tree was the working copy at call time, with session 8's dispatch plan
# half written in it. Here: a540828 (session 7's final tree, this checkout) against 1508b2a (before those changes),
# both from /tmp copies, order swapped every round; gpu_bench e2e, run 57's shape, 6 rounds.
# Before the call: git worktree or checkout of a540828 is NOT needed: the script extracts both from .df/ab
#   mkdir -p .df/ab && git archive 1508b2a | gzip > .df/ab/old.tgz && git archive a540828 | gzip > .df/ab/new.tgz
# carry [".whl", ".df/ab"].
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
HERE=$PWD; NEWT=$(mktemp -d /tmp/s7.XXXX); tar -xzf .df/ab/new.tgz -C "$NEWT"; cp -r .whl "$NEWT/"
(cd "$NEWT" && AB_BENCH=gpu_bench AB_TIMEOUT=80 bash "$HERE/benchmarks/device/ab_trees.sh" "$OUT" "$HERE/.df/ab/old.tgz" 6 \
  --sections e2e --systems streaming --policies defrag --layers 8 --concurrency 256 --max-new 64)
