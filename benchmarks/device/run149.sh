#!/usr/bin/env bash
# Device run 149 (nvidia-h200, ONE GPU, ~5 minutes): prompt chunks through the paged kernels (CudaExecutor.prompts,
# "paged" the default; NOTES §35 item 1). (1) one_gpu_checks.sh: the GPU tests and gpu_bench's correctness section,
# where every prompt now runs through the Triton paged kernels; (2) mixed_batch_bench at GPT-OSS-20B shapes, bf16, one
# layer: a mixed batch and the chunk alone by each prompt path (paged / split / eager), four shapes: 256 decode rows +
# a 256-row chunk (512 rows: above the largest bucket, the paged body without a graph), 128 + 128 and 64 + 64 (graphs),
# and 128 + 128 with the chunk at positions 2048.. over 2048-token decode contexts (long reads per row).
# Output: env.txt, checks.txt, gpu_bench.md, mixed.md.
. benchmarks/device/start.sh "$@"
bash benchmarks/device/one_gpu_checks.sh "$OUT"
M="timeout 90 python3 benchmarks/mixed_batch_bench.py --spec gpt-oss-20b --layers 1"
{ $M --decode 256 --chunk 256 --context 512
  $M --decode 128 --chunk 128 --context 512
  $M --decode 64 --chunk 64 --context 512
  $M --decode 128 --chunk 128 --context 2048 --chunk-at 2048
} > "$OUT/mixed.md" 2>&1
echo "mixed_batch_bench exit $?" | tee -a "$OUT/env.txt"; grep -E "^\| (mixed|prompt|pure)|FAILED|ok$" "$OUT/mixed.md"
