#!/usr/bin/env bash
# Device run 2 (nvidia-h200-x2): the multi-process runtime over NCCL on two GPUs (tokens vs the CPU
# run of the same plan), the transport microbenchmark over NCCL, then the executor correctness
# section again and the end-to-end section. Usage: bash benchmarks/device/run2_nccl.sh $OUT
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
df() { python3 -m dataflow "$@"; }
cd /tmp && cp -r "$OLDPWD/benchmarks/device/prompts.jsonl" . 2>/dev/null
{ date -u; nvidia-smi --query-gpu=name --format=csv; nvidia-smi topo -m; } 2>&1 | tee $OUT/env.txt
for dev in cpu cuda; do
  df compile tiny --ranks 2 --device $dev -o plan_$dev >/dev/null
done
timeout 120 python3 -m dataflow run plan_cpu --in-process -q --num-requests 12 --max-new-tokens 24 --ignore-eos -o cpu.jsonl 2>&1 | tail -14 | tee $OUT/run_cpu.txt
for pol in defrag flfs mtfs aging; do
  timeout 150 python3 -m dataflow run plan_cuda -q --num-requests 12 --max-new-tokens 24 --ignore-eos --policy $pol -o cuda_$pol.jsonl 2>&1 | tail -16 | tee $OUT/run_nccl_$pol.txt
  python3 - cpu.jsonl cuda_$pol.jsonl <<'PY' | tee -a $OUT/run_nccl_compare.txt
import json,sys
a={r["id"]:r["output_token_ids"] for r in map(json.loads,open(sys.argv[1]))}
b={r["id"]:r["output_token_ids"] for r in map(json.loads,open(sys.argv[2]))}
same=sum(a[k]==b.get(k) for k in a); print(sys.argv[2], "requests equal to CPU:", same, "/", len(a))
PY
done
timeout 120 python3 -m dataflow transport-bench --device cuda --ranks 2 --sizes 0,4K,184K,1M --messages 500 2>&1 | tail -20 | tee $OUT/transport_nccl.txt
cd "$OLDPWD"
timeout 200 python3 benchmarks/gpu_bench.py --out $OUT --sections correctness,e2e 2>&1 | tee $OUT/gpu_bench.log | grep -v "^ " | tail -60
