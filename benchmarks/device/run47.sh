#!/usr/bin/env bash
# Device run 47 (nvidia-h200-x2, ~6 minutes; session 6). Run 46's profiled launch had rank 0 paying 1.5-2x rank 1's
# time in every phase of the same loop (run 39: balanced): is a rank's serving thread sharing a physical core
# (hyperthread siblings) or running far from its GPU? runtime/cpu_bind.py pins each rank's serving thread to a core
# of its own near its GPU, other threads elsewhere (on by default for CUDA ranks, both systems). (1) The machine's
# CPU topology and GPU affinity; (2) 20B-L8, bf16, C=256, clean, streaming/defrag + 30 ms hold and all-gather EP,
# binding off (DATAFLOW_CPU_BIND=0) vs on, alternating invocations, 3 rounds; (3) one profiled streaming launch with
# binding on (phase timers of both ranks). Output: env.txt, topo.txt, ab.txt, bind.txt, phases.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
export DATAFLOW_KEYED_ROUTER=graph  # the default when this run was made (session 6 made the host router the default again)
mkdir -p "$OUT"; OUT=$(cd "$OUT" && pwd); date -u > "$OUT/env.txt"
{ lscpu | grep -E "^(CPU\(s\)|Thread|Core|Socket|NUMA)"; nvidia-smi topo -m; } > "$OUT/topo.txt" 2>&1
P=$(mktemp -d /tmp/run47.XXXX)
S="streaming-defrag:hold_fill=1;hold_us=30000"
for r in 1 2 3; do
  for b in 0 1; do
    d="$P/bind$b.$r"
    DATAFLOW_CPU_BIND=$b timeout 75 python3 benchmarks/gpu_ep_bench.py --out "$d" --budget 65 --systems "$S,ag-ep" \
      --scenarios clean --concurrency 256 --new-tokens 64:128 > "$d.log" 2>&1
    echo "bind=$b round $r exit $?" >> "$OUT/env.txt"
    grep "^| [as]" "$d/ep_bench.md" | cut -c1-150 | sed "s/^/bind=$b r$r /" | tee -a "$OUT/ab.txt"
    grep -h "serving thread on CPU\|CPU binding skipped" "$d.log" | sort | uniq -c | head -4 >> "$OUT/bind.txt"
  done
done
d="$P/prof"; mkdir -p "$d"
DATAFLOW_PROFILE_RANK=all DATAFLOW_PROFILE_CPROFILE=0 DATAFLOW_PROFILE_OUT="$d/rank{rank}.prof" timeout 80 python3 benchmarks/gpu_ep_bench.py \
  --out "$d" --budget 70 --systems "$S" --scenarios clean --concurrency 256 --new-tokens 64:128 > "$d.log" 2>&1
echo "prof exit $?" >> "$OUT/env.txt"
{ grep "^| streaming" "$d/ep_bench.md" | cut -c1-200; for k in 0 1; do echo "=== rank $k"; head -16 "$d/rank$k.prof.phases.txt"; done; } > "$OUT/phases.txt" 2>&1
head -6 "$OUT/phases.txt"; cat "$OUT/bind.txt" | head -8
