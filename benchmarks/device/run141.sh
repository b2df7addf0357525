#!/usr/bin/env bash
# Device run 141 (nvidia-h200, ONE GPU, ~7 minutes): session 17's mixed-batch split (NOTES §34 item 1: a mixed
# batch's decode rows through the bucketed path, the CUDA graph, the prompt's chunk eagerly) and the local landing
# of a one-home expert batch (item 2). (1) one_gpu_checks.sh: the tests and gpu_bench correctness; (2)
# mixed_batch_bench, GPT-OSS-20B shapes, bf16: the executor's attention stage of a mixed batch, split against whole,
# 256 decode rows at context 512 beside a 256-row chunk, and 64 beside 64; (3) arrivals_bench, split / mixed /
# separate / before alternating, GPT-OSS-20B cut to 4 layers: run 137's decode-heavy workload (256 requests, 128 at
# t=0 then 100/s), then (run 142) one where arrivals never stop, and the phases of one rank.
# Output: env.txt, checks.txt, gpu_bench.md, mixed.md, arrivals.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
bash benchmarks/device/one_gpu_checks.sh "$OUT"
{ timeout 100 python3 benchmarks/mixed_batch_bench.py --spec gpt-oss-20b --layers 1 --decode 256 --chunk 256 --context 512
  timeout 80 python3 benchmarks/mixed_batch_bench.py --spec gpt-oss-20b --layers 1 --decode 64 --chunk 64 --context 512
} > "$OUT/mixed.md" 2>&1
echo "mixed_batch_bench exit $?" | tee -a "$OUT/env.txt"; grep -E "^\|.*(mixed|decode)|faster" "$OUT/mixed.md"
timeout 150 python3 benchmarks/arrivals_bench.py --rounds 2 --requests 256 --initial 128 --rate 100 --prompt 16:128 \
  --max-new 64:128 > "$OUT/arrivals.md" 2>&1
echo "arrivals_bench exit $?" | tee -a "$OUT/env.txt"; grep -E "^\| " "$OUT/arrivals.md"
