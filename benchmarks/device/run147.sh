#!/usr/bin/env bash
# Device run 147 (nvidia-h200, ONE GPU, ~7 minutes): the eager attention path without host synchronizations (NOTES
# §34 item 5: the positions as the host knows them, the KV stores' index uploads through the pinned ring). (1)
# one_gpu_checks.sh; (2) mixed_batch_bench, GPT-OSS-20B shapes (the executor's chunk part runs eagerly); (3)
# arrivals_bench (the default: split), this tree against the tree before (e62c7f9, carried as .df/ab/old.tgz), launches
# alternating, 2 each: never-ending arrivals of short prompts (512 requests, 64 at t=0 then 300/s, 16-128 tokens) and
# a prefill-heavy one (384 requests, 128 at t=0 then 400/s, 64-512 tokens), GPT-OSS-20B cut to 4 layers, bf16.
# Output: env.txt, checks.txt, gpu_bench.md, mixed.md, ab.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
OLD=$(mktemp -d /tmp/old_tree.XXXX); tar -xzf .df/ab/old.tgz -C "$OLD"
bash benchmarks/device/one_gpu_checks.sh "$OUT"
{ timeout 100 python3 benchmarks/mixed_batch_bench.py --spec gpt-oss-20b --layers 1 --decode 256 --chunk 256 --context 512
  timeout 80 python3 benchmarks/mixed_batch_bench.py --spec gpt-oss-20b --layers 1 --decode 64 --chunk 64 --context 512
} > "$OUT/mixed.md" 2>&1
echo "mixed_batch_bench exit $?" | tee -a "$OUT/env.txt"; grep -E "^\|.*(mixed|decode)|faster" "$OUT/mixed.md"
for W in busy prefill; do
  ARGS="--rounds 1 --requests 512 --initial 64 --rate 300 --prompt 16:128 --max-new 64:128 --variants split"
  [ $W = prefill ] && ARGS="--rounds 1 --requests 384 --initial 128 --rate 400 --prompt 64:512 --max-new 64:128 --variants split"
  for r in 1 2; do
    ORDER="old new"; [ $r = 2 ] && ORDER="new old"
    for v in $ORDER; do
      T=$PWD; [ $v = old ] && T=$OLD
      (cd "$T" && PYTHONPATH=/tmp/site:$T timeout 110 python3 benchmarks/arrivals_bench.py $ARGS) 2>&1 \
        | grep -E "^\| split" | sed "s/^| split/| $W $v r$r/" | tee -a "$OUT/ab.txt"
    done
  done
done
