#!/usr/bin/env bash
# Device run 74 (nvidia-h200-x2, TWO GPUs, ~8 minutes): session 10. The device-routed payload made by the attention
# graph and consumed whole by the routed expert graph (NOTES §27 item 2). (1) gpu_bench correctness on GPU 0, both
# FFN implementations (the attention and routed expert graphs changed); (2) fp32 2-GPU NCCL tokens == CPU (device-
# routed by the plan); (3) A/B against e1f7bd0 (before it), 20B-L8, bf16, C=256, clean, streaming/defrag + 30 ms hold,
# 2 rounds (ab_trees.sh): complete:attn, execute:expert per call in phases.txt.
# Before the call: mkdir -p .df/ab && git archive e1f7bd0 | gzip > .df/ab/old.tgz; carry [".whl", ".df/ab"].
# Output: env.txt, gpu_bench.md, tokens.txt, ab.txt, phases.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -1 "$OUT/gpu_bench.log"; rm -f "$OUT/gpu_bench.json"
bash benchmarks/device/fp32_tokens_vs_cpu.sh "$OUT" defrag | grep "2-GPU"
AB_TIMEOUT=95 bash benchmarks/device/ab_trees.sh "$OUT" .df/ab/old.tgz 2 --budget 80 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency 256 --new-tokens 64:128
