#!/usr/bin/env bash
# Device run 138 (nvidia-h200, ONE GPU, ~1 minute): benchmarks/device/tf_diff_probe.py: where the bf16 teacher-forced
# logits differ most from the fp32 reference with separate attention batches for prompts' chunks and without (runs
# 136-137: 8 gpu_bench rows over tolerance with them). Output: env.txt, probe.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
(cd benchmarks/device && timeout 200 python3 tf_diff_probe.py) > "$OUT/probe.txt" 2>&1
echo "probe exit $?" | tee -a "$OUT/env.txt"; cat "$OUT/probe.txt" | tail -8
