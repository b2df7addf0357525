#!/usr/bin/env bash
# Device run 69 (nvidia-h200-x2, TWO GPUs, ~9 minutes): session 9, after run 67 made the device-routed dispatch the
# default on a GPU (DATAFLOW_DISPATCH=auto). (1) gpu_bench's correctness section on GPU 0 with the default: fp32 GPU
# tokens == CPU and bf16 within tolerance, every policy, both FFN implementations, through the new expert_routed
# graph kind (grouped_mm masks a held row: only a GPU runs it); (2) fp32 2-GPU NCCL tokens == CPU with the default;
# (3) the expert_routed graph kind (c635b03: slot expansion, id mapping and masking inside the graph, 12.3 -> 7.5
# tensor calls per expert batch on the twin) against 7d17415 (the same done by the host, session 8), both with
# DATAFLOW_DISPATCH=device, GPT-OSS-20B cut to 8 layers, bf16, C=256, clean, streaming/defrag + 30 ms hold, 2 rounds
# (ab_trees.sh). Before the call: mkdir -p .df/ab && git archive 7d17415 | gzip > .df/ab/old.tgz; carry
# [".whl", ".df/ab"]. Output: env.txt, gpu_bench.md, tokens.txt, ab.txt, phases.txt (compare execute:expert per call).
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
CUDA_VISIBLE_DEVICES=0 timeout 130 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness (default dispatch) exit $?" | tee -a "$OUT/env.txt"; tail -2 "$OUT/gpu_bench.log"; rm -f "$OUT/gpu_bench.json" "$OUT/gpu_bench.log"
bash benchmarks/device/fp32_tokens_vs_cpu.sh "$OUT" defrag | grep "2-GPU"
DATAFLOW_DISPATCH=device AB_TIMEOUT=95 bash benchmarks/device/ab_trees.sh "$OUT" .df/ab/old.tgz 2 --budget 80 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency 256 --new-tokens 64:128
