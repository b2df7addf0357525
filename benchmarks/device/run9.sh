#!/usr/bin/env bash
# Device run 9 (nvidia-h200-x2, ~5 minutes): where a streaming rank's host time goes on the GPU (NOTES §13).
# Streaming/defrag, GPT-OSS-20B cut to 8 layers, bf16, C=256 per rank, clean, rank 0 profiled:
#   (a) phase timers only (DATAFLOW_PROFILE_CPROFILE=0): wall per loop phase, per batch kind;
#   (b) the same run under cProfile (function breakdown; slower, read the shares, not the absolutes).
# Output: env.txt, ep_a.log, phases_a.txt, ep_b.log, phases_b.txt, ep_bench.md (<= 8 files).
# Usage: bash benchmarks/device/run9.sh $OUT            (device tool: carry [".whl"])
# CPU dry run: bash benchmarks/device/run9.sh /tmp/r9 --cpu
set -u
OUT=${1:?out dir}; shift
CPU=0; [ "${1:-}" = "--cpu" ] && CPU=1
if [ $CPU = 0 ]; then
  . benchmarks/device/prelude.sh
  FLAGS="--budget 100 --systems streaming-defrag --scenarios clean --concurrency 256"
else
  export PYTHONPATH=$PWD PYTHONUNBUFFERED=1
  FLAGS="--smoke --budget 100 --systems streaming-defrag --scenarios clean"
fi
mkdir -p "$OUT"
{ date -u; git log --oneline -1 2>/dev/null; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>&1 | head -3;
  python3 -c 'import torch;print("torch",torch.__version__,"cuda",torch.cuda.is_available(),torch.cuda.device_count())'; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
P=$(mktemp -d /tmp/run9.XXXX)
for v in a b; do
  CP=0; [ $v = b ] && CP=1
  DATAFLOW_PROFILE_RANK=0 DATAFLOW_PROFILE_CPROFILE=$CP DATAFLOW_PROFILE_OUT=$P/r$v \
    timeout 150 python3 benchmarks/gpu_ep_bench.py --out "$P/$v" $FLAGS > "$OUT/ep_$v.log" 2>&1
  echo "ep_$v exit $?" | tee -a "$OUT/env.txt"; tail -6 "$OUT/ep_$v.log"
  cp "$P/r$v.phases.txt" "$OUT/phases_$v.txt" 2>/dev/null || echo "no phases file for $v" | tee -a "$OUT/env.txt"
  head -30 "$OUT/phases_$v.txt" 2>/dev/null
done
cp "$P/a/ep_bench.md" "$OUT/ep_bench.md" 2>/dev/null
ls "$OUT"
