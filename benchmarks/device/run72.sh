#!/usr/bin/env bash
# Device run 72 (nvidia-h200-x2, TWO GPUs, ~4 minutes; the session's last device minutes): session 9's final tree.
# (1) gpu_bench correctness on GPU 0, now on a cuda plan (its dispatch recorded in the plan: device-routed), both
# FFN implementations; (2) fp32 2-GPU NCCL tokens == CPU (dataflow compile --device cuda: device-routed by the plan);
# (3) 20B-L8, C=256, clean and compute hog, streaming/defrag + 30 ms hold against all-gather EP, 1 round: the
# expert GB/s column for device-routed expert batches (sampled, one in 8) and the final tree's numbers.
# Output: env.txt, gpu_bench.md, tokens.txt, ep.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -1 "$OUT/gpu_bench.log"; rm -f "$OUT/gpu_bench.json" "$OUT/gpu_bench.log"
bash benchmarks/device/fp32_tokens_vs_cpu.sh "$OUT" defrag | grep "2-GPU"
P=$(mktemp -d /tmp/run72.XXXX)
timeout 130 python3 benchmarks/gpu_ep_bench.py --out "$P" --budget 125 --launch-timeout 70 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" --scenarios clean,compute-hog --concurrency 256 \
  --new-tokens 64:128 > "$P/ep.log" 2>&1
echo "ep exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/ep.md"
grep "^| " "$OUT/ep.md" | grep -v "^|---" | cut -c1-240; grep -i "failed\|timed out" "$P/ep.log" | head -3 >> "$OUT/env.txt"
