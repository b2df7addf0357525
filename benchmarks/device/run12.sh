#!/usr/bin/env bash
# Device run 12 (nvidia-h200-x2, ~3 minutes): GPU rank processes with 1 intra-op thread (new default,
# runtime/launch.set_rank_threads) vs 16 (the old cpu_count // ranks), streaming/defrag and all-gather EP,
# clean and delay, C=256, GPT-OSS-20B cut to 8 layers, bf16; rank 0 phase timers + send-post step timers.
# Output: env.txt, ep_t{16,1}.log, phases_t{16,1}.txt, ep_bench.md (6 files).
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; { date -u; git log --oneline -1; nproc; } > "$OUT/env.txt"
P=$(mktemp -d /tmp/run12.XXXX)
for t in 16 1; do
  DATAFLOW_RANK_THREADS=$t DATAFLOW_PROFILE_TRANSPORT=1 DATAFLOW_PROFILE_RANK=0 DATAFLOW_PROFILE_CPROFILE=0 DATAFLOW_PROFILE_OUT=$P/r$t \
    timeout 200 python3 benchmarks/gpu_ep_bench.py --out "$P/t$t" --budget 180 --systems streaming-defrag,ag-ep --scenarios clean,delay --concurrency 256 > "$OUT/ep_t$t.log" 2>&1
  echo "ep_t$t exit $?" | tee -a "$OUT/env.txt"; grep -E "tok/s|send post" "$OUT/ep_t$t.log" | grep -v "rank 0: done" | tail -7
  cp "$P/r$t.phases.txt" "$OUT/phases_t$t.txt"; head -16 "$OUT/phases_t$t.txt"
done
cp "$P/t1/ep_bench.md" "$OUT/ep_bench.md"
