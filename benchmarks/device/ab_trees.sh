#!/usr/bin/env bash
# Helper of the A/B runs (31's pattern; used by 36): `bash benchmarks/device/ab_trees.sh OUT OLD_TGZ ROUNDS GPU_EP_BENCH_ARGS...`
# (from the repository root, after prelude.sh). Alternates launches of gpu_ep_bench from the tree in OLD_TGZ (a
# `git archive | gzip` of the commit before, carried with the device tool's `carry`) and from this tree, ROUNDS
# times, with both ranks' phase timers. Appends to OUT/ab.txt (the table row of each launch), OUT/phases.txt and
# OUT/env.txt (exit codes).
set -u
OUT=$(cd "${1:?out dir}" && pwd); TGZ=${2:?old tree tarball}; ROUNDS=${3:?rounds}; shift 3
OLD=$(mktemp -d /tmp/old_tree.XXXX); tar -xzf "$TGZ" -C "$OLD"
NEW=$PWD
P=$(mktemp -d /tmp/ab.XXXX)
for r in $(seq 1 "$ROUNDS"); do
  for v in old new; do
    T=$NEW; [ $v = old ] && T=$OLD
    mkdir -p "$P/$v$r"
    (cd "$T" && PYTHONPATH=/tmp/site:$T DATAFLOW_PROFILE_RANK=all DATAFLOW_PROFILE_CPROFILE=0 DATAFLOW_PROFILE_OUT="$P/$v$r/rank{rank}.prof" \
      timeout 120 python3 benchmarks/gpu_ep_bench.py --out "$P/$v$r" "$@" > "$P/$v$r.log" 2>&1)
    echo "$v round $r exit $?" >> "$OUT/env.txt"
    echo "$v $r $(grep '^| streaming' "$P/$v$r/ep_bench.md" | cut -c1-200)" | tee -a "$OUT/ab.txt"
    for k in 0 1; do echo "=== $v round $r rank $k"; head -16 "$P/$v$r/rank$k.prof.phases.txt"; done >> "$OUT/phases.txt" 2>&1
  done
done
