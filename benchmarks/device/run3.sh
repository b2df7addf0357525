#!/usr/bin/env bash
# Device run 3 (nvidia-h200-x2, < 9 minutes): the fixes of runs 1-2 checked on the GPUs.
#  1. `dataflow run` one process per GPU over NCCL, every policy, on the DEFAULT cuda plan of tiny
#     (run 2 died with CUDA OOM zeroing 140 GiB of KV per rank: now compiled for 132 GiB and clamped
#     to the real free memory at run time), tokens vs the fp32 CPU in-process run of the same model
#     (equal requests, first divergence).
#  2. gpu_bench: correctness (fp32 tokens == CPU; bf16 teacher-forced logits within u(6L+2) and
#     tokens up to near-ties, router-x30 variant), e2e (streaming vs ag-ep vs a2a-ep, C=64,256,
#     2 in-process ranks on GPU 0) and the multi-process 2-GPU streaming variant (--mp-ranks 2).
# Every step has its own `timeout`, capped by what is left of an 8m50s budget, so a hang cannot eat
# the call. Output: at most 6 files under $1 (env.txt, nccl_runs.txt, gpu_bench.{log,md,json}, steps.txt).
# Usage: bash benchmarks/device/run3.sh $OUT      (device tool: carry [".whl"])
# CPU dry run: sed '/pip install/d' benchmarks/device/run3.sh | DEV=cpu bash -s -- /tmp/run3
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
export PYTHONPATH=${PYTHONPATH:-$PWD}
DEV=${DEV:-cuda}          # the device the "GPU" plan targets (cpu: dry run of this script)
BUDGET=530                # seconds for the whole script
ROOT=$PWD
mkdir -p "$OUT"
OUT=$(cd "$OUT" && pwd)
STEPS=$OUT/steps.txt
: > "$STEPS"
left() { local l=$((BUDGET - SECONDS)); [ "$l" -lt 1 ] && l=1; [ "$1" -lt "$l" ] && echo "$1" || echo "$l"; }
step() {  # step NAME LIMIT CMD...: run with timeout min(LIMIT, budget left); record rc and seconds
  local name=$1 lim; lim=$(left "$2"); shift 2
  local t0=$SECONDS
  timeout -k 5 "$lim" "$@"; local rc=$?
  echo "$(date -u +%T) $name rc=$rc ${lim}s-limit took=$((SECONDS - t0))s" >> "$STEPS"
  return $rc
}

{ date -u; nvidia-smi --query-gpu=name,memory.total,memory.used --format=csv 2>&1;
  python3 -c 'import torch;print("torch",torch.__version__,"cuda",torch.cuda.is_available(),torch.cuda.device_count());
[print(i,torch.cuda.mem_get_info(i)) for i in range(torch.cuda.device_count())]' 2>&1; } > "$OUT/env.txt"

# ---------------------------------------------------------------- 1. multi-process over NCCL
W=$(mktemp -d /tmp/run3.XXXX)
cd "$W"
NCCL=$OUT/nccl_runs.txt
{
  echo "== compile (default device memory; cpu plan for the reference run)"
  python3 -m dataflow compile tiny --ranks 2 --device "$DEV" -o plan_gpu 2>&1 | tail -6
  python3 -m dataflow compile tiny --ranks 2 --device cpu -o plan_cpu 2>&1 | tail -2
  echo "== CPU in-process reference run (fp32)"
  step cpu-run 90 python3 -m dataflow run plan_cpu --in-process -q --num-requests 12 --max-new-tokens 24 \
    --ignore-eos -o cpu.jsonl 2>&1 | tail -14
  for pol in defrag flfs mtfs aging; do
    echo "== $DEV multi-process (one process per GPU, NCCL) policy $pol"
    step "nccl-$pol" 75 python3 -m dataflow run plan_gpu -q --num-requests 12 --max-new-tokens 24 --ignore-eos \
      --policy "$pol" --procs-timeout 65 -o "gpu_$pol.jsonl" 2>&1 | grep -v '^\[rank [0-9]\]   ' | tail -16
  done
  echo "== --kv-blocks in multi-process mode (explicit small pool)"
  step nccl-kvblocks 60 python3 -m dataflow run plan_gpu -q --num-requests 12 --max-new-tokens 24 --ignore-eos \
    --kv-blocks 64 --procs-timeout 50 -o gpu_kv64.jsonl 2>&1 | grep -v '^\[rank [0-9]\]   ' | tail -4
  echo "== tokens vs the CPU run"
  python3 - cpu.jsonl gpu_defrag.jsonl gpu_flfs.jsonl gpu_mtfs.jsonl gpu_aging.jsonl gpu_kv64.jsonl <<'PY'
import json, os, sys
def load(p):
    return {r["id"]: r["output_token_ids"] for r in map(json.loads, open(p))} if os.path.exists(p) else None
a = load(sys.argv[1])
if a is None:
    sys.exit("no CPU reference output")
for p in sys.argv[2:]:
    b = load(p)
    if b is None:
        print(f"{p}: MISSING (the run failed: see above)"); continue
    same = sum(a[k] == b.get(k) for k in a)
    first = None
    for k in sorted(a, key=str):
        x, y = a[k], b.get(k) or []
        n = next((i for i in range(max(len(x), len(y))) if i >= len(x) or i >= len(y) or x[i] != y[i]), None)
        if n is not None and (first is None or n < first[1]):
            first = (k, n, x[n:n + 3], y[n:n + 3])
    print(f"{p}: requests equal to CPU {same}/{len(a)}"
          + ("" if first is None else f"; earliest divergence: request {first[0]} step {first[1]} cpu {first[2]} vs {first[3]}"))
PY
} > "$NCCL" 2>&1
cd "$ROOT"
rm -rf "$W"

# ---------------------------------------------------------------- 2. gpu_bench
step gpu-bench 420 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness,e2e --concurrency 64,256 \
  --mp-ranks 2 --mp-timeout 150 > "$OUT/gpu_bench.log" 2>&1
echo "total ${SECONDS}s" >> "$STEPS"
cat "$STEPS"
grep -h "requests equal\|MISSING" "$NCCL"
grep -v "^ " "$OUT/gpu_bench.log" | grep -v "^Traceback\|^  File" | tail -40
