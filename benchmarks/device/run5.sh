#!/usr/bin/env bash
# Device run 5 (nvidia-h200-x2, < 10 minutes): (1) `dataflow run` one process per GPU over NCCL on
# the default cuda plan of tiny, every policy, tokens vs the fp32 CPU in-process run (run 3 failed
# here with a capture error while NCCL lanes were active: graphs are now captured thread_local and
# before serving); (2) the streaming vs NCCL-collective EP benchmark (run4_ep.sh) with a shorter budget.
# Output: nccl_runs.txt + run4's env.txt, ep_bench.{log,json,md}.   Usage: bash benchmarks/device/run5.sh $OUT [bench flags]
set -u
OUT=${1:?out dir}; shift
. benchmarks/device/prelude.sh
ROOT=$PWD; W=$(mktemp -d /tmp/run5.XXXX); cd "$W"
{
  python3 -m dataflow compile tiny --ranks 2 --device cuda -o plan_gpu 2>&1 | tail -3
  python3 -m dataflow compile tiny --ranks 2 --device cpu -o plan_cpu >/dev/null 2>&1
  timeout 60 python3 -m dataflow run plan_cpu --in-process -q --num-requests 12 --max-new-tokens 24 --ignore-eos -o cpu.jsonl 2>&1 | grep -E "tokens/s|finished"
  for pol in defrag flfs mtfs aging; do
    echo "== NCCL, one process per GPU, policy $pol"
    timeout -k 5 40 python3 -m dataflow run plan_gpu -q --num-requests 12 --max-new-tokens 24 --ignore-eos \
      --policy "$pol" --procs-timeout 35 -o "gpu_$pol.jsonl" 2>&1 | grep -v 'ProcessGroupNCCL\|^\[rank [0-9]\]   ' | grep -E "error|tokens/s|finished|processes" | head -6
    python3 - cpu.jsonl "gpu_$pol.jsonl" <<'PY'
import json, os, sys
ld = lambda p: {r["id"]: r["output_token_ids"] for r in map(json.loads, open(p))} if os.path.exists(p) else None
a, b = ld(sys.argv[1]), ld(sys.argv[2])
print(f"{sys.argv[2]}: " + ("MISSING" if b is None else f"requests equal to the CPU run {sum(a[k] == b.get(k) for k in a)}/{len(a)}"))
PY
  done
} > "$OUT/nccl_runs.txt" 2>&1
cat "$OUT/nccl_runs.txt"
cd "$ROOT"
EP_BUDGET=360 EP_TIMEOUT=400 bash benchmarks/device/run4_ep.sh "$OUT" "$@"
