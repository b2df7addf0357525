#!/usr/bin/env bash
# Device run 91 (nvidia-h200-x2, ~2 minutes): session 11, last. The attention graph's two RMSNorms as one Triton launch
# each (kernels/rms_norm.py; run 88: 77 launches per attention replay, ~140 us of 243-272 us in small kernels).
# (1) gpu_bench correctness on GPU 0 (the bf16 tolerance and the fp32 tokens); (2) fp32 2-GPU tokens == CPU under the
# hold; (3) the attention graph's kernels (--profile-graphs), B=256, context 256, against run 88.
# Output: env.txt, gpu_bench.md, tokens.txt, gpu_bench_profile.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -1 "$OUT/gpu_bench.log"; rm -f "$OUT/gpu_bench.json"
bash benchmarks/device/fp32_tokens_vs_cpu.sh "$OUT" "defrag:hold_fill=1,hold_us=3000" | grep "2-GPU"
P=$(mktemp -d /tmp/run91.XXXX)
CUDA_VISIBLE_DEVICES=0 timeout 90 python3 benchmarks/gpu_bench.py --out "$P" --sections executor --profile-graphs \
  --attn-batch 256 --contexts 256 --expert-rows 1024 --ffn-impls triton > "$P/gb.log" 2>&1
echo "gpu_bench profile exit $?" | tee -a "$OUT/env.txt"; cp "$P/gpu_bench.md" "$OUT/gpu_bench_profile.md"
grep -E "attention graphs=True" "$P/gb.log"; grep -E -A4 "^attention B=256" "$OUT/gpu_bench_profile.md" | grep -E "^attention|all|rms_norm"
