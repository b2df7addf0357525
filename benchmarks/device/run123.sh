#!/usr/bin/env bash
# Device run 123 (nvidia-h200, ONE GPU, ~2 minutes): where a layer-wave's CUDA calls go, and why the layer-0 embedding
# costs 200-250 us (run 122's laps: the ids' upload 103-123 us, the row gather 58-72 us). gpu_ep_bench with ONE rank
# process (no peers), 20B-L8, bf16, C=256, streaming/defrag + 30 ms hold, clean, with a torch.profiler trace of the
# rank's batches 3000-3239 (DATAFLOW_PROFILE_TORCH; host ops, CUDA runtime calls, kernels), summarized by
# benchmarks/trace_summary.py, and the executor's laps. Output: env.txt, run.log, trace_summary.txt, trace.json.gz.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
P=$(mktemp -d /tmp/run123.XXXX)
DATAFLOW_PROFILE_EXEC=1 DATAFLOW_PROFILE_RANK=0 DATAFLOW_PROFILE_CPROFILE=0 DATAFLOW_PROFILE_TORCH=3000:240 \
  DATAFLOW_PROFILE_OUT="$P/rank{rank}.prof" timeout 150 python3 benchmarks/gpu_ep_bench.py --out "$P/o" --budget 120 \
  --ranks 1 --rounds 1 --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency 256 \
  --new-tokens 64:128 > "$OUT/run.log" 2>&1
echo "bench exit $?" | tee -a "$OUT/env.txt"
python3 benchmarks/trace_summary.py "$P/rank0.prof.trace.json" > "$OUT/trace_summary.txt" 2>&1
head -60 "$OUT/trace_summary.txt"
gzip -c "$P/rank0.prof.trace.json" > "$OUT/trace.json.gz"; ls -la "$OUT"
grep -E "embed:|executor attention|decision" "$OUT/run.log" | cut -c1-300
