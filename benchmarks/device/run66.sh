#!/usr/bin/env bash
# Device run 66 (nvidia-h200, ONE GPU, ~3 minutes): run 65's e2e comparison again, 4 rounds, with step timers in the
# device-routed path (NOTES §25): gpu_bench e2e, run 57's shape (20B-L8, bf16, 2 in-process ranks on GPU 0, C=256,
# 64 new tokens), DATAFLOW_DISPATCH=host and =device alternating (order swapped every round), same tree.
# (Correctness of the device-routed path on the GPU: run 65.) Output: env.txt, ab.txt, phases.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
P=$(mktemp -d /tmp/run66.XXXX)
for r in 1 2 3 4; do
  ORDER="host device"; [ $((r % 2)) = 0 ] && ORDER="device host"
  for m in $ORDER; do
    DATAFLOW_DISPATCH=$m DATAFLOW_PROFILE_EXEC=1 timeout 80 python3 benchmarks/gpu_bench.py --out "$P/$m$r" --sections e2e \
      --systems streaming --policies defrag --layers 8 --concurrency 256 --max-new 64 > "$P/$m$r.log" 2>&1
    echo "$m round $r exit $?" >> "$OUT/env.txt"
    echo "$m $r $(grep '^| streaming' "$P/$m$r/gpu_bench.md" | cut -c1-200)" | tee -a "$OUT/ab.txt"
    { echo "=== $m round $r"; grep -E "attention dispatch:|executor (attention|experts):" "$P/$m$r.log"; } >> "$OUT/phases.txt"
  done
done
