#!/usr/bin/env bash
# Device run 57 (nvidia-h200, ONE GPU, ~6 minutes): the A/B that run 55 was written for, on the one GPU lent in session
# 8. Session 7's unmeasured host-path changes (bounded device waits, routing as numpy arrays, cached static views;
# NOTES §22 items 11, 14, 15), this tree against the tree in .df/ab/old.tgz, in alternating launches of
# gpu_bench's e2e section: GPT-OSS-20B cut to 8 layers, bf16, decode-only, Zipf routing in the attention graph,
# 2 in-process ranks sharing GPU 0 (in-process transport, no NCCL: the executor and engine host paths are the
# same code as the 2-GPU runs', the sends are not), streaming/defrag, C=256, 64 new tokens, 3 rounds.
# Before the call: mkdir -p .df/ab && git archive OLD | gzip > .df/ab/old.tgz; carry [".whl", ".df/ab"].
# Output: env.txt, ab.txt (one table row per launch: tok/s, ITL, attention / expert host us per batch and the share
# hidden), phases.txt (the engine's dispatch and the executor's per-step wall clocks, DATAFLOW_PROFILE_EXEC=1).
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
AB_BENCH=gpu_bench AB_TIMEOUT=80 bash benchmarks/device/ab_trees.sh "$OUT" .df/ab/old.tgz 3 --sections e2e \
  --systems streaming --policies defrag --layers 8 --concurrency 256 --max-new 64
