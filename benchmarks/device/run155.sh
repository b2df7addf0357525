#!/usr/bin/env bash
# Device run 155 (nvidia-h200, ONE GPU, ~6 minutes): prompt-only batches yield to overdue decode rows (the engine's
# decode-wait bound, DATAFLOW_DECODE_WAIT_MS, default 2 ms per stage; decode lanes in the attention and expert
# queues; NOTES §36 item 2). (1) one_gpu_checks.sh (the GPU tests; gpu_bench correctness: tokens against the
# reference); (2) arrivals_bench paged (the bound) against no-yield (DATAFLOW_DECODE_WAIT_MS=0), 3 rounds each: run
# 154's 2-8k-token prompts, run 151's 256-2,048, run 150's never-ending short ones. Output: env.txt, checks.txt,
# gpu_bench.md, arrivals_8k.md, arrivals_long.md, arrivals_busy.md.
. benchmarks/device/start.sh "$@"
bash benchmarks/device/one_gpu_checks.sh "$OUT"
A="timeout 150 python3 benchmarks/arrivals_bench.py --rounds 3 --variants paged,no-yield"
$A --requests 96 --initial 32 --rate 40 --prompt 2048:8192 --max-new 16:32 > "$OUT/arrivals_8k.md" 2>&1
echo "arrivals 8k exit $?" | tee -a "$OUT/env.txt"; cat "$OUT/arrivals_8k.md"
$A --requests 256 --initial 64 --rate 200 --prompt 256:2048 --max-new 32:64 > "$OUT/arrivals_long.md" 2>&1
echo "arrivals long exit $?" | tee -a "$OUT/env.txt"; cat "$OUT/arrivals_long.md"
$A --requests 512 --initial 64 --rate 300 --prompt 16:128 --max-new 64:128 > "$OUT/arrivals_busy.md" 2>&1
echo "arrivals busy exit $?" | tee -a "$OUT/env.txt"; grep -E "^\||round" "$OUT/arrivals_busy.md"
