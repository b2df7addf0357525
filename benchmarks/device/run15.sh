#!/usr/bin/env bash
# Device run 15 (nvidia-h200-x2, ~2 minutes): correctness after this session's transport changes (engine-thread
# receives, pair communicators at construction), expert-sharded weights and the wave hold: a 2-GPU fp32
# `dataflow run` (CUDA executor, NCCL) must give the CPU run's tokens, for defrag and defrag + wave hold.
# Output: env.txt, tokens.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
bash benchmarks/device/fp32_tokens_vs_cpu.sh "$OUT" defrag "defrag:hold_fill=1,hold_us=3000"
