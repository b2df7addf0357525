#!/usr/bin/env bash
# Device run 144 (nvidia-h200, ONE GPU, ~4 minutes): (1) gpu_bench's correctness section with router near-tie steps
# left out of the bf16 teacher-forced comparison (NOTES §34 item 3); (2) is run 142-143's split-vs-mixed difference
# under never-ending arrivals (split ~7-12% fewer tokens/s, TTFT ~2x, ITL p99 6 against 200-500 ms, with only 4-8 of
# ~700 attention batches split) the split's or the run's dynamics: the busy workload at 250/s and 350/s, split /
# mixed alternating, 2 rounds each.
# Output: env.txt, gpu_bench.md, arrivals_250.md, arrivals_350.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
timeout 120 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -1 "$OUT/gpu_bench.log"; grep -E "tf max" "$OUT/gpu_bench.log" | cut -c1-40,100-260 | head -20
rm -f "$OUT/gpu_bench.json" "$OUT/gpu_bench.log"
for R in 250 350; do
  timeout 130 python3 benchmarks/arrivals_bench.py --rounds 2 --requests 512 --initial 64 --rate $R --prompt 16:128 \
    --max-new 64:128 --variants split,mixed > "$OUT/arrivals_$R.md" 2>&1
  echo "arrivals_bench rate $R exit $?" | tee -a "$OUT/env.txt"; grep -E "^\| |round|attention batches" "$OUT/arrivals_$R.md"
done
