#!/usr/bin/env bash
# Device run 153 (nvidia-h200, ONE GPU, ~5 minutes): the row-block attention as the default for batches with prompt
# chunks, decode rows beside a chunk through the decode kernel (kernels.paged_attention.paged_row_block_attention_triton;
# NOTES §36 item 1). (1) one_gpu_checks.sh (the kernels' tests compiled on the GPU; gpu_bench correctness with blocks
# on); (1b) row_block_kernel_bench: a chunk alone, and beside decode rows (decode kernel / one-row blocks for them);
# (2) mixed_batch_bench, GPT-OSS-20B shapes, bf16, eager / paged row by row / paged by row blocks, run 152's shapes;
# (3) arrivals_bench paged against per-row, 3 rounds: long prompts (run 151's load), never-ending short ones (run 150's).
# Output: env.txt, checks.txt, gpu_bench.md, kernel.md, mixed.md, arrivals_long.md, arrivals_busy.md.
. benchmarks/device/start.sh "$@"
bash benchmarks/device/one_gpu_checks.sh "$OUT"
K="timeout 60 python3 benchmarks/row_block_kernel_bench.py"
{ $K --chunk 256 --at 3840
  $K --chunk 128 --at 2048 --decode 128 --decode-at 2048
  $K --chunk 256 --at 3840 --decode 64 --decode-at 4096
} > "$OUT/kernel.md" 2>&1
echo "row_block_kernel_bench exit $?" | tee -a "$OUT/env.txt"; cat "$OUT/kernel.md"
M="timeout 90 python3 benchmarks/mixed_batch_bench.py --spec gpt-oss-20b"
{ $M --layer 1 --decode 128 --chunk 128 --context 2048 --chunk-at 2048
  $M --layer 1 --decode 64 --chunk 256 --context 4096 --chunk-at 3840
  $M --decode 128 --chunk 128 --context 512
} > "$OUT/mixed.md" 2>&1
echo "mixed_batch_bench exit $?" | tee -a "$OUT/env.txt"; grep -E "^\| (mixed|prompt|pure)|FAILED|ok$|window" "$OUT/mixed.md"
A="timeout 170 python3 benchmarks/arrivals_bench.py --rounds 3 --variants paged,per-row"
$A --requests 256 --initial 64 --rate 200 --prompt 256:2048 --max-new 32:64 > "$OUT/arrivals_long.md" 2>&1
echo "arrivals long exit $?" | tee -a "$OUT/env.txt"; grep -E "^\|" "$OUT/arrivals_long.md"
$A --requests 512 --initial 64 --rate 300 --prompt 16:128 --max-new 64:128 > "$OUT/arrivals_busy.md" 2>&1
echo "arrivals busy exit $?" | tee -a "$OUT/env.txt"; grep -E "^\|" "$OUT/arrivals_busy.md"
