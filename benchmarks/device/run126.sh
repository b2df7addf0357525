#!/usr/bin/env bash
# Device run 126 (nvidia-h200, ONE GPU, ~2 minutes): session 15's tree after attention outputs became views of the static
# buffers (NOTES §32 item 13), and the layer-0 embedding went into the
# attention input (NOTES §32 item 12). (1) the kernel/executor/runtime-unit/scheduler tests on the GPU and gpu_bench's
# correctness section (CUDA executor tokens against the reference: the claims at layer 0 and deeper on the GPU);
# (2) run 124's launch (one rank process, 20B-L8, C=256, streaming/defrag + 30 ms hold) with the laps, no trace.
# Output: env.txt, checks.txt, gpu_bench.md, laps.log.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
timeout 120 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_executor_cuda.py tests/test_runtime_units.py tests/test_scheduler.py 2>&1 | tail -3 | tee "$OUT/checks.txt"
timeout 120 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -1 "$OUT/gpu_bench.log"; rm -f "$OUT/gpu_bench.json" "$OUT/gpu_bench.log"
P=$(mktemp -d /tmp/run126.XXXX)
DATAFLOW_PROFILE_EXEC=1 DATAFLOW_PROFILE_RANK=0 DATAFLOW_PROFILE_CPROFILE=0 DATAFLOW_PROFILE_OUT="$P/rank{rank}.prof" \
  timeout 150 python3 benchmarks/gpu_ep_bench.py --out "$P/o" --budget 120 --ranks 1 --rounds 1 \
  --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency 256 --new-tokens 64:128 > "$P/run.log" 2>&1
echo "bench exit $?" | tee -a "$OUT/env.txt"
{ grep -E "embed:|executor|decision|^\| streaming" "$P/run.log" | cut -c1-700; head -20 "$P/rank0.prof.phases.txt"; } > "$OUT/laps.log"
grep -E "embed:|h_copy|^\| streaming" "$OUT/laps.log" | cut -c1-300
