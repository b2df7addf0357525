#!/usr/bin/env bash
# Device run 93 (nvidia-h200-x2, TWO GPUs, ~9 minutes): session 12. The attention graph's next fusions (NOTES §29):
# RoPE on q and k, the KV write and the context lengths in one Triton kernel (kernels/rope_kv_write.py, cos/sin from a
# per-position table), q/k/v in one GEMM (models.weights.stack_qkv), the residual add written into the output buffer.
# (1) the new kernel's tests on the GPU, where bf16 must be bit-equal to the torch reference (the interpreter only
# checks within a few ulps), and the fused RMSNorm's; (2) gpu_bench correctness on GPU 0; (3) fp32 2-GPU tokens == CPU
# under the hold; (4) the attention graph's kernels (--profile-graphs), B=256, context 256, against run 91 (61
# launches, 194 / 224 us); (5) A/B against 1635c0a (session 11's last tree), 20B-L8, bf16, C=256, clean,
# streaming/defrag + 30 ms hold, 2 rounds, with both trees' wave timelines (attention device end, legs, cycle).
# Before the call: mkdir -p .df/ab && git archive 1635c0a | gzip > .df/ab/old.tgz; carry [".whl", ".df/ab"].
# Output: env.txt, kernels_pytest.txt, gpu_bench.md, tokens.txt, gpu_bench_profile.md, ab.txt, phases.txt,
# timelines.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
CUDA_VISIBLE_DEVICES=0 timeout 120 python3 -m pytest -q -p no:cacheprovider tests/test_kernels.py -k "rope_kv_write or rms_norm" \
  > "$OUT/kernels_pytest.txt" 2>&1
echo "kernel pytest exit $?: $(tail -1 "$OUT/kernels_pytest.txt")" | tee -a "$OUT/env.txt"
CUDA_VISIBLE_DEVICES=0 timeout 100 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -1 "$OUT/gpu_bench.log"; rm -f "$OUT/gpu_bench.json"
bash benchmarks/device/fp32_tokens_vs_cpu.sh "$OUT" "defrag:hold_fill=1,hold_us=3000" | grep "2-GPU"
P=$(mktemp -d /tmp/run93.XXXX)
CUDA_VISIBLE_DEVICES=0 timeout 90 python3 benchmarks/gpu_bench.py --out "$P" --sections executor --profile-graphs \
  --attn-batch 256 --contexts 256 --expert-rows 1024 --ffn-impls triton > "$P/gb.log" 2>&1
echo "gpu_bench profile exit $?" | tee -a "$OUT/env.txt"; cp "$P/gpu_bench.md" "$OUT/gpu_bench_profile.md"
grep -E -A4 "^attention B=256" "$OUT/gpu_bench_profile.md" | grep -E "^attention|all|rope|rms_norm"
DATAFLOW_TIMELINE=1 AB_TIMEOUT=95 bash benchmarks/device/ab_trees.sh "$OUT" .df/ab/old.tgz 2 --budget 80 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency 256 --new-tokens 64:128
grep -E "^===|^  (attn host|attn device|to holder|cycle|home tail)" "$OUT/timelines.txt"
