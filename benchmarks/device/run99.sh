#!/usr/bin/env bash
# Device run 99 (nvidia-h200-x2, TWO GPUs, ~4 minutes): session 12, last. (1) gpu_bench correctness on GPU 0 and the
# fp32 2-GPU tokens == CPU on the final tree (since run 95 the engine only gained a metric counter in next_batch);
# (2) the 120B column at the C=256 (attention cap 256): GPT-OSS-120B cut to 18 layers, bf16, 48-96 new
# tokens, streaming/defrag + 30 ms hold against all-gather EP, clean, NVLink hog, compute hog on GPU 1, one round
# (run 86: C=128, 1.09x / 1.16x / 3.41x; run 98: C=512, 0.92x / 1.04x / 2.64x). Output: env.txt, gpu_bench.md,
# tokens.txt, ep120.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -1 "$OUT/gpu_bench.log"; rm -f "$OUT/gpu_bench.json"
bash benchmarks/device/fp32_tokens_vs_cpu.sh "$OUT" "defrag:hold_fill=1,hold_us=3000" | grep "2-GPU"
P=$(mktemp -d /tmp/run99.XXXX)
timeout 300 python3 benchmarks/gpu_ep_bench.py --out "$P" --model gpt-oss-120b --budget 290 --rounds 1 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000,ag-ep" --scenarios clean,nvlink-hog,compute-hog \
  --concurrency 256 --new-tokens 48:96 > "$P/ep120.log" 2>&1
echo "ep120 exit $?" | tee -a "$OUT/env.txt"; cp "$P/ep_bench.md" "$OUT/ep120.md"
grep "^| " "$OUT/ep120.md" | grep -v "^|---" | cut -c1-230
grep -i "error\|failed\|timed out\|skipped" "$P/ep120.log" | grep -v "TCPStore\|should dump" | head -5 | tee -a "$OUT/env.txt"
