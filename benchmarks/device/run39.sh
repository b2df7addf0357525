#!/usr/bin/env bash
# Device run 39 (nvidia-h200-x2, ~6 minutes), session 5. Run 38's step timers showed single torch calls costing
# 25-90 us inside a streaming rank's loop, 3-6x their cost in host_speed.py's tight loops on the same host. Question:
# is the loop running on a core that sleeps between batches (a streaming rank blocks in ZeroMQ / sleeps in its
# idle and hold waits; the barrier's host never does)? DATAFLOW_SPIN=1 makes those waits busy-poll.
# (1) GPU tests and fp32 2-GPU tokens == CPU (defrag, defrag + hold) after the wire-form and merge changes; (2)
# streaming/defrag + 30 ms hold, 20B-L8, bf16, C=256, clean, this tree, sleep vs spin alternating, 3 rounds, with
# phase and step timers; (3) all-gather EP once. Output: env.txt, tokens.txt, ab.txt, phases.txt, steps.txt, agep.md.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"
bash benchmarks/device/gpu_checks.sh "$OUT" defrag "defrag:hold_fill=1,hold_us=3000"
OUT=$(cd "$OUT" && pwd)
P=$(mktemp -d /tmp/run39.XXXX)
for r in 1 2 3; do
  for v in 0 1; do
    d="$P/spin$v.$r"; mkdir -p "$d"
    DATAFLOW_SPIN=$v DATAFLOW_PROFILE_EXEC=1 DATAFLOW_PROFILE_RANK=all DATAFLOW_PROFILE_CPROFILE=0 DATAFLOW_PROFILE_OUT="$d/rank{rank}.prof" \
      timeout 120 python3 benchmarks/gpu_ep_bench.py --out "$d" --budget 110 --systems "streaming-defrag:hold_fill=1;hold_us=30000" \
      --scenarios clean --concurrency 256 --new-tokens 64:128 > "$d.log" 2>&1
    echo "spin=$v round $r exit $?" >> "$OUT/env.txt"
    echo "spin=$v $r $(grep '^| streaming' "$d/ep_bench.md" | cut -c1-200)" | tee -a "$OUT/ab.txt"
    for k in 0 1; do echo "=== spin=$v round $r rank $k"; head -16 "$d/rank$k.prof.phases.txt"; done >> "$OUT/phases.txt" 2>&1
    { echo "=== spin=$v round $r"; grep -E "executor (attention|experts):|attention dispatch:" "$d.log" | tail -6; } >> "$OUT/steps.txt"
  done
done
timeout 150 python3 benchmarks/gpu_ep_bench.py --out "$P/ag" --budget 140 --systems ag-ep --scenarios clean --concurrency 256 --new-tokens 64:128 > "$P/ag.log" 2>&1
echo "ag exit $?" >> "$OUT/env.txt"; cp "$P/ag/ep_bench.md" "$OUT/agep.md"; grep "^| ag" "$OUT/agep.md" | cut -c1-200
grep -A3 "=== spin=1 round 3" "$OUT/steps.txt" | cut -c1-400
