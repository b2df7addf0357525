#!/usr/bin/env bash
# Device run 150 (nvidia-h200, ONE GPU, ~4 minutes): end to end with prompts arriving during decode, the three prompt
# paths of CudaExecutor side by side in one launch (arrivals_bench: paged / split / eager, 2 rounds, order alternating,
# after an untimed pass), GPT-OSS-20B cut to 4 layers, bf16, one rank: never-ending arrivals of short prompts (512
# requests, 64 at t=0 then 300/s, 16-128 tokens) and a prefill-heavy load (384 requests, 128 at t=0 then 400/s,
# 64-512 tokens). Output: env.txt, arrivals_busy.md, arrivals_prefill.md.
. benchmarks/device/start.sh "$@"
A="timeout 140 python3 benchmarks/arrivals_bench.py --rounds 2"
$A --requests 512 --initial 64 --rate 300 --prompt 16:128 --max-new 64:128 > "$OUT/arrivals_busy.md" 2>&1
echo "arrivals busy exit $?" | tee -a "$OUT/env.txt"; grep -E "^\|" "$OUT/arrivals_busy.md"
$A --requests 384 --initial 128 --rate 400 --prompt 64:512 --max-new 64:128 > "$OUT/arrivals_prefill.md" 2>&1
echo "arrivals prefill exit $?" | tee -a "$OUT/env.txt"; grep -E "^\|" "$OUT/arrivals_prefill.md"
