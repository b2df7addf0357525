#!/usr/bin/env bash
# Device run 11 (nvidia-h200-x2, ~2 minutes): what a NCCL send / receive post costs inside a streaming
# rank (DATAFLOW_PROFILE_TRANSPORT=1: wall us per step of _post / the receive post), sends from a
# dedicated stream + own event ("stream") vs from the compute stream with the Work's completion
# ("direct"). Same workload as runs 9/10 (GPT-OSS-20B cut to 8 layers, bf16, C=256, clean), phase timers.
# Output: env.txt, ep_{stream,direct}.log, phases_{stream,direct}.txt (5 files).
# (The DATAFLOW_NCCL_SEND=direct switch was removed after this run: no throughput difference; the "direct"
# half now runs the default path again.)
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; { date -u; git log --oneline -1; } > "$OUT/env.txt"
P=$(mktemp -d /tmp/run11.XXXX)
for m in stream direct; do
  DATAFLOW_NCCL_SEND=$m DATAFLOW_PROFILE_TRANSPORT=1 DATAFLOW_PROFILE_RANK=0 DATAFLOW_PROFILE_CPROFILE=0 DATAFLOW_PROFILE_OUT=$P/r$m \
    timeout 120 python3 benchmarks/gpu_ep_bench.py --out "$P/$m" --budget 100 --systems streaming-defrag --scenarios clean --concurrency 256 > "$OUT/ep_$m.log" 2>&1
  echo "ep_$m exit $?" | tee -a "$OUT/env.txt"; grep -E "tok/s|send post|recv post" "$OUT/ep_$m.log" | tail -6
  cp "$P/r$m.phases.txt" "$OUT/phases_$m.txt"; head -16 "$OUT/phases_$m.txt"
done
