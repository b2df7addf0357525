#!/usr/bin/env bash
# Device run 156 (nvidia-h200, ONE GPU, ~3 minutes): the decode-wait bound's level. Run 155 put ITL p99 under prompt
# floods from 0.5-1.1 s to 25-31 ms with the 2 ms default, but ITL p50 there from ~4 to ~19 ms and, in the busy load
# of short prompts, ITL p50 3.65 -> 4.8 ms. arrivals_bench, 3 rounds: paged (2 ms), yield-10, no-yield, on run 154's
# 2-8k-token prompts and run 150's busy load. Output: env.txt, arrivals_8k.md, arrivals_busy.md.
. benchmarks/device/start.sh "$@"
A="timeout 120 python3 benchmarks/arrivals_bench.py --rounds 3 --variants paged,yield-10,no-yield"
$A --requests 96 --initial 32 --rate 40 --prompt 2048:8192 --max-new 16:32 > "$OUT/arrivals_8k.md" 2>&1
echo "arrivals 8k exit $?" | tee -a "$OUT/env.txt"; grep -E "^\||round" "$OUT/arrivals_8k.md"
$A --requests 512 --initial 64 --rate 300 --prompt 16:128 --max-new 64:128 > "$OUT/arrivals_busy.md" 2>&1
echo "arrivals busy exit $?" | tee -a "$OUT/env.txt"; cat "$OUT/arrivals_busy.md"
