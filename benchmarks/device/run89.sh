#!/usr/bin/env bash
# Device run 89 (nvidia-h200-x2, TWO GPUs, ~7 minutes): session 11. The expert permute as one program per chunk
# (kernels/permute.py): run 88 found the single-program counting sort at 44 us (1,024 rows) and 79 us (2,048) per expert
# batch, against ~3-6 us of bytes. (1) gpu_bench correctness on GPU 0 (the Triton FFN graphs use it); (2) the expert
# graphs' kernels (--profile-graphs) at 1,024 and 2,048 rows; (3) fp32 2-GPU tokens == CPU under the hold; (4) A/B
# against 76f3e52 (before it), 20B-L8, bf16, C=256, clean, streaming/defrag + 30 ms hold, 2 rounds.
# Before the call: mkdir -p .df/ab && git archive 76f3e52 | gzip > .df/ab/old.tgz; carry [".whl", ".df/ab"].
# Output: env.txt, gpu_bench.md (correctness), gpu_bench_profile.md, tokens.txt, ab.txt, phases.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -1 "$OUT/gpu_bench.log"; rm -f "$OUT/gpu_bench.json"
P=$(mktemp -d /tmp/run89.XXXX)
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 benchmarks/gpu_bench.py --out "$P" --sections executor --profile-graphs \
  --attn-batch 256 --contexts 256 --expert-rows 1024,2048 --ffn-impls triton > "$P/gb.log" 2>&1
echo "gpu_bench profile exit $?" | tee -a "$OUT/env.txt"; cp "$P/gpu_bench.md" "$OUT/gpu_bench_profile.md"
grep -E "experts ffn=triton +graphs=True" "$P/gb.log"; grep -E "_permute_kernel|^experts triton" "$OUT/gpu_bench_profile.md"
bash benchmarks/device/fp32_tokens_vs_cpu.sh "$OUT" "defrag:hold_fill=1,hold_us=3000" | grep "2-GPU"
AB_TIMEOUT=90 bash benchmarks/device/ab_trees.sh "$OUT" .df/ab/old.tgz 2 --budget 75 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency 256 --new-tokens 64:128
