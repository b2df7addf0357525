#!/usr/bin/env bash
# Device run 18 (nvidia-h200-x2, ~4 minutes): where does a streaming rank's host time go? A sampling
# profile (py-spy, carried as a wheel in .whl/) of streaming/defrag, GPT-OSS-20B cut to 8 layers, bf16,
# C=256, clean: (a) Python stacks of every thread, idle included, 500 Hz, not pausing the ranks;
# (b) Python + native stacks, 200 Hz (pauses each rank per sample). Collapsed stacks: pyspy_{py,native}.txt.
set -u
OUT=${1:?out dir}
. benchmarks/device/prelude.sh
mkdir -p "$OUT"; date -u > "$OUT/env.txt"; nproc >> "$OUT/env.txt"; cat /proc/sys/kernel/yama/ptrace_scope >> "$OUT/env.txt" 2>&1
SPY=/tmp/site/bin/py-spy
ARGS="--budget 200 --systems streaming-defrag --scenarios clean --concurrency 256 --new-tokens 64:128"
P=$(mktemp -d /tmp/run18.XXXX)
timeout 230 $SPY record --subprocesses --threads --idle --nonblocking --rate 500 --format raw -o "$OUT/pyspy_py.txt" -- \
  python3 benchmarks/gpu_ep_bench.py --out "$P/a" $ARGS > "$OUT/a.log" 2>&1
echo "a exit $?" | tee -a "$OUT/env.txt"; grep "^|" "$P/a/ep_bench.md"
timeout 230 $SPY record --subprocesses --threads --native --rate 200 --format raw -o "$OUT/pyspy_native.txt" -- \
  python3 benchmarks/gpu_ep_bench.py --out "$P/b" $ARGS > "$OUT/b.log" 2>&1
echo "b exit $?" | tee -a "$OUT/env.txt"; grep "^|" "$P/b/ep_bench.md"
