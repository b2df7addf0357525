#!/usr/bin/env bash
# Device run 137 (nvidia-h200, ONE GPU, ~4 minutes): after run 136, separate attention batches for prompts' chunks
# made opt-in (DATAFLOW_SEPARATE_PREFILL=1; NOTES §33 item 4). (1) gpu_bench's correctness section with the default
# (mixed batches) and then with DATAFLOW_SEPARATE_PREFILL=1 (run 136's 8 bf16 rows over tolerance: again?);
# (2) benchmarks/arrivals_bench.py on a decode-heavy workload (short prompts arriving through the decode phase:
# every arrival makes its wave's step mixed): 256 requests, 128 at t=0, then 100/s, prompts 16-128, 64-128 new
# tokens, GPT-OSS-20B cut to 4 layers, bf16, separate / mixed / before, 2 rounds.
# Output: env.txt, gpu_bench.md, gpu_bench_separate.md, arrivals.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
timeout 100 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -1 "$OUT/gpu_bench.log"; rm -f "$OUT/gpu_bench.json" "$OUT/gpu_bench.log"
mkdir -p /tmp/sep; DATAFLOW_SEPARATE_PREFILL=1 timeout 100 python3 benchmarks/gpu_bench.py --out /tmp/sep --sections correctness > /tmp/sep/log 2>&1
echo "gpu_bench correctness, separate, exit $?" | tee -a "$OUT/env.txt"; tail -1 /tmp/sep/log; cp /tmp/sep/gpu_bench.md "$OUT/gpu_bench_separate.md"
timeout 300 python3 benchmarks/arrivals_bench.py --rounds 2 --requests 256 --initial 128 --rate 100 --prompt 16:128 \
  --max-new 64:128 > "$OUT/arrivals.md" 2>&1
echo "arrivals_bench exit $?" | tee -a "$OUT/env.txt"; cat "$OUT/arrivals.md"
