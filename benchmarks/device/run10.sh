#!/usr/bin/env bash
# Device run 10 (nvidia-h200-x2, ~4 minutes): NCCL receives posted by the engine thread (no receptor
# thread) vs the receptor thread (NOTES §13). Same workload as run 9 (streaming/defrag, GPT-OSS-20B cut
# to 8 layers, bf16, C=256 per rank), rank 0's phase timers; then the new default against all-gather EP,
# clean and with delay bursts; and the NCCL transport bench in both modes.
# Output: env.txt, transport.txt, phases_{thread,engine}.txt, ep_{thread,engine}.log, ep_bench.md (7 files).
# Usage: bash benchmarks/device/run10.sh $OUT            (device tool: carry [".whl"])
set -u
OUT=${1:?out dir}
MODES=${2:-thread engine}   # run 10b: "engine" only (after the pair-communicator fix)
. benchmarks/device/prelude.sh
mkdir -p "$OUT"
{ date -u; git log --oneline -1 2>/dev/null; nvidia-smi --query-gpu=name,memory.used,memory.total --format=csv 2>&1 | head -3;
  python3 -c 'import torch;print("torch",torch.__version__,"cuda",torch.cuda.is_available(),torch.cuda.device_count())'; } > "$OUT/env.txt" 2>&1
cat "$OUT/env.txt"
for m in $MODES; do
  echo "== transport-bench receive_on=$m" >> "$OUT/transport.txt"
  DATAFLOW_RECEIVE_ON=$m timeout 60 python3 -m dataflow transport-bench --device cuda --ranks 2 --sizes 0,4K,184K,1M --messages 500 2>&1 | grep -v ProcessGroupNCCL | tail -8 >> "$OUT/transport.txt"
done
cat "$OUT/transport.txt"
P=$(mktemp -d /tmp/run10.XXXX)
for m in $MODES; do
  SYS=streaming-defrag; SC=clean
  [ $m = engine ] && { SYS=streaming-defrag,ag-ep; SC=clean,delay; }
  DATAFLOW_RECEIVE_ON=$m DATAFLOW_PROFILE_RANK=0 DATAFLOW_PROFILE_CPROFILE=0 DATAFLOW_PROFILE_OUT=$P/r$m \
    timeout 200 python3 benchmarks/gpu_ep_bench.py --out "$P/$m" --budget 180 --systems $SYS --scenarios $SC --concurrency 256 > "$OUT/ep_$m.log" 2>&1
  echo "ep_$m exit $?" | tee -a "$OUT/env.txt"; grep -E "tok/s" "$OUT/ep_$m.log" | tail -6
  cp "$P/r$m.phases.txt" "$OUT/phases_$m.txt" 2>/dev/null || echo "no phases file for $m" | tee -a "$OUT/env.txt"
  head -18 "$OUT/phases_$m.txt" 2>/dev/null
done
cp "$P/engine/ep_bench.md" "$OUT/ep_bench.md" 2>/dev/null
ls "$OUT"
