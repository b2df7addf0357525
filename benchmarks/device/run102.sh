#!/usr/bin/env bash
# Device run 102 (nvidia-h200-x2, TWO GPUs, ~5 minutes): session 13. Run 101 (one round per launch) found an attention
# cap above the load free at C=256 (32.0k tok/s at cap 256 and at cap 1024) and 6% lower at C=512 (cap 512: 50.2k,
# cap 1024: 47.3k), inside the launch-to-launch drift. The default cap is to follow the load only if a large cap costs
# nothing, so: 3 rounds, alternating, streaming/defrag + 30 ms hold, 20B-L8, bf16, clean: C=256 at caps 256 / 1024,
# C=512 at caps 512 / 1024; C=512 at cap 256 (today's default, two waves) once; C=1024 at cap 1024 twice (run 101's
# 52.6k against run 97's 71.6k). Also (0) benchmarks/triton_launch_bench.py: a Triton launch taken apart.
# Output (8 files at most come back): env.txt, summary.txt (every launch's table row), triton_launch.txt, logs.tgz.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; echo "tree sources: $(bash benchmarks/device/tree_hash.sh)" >> "$OUT/env.txt"
unset DATAFLOW_DISPATCH
timeout 60 python3 benchmarks/triton_launch_bench.py --reps 1000 > "$OUT/triton_launch.txt" 2>&1; echo "triton_launch exit $?" >> "$OUT/env.txt"
SYS="streaming-defrag:hold_fill=1;hold_us=30000"
P=$(mktemp -d /tmp/run102.XXXX)
launch() {  # round C CAP
  local tag="r$1-C$2-cap$3"
  timeout 100 python3 benchmarks/gpu_ep_bench.py --out "$P/$tag" --budget 90 --rounds 1 --attn-cap $3 --systems "$SYS" \
    --scenarios clean --concurrency $2 --new-tokens 64:128 > "$P/$tag.log" 2>&1
  echo "$tag exit $?" >> "$OUT/env.txt"
  echo "$tag $(grep '^| streaming' "$P/$tag/ep_bench.md" | cut -d'|' -f5,9,10,11,13,14,16 | tr -s ' ')" | tee -a "$OUT/summary.txt"
}
for r in 1 2 3; do
  launch $r 256 256; launch $r 256 1024; launch $r 512 512; launch $r 512 1024
done
launch 1 512 256; launch 1 1024 1024; launch 2 1024 1024
tar czf "$OUT/logs.tgz" -C "$P" .
cat "$OUT/triton_launch.txt"
