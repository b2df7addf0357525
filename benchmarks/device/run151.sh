#!/usr/bin/env bash
# Device run 151 (nvidia-h200, ONE GPU, ~7 minutes): session 18's tree with the split path removed (prompts "paged" or
# "eager"). (1) one_gpu_checks.sh; (2) mixed_batch_bench at GPT-OSS-20B shapes, bf16, on a layer without a window
# (layer 1): 128 decode rows at context 2048 + a 128-row chunk at 2048.., and 64 decode rows at 4096 + a 256-row chunk at
# 3840.. (each row of a chunk reads its whole context: the case where the paged kernel's per-row reads cost most);
# (3) arrivals_bench, paged against eager, longer prompts (256 requests, 64 at t=0 then 200/s, 256-2048 tokens, 32-64
# new), GPT-OSS-20B cut to 4 layers. Output: env.txt, checks.txt, gpu_bench.md, mixed.md, arrivals_long.md.
. benchmarks/device/start.sh "$@"
bash benchmarks/device/one_gpu_checks.sh "$OUT"
M="timeout 90 python3 benchmarks/mixed_batch_bench.py --spec gpt-oss-20b --layer 1"
{ $M --decode 128 --chunk 128 --context 2048 --chunk-at 2048
  $M --decode 64 --chunk 256 --context 4096 --chunk-at 3840
} > "$OUT/mixed.md" 2>&1
echo "mixed_batch_bench exit $?" | tee -a "$OUT/env.txt"; grep -E "^\| (mixed|prompt|pure)|FAILED|ok$|window" "$OUT/mixed.md"
timeout 240 python3 benchmarks/arrivals_bench.py --rounds 2 --requests 256 --initial 64 --rate 200 --prompt 256:2048 \
  --max-new 32:64 > "$OUT/arrivals_long.md" 2>&1
echo "arrivals long exit $?" | tee -a "$OUT/env.txt"; grep -E "^\||round" "$OUT/arrivals_long.md"
