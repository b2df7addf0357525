#!/usr/bin/env bash
# Device run 20 (nvidia-h200-x2, ~2 minutes): is a streaming rank's host waiting for its GPU?
# (1) h2d_probe.py: host time of a pageable vs pinned host->device copy behind queued GPU work.
# (2) streaming/defrag, GPT-OSS-20B cut to 8 layers, bf16, C=256, clean, both ranks with the phase
#     timers and a torch.profiler trace of batches 2500-2799 (DATAFLOW_PROFILE_TORCH), summarized by
#     benchmarks/trace_summary.py (device busy share, CUDA runtime calls by host time).
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
python3 benchmarks/device/h2d_probe.py > "$OUT/h2d_probe.txt" 2>&1; cat "$OUT/h2d_probe.txt"
P=$(mktemp -d /tmp/run20.XXXX)
DATAFLOW_PROFILE_RANK=all DATAFLOW_PROFILE_CPROFILE=0 DATAFLOW_PROFILE_TORCH=2500:300 DATAFLOW_PROFILE_OUT="$P/rank{rank}.prof" \
  timeout 200 python3 benchmarks/gpu_ep_bench.py --out "$P" --budget 190 --systems streaming-defrag --scenarios clean --concurrency 256 > "$OUT/ep.log" 2>&1
echo "exit $?" | tee -a "$OUT/env.txt"; grep "^|" "$P/ep_bench.md"
cp "$P"/*.phases.txt "$OUT/"; gzip -c "$P/rank0.prof.trace.json" > "$OUT/rank0.trace.json.gz"
python3 benchmarks/trace_summary.py "$P"/rank*.prof.trace.json > "$OUT/trace_summary.txt" 2>&1; cat "$OUT/trace_summary.txt"
