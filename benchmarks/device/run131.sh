#!/usr/bin/env bash
# Device run 131 (nvidia-h200, ONE GPU, ~8 minutes): session 16's step-ahead (NOTES §33 item 1: a sample batch's next
# step queued at its launch, the greedy ids left on the device for the embedding). (1) the kernel/executor/runtime-unit/
# scheduler tests on the GPU (the step-ahead test with EOS requests draining) and gpu_bench's correctness section (CUDA
# executor tokens against the reference, step-ahead on); (2) one rank process, 20B-L8, streaming/defrag + 30 ms hold
# (runs 124-130's setting), DATAFLOW_STEP_AHEAD=1 against =0 as variants of one launch, C=256 3 rounds, then C=512
# 2 rounds; rank 0's phases of each variant's last round.
# Output: env.txt, checks.txt, gpu_bench.md, ep256.md, ep512.md, phases.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
timeout 150 python3 -m pytest -q -x -p no:cacheprovider tests/test_kernels.py tests/test_executor_cuda.py tests/test_runtime_units.py tests/test_scheduler.py 2>&1 | tail -3 | tee "$OUT/checks.txt"
timeout 120 python3 benchmarks/gpu_bench.py --out "$OUT" --sections correctness > "$OUT/gpu_bench.log" 2>&1
echo "gpu_bench correctness exit $?" | tee -a "$OUT/env.txt"; tail -1 "$OUT/gpu_bench.log"; rm -f "$OUT/gpu_bench.json" "$OUT/gpu_bench.log"
for C in 256 512; do
  R=3; [ $C = 512 ] && R=2
  P=$(mktemp -d /tmp/run131.XXXX)
  DATAFLOW_PROFILE_RANK=0 DATAFLOW_PROFILE_CPROFILE=0 \
    timeout 280 python3 benchmarks/gpu_ep_bench.py --out "$P/o" --budget 270 --ranks 1 --rounds $R \
    --variants "ahead:DATAFLOW_STEP_AHEAD=1,DATAFLOW_PROFILE_OUT=$P/ahead{rank}.prof;off:DATAFLOW_STEP_AHEAD=0,DATAFLOW_PROFILE_OUT=$P/off{rank}.prof" \
    --systems "streaming-defrag:hold_fill=1;hold_us=30000" --scenarios clean --concurrency $C --new-tokens 64:128 > "$P/run.log" 2>&1
  echo "bench C=$C exit $?" | tee -a "$OUT/env.txt"
  cp "$P/o/ep_bench.md" "$OUT/ep$C.md" 2>/dev/null
  for v in ahead off; do { echo "=== C=$C $v (its last round)"; head -16 "$P/${v}0.prof.phases.txt"; } >> "$OUT/phases.txt" 2>&1; done
  grep -E "^\| streaming" "$OUT/ep$C.md" | cut -c1-200
done
