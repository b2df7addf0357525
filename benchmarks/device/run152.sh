#!/usr/bin/env bash
# Device run 152 (nvidia-h200, ONE GPU, ~8 minutes): the row-block attention for batches with prompt chunks
# (kernels.paged_attention.paged_row_block_attention_triton; NOTES §35 item 4). (1) one_gpu_checks.sh (the kernel's
# test compiled on the GPU); (1b) row_block_kernel_bench: the kernel alone against the decode kernel, tile shapes;
# (2) mixed_batch_bench, GPT-OSS-20B shapes, bf16, eager / paged row by row / paged by row
# blocks: layer 1 (no window) 128 decode rows at 2048 + a 128-row chunk at 2048.., 64 at 4096 + a 256-row chunk at
# 3840..; layer 0 (window 128) 128 + 128 at 512 and 0..; (3) arrivals_bench paged against per-row, 2 rounds: long
# prompts (run 151's load) and never-ending short ones (run 150's busy load). Output: env.txt, checks.txt,
# gpu_bench.md, kernel.md, mixed.md, arrivals_long.md, arrivals_busy.md.
. benchmarks/device/start.sh "$@"
export DATAFLOW_ROW_BLOCKS=1  # the row-block attention is opt-in until this run has checked it
bash benchmarks/device/one_gpu_checks.sh "$OUT"
{ timeout 60 python3 benchmarks/row_block_kernel_bench.py --chunk 256 --at 3840
  timeout 60 python3 benchmarks/row_block_kernel_bench.py --chunk 128 --at 2048
} > "$OUT/kernel.md" 2>&1
echo "row_block_kernel_bench exit $?" | tee -a "$OUT/env.txt"; cat "$OUT/kernel.md"
M="timeout 90 python3 benchmarks/mixed_batch_bench.py --spec gpt-oss-20b"
{ $M --layer 1 --decode 128 --chunk 128 --context 2048 --chunk-at 2048
  $M --layer 1 --decode 64 --chunk 256 --context 4096 --chunk-at 3840
  $M --decode 128 --chunk 128 --context 512
} > "$OUT/mixed.md" 2>&1
echo "mixed_batch_bench exit $?" | tee -a "$OUT/env.txt"; grep -E "^\| (mixed|prompt|pure)|FAILED|ok$|window" "$OUT/mixed.md"
A="timeout 150 python3 benchmarks/arrivals_bench.py --rounds 2 --variants paged,per-row"
$A --requests 256 --initial 64 --rate 200 --prompt 256:2048 --max-new 32:64 > "$OUT/arrivals_long.md" 2>&1
echo "arrivals long exit $?" | tee -a "$OUT/env.txt"; grep -E "^\|" "$OUT/arrivals_long.md"
$A --requests 512 --initial 64 --rate 300 --prompt 16:128 --max-new 64:128 > "$OUT/arrivals_busy.md" 2>&1
echo "arrivals busy exit $?" | tee -a "$OUT/env.txt"; grep -E "^\|" "$OUT/arrivals_busy.md"
