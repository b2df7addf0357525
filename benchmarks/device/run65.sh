#!/usr/bin/env bash
# Device run 65 (nvidia-h200, ONE GPU, ~3 minutes): the device-routed dispatch (DATAFLOW_DISPATCH=device, NOTES §25)
# on a GPU for the first time. (1) gpu_bench's correctness section with it on: fp32 GPU tokens == CPU and bf16
# teacher-forced logits within tolerance, every policy, both FFN implementations (grouped_mm masks a held row
# instead of a sentinel: only a GPU runs it); (2) gpu_bench e2e, run 57's shape (20B-L8, bf16, 2 in-process ranks
# on GPU 0, C=256, 64 new tokens), DATAFLOW_DISPATCH=host and =device alternating, 3 rounds, same tree.
# Output: env.txt, gpu_bench.md (correctness), ab.txt, phases.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
DATAFLOW_DISPATCH=device timeout 120 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness (device-routed) exit $?" | tee -a "$OUT/env.txt"; tail -2 "$OUT/gpu_bench.log"; rm -f "$OUT/gpu_bench.json" "$OUT/gpu_bench.log"
P=$(mktemp -d /tmp/run65.XXXX)
for r in 1 2 3; do
  ORDER="host device"; [ $((r % 2)) = 0 ] && ORDER="device host"
  for m in $ORDER; do
    DATAFLOW_DISPATCH=$m DATAFLOW_PROFILE_EXEC=1 timeout 80 python3 benchmarks/gpu_bench.py --out "$P/$m$r" --sections e2e \
      --systems streaming --policies defrag --layers 8 --concurrency 256 --max-new 64 > "$P/$m$r.log" 2>&1
    echo "$m round $r exit $?" >> "$OUT/env.txt"
    echo "$m $r $(grep '^| streaming' "$P/$m$r/gpu_bench.md" | cut -c1-200)" | tee -a "$OUT/ab.txt"
    { echo "=== $m round $r"; grep -E "attention dispatch:|executor (attention|experts):" "$P/$m$r.log"; } >> "$OUT/phases.txt"
  done
done
