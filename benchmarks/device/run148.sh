#!/usr/bin/env bash
# Device run 148 (nvidia-h200, ONE GPU, ~4 minutes): run 147's per-layer numbers against the tree before, on one
# instance (hosts differ 2x between instances: run 147's "one segment at a time" 309 ms against run 141's 132):
# mixed_batch_bench at GPT-OSS-20B shapes, 256 decode rows + a 256-row chunk and 64 + 64, from this tree and from
# e62c7f9 (.df/ab/old.tgz), launches alternating old new new old.
# Output: env.txt, mixed_ab.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
OLD=$(mktemp -d /tmp/old_tree.XXXX); tar -xzf .df/ab/old.tgz -C "$OLD"
for v in old new new old; do
  T=$PWD; [ $v = old ] && T=$OLD
  for shape in "256 256" "64 64"; do
    set -- $shape
    (cd "$T" && PYTHONPATH=/tmp/site:$T timeout 100 python3 benchmarks/mixed_batch_bench.py --spec gpt-oss-20b --layers 1 \
      --decode $1 --chunk $2 --context 512 --reps 10) 2>&1 | grep -E "^\| (pure|mixed)" | sed "s/^| /| $v $1+$2: /" | tee -a "$OUT/mixed_ab.txt"
  done
done
