#!/usr/bin/env bash
# Device run 88 (nvidia-h200-x2, GPU 0 only, ~2 minutes): session 11. What the captured graphs run on the device
# (gpu_bench --profile-graphs: torch.profiler over 10 replays, kernels grouped by name). NOTES §7 counted ~68 nodes in
# one decode attention layer on the CPU twin and predicted fusions from it; run 84's timeline puts ~400 us of device
# per 256-row attention batch on the wave's critical path against a ~40 us bytes floor at short contexts. Attention
# B=256 at ctx 256 and 2048 (GPT-OSS-20B shapes, bf16, both layer kinds: sliding and full), and the host-routed expert
# graph at 1,024 and 2,048 rows (Triton FFN). Output: env.txt, gpu_bench.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
CUDA_VISIBLE_DEVICES=0 timeout 400 python3 benchmarks/gpu_bench.py --out "$OUT" --sections executor --profile-graphs \
  --attn-batch 256 --contexts 256,2048 --expert-rows 1024,2048 --ffn-impls triton > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench executor exit $?" | tee -a "$OUT/env.txt"; rm -f "$OUT/gpu_bench.json"
grep -E "attention graphs=True|experts ffn=triton +graphs=True" "$OUT/gpu_bench.log"
sed -n '/### Graph kernels/,$p' "$OUT/gpu_bench.md" | head -120
