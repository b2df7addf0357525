#!/usr/bin/env bash
# Device run 106 (nvidia-h200-x2, TWO GPUs, ~3 minutes): session 13's final tree (default attention cap 1024; the
# startup heap frozen before each workload, unfrozen and collected again before the next; kernels/fast_launch.py
# removed again). (1) gpu_bench correctness on GPU 0; fp32 2-GPU tokens == CPU; (2) a launch of several workloads per
# rank process (warm-up, clean, NVLink hog), 20B-L8, bf16, C=512, streaming/defrag + 30 ms hold against all-gather EP,
# one round: ITL p99 without the collector's stalls, and nothing held across workloads.
# Output: env.txt, gpu_bench.md, tokens.txt, ep512.md, logs.tgz.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
P=$(mktemp -d /tmp/run106.XXXX)
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$P/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -1 "$P/gpu_bench.log"; rm -f "$OUT/gpu_bench.json"
bash benchmarks/device/fp32_tokens_vs_cpu.sh "$OUT" "defrag:hold_fill=1,hold_us=3000" | grep "2-GPU"
timeout 150 python3 benchmarks/gpu_ep_bench.py --out "$P/m" --budget 140 --rounds 1 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" --scenarios clean,nvlink-hog \
  --concurrency 512 --new-tokens 64:128 > "$P/m.log" 2>&1
echo "ep512 exit $?" | tee -a "$OUT/env.txt"; cp "$P/m/ep_bench.md" "$OUT/ep512.md"
grep "^| " "$OUT/ep512.md" | grep -v "^|---" | cut -c1-170
grep -i "error\|failed\|timed out\|skipped\|out of memory\|leaked" "$P/m.log" | grep -v "TCPStore\|should dump\|frame #" | head -5 | tee -a "$OUT/env.txt"
tar czf "$OUT/logs.tgz" -C "$P" .
