#!/usr/bin/env bash
# Sourced by the device run scripts from run 149 on, as `. benchmarks/device/start.sh "$@"` (from the repository root):
# the header every run script had repeated. OUT (the first argument) made and absolute; prelude.sh (the wheels, the
# NCCL settings); OUT/env.txt started with the date and the hash of the tree's sources; the plan's dispatch default.
set -u
OUT=${1:?out dir}
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd)
. benchmarks/device/prelude.sh
date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
