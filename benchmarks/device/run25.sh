#!/usr/bin/env bash
# Device run 25 (nvidia-h200-x2, ~3 minutes): correctness after session 3 (direct NCCL p2p through ctypes, pinned index
# copies): a 2-GPU fp32
# `dataflow run` (CUDA executor, NCCL) must give the CPU run's tokens, for every policy (defrag, mtfs, flfs, defrag + wave hold).
# Output: env.txt, tokens.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
bash benchmarks/device/fp32_tokens_vs_cpu.sh "$OUT" defrag mtfs flfs "defrag:hold_fill=1,hold_us=3000"
